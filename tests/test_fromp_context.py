"""FROMP's context points (``context_points`` / ``context_weight``, :mod:`continual_blr.regularizers.context`).

The failure they target (issue 43, the reduced ResNet-18): the penalty is met at the memorable points while the rest
of a past task's function drifts. Reproduced small: a wide ReLU MLP with two 2-way heads, 4 memorable points of task
1, task 2 trained with FROMP; the head-1 logits of task 1's held-out inputs move far more than at the memorable
points. Oracles: float64 brute force (per-example Jacobians and the GGN from ``tests/oracles.py``, the previous
network's outputs from an independent copy), exact zeros at the task's start.
"""

from __future__ import annotations

import copy

import pytest
import torch

import oracles as O
from conftest import EXACT
from continual_blr.data import make_stream
from continual_blr.data.stream import Task
from continual_blr.loop import fit_task
from continual_blr.memory import NormStatistics
from continual_blr.methods import MethodParamsError, TrainConfig, build_method
from continual_blr.models import build_model
from continual_blr.regularizers.functional import FunctionalRegularizer
from continual_blr.types import Batch

DT = torch.float64


def _two_tasks(hidden=(16, 16), n_train=100):
    s = make_stream("synthetic", scenario="task", n_tasks=2, n_classes_per_task=2, n_features=5, n_train=n_train,
                    n_test=200, seed=0, separation=2.0)
    tasks = [t.to("cpu", dtype=DT) for t in s.tasks]
    model = build_model("mlp", (5,), 2, 2, hidden=hidden, generator=torch.Generator().manual_seed(0)).to(DT)
    return s, tasks, model


def _fit_task1(model, task, epochs=30):
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(epochs):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(task.x_train, head=task.head), task.y_train).backward()
        opt.step()


def _grad(model):
    return torch.cat([torch.zeros(p.numel(), dtype=p.dtype) if p.grad is None else p.grad.reshape(-1)
                      for p in model.parameters()])


def _perturb(model, scale=0.05, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=DT))


@pytest.mark.parametrize("output", ["probs", "logits"])
@pytest.mark.parametrize("tau_scale", ["none", "kernel"])
def test_the_context_term_equals_its_definition(output, tau_scale):
    """penalty(context n) − penalty(context 0) = (τ w / 2) Σ_c (1/d̄_c) Σ_{x ∈ first n rows} (o_c(x; θ) −
    o_c(x; θ₀))², with o the compared outputs of task 1's head, θ₀ an independent copy of the weights at the
    rebuild, and d̄_c the mean diagonal of J_c Σ J_cᵀ at the memorable points from per-example Jacobians and
    Σ = diag 1/(GGN + δ) of task 1's data (1 under ``tau_scale: kernel``); and the gradients differ by the oracle's."""
    torch.manual_seed(0)
    _, tasks, model = _two_tasks()
    _fit_task1(model, tasks[0])
    kw = dict(tau=3.0, n_points=6, prior_precision=1e-2, output=output, tau_scale=tau_scale)
    with_ctx = FunctionalRegularizer(**kw, context_points=7, context_weight=0.5)
    without = FunctionalRegularizer(**kw)
    for reg in (with_ctx, without):
        reg.on_task_end(model, tasks[0])
        reg.rebuild(model)
    model0 = copy.deepcopy(model)
    _perturb(model)
    batch = Batch(tasks[1].x_train[:10], tasks[1].y_train[:10], tasks[1].head)

    def value_and_grad(reg):
        model.zero_grad()
        v = reg.penalty(model, batch, tasks[1])
        v.backward()
        return v.detach(), _grad(model)

    (v1, g1), (v0, g0) = value_and_grad(with_ctx), value_and_grad(without)

    def compared(f):
        return f.softmax(-1) if output == "probs" else f - f.mean(-1, keepdim=True)

    x_mem = with_ctx.memory[0].x
    fisher = torch.diagonal(O.ggn(model0, tasks[0].x_train, head=0))
    sigma = torch.diag(1.0 / (fisher + 1e-2))
    j = O.jacobians(model0.eval(), x_mem, head=0, output_fn=compared)  # [M, C, P]
    dbar = torch.einsum("mcp,pq,mcq->cm", j, sigma, j).mean(-1)  # [C]
    if tau_scale == "kernel":
        dbar = torch.ones_like(dbar)
    xc = batch.x[:7]
    model.zero_grad()
    d = compared(model(xc, head=0)) - compared(model0(xc, head=0)).detach()
    expect = 0.5 * 3.0 * 0.5 * ((d * d).sum(0) / dbar).sum()
    expect.backward()
    g_expect = _grad(model)
    assert float(expect.detach()) > 1e-9  # the perturbation moves the outputs (1e3 × the tolerance)
    torch.testing.assert_close(v1 - v0, expect.detach(), **EXACT)
    torch.testing.assert_close(g1 - g0, g_expect, **EXACT)


def test_the_context_term_is_zero_at_the_tasks_start_and_zero_points_change_nothing():
    """At θ = θ_{t−1} the context term and its gradient are exactly 0 (the same penalty and gradient as without it),
    and ``context_points`` 0 gives the penalty without the option bit for bit at any θ."""
    _, tasks, model = _two_tasks()
    _fit_task1(model, tasks[0])
    regs = [FunctionalRegularizer(tau=2.0, n_points=6, output="logits", context_points=n) for n in (0, 8)]
    base = FunctionalRegularizer(tau=2.0, n_points=6, output="logits")
    for reg in regs + [base]:
        reg.on_task_end(model, tasks[0])
        reg.rebuild(model)
    batch = Batch(tasks[1].x_train[:16], tasks[1].y_train[:16], tasks[1].head)
    for perturbed in (False, True):
        if perturbed:
            _perturb(model)
        outs = []
        for reg in regs + [base]:
            model.zero_grad()
            v = reg.penalty(model, batch, tasks[1])
            v.backward()
            outs.append((v.detach(), _grad(model)))
        assert torch.equal(outs[0][0], outs[2][0]) and torch.equal(outs[0][1], outs[2][1])
        if not perturbed:
            assert torch.equal(outs[1][0], outs[2][0]) and torch.equal(outs[1][1], outs[2][1])
        else:
            assert float(outs[1][0]) > float(outs[2][0])


def _shared_input_tasks():
    """Two 2-way tasks on the **same** input distribution (x ~ N(0, I₅)) with different labellings, sign(x₀ + x₁) and
    sign(x₁ − x₂): as split CIFAR's tasks, all natural images, share low-level statistics. 200 train / 200 test each."""
    g = torch.Generator().manual_seed(0)

    def task(i, w):
        x = torch.randn(400, 5, generator=g, dtype=DT)
        y = (x @ torch.tensor(w, dtype=DT) > 0).long()
        return Task(i, x[:200], y[:200], x[200:], y[200:], (2 * i, 2 * i + 1), i, f"shared/{i}")

    return [task(0, [1.0, 1.0, 0.0, 0.0, 0.0]), task(1, [0.0, 1.0, -1.0, 0.0, 0.0])]


def test_context_points_hold_the_held_out_function_that_memorable_points_alone_let_drift():
    """The failure (issue 43, ResNet): trained on task 2 with FROMP over 4 memorable points of task 1 (logits), a
    wide MLP keeps head 1's centred logits at those points within 0.05 RMS of the previous function while task 1's
    held-out inputs drift 20 × further and their accuracy falls by more than 10 points. With 32 context points
    (w 1) the held-out drift falls at least 5-fold, task 1's held-out accuracy stays within 2 points of where it
    was, and task 2 is still learned (≥ 90 %)."""
    tasks = _shared_input_tasks()
    stream = make_stream("synthetic", scenario="task", n_tasks=2, n_classes_per_task=2, n_features=5, n_train=20,
                         n_test=20, seed=0)

    def run(context_points):
        model = build_model("mlp", (5,), 2, 2, hidden=(64, 64), generator=torch.Generator().manual_seed(0)).to(DT)
        method = build_method("fromp", {"tau": 10.0, "n_points": 4, "prior_precision": 1e-3, "output": "logits",
                                        "context_points": context_points}, seed=0)
        train = TrainConfig(epochs=30, batch_size=32, lr=0.01)
        method.setup(model, stream, train)
        g = torch.Generator().manual_seed(0)
        fit_task(model, tasks[0], method, train, seen=tasks[:1], generator=g, progress=False)
        mem_x = method.regularizer.memory[0].x
        model.eval()
        with torch.no_grad():
            held0, mem0 = model(tasks[0].x_test, head=0), model(mem_x, head=0)
        fit_task(model, tasks[1], method, train, seen=tasks, generator=g, progress=False)
        model.eval()
        with torch.no_grad():
            held1, mem1 = model(tasks[0].x_test, head=0), model(mem_x, head=0)
            new = model(tasks[1].x_test, head=1)
        c = lambda f: f - f.mean(-1, keepdim=True)  # noqa: E731
        rms = lambda a, b: float((c(a) - c(b)).pow(2).mean().sqrt())  # noqa: E731
        acc = lambda f, y: float((f.argmax(-1) == y).double().mean())  # noqa: E731
        return (rms(held1, held0), rms(mem1, mem0), acc(held0, tasks[0].y_test), acc(held1, tasks[0].y_test),
                acc(new, tasks[1].y_test))

    held, mem, before, after, _ = run(0)
    assert mem < 0.05 and held > 20 * mem and after < before - 0.10, \
        f"failure not reproduced: held-out drift {held:.3f}, memorable {mem:.3f}, accuracy {before} -> {after}"
    held_ctx, _, before_ctx, after_ctx, new_ctx = run(32)
    assert held_ctx < held / 5, (held_ctx, held)
    assert after_ctx >= before_ctx - 0.02 and new_ctx >= 0.90, (before_ctx, after_ctx, new_ctx)


def test_per_task_statistics_reach_the_frozen_network_too():
    """Under per-task BatchNorm statistics both forwards of the context term run on the stored task's statistics:
    at the rebuild's weights, with the network's own running statistics (and the frozen copy's) other than the
    stored task's, the term is exactly 0."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 2)).to(DT)
    x = torch.randn(40, 5, dtype=DT)
    y = (x[:, 0] > 0).long()
    task = Task(0, x, y, x, y, (0, 1), 0, "bn/0")
    model.train()
    model(x)  # running statistics
    reg = FunctionalRegularizer(tau=1.0, n_points=4, output="logits", context_points=10)
    stats = NormStatistics()
    stats.save(model, 0)
    reg.norm_statistics = stats
    reg.on_task_end(model, task)
    model.train()
    with torch.no_grad():
        model(x - 2.0)  # a later task's statistics: the frozen copy taken at the rebuild holds these
    reg.rebuild(model)
    model.train()
    with torch.no_grad():
        model(3.0 * x + 1.0)  # the network's own statistics move; task 0's stored ones do not
    batch = Batch(x[:10], y[:10], 0)
    assert float(reg._context(model, batch, None, None).detach()) == 0.0
    reg.norm_statistics = None  # planted: the current statistics for the current network, stale ones frozen
    assert float(reg._context(model, batch, None, None).detach()) > 1e-6


def test_bad_context_settings_are_one_line_errors():
    for params, word in (({"context_points": -1}, "params.context_points"),
                         ({"context_points": 2.5}, "params.context_points"),
                         ({"context_weight": float("nan")}, "params.context_weight"),
                         ({"context_points": 4, "fused_forward": True}, "params.context_points"),
                         ({"context_points": 4, "tasks_per_step": 1, "task_estimator": "saga"},
                          "params.context_points")):
        with pytest.raises((MethodParamsError, ValueError), match=word):
            build_method("fromp", params, seed=0)
    with pytest.raises(ValueError, match="context_weight"):
        FunctionalRegularizer(context_weight=-1.0)


def test_one_body_pass_gives_each_tasks_own_forward():
    """With one set of BatchNorm statistics a multi-head network's context term runs its body once for every stored
    task's head; the sum equals that of one forward per task (``per_task_norm``) bit for bit, its gradient to
    round-off (the heads' pulls on the body are summed before one backward through it instead of after three)."""
    from contextlib import nullcontext

    from continual_blr.regularizers.context import context_sum, frozen_copy
    from continual_blr.regularizers.functional import _prob_fn

    g = torch.Generator().manual_seed(0)
    model = build_model("mlp", (5,), 2, 3, hidden=(8,), generator=g).to(DT)
    snapshot = frozen_copy(model)
    _perturb(model)
    from continual_blr.memory import MemoryEntry
    entries = []
    for t in range(3):
        e = MemoryEntry(task_id=t, head=t, x=torch.zeros(1, 5, dtype=DT), y=torch.zeros(1, dtype=torch.long),
                        indices=torch.zeros(1, dtype=torch.long), scores=torch.zeros(1, dtype=DT), selection="lambda")
        e.extras["context_scale"] = torch.tensor([1.0 + t, 2.0 + t], dtype=DT)
        entries.append(e)
    x = torch.randn(6, 5, generator=g, dtype=DT)
    results = []
    for per_task in (False, True):
        model.zero_grad()
        v = context_sum(model, snapshot, x, entries, lambda cols: _prob_fn(cols, False, "logits"),
                        lambda m, t: nullcontext(), per_task_norm=per_task)
        v.backward()
        results.append((v.detach(), _grad(model)))
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1], **EXACT)  # the body's gradient summed in another order
    assert float(results[0][0]) > 0


def test_under_tasks_per_step_every_stored_task_enters_the_context_term():
    """With k = 1 of 2 stored tasks drawn for the memorable part, the context term still sums over both tasks: the
    difference with and without context points equals ``context_sum`` over the whole memory (same draws)."""
    from contextlib import nullcontext

    from continual_blr.regularizers.context import context_sum
    from continual_blr.regularizers.functional import _prob_fn

    s = make_stream("synthetic", scenario="task", n_tasks=3, n_classes_per_task=2, n_features=5, n_train=60,
                    n_test=10, seed=0)
    tasks = [t.to("cpu", dtype=DT) for t in s.tasks]
    model = build_model("mlp", (5,), 2, 3, hidden=(16,), generator=torch.Generator().manual_seed(0)).to(DT)
    regs = [FunctionalRegularizer(tau=2.0, n_points=4, output="logits", tasks_per_step=1, context_points=n,
                                  generator=torch.Generator().manual_seed(3)) for n in (8, 0)]
    for t in tasks[:2]:
        _fit_task1(model, t, epochs=5)
        for reg in regs:
            reg.on_task_end(model, t)
    for reg in regs:
        reg.rebuild(model)
    snapshot = regs[0]._snapshot
    _perturb(model)
    batch = Batch(tasks[2].x_train[:8], tasks[2].y_train[:8], tasks[2].head)
    with torch.no_grad():
        diff = regs[0].penalty(model, batch, tasks[2]) - regs[1].penalty(model, batch, tasks[2])
        full = context_sum(model, snapshot, batch.x, list(regs[0].memory), lambda c: _prob_fn(c, False, "logits"),
                           lambda m, t: nullcontext())
    assert len(regs[0].memory) == 2 and float(full) > 0
    torch.testing.assert_close(diff, 0.5 * 2.0 * full, **EXACT)
