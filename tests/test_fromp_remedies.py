"""FROMP's failures on split CIFAR-10 (issue 43), each reproduced small, and the library's remedies for them.

1. Saturation: a memorised task's memorable point ends with K_ii = (λ² G)_ii ≈ 0 at a later rebuild, so the
   penalty weighs it by 1/ε. Remedy: kernel health (``jitter_relative``, ``drop_below``) — no kept point below the
   floor, the dropped ones counted.
2. A flipped point on its plateau: Δp ≈ 1 at such a point costs ≈ τ/ε while the gradient (∝ λ) vanishes.
   Remedies: ``output: logits`` (centred logits: no λ factors; quadratic, with the GP's own weight) or dropping it.
3. BatchNorm running statistics: the penalty runs in eval mode on statistics every train-mode batch of the new task
   overwrites, so with no weight change it rises. Remedy: ``train.batchnorm: per_task``.

Oracles: dense float64 brute force (per-example Jacobians from ``tests/oracles.py``, the diagonal GGN, explicit
kernels and solves), closed forms on a linear model, and exact equalities (a penalty of exactly 0, statistics
equal bit for bit). Tolerances: ``EXACT`` (conftest) for float64 oracles; ``LINEARISATION`` where a penalty is
compared with its linearised value at a step of 1e-6 (relative error O(step)).
"""

from __future__ import annotations

import copy
import csv
import math

import pytest
import torch
from torch import nn

import oracles as O
from conftest import EXACT
from continual_blr.data import make_stream
from continual_blr.data.stream import Task
from continual_blr.loop import evaluate_task, fit_task, run_stream
from continual_blr.memory import NormStatistics, norm_layers
from continual_blr.methods import MethodParamsError, TrainConfig, build_method
from continual_blr.models import MultiHeadNet, build_model
from continual_blr.regularizers.functional import FunctionalRegularizer, _unit_mean_diagonal, condition_kernel
from continual_blr.types import Batch, flatten, unflatten

DT = torch.float64
EPS = 1e-6
LINEARISATION = dict(rtol=1e-4, atol=0.0)  # penalty at a step of size 1e-6 vs its quadratic (linearised) value


def _grad(model):
    return flatten({n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()})


def _penalty_and_grad(reg, model, task):
    model.zero_grad()
    pen = reg.penalty(model, Batch(task.x_train[:2], task.y_train[:2], task.head), task)
    pen.backward()
    return pen.detach(), _grad(model)


# ------------------------------------------------------------------------------------------ 1. saturation


def _memorised_stream_and_model(drop_below=0.0, jitter_relative=0.0):
    """Issue 43's precondition: a ReLU MLP with three 2-way heads, task 1 memorised, task 2 trained without the
    penalty (τ = 0); returns the method after task 3's rebuild. Float64, about a second."""
    torch.set_num_threads(1)
    s = make_stream("synthetic", scenario="task", n_tasks=3, n_classes_per_task=2, n_features=5, n_train=100,
                    n_test=10, seed=0, separation=3.0)
    tasks = [t.to("cpu", dtype=DT) for t in s.tasks]
    model = build_model("mlp", (5,), 2, 3, hidden=(16, 16), generator=torch.Generator().manual_seed(0)).to(DT)
    method = build_method("fromp", {"tau": 0.0, "n_points": 10, "prior_precision": 1e-4, "jitter": EPS,
                                    "jitter_relative": jitter_relative, "drop_below": drop_below}, seed=0)
    method.setup(model, s, TrainConfig())
    train = TrainConfig(epochs=40, batch_size=50, lr=0.05)
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        fit_task(model, tasks[i], method, train, seen=tasks[: i + 1], generator=g, progress=False)
    method.on_task_start(model, tasks[2])
    return method, model, tasks


def test_saturated_points_reach_the_jitter_and_the_health_option_drops_and_counts_them():
    """Today's kernels (health off): task 1's memorable points include some with K_ii ≤ 2ε at task 3's rebuild
    (the precondition). With ``jitter_relative`` r = 1e-6 and ``drop_below`` c = 100: ε' = max(ε, r · max d)
    per class kernel, every kept (point, class) has d_i ≥ c ε', the dropped ones are exactly those below (the
    oracle: the diagonal of the health-off kernel minus ε), and the count is in the regulariser's health record and
    in the method's epoch log."""
    method, model, tasks = _memorised_stream_and_model()
    reg = method.regularizer
    k1 = reg.memory[0].extras["kernel"]  # K + εI of task 1, health off
    d = torch.diagonal(k1, dim1=-2, dim2=-1) - EPS
    assert int((d <= EPS).sum()) >= 1, "precondition not reproduced: no memorable point of task 1 at the jitter"

    r, c = 1e-6, 100.0
    reg.jitter_relative, reg.drop_below = r, c
    method.on_task_start(model, tasks[2])
    e = reg.memory[0]
    eps = torch.clamp(r * d.amax(-1), min=EPS)  # [C]
    keep = e.extras["keep"]
    torch.testing.assert_close(e.extras["jitters"], eps, **EXACT)
    # the same (point, class) pairs as the oracle, none kept below the floor (no pair within 1 % of it here)
    assert not bool(((d - c * eps[:, None]).abs() < 0.01 * c * eps[:, None]).any())
    assert torch.equal(keep, d >= c * eps[:, None])
    assert bool((d[keep] >= (c * eps[:, None]).expand_as(d)[keep]).all())
    dropped_points = int((~keep).any(0).sum())
    assert dropped_points >= 1
    rec = reg.health[-1][0]
    assert (rec["task_id"], rec["dropped_points"], rec["dropped_outputs"]) == (0, dropped_points, int((~keep).sum()))
    stats = method.epoch_stats()
    assert stats["kernel_dropped"] == sum(r_["dropped_points"] for r_ in reg.health[-1])
    assert stats["kernel_min_diag"] == pytest.approx(min(r_["min_diag"] for r_ in reg.health[-1]), rel=1e-12)

    # the penalty equals the oracle over the kept pairs only: (τ/2) Σ_c Δp_keptᵀ (K_kept + ε'_c I)⁻¹ Δp_kept
    reg.tau = 2.0
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=DT))
    pen, _ = _penalty_and_grad(reg, model, tasks[2])
    expect = torch.zeros((), dtype=DT)
    for entry in reg.memory:
        kraw = entry.extras["kernel"].clone()
        kp = entry.extras["keep"]
        with torch.no_grad():
            dp = model(entry.x, head=entry.head).softmax(-1) - entry.extras["p_old"]
        for cls in range(2):
            idx = kp[cls].nonzero().squeeze(1)
            kc = kraw[cls][idx][:, idx]  # the kept block of K' + ε'I is K_kept + ε'I
            expect = expect + dp[idx, cls] @ torch.linalg.solve(kc, dp[idx, cls])
    torch.testing.assert_close(pen, 0.5 * reg.tau * expect, **EXACT)


def test_condition_kernel_equals_its_definition():
    """``condition_kernel`` on random PSD kernels with planted tiny diagonals: ε' = max(ε, r max d), keep = d ≥ c ε',
    K' = K on kept pairs + the identity on dropped rows, L Lᵀ = K' + ε'I."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 6, 6, generator=g, dtype=DT)
    a[:, 2] *= 1e-6  # point 2 of every kernel has a vanishing Jacobian
    k = a @ a.mT
    kj, chol, eps, keep, d = condition_kernel(k, 1e-6, 1e-3, 10.0)
    torch.testing.assert_close(d, torch.diagonal(k, dim1=-2, dim2=-1), **EXACT)
    torch.testing.assert_close(eps, torch.clamp(1e-3 * d.amax(-1), min=1e-6), **EXACT)
    assert torch.equal(keep, d >= 10.0 * eps[:, None]) and not bool(keep[:, 2].any()) and bool(keep[:, 0].all())
    both = keep[:, :, None] & keep[:, None, :]
    expect = torch.where(both, k, 0.0) + torch.diag_embed((~keep).to(DT)) + eps[:, None, None] * torch.eye(6, dtype=DT)
    torch.testing.assert_close(kj, expect, **EXACT)
    torch.testing.assert_close(chol @ chol.mT, expect, **EXACT)
    kj0, _, eps0, keep0, _ = condition_kernel(k, 1e-6)  # options off: the absolute jitter, nothing dropped
    assert keep0 is None and bool((eps0 == 1e-6).all())
    torch.testing.assert_close(kj0, k + 1e-6 * torch.eye(6, dtype=DT), **EXACT)


# ------------------------------------------------------------------------------- 2. a flipped point's plateau


def _saturated_logistic() -> tuple[nn.Module, Task]:
    """f(x) = W x + b on one 2-way head, W = [[10, 0], [−10, 0]], b = 0, and the task of the two points x_a = (1, 0)
    (class 0) and x_b = (−1, 0) (class 1): margins ±20, both saturated (λ = p(1 − p) ≈ 2e-9)."""
    model = build_model("linear", (2,), 2, 1).to(DT)
    with torch.no_grad():
        model.heads[0].weight.copy_(torch.tensor([[10.0, 0.0], [-10.0, 0.0]], dtype=DT))
        model.heads[0].bias.zero_()
    x = torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=DT)
    y = torch.tensor([0, 1])
    return model, Task(0, x, y, x, y, (0, 1), 0, "saturated/0")


def _flip_setup(**kw):
    """Logistic regression with one 2-way head, f(x) = W x + b, W = [[s, 0], [−s, 0]], b = 0: the margin
    m(x) = f_0 − f_1 = 2 s x_1 is 20 at x_a = (1, 0) (class 0) and −20 at x_b = (−1, 0) (class 1), so both are
    saturated (λ = p(1 − p) ≈ 2e-9) when task 1 ends and at the rebuild. Then the head is negated: both points
    flip (Δp = ∓(1 − 4e-9))."""
    model, task = _saturated_logistic()
    reg = FunctionalRegularizer(tau=10.0, n_points=2, prior_precision=1e-3, jitter=EPS, **kw)
    reg.on_task_end(model, task)
    reg.rebuild(model)
    with torch.no_grad():
        model.heads[0].weight.neg_()
    return reg, model, task


def test_a_flipped_saturated_point_sits_on_a_plateau_of_tau_over_eps_with_probabilities():
    """The failure, with today's probability kernel: both points cost ≈ (τ/2) · 2 classes · Δp²/ε = τ/ε each, and
    the gradient, ∝ λ ≈ 2e-9 at the flipped weights, is ~1e-9 of the penalty: Adam cannot walk off the plateau."""
    reg, model, task = _flip_setup()
    pen, grad = _penalty_and_grad(reg, model, task)
    assert float(pen) > 0.99 * 2 * reg.tau / EPS
    assert float(grad.norm()) < 1e-6 * float(pen)


def test_the_logit_kernel_bounds_a_flipped_point_with_the_gps_own_weight():
    """``output: logits``: the penalty and its gradient equal the brute-force oracle over centred logits
    f̃ = f − mean f (Jacobians from autograd, Σ = diag 1/(F + δ) with F the oracle GGN at task 1's end):
    (τ/2) Σ_c Δf̃_cᵀ (K_c + εI)⁻¹ Δf̃_c and τ Σ_c J_cᵀ (K_c + εI)⁻¹ Δf̃_c (exact on a linear model). It is of the
    order of τ Δm²/G (here 8: Δf̃ = 20, K_ii ≈ 10³), not τ/ε = 1e7, and its gradient does not vanish."""
    model0 = build_model("linear", (2,), 2, 1).to(DT)
    reg, model, task = _flip_setup(output="logits")
    with torch.no_grad():
        model0.heads[0].weight.copy_(-model.heads[0].weight)
        model0.heads[0].bias.copy_(model.heads[0].bias)
    centre = lambda f: f - f.mean(-1, keepdim=True)  # noqa: E731
    fisher = torch.diagonal(O.ggn(model0, task.x_train, head=0))
    sigma = torch.diag(1.0 / (fisher + 1e-3))
    j = O.jacobians(model0, task.x_train, head=0, output_fn=centre)  # [M, C, P], constant on a linear model
    k = O.kernel(j, sigma, blockwise=True) + EPS * torch.eye(2, dtype=DT)
    with torch.no_grad():
        df = centre(model(task.x_train)) - centre(model0(task.x_train))  # [M, C]
    pen, grad = _penalty_and_grad(reg, model, task)
    expect = sum(df[:, c] @ torch.linalg.solve(k[c], df[:, c]) for c in range(2))
    expect_grad = reg.tau * sum(j[:, c].T @ torch.linalg.solve(k[c], df[:, c]) for c in range(2))
    torch.testing.assert_close(pen, 0.5 * reg.tau * expect, **EXACT)
    torch.testing.assert_close(grad, expect_grad, **EXACT)
    assert float(pen) < 1e-5 * reg.tau / EPS and float(grad.norm()) > 1e-3 * float(pen)


def _penalty_top_curvature(output: str, scale: float) -> float:
    """The largest eigenvalue of the penalty's Hessian (float64, by ``torch.autograd.functional.hessian`` over the
    head's six weights) at the rebuild's weights times ``scale``, for the saturated logistic regression of
    :func:`_flip_setup` (margin 20 at the rebuild, λ ≈ 2e-9)."""
    model, task = _saturated_logistic()
    reg = FunctionalRegularizer(tau=10.0, n_points=2, prior_precision=1e-3, jitter=EPS, output=output)
    reg.on_task_end(model, task)
    reg.rebuild(model)
    like = {n: p.detach() for n, p in model.named_parameters()}
    theta = flatten(like) * scale
    batch = Batch(task.x_train, task.y_train, 0)
    h = torch.autograd.functional.hessian(
        lambda t: reg.penalty(model, batch, task, params=unflatten(t, like)), theta)
    return float(torch.linalg.eigvalsh(h).max())


def test_off_saturation_the_probability_penalty_stiffens_and_the_logit_penalty_does_not():
    """The blow-up mechanism of ``benchmarks/results/traces/diagnose_fromp_adam_sharpness.md``: the kernel is fixed
    at the rebuild, where the points are saturated. Moving them off saturation (margin 20 → 2, the weights scaled by
    0.1, no flip) raises the probability penalty's largest curvature by a factor of more than 10⁶ — its term
    τ J_pᵀ K⁻¹ J_p grows with λ² = (p(1 − p))² while K⁻¹ keeps the rebuild's tiny λ — so an optimiser stable at the
    floor overshoots there. Over centred logits (``output: logits``) the penalty of a linear model is an exact
    quadratic: its Hessian is the same at both weights (float64 round-off)."""
    floor, moved = _penalty_top_curvature("probs", 1.0), _penalty_top_curvature("probs", 0.1)
    assert moved > 1e6 * max(floor, 1e-300)
    floor_l, moved_l = _penalty_top_curvature("logits", 1.0), _penalty_top_curvature("logits", 0.1)
    assert floor_l > 0 and moved_l == pytest.approx(floor_l, rel=1e-9)


def test_dropping_a_flipped_point_removes_its_plateau_and_counts_it():
    """``drop_below`` with the probability kernel: both points have K_ii ≈ λ²G ≈ 1e-15 < 100 ε at the rebuild, so
    both are left out: the penalty is exactly 0 and the record counts 2 points (4 (point, class) pairs)."""
    reg, model, task = _flip_setup(drop_below=100.0)
    pen, _ = _penalty_and_grad(reg, model, task)
    assert float(pen) == 0.0
    rec = reg.health[-1][0]
    assert (rec["dropped_points"], rec["dropped_outputs"]) == (2, 4)


# ------------------------------------------------------------------------ τ in the kernel's units (tau_scale)


@pytest.mark.parametrize("output", ["logits", "probs"])
def test_tau_scale_kernel_equals_the_oracle_with_each_kernel_at_unit_mean_diagonal(output):
    """``tau_scale: kernel`` on the flipped logistic regression: the penalty and its gradient equal the float64
    brute force (τ/2) Σ_c Δ_cᵀ (K_c / d̄_c + εI)⁻¹ Δ_c and τ Σ_c J_cᵀ (K_c / d̄_c + εI)⁻¹ Δ_c, with K_c = J_c Σ J_cᵀ
    from autograd Jacobians, Σ = diag 1/(F + δ) from the oracle GGN and d̄_c = tr K_c / M (exact on a linear
    model); the health record holds d̄'s range. On probabilities the saturated kernel's d̄ ≈ 1e-15 makes the
    flipped points cost ≈ τ/ε' per class as before, but at the normalised kernel's scale."""
    model0 = build_model("linear", (2,), 2, 1).to(DT)
    reg, model, task = _flip_setup(output=output, tau_scale="kernel")
    with torch.no_grad():
        model0.heads[0].weight.copy_(-model.heads[0].weight)
        model0.heads[0].bias.copy_(model.heads[0].bias)
    if output == "logits":
        out = lambda f: f - f.mean(-1, keepdim=True)  # noqa: E731
    else:
        out = lambda f: f.softmax(-1)  # noqa: E731
    fisher = torch.diagonal(O.ggn(model0, task.x_train, head=0))
    sigma = torch.diag(1.0 / (fisher + 1e-3))
    j = O.jacobians(model0, task.x_train, head=0, output_fn=out)  # [M, C, P]
    k = O.kernel(j, sigma, blockwise=True)  # [C, M, M]
    dbar = torch.diagonal(k, dim1=-2, dim2=-1).mean(-1)
    kn = k / dbar[:, None, None] + EPS * torch.eye(2, dtype=DT)
    with torch.no_grad():
        delta = out(model(task.x_train)) - out(model0(task.x_train))
    pen, grad = _penalty_and_grad(reg, model, task)
    expect = sum(delta[:, c] @ torch.linalg.solve(kn[c], delta[:, c]) for c in range(2))
    torch.testing.assert_close(pen, 0.5 * reg.tau * expect, **EXACT)
    if output == "logits":  # J is constant on a linear model only for the logits
        expect_grad = reg.tau * sum(j[:, c].T @ torch.linalg.solve(kn[c], delta[:, c]) for c in range(2))
        torch.testing.assert_close(grad, expect_grad, **EXACT)
    rec = reg.health[-1][0]
    assert rec["kernel_scale"] == pytest.approx([float(dbar.min()), float(dbar.max())], rel=1e-12)
    torch.testing.assert_close(reg.memory[0].extras["kernel_scale"], dbar, **EXACT)


def test_unit_mean_diagonal_divides_each_matrix_and_leaves_a_zero_one_alone():
    """Each [n, n] matrix divided by tr K / n (its returned scale), in float64; an all-zero matrix (no point has a
    Jacobian) comes back as it was, with scale 1, not as NaN."""
    k = torch.zeros(3, 4, 4, dtype=torch.float32)
    k[0] = torch.diag(torch.tensor([1.0, 2.0, 3.0, 6.0]))
    k[1] = 5.0 * torch.eye(4)
    kn, scale = _unit_mean_diagonal(k)
    assert kn.dtype == DT
    torch.testing.assert_close(scale, torch.tensor([3.0, 5.0, 1.0], dtype=DT), **EXACT)
    torch.testing.assert_close(kn[0], torch.diag(torch.tensor([1 / 3, 2 / 3, 1.0, 2.0], dtype=DT)), **EXACT)
    torch.testing.assert_close(kn[1], torch.eye(4, dtype=DT), **EXACT)
    assert torch.equal(kn[2], torch.zeros(4, 4, dtype=DT))


def test_a_state_is_refused_by_a_regulariser_with_the_other_tau_scale():
    """The stored Cholesky factors are of K / d̄ under ``tau_scale: kernel`` and of K otherwise: loading a state into a
    regulariser with the other setting is a one-line error both ways (its penalty would silently use the wrong
    kernel until the next rebuild); the same setting loads."""
    states = {}
    for scale in ("kernel", "none"):
        reg, _, _ = _flip_setup(output="logits", tau_scale=scale)
        states[scale] = reg.state_dict()
    for saved, other in (("kernel", "none"), ("none", "kernel")):
        fresh = FunctionalRegularizer(tau=10.0, n_points=2, prior_precision=1e-3, jitter=EPS, output="logits",
                                      tau_scale=other)
        with pytest.raises(ValueError, match=rf"built with tau_scale '{saved}', this regulariser uses '{other}'"):
            fresh.load_state_dict(states[saved])
        same = FunctionalRegularizer(tau=10.0, n_points=2, prior_precision=1e-3, jitter=EPS, output="logits",
                                     tau_scale=saved)
        same.load_state_dict(states[saved])
        assert len(same.memory) == 1


@pytest.mark.parametrize("kernel", ["classwise", "full"])
def test_tau_scale_kernel_makes_the_penalty_independent_of_the_posteriors_scale(kernel):
    """Σ = (F + δ)⁻¹ multiplied by c = 1e3 (F and δ divided by c): with ``tau_scale: kernel`` the penalty is unchanged
    to round-off (K / d̄ does not move, and the jitter applies after normalising); with the paper's absolute τ it
    falls by about c (the same Δ against a kernel c times larger)."""
    s = make_stream("synthetic", scenario="task", n_tasks=2, n_classes_per_task=3, n_features=4, n_train=30,
                    n_test=4, seed=2)
    tasks = [t.to("cpu", dtype=DT) for t in s.tasks]
    pens = {}
    for scale in ("kernel", "none"):
        for c in (1.0, 1e3):
            model = build_model("mlp", (4,), 3, 2, hidden=(6,), generator=torch.Generator().manual_seed(0)).to(DT)
            reg = FunctionalRegularizer(tau=2.0, n_points=6, prior_precision=0.5 / c, jitter=1e-8, kernel=kernel,
                                        tau_scale=scale)
            reg.on_task_end(model, tasks[0])
            reg.fisher = {n: f / c for n, f in reg.fisher.items()}
            reg.rebuild(model)
            _small_step(model, 1e-2)
            with torch.no_grad():
                pens[scale, c] = reg.penalty(model, Batch(tasks[1].x_train, tasks[1].y_train, 1), tasks[1])
    assert float(pens["kernel", 1.0]) > 0
    torch.testing.assert_close(pens["kernel", 1e3], pens["kernel", 1.0], rtol=1e-9, atol=0.0)
    assert float(pens["none", 1.0] / pens["none", 1e3]) == pytest.approx(1e3, rel=1e-3)


# ------------------------------------------------------------- the logit kernel's τ matches at unsaturated points


def _small_step(model, scale):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(5), dtype=DT))


@pytest.mark.parametrize("k,zero_head,kernel", [(2, False, "classwise"), (2, False, "full"), (3, True, "classwise"),
                                                (3, True, "identity")])
def test_logit_penalty_equals_the_probability_penalty_at_unsaturated_points(k, zero_head, kernel):
    """With ε = 0 and a step of 1e-6 (linear regime), the centred-logit penalty equals the probability penalty with
    the same τ: for 2-way heads at any p (Δp = λΔm, K_p = λ² G: λ cancels), and for a 3-way head at the uniform
    prediction (Λ = P/C); FROMP-L2 (K = I) with its 1/C² rescaling there."""
    s = make_stream("synthetic", scenario="task", n_tasks=2, n_classes_per_task=k, n_features=4, n_train=12,
                    n_test=4, seed=3)
    tasks = [t.to("cpu", dtype=DT) for t in s.tasks]
    pens = []
    for output in ("probs", "logits"):
        model = build_model("mlp", (4,), k, 2, hidden=(6,), generator=torch.Generator().manual_seed(0)).to(DT)
        if zero_head:
            with torch.no_grad():
                model.heads[0].weight.zero_()
                model.heads[0].bias.zero_()
        reg = FunctionalRegularizer(tau=3.0, n_points=2 * k, prior_precision=0.5, jitter=0.0, kernel=kernel,
                                    output=output)
        reg.on_task_end(model, tasks[0])
        reg.rebuild(model)
        _small_step(model, 1e-6)
        with torch.no_grad():
            pens.append(reg.penalty(model, Batch(tasks[1].x_train, tasks[1].y_train, 1), tasks[1]))
    assert float(pens[0]) > 0
    torch.testing.assert_close(pens[1], pens[0], **LINEARISATION)


# ----------------------------------------------------------------------------- 3. BatchNorm running statistics


def _bn_net(n_heads=2):
    torch.manual_seed(0)  # only inside fork_rng below
    body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
    return MultiHeadNet(body, 8, 2, n_heads).to(DT)


def _bn_stream():
    s = make_stream("synthetic", scenario="task", n_tasks=2, n_classes_per_task=2, n_features=4, n_train=40,
                    n_test=20, seed=1)
    return s, [t.to("cpu", dtype=DT) for t in s.tasks]


@pytest.mark.parametrize("mode", ["shared", "per_task"])
def test_new_task_batches_raise_the_penalty_through_running_statistics_only_when_shared(mode):
    """No weight changes at all: task 1's running statistics are set by train-mode passes over its data, task 1
    ends (memorable points, curvature), the rebuild makes the penalty exactly 0, then train-mode passes over task
    2's data move the running statistics. ``shared``: the penalty rises (by orders of magnitude over 0);
    ``per_task`` (task 1's statistics kept and used for its points): it stays exactly 0."""
    with torch.random.fork_rng():
        model = _bn_net()
    _, (t1, t2) = _bn_stream()
    model.train()
    with torch.no_grad():
        for _ in range(20):
            model(t1.x_train, head=0)
    reg = FunctionalRegularizer(tau=10.0, n_points=6, prior_precision=1e-2, jitter=EPS)
    reg.on_task_end(model, t1)
    if mode == "per_task":
        store = NormStatistics()
        store.save(model, t1.task_id)
        reg.norm_statistics = store
    reg.on_task_start(model, t2)
    batch = Batch(t2.x_train[:8], t2.y_train[:8], 1)
    with torch.no_grad():
        assert float(reg.penalty(model, batch, t2)) == 0.0
        for _ in range(20):
            model(t2.x_train, head=1)  # train mode: the running statistics follow task 2
        pen = float(reg.penalty(model, batch, t2))
    if mode == "shared":
        assert pen > 1.0
    else:
        assert pen == 0.0


def _bn_run(mode, method="none", on_task_end=None, resume=None, restore=None, n_tasks=2):
    s = make_stream("synthetic", scenario="task", n_tasks=n_tasks, n_classes_per_task=2, n_features=4, n_train=40,
                    n_test=200, seed=1, separation=0.7)
    with torch.random.fork_rng():
        model = _bn_net(n_tasks)
    m = build_method(method, {"n_points": 4} if method == "fromp" else None, seed=0)
    s.tasks = [t.to("cpu", dtype=DT) for t in s.tasks]
    res = run_stream(model, s, m, TrainConfig(epochs=2, batch_size=10, lr=0.01, batchnorm=mode), seed=0,
                     progress=False, on_task_end=on_task_end, resume=resume, restore=restore)
    return res, model, m, s


def test_per_task_statistics_are_kept_at_each_task_end_and_used_for_its_evaluation():
    """``per_task``: the statistics kept for task 0 are the model's at task 0's end (bit for bit), and R[1][0] is
    task 0's accuracy on them; ``shared``: R[1][0] is the accuracy on the final statistics."""
    snaps = {}

    def grab(progress, model, method):
        snaps[progress.next_task] = (copy.deepcopy(progress.norm_statistics),
                                     {k: v.clone() for k, v in model.state_dict().items()})

    res, model, m, s = _bn_run("per_task", on_task_end=grab)
    store = NormStatistics()
    store.load_state_dict(snaps[2][0])
    assert sorted(store.tasks) == [0, 1]
    for key, t in store.tasks[0].items():
        assert torch.equal(t, snaps[1][1][key])
    final = {k: v for k, v in model.state_dict().items() if "running" in k}
    assert any(not torch.equal(store.tasks[0][k], v) for k, v in final.items())
    oracle = copy.deepcopy(model)  # the final weights with task 0's statistics loaded as plain buffers
    oracle.load_state_dict({**model.state_dict(), **store.tasks[0]})
    acc0 = evaluate_task(oracle, m, s.tasks[0])
    assert acc0 != evaluate_task(model, m, s.tasks[0])  # the check below can tell the two statistics apart
    assert res.acc_matrix[1][0] == acc0
    with store.use(model, 0):
        assert evaluate_task(model, m, s.tasks[0]) == acc0
    assert all(torch.equal(model.state_dict()[k], v) for k, v in final.items())  # put back after use
    shared, model_s, m_s, s_s = _bn_run("shared")
    assert shared.acc_matrix[1][0] == evaluate_task(model_s, m_s, s_s.tasks[0])


def test_frozen_statistics_stay_at_task_ones_while_the_affine_weights_train():
    """``frozen``: after task 0 the running statistics never change (bit for bit); γ and β still move."""
    snaps = {}

    def grab(progress, model, method):
        snaps[progress.next_task] = {k: v.clone() for k, v in model.state_dict().items()}

    _bn_run("frozen", on_task_end=grab)
    for k in ("body.1.running_mean", "body.1.running_var", "body.1.num_batches_tracked"):
        assert torch.equal(snaps[1][k], snaps[2][k])
    assert not torch.equal(snaps[1]["body.1.weight"], snaps[2]["body.1.weight"])
    _bn_run("shared", on_task_end=grab)
    assert not torch.equal(snaps[1]["body.1.running_mean"], snaps[2]["body.1.running_mean"])


def test_per_task_fromp_gets_the_store_and_a_resumed_run_equals_an_uninterrupted_one():
    """Under ``per_task`` the loop hands its store to FROMP's regulariser; a run resumed at the task boundary (model,
    method and the kept statistics restored from the LoopProgress) ends with the same accuracy matrix."""
    saved = {}

    def grab(progress, model, method):
        saved[progress.next_task] = (copy.deepcopy(progress), copy.deepcopy(model.state_dict()),
                                     copy.deepcopy(method.state_dict()))

    full, _, m, _ = _bn_run("per_task", method="fromp", on_task_end=grab, n_tasks=3)
    assert isinstance(m.regularizer.norm_statistics, NormStatistics)
    assert sorted(m.regularizer.norm_statistics.tasks) == [0, 1, 2]
    progress, model_state, method_state = saved[2]

    def restore(model, method):
        model.load_state_dict(model_state)
        method.load_state_dict(method_state)

    resumed, _, _, _ = _bn_run("per_task", method="fromp", resume=progress, restore=restore, n_tasks=3)
    assert resumed.acc_matrix == full.acc_matrix


def test_batchnorm_option_is_validated_and_a_plain_network_is_untouched():
    assert TrainConfig().batchnorm == "shared"
    with pytest.raises(ValueError, match=r"train.batchnorm: got 'per-task'; allowed: 'shared', 'per_task', 'frozen'"):
        TrainConfig(batchnorm="per-task")
    model = build_model("mlp", (4,), 2, 2, hidden=(3,))
    assert norm_layers(model) == []


# ------------------------------------------------------------------------------- options, run log


@pytest.mark.parametrize("name", ["fromp", "frorp", "fromp-l2", "fromp-replay"])
def test_every_fromp_family_method_takes_the_options(name):
    m = build_method(name, {"output": "logits", "jitter_relative": 1e-6, "drop_below": 10.0})
    reg = m.regularizer
    assert (reg.output, reg.jitter_relative, reg.drop_below) == ("logits", 1e-6, 10.0)
    with pytest.raises(MethodParamsError, match=r"params.output: got 'logit'; allowed: 'probs', 'logits'"):
        build_method(name, {"output": "logit"})
    with pytest.raises(MethodParamsError, match=r"params.drop_below: must be a finite number >= 0"):
        build_method(name, {"drop_below": -1.0})
    assert build_method(name).regularizer.output == "probs"
    assert build_method(name).regularizer.tau_scale == "none"
    if name != "fromp-l2":
        assert build_method(name, {"tau_scale": "kernel"}).regularizer.tau_scale == "kernel"
    else:
        with pytest.raises(MethodParamsError, match=r"params.tau_scale: 'kernel' needs a kernel .* allowed: 'none'"):
            build_method(name, {"tau_scale": "kernel"})
    with pytest.raises(MethodParamsError, match=r"params.tau_scale: got 'diag'; allowed: 'none', 'kernel'"):
        build_method(name, {"tau_scale": "diag"})


def test_the_run_log_shows_the_penalty_apart_from_the_data_loss(tmp_path):
    """``train_log.csv`` of a FROMP run: ``data_loss + penalty = train_loss`` in every epoch (float32 sums), the
    penalty 0 on the first task and > 0 on the second, the kernel health columns present."""
    from tiny_runs import tiny_run

    tiny_run(tmp_path, "[{name: fromp, params: {n_points: 4, drop_below: 1.0}}]")
    rows = list(csv.DictReader(open(tmp_path / "run" / "fromp" / "train_log.csv")))
    assert {"data_loss", "penalty", "kernel_dropped", "kernel_min_diag"} <= set(rows[0])
    for r in rows:
        assert float(r["data_loss"]) + float(r["penalty"]) == pytest.approx(float(r["train_loss"]), rel=1e-5)
    assert float(rows[0]["penalty"]) == 0.0 and float(rows[-1]["penalty"]) > 0.0
    assert float(rows[-1]["kernel_min_diag"]) > 0.0
    for r in rows:  # the largest step is at least the epoch's mean
        assert float(r["data_loss_max"]) >= float(r["data_loss"]) * (1 - 1e-6)
        assert float(r["penalty_max"]) >= float(r["penalty"]) * (1 - 1e-6)


def test_the_penalty_log_keeps_the_largest_step_of_the_epoch():
    """Hand-made steps (data, penalty, batch size): means weighted by the batch sizes, maxima of one step, and
    a fresh epoch after ``pop`` (NaN maxima for an epoch with no step)."""
    from continual_blr.methods.fromp import PenaltyLog

    reg = FunctionalRegularizer(n_points=2)
    log = PenaltyLog()
    for data, pen, n in [(1.0, 0.5, 2), (3.0, 0.1, 1), (0.5, 0.2, 1)]:
        log.add(torch.tensor(data), torch.tensor(pen), n)
    out = log.pop(reg, started=False)
    assert out["data_loss"] == pytest.approx((2 * 1.0 + 3.0 + 0.5) / 4)
    assert out["penalty"] == pytest.approx((2 * 0.5 + 0.1 + 0.2) / 4)
    assert out["data_loss_max"] == pytest.approx(3.0) and out["penalty_max"] == pytest.approx(0.5)
    log.add(torch.tensor(0.25), torch.tensor(0.0), 3)
    again = log.pop(reg, started=False)
    assert again["data_loss_max"] == pytest.approx(0.25) and again["penalty_max"] == 0.0
    assert math.isnan(log.pop(reg, started=False)["data_loss_max"])
