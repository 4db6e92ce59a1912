"""FROMP's ``tasks_per_step``: the penalty over k of the n stored tasks per step, scaled by n / k.

The guarantee in :mod:`continual_blr.regularizers.functional`: the estimate is unbiased, for the penalty and for its
gradient. Oracle: the exact expectation, the average over all C(n, k) equally likely subsets, against the penalty
over every task, in float64 (tolerance ``EXACT``). Planted bugs it catches: the n / k factor left out, a subset that
keeps a task twice or leaves a position unreachable, k ≥ n drawing anyway.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from conftest import EXACT
from fromp_cases import store_past_tasks
from continual_blr.data import make_stream
from continual_blr.methods import MethodParamsError, build_method
from continual_blr.models import build_model
from continual_blr.regularizers.functional import FunctionalRegularizer
from continual_blr.types import Batch, flatten

DT = torch.float64


def _regulariser_with_past(scenario: str, k: int, n_past: int = 4, kernel: str = "classwise"):
    """A float64 MLP and a regulariser holding ``n_past`` tasks of a synthetic stream; the weights are moved after
    the rebuild so that every Δp is nonzero. Returns (regulariser, model, the current task)."""
    torch.set_num_threads(1)
    s = make_stream("synthetic", scenario=scenario, n_tasks=n_past + 1, n_classes_per_task=2, n_features=5,
                    n_train=30, n_test=5, seed=0)
    tasks = [t.to("cpu", dtype=DT) for t in s.tasks]
    model = build_model("mlp", (5,), s.n_outputs, s.n_heads, hidden=(8,),
                        generator=torch.Generator().manual_seed(0)).to(DT)
    reg = FunctionalRegularizer(tau=3.0, n_points=6, kernel=kernel, prior_precision=1e-2, jitter=1e-6,
                                class_incremental=scenario == "class", tasks_per_step=k,
                                generator=torch.Generator().manual_seed(1))
    store_past_tasks(reg.on_task_end, reg.on_task_start, model, tasks, torch.Generator().manual_seed(2))
    return reg, model, tasks[-1]


def _value_and_grad(reg, model, task, subset):
    model.zero_grad()
    batch = Batch(task.x_train[:2], task.y_train[:2], task.head)
    pen = reg._penalty(model, batch, task, None, None, subset)
    pen.backward()
    return pen.detach(), flatten({n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                               for n, p in model.named_parameters()})


@pytest.mark.parametrize("scenario", ["task", "class"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_estimate_is_unbiased_for_the_penalty_and_its_gradient(scenario, k):
    """E_S[(n / k) · R_S] over the C(n, k) equally likely k-subsets S equals the penalty over all n tasks, value
    and gradient (multi-head: one forward per stored task; class-incremental: the tasks share one head's forward)."""
    reg, model, task = _regulariser_with_past(scenario, k)
    n = len(reg.memory)
    full_v, full_g = _value_and_grad(reg, model, task, None)
    assert full_v > 0
    subsets = list(itertools.combinations(range(n), k))
    vals, grads = zip(*(_value_and_grad(reg, model, task, list(s)) for s in subsets))
    torch.testing.assert_close(torch.stack(vals).mean(), full_v, **EXACT)
    torch.testing.assert_close(torch.stack(grads).mean(0), full_g, **EXACT)
    # and a single draw is not the full penalty (the test would pass vacuously if every subset were everything)
    assert not torch.allclose(vals[0], full_v, rtol=1e-6, atol=0.0)


def test_the_full_kernel_estimate_is_unbiased_too():
    reg, model, task = _regulariser_with_past("task", 2, kernel="full")
    full_v, full_g = _value_and_grad(reg, model, task, None)
    vals, grads = zip(*(_value_and_grad(reg, model, task, list(s))
                        for s in itertools.combinations(range(len(reg.memory)), 2)))
    torch.testing.assert_close(torch.stack(vals).mean(), full_v, **EXACT)
    torch.testing.assert_close(torch.stack(grads).mean(0), full_g, **EXACT)


def test_draws_are_k_distinct_tasks_every_task_as_often_and_seeded():
    """Each draw: k distinct positions in range, sorted. Over 6,000 draws of k = 1 of n = 4, every task is drawn
    with frequency 1/4 within 5 binomial standard deviations. Two regularisers with equally seeded generators draw
    the same sequence."""
    reg, _, _ = _regulariser_with_past("task", 2)
    n, draws = len(reg.memory), [reg.draw_tasks() for _ in range(3000)]
    assert all(len(d) == 2 and len(set(d)) == 2 and d == sorted(d) and 0 <= d[0] and d[-1] < n for d in draws)
    reg.tasks_per_step = 1
    counts = torch.bincount(torch.tensor([reg.draw_tasks()[0] for _ in range(6000)]), minlength=n).double()
    sd = math.sqrt(6000 * 0.25 * 0.75)
    assert ((counts - 1500).abs() < 5 * sd).all(), counts
    a, _, _ = _regulariser_with_past("task", 1)
    b, _, _ = _regulariser_with_past("task", 1)
    assert [a.draw_tasks() for _ in range(20)] == [b.draw_tasks() for _ in range(20)]


def test_k_at_least_n_or_zero_uses_every_task_and_draws_nothing():
    """k = 0 and k ≥ n: no subset, the generator untouched, the public penalty equals the full one bit for bit."""
    for k in (0, 4, 7):
        reg, model, task = _regulariser_with_past("task", k)
        state = reg.generator.get_state()
        assert reg.draw_tasks() is None
        v = reg.penalty(model, Batch(task.x_train[:2], task.y_train[:2], task.head), task)
        assert torch.equal(reg.generator.get_state(), state)
        assert torch.equal(v, reg._penalty(model, Batch(task.x_train[:2], task.y_train[:2], task.head), task,
                                           None, None, None))


def test_the_public_penalty_uses_one_draw_per_call():
    """penalty(...) with k = 1 of 4 equals the scaled single-task term of the task the generator draws next."""
    reg, model, task = _regulariser_with_past("task", 1)
    batch = Batch(task.x_train[:2], task.y_train[:2], task.head)
    ahead = torch.Generator().manual_seed(0)
    ahead.set_state(reg.generator.get_state())
    expected_subset = sorted(torch.randperm(len(reg.memory), generator=ahead)[:1].tolist())
    v = reg.penalty(model, batch, task)
    torch.testing.assert_close(v, reg._penalty(model, batch, task, None, None, expected_subset), rtol=0, atol=0)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_a_bad_tasks_per_step_is_a_one_line_error(bad):
    with pytest.raises(MethodParamsError, match="tasks_per_step"):
        build_method("fromp", {"tasks_per_step": bad})
    with pytest.raises(ValueError, match="tasks_per_step"):
        FunctionalRegularizer(tasks_per_step=bad)


def test_every_fromp_type_method_takes_it():
    for name in ("fromp", "frorp", "fromp-l2", "fromp-replay"):
        m = build_method(name, {"tasks_per_step": 2})
        assert m.regularizer.tasks_per_step == 2
        assert m.regularizer.generator is m.generator  # drawn from the method's stream: saved with a checkpoint


# ------------------------------------------------------------------------------------- task_estimator: saga


def _saga_grad(reg, model, task, subset, state):
    """The gradient and value of the SAGA term for ``subset`` from the table ``state`` (restored afterwards)."""
    import copy

    saved = reg._saga
    reg._saga = copy.deepcopy(state)
    model.zero_grad()
    out = reg._saga_penalty(model, Batch(task.x_train[:2], task.y_train[:2], task.head), task, None, None, subset)
    out.backward()
    g = flatten({n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
    reg._saga = saved
    return out.detach(), g


def _stale_table(reg, model, task):
    """A table of per-task gradients taken at other weights: three SAGA draws with the weights moved between them."""
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        reg.penalty(model, Batch(task.x_train[:2], task.y_train[:2], task.head), task)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=DT))
    assert len(reg._saga[1]) >= 2  # some tasks hold a stale gradient, maybe not all
    return reg._saga


@pytest.mark.parametrize("scenario", ["task", "class"])
@pytest.mark.parametrize("k", [1, 2])
def test_saga_is_unbiased_from_any_table_and_its_value_is_the_plain_estimate(scenario, k):
    """E_S[v] = ∇R(θ) exactly (average over the C(n, k) subsets, float64), from a table of gradients taken at other
    weights; the returned value is the plain estimate (n / k) Σ_S R_s."""
    reg, model, task = _regulariser_with_past(scenario, k)
    reg.task_estimator = "saga"
    state = _stale_table(reg, model, task)
    full_v, full_g = _value_and_grad(reg, model, task, None)
    subsets = [list(s) for s in itertools.combinations(range(len(reg.memory)), k)]
    results = [_saga_grad(reg, model, task, s, state) for s in subsets]
    torch.testing.assert_close(torch.stack([g for _, g in results]).mean(0), full_g, **EXACT)
    for s, (value, _) in zip(subsets, results):
        torch.testing.assert_close(value, _value_and_grad(reg, model, task, s)[0], **EXACT)
    # and the table matters: one draw's v differs from the plain estimate's gradient for the same subset
    assert not torch.allclose(results[0][1], _value_and_grad(reg, model, task, subsets[0])[1], rtol=1e-6, atol=0.0)


def test_saga_starts_each_task_from_a_zero_table():
    """After a rebuild (a task start, Δp = 0) the table is empty: the first draw's v is the plain estimate's
    gradient (n / k) ∇R_S, exactly."""
    reg, model, task = _regulariser_with_past("task", 1)
    reg.task_estimator = "saga"
    _stale_table(reg, model, task)
    reg.rebuild(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    _, plain = _value_and_grad(reg, model, task, [2])
    _, first = _saga_grad(reg, model, task, [2], reg._saga)
    torch.testing.assert_close(first, plain, **EXACT)


def test_saga_refuses_a_params_closure_and_a_bad_name():
    reg, model, task = _regulariser_with_past("task", 1)
    reg.task_estimator = "saga"
    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="task_estimator: 'saga' needs the model's own parameters"):
        reg.penalty(model, Batch(task.x_train[:2], task.y_train[:2], task.head), task, params=params)
    with pytest.raises(MethodParamsError, match="task_estimator"):
        build_method("fromp", {"task_estimator": "sag"})
