"""``train.warmup_steps``: each task's first k optimiser steps at lr · i / k, then at lr (``continual_blr.loop``)."""

from __future__ import annotations

import pytest
import torch

from continual_blr.data import make_stream
from continual_blr.loop import fit_task
from continual_blr.methods import TrainConfig, build_method
from continual_blr.models import build_model


class _RecordingSGD(torch.optim.SGD):
    """SGD that records every parameter group's ``lr`` at each step."""

    seen: list[list[float]]

    def step(self, closure=None):  # noqa: D102
        self.seen.append([g["lr"] for g in self.param_groups])
        return super().step(closure)


def _lrs(warmup_steps: int, tasks: int = 2) -> list[list[list[float]]]:
    s = make_stream("synthetic", scenario="task", n_tasks=tasks, n_classes_per_task=2, n_features=4, n_train=40,
                    n_test=8, seed=0)
    model = build_model("mlp", (4,), 2, tasks, hidden=(8,), generator=torch.Generator().manual_seed(0))
    method = build_method("none", {}, seed=0)
    train = TrainConfig(epochs=3, batch_size=16, lr=0.3, optimizer="sgd", warmup_steps=warmup_steps)
    method.setup(model, s, train)
    per_task = []

    def make(model_, task, train_):
        opt = _RecordingSGD([{"params": list(model_.body.parameters())},
                             {"params": list(model_.heads.parameters()), "lr": 0.6}], lr=train_.lr)
        opt.seen = []
        per_task.append(opt.seen)
        return opt

    method.make_optimizer = make
    g = torch.Generator().manual_seed(0)
    for i, t in enumerate(s.tasks):
        fit_task(model, t, method, train, seen=s.tasks[: i + 1], generator=g, progress=False)
    return per_task


def test_each_tasks_first_steps_ramp_linearly_then_hold_every_groups_own_rate():
    """k = 4, 9 steps a task (3 epochs of 3 minibatches), two groups at 0.3 and 0.6: steps 1-4 at i/4 of each group's
    rate, steps 5-9 at the full rate, and the ramp starts again with the second task's fresh optimiser."""
    for seen in _lrs(4):
        expect = [[0.3 * f, 0.6 * f] for f in (0.25, 0.5, 0.75, 1.0)] + [[0.3, 0.6]] * 5
        assert len(seen) == 9
        for got, want in zip(seen, expect):
            assert got == pytest.approx(want, rel=1e-15)


def test_no_warmup_leaves_the_rates_alone():
    for seen in _lrs(0):
        assert seen == [[0.3, 0.6]] * 9


def test_bad_warmup_is_a_one_line_error():
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="train.warmup_steps"):
            TrainConfig(warmup_steps=bad)
