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


def _kept_optimiser_rates(name: str, n_tasks: int, warmup_steps: int) -> list[list[list[float]]]:
    """Method ``name``'s (a BLR method: one optimiser kept across the stream) parameter groups' ``lr`` at every step,
    per task, over a small ``n_tasks``-task stream of 6 steps a task."""
    s = make_stream("synthetic", scenario="task", n_tasks=n_tasks, n_classes_per_task=2, n_features=4, n_train=40,
                    n_test=8, seed=0)
    model = build_model("mlp", (4,), 2, n_tasks, hidden=(8,), generator=torch.Generator().manual_seed(0))
    method = build_method(name, {}, seed=0)
    train = TrainConfig(epochs=2, batch_size=16, lr=0.05, warmup_steps=warmup_steps)
    method.setup(model, s, train)
    per_task: list[list[list[float]]] = []
    make, wrapped = method.make_optimizer, set()

    def recording(model_, task, train_):
        opt = make(model_, task, train_)
        per_task.append([])
        if id(opt) not in wrapped:  # one optimiser for the whole stream: wrap its step once
            wrapped.add(id(opt))
            step = opt.step

            def step_and_record(*args, **kwargs):
                per_task[-1].append([g["lr"] for g in opt.param_groups])
                return step(*args, **kwargs)

            opt.step = step_and_record
        return opt

    method.make_optimizer = recording
    g = torch.Generator().manual_seed(0)
    for i, t in enumerate(s.tasks):
        fit_task(model, t, method, train, seen=s.tasks[: i + 1], generator=g, progress=False)
    assert len(wrapped) == 1 and len(per_task) == n_tasks, "the tests need one optimiser kept across the tasks"
    return per_task


@pytest.mark.parametrize("name", ["blr", "ivon"])
def test_the_bayesian_learning_rules_step_sizes_ramp_too(name):
    """The BLR optimisers (their state is the posterior, kept across tasks) take the same ramp: k = 3, each task's
    steps 1-3 at i/3 of the rate its step 4 runs at, and that rate the same at both tasks."""
    per_task = _kept_optimiser_rates(name, 2, 3)
    full = per_task[0][3]
    assert all(b > 0 for b in full)
    for seen in per_task:
        assert len(seen) > 3
        for i, got in enumerate(seen, start=1):
            assert got == pytest.approx([b * min(i / 3, 1.0) for b in full], rel=1e-15)


def test_a_kept_optimiser_that_ends_a_task_inside_its_ramp_ramps_to_the_full_rate_at_the_next():
    """k = 50 with 6 steps a task: every task ends inside its ramp, and each next task's first step is again at 1/50
    of the first task's full rate (not of the reduced rate the last task ended at)."""
    per_task = _kept_optimiser_rates("ivon", 3, 50)
    first = per_task[0][0]
    assert first[0] > 0 and per_task[0][-1][0] == pytest.approx(first[0] * len(per_task[0]), rel=1e-12)
    assert per_task[1][0] == first and per_task[2][0] == first
