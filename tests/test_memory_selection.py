"""Memories chosen by measured value: the memory-perturbation sensitivity and the rules built on it.

Oracles, in float64 on tiny networks:

* V_i = J_i Σ J_iᵀ with J_i from ``torch.func.jacrev`` of one example's logits (a dense brute force) against the
  fast path of :mod:`continual_blr.curvature.prediction_covariance` (no per-example Jacobian for Linear layers);
* F = Σ_i J_iᵀ Λ_i J_i's diagonal from the same brute-force Jacobians against the one-pass GGN, and the
  sensitivity s_i = ‖J_i Σ J_iᵀ e_i‖₁ with Σ = diag(1 / (F₀ + F + δ)) against the brute force;
* the rules: per-class counts, top-k of the brute-force scores, one draw per stratum, determinism under a
  generator, prefixes spread over the range; FROMP, fromp-replay, er and derpp storing what the rules choose;
* one-line ``ValueError`` naming the field and the allowed values for every bad selection.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from conftest import EXACT
from continual_blr.curvature import curvature
from continual_blr.curvature.prediction_covariance import diag_prediction_covariance, ggn_diag_and_sensitivity
from continual_blr.data.stream import Task
from continual_blr.memory import SELECTIONS, _strata_order, select_per_class, selection_scores, share_budget
from continual_blr.methods import TrainConfig, build_method
from continual_blr.methods.fromp import FROMPParams
from continual_blr.models import MLP
from continual_blr.methods.replay import DERPPParams, ERParams
from continual_blr.regularizers.functional import FunctionalRegularizer
from continual_blr.replay_buffer import ReplayBuffer
from continual_blr.types import Batch

DT = torch.float64


def _mlp(seed: int = 0, k: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, k)).to(DT)


def _cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    m = m.to(DT).eval()
    m[1].running_mean.normal_()
    m[1].running_var.uniform_(0.5, 2.0)
    return m


def _jacobians(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Brute force: J [N, K, P] from jacrev of each example's logits (``types.flatten`` order of the parameters)."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def f(p, xi):
        return functional_call(model, p, (xi.unsqueeze(0),))[0]

    rows = []
    for xi in x:
        jac = jacrev(f)(params, xi)
        rows.append(torch.cat([jac[n].reshape(jac[n].shape[0], -1) for n in params], dim=1))
    return torch.stack(rows)


def _flat(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in d.values()])


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_prediction_covariance_equals_jacrev_brute_force_float64(arch):
    """V_i by the fast path (Linear layers from output gradients and inputs; Conv2d / BatchNorm from their
    materialised VJPs) equals J_i diag(s) J_iᵀ with J_i from jacrev, to 1e-10."""
    model = _mlp() if arch == "mlp" else _cnn()
    x = torch.randn(7, 4, dtype=DT) if arch == "mlp" else torch.randn(7, 1, 6, 6, dtype=DT)
    var = {n: torch.rand(p.shape, dtype=DT) + 0.1 for n, p in model.named_parameters()}
    j = _jacobians(model, x)
    brute = torch.einsum("nkp,p,nlp->nkl", j, _flat(var), j)
    torch.testing.assert_close(diag_prediction_covariance(model, x, var), brute, **EXACT)


@pytest.mark.parametrize("with_prior", [False, True])
def test_one_pass_ggn_and_sensitivity_equal_brute_force_float64(with_prior):
    """One backward with identity cotangents gives (a) the diagonal GGN Σ_i diag(J_iᵀ Λ_i J_i) — equal to the brute
    force and to the curvature engine's ``ggn`` — and (b) s_i = ‖J_i Σ J_iᵀ e_i‖₁ with Σ = diag(1 / (F₀ + F + δ)),
    F₀ the prior curvature (FROMP's past tasks)."""
    model = _mlp(1)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(11, 4, generator=gen, dtype=DT)
    y = torch.randint(0, 3, (11,), generator=gen)
    delta = 0.3
    prior = ({n: torch.rand(p.shape, generator=gen, dtype=DT) for n, p in model.named_parameters()}
             if with_prior else None)
    ggn, s = ggn_diag_and_sensitivity(model, x, y, prior_precision=delta, prior_ggn=prior, chunk_size=4)
    j = _jacobians(model, x)
    p = torch.softmax(model(x), -1).detach()
    lam = torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1)
    f_brute = torch.einsum("nkp,nkl,nlp->p", j, lam, j)
    torch.testing.assert_close(_flat(ggn), f_brute, **EXACT)
    torch.testing.assert_close(ggn, curvature(model, x, kind="ggn", structure="diag"), **EXACT)
    sigma = 1.0 / (f_brute + (_flat(prior) if prior else 0.0) + delta)
    e = p - torch.nn.functional.one_hot(y, 3).to(DT)
    s_brute = torch.einsum("nkp,p,nlp,nl->nk", j, sigma, j, e).abs().sum(-1)
    torch.testing.assert_close(s, s_brute, **EXACT)


def test_sensitivity_selection_is_the_per_class_top_k_of_the_brute_force_scores():
    """``selection_scores(..., "sensitivity")`` + ``select_per_class`` keep, per class, the k largest brute-force
    ‖J Σ Jᵀ e‖₁ (Σ of the data's own GGN and δ), in descending order."""
    model = _mlp(2)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 4, generator=gen, dtype=DT)
    y = torch.randint(0, 3, (40,), generator=gen)
    scores, ggn = selection_scores(model, x, y, selection="sensitivity", prior_precision=0.5)
    assert ggn is not None
    j = _jacobians(model, x)
    p = torch.softmax(model(x), -1).detach()
    lam = torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1)
    sigma = 1.0 / (torch.einsum("nkp,nkl,nlp->p", j, lam, j) + 0.5)
    e = p - torch.nn.functional.one_hot(y, 3).to(DT)
    brute = torch.einsum("nkp,p,nlp,nl->nk", j, sigma, j, e).abs().sum(-1)
    idx = select_per_class(scores, y, 9, selection="sensitivity")
    expect = []
    for c in range(3):
        members = (y == c).nonzero().squeeze(1)
        expect += members[torch.argsort(brute[members], descending=True)[:3]].tolist()
    assert idx.tolist() == expect


def test_per_class_counts_of_every_rule():
    """Every rule gives each class its allocation k_c (n_points // C, one more for the first n_points % C classes),
    and all of a class that has fewer; indices grouped by class."""
    gen = torch.Generator().manual_seed(0)
    y = torch.cat([torch.full((n,), c) for c, n in ((0, 30), (1, 25), (2, 2), (5, 40))])
    scores = torch.rand(y.shape[0], generator=gen, dtype=DT)
    for rule in SELECTIONS:
        idx = select_per_class(scores, y, 22, selection=rule, generator=torch.Generator().manual_seed(1))
        counts = {c: int((y[idx] == c).sum()) for c in (0, 1, 2, 5)}
        assert counts == {0: 6, 1: 6, 2: 2, 5: 5}, (rule, counts)
        assert y[idx].tolist() == sorted(y[idx].tolist())
        assert len(set(idx.tolist())) == idx.numel()


def test_stratified_draws_one_per_stratum_in_van_der_corput_order():
    """Stratified: with n examples of a class ranked by descending score and k strata of ranks ⌊jn/k⌋ …
    ⌊(j+1)n/k⌋ − 1, the m-th pick lies in stratum order[m] (top stratum first, then the median, the quartiles, …);
    so the first pick is among the top ⌈n/k⌉ and every prefix of length 2^L hits 2^L evenly spaced strata."""
    n, k = 53, 8
    scores = torch.randperm(n, generator=torch.Generator().manual_seed(2)).to(DT)
    y = torch.zeros(n, dtype=torch.long)
    order = _strata_order(k)
    assert order == [0, 4, 2, 6, 1, 5, 3, 7]
    for seed in range(20):
        idx = select_per_class(scores, y, k, selection="stratified", generator=torch.Generator().manual_seed(seed))
        rank = (n - 1 - scores[idx]).long()  # scores are a permutation of 0..n-1: rank by descending score
        for r, j in zip(rank.tolist(), order):
            assert (j * n) // k <= r < ((j + 1) * n) // k


def test_random_draws_are_deterministic_under_a_generator():
    """The same generator state gives the same choice; another seed another choice (random and stratified)."""
    scores = torch.rand(200, generator=torch.Generator().manual_seed(0), dtype=DT)
    y = torch.arange(200) % 4
    for rule in ("random", "stratified"):
        a = select_per_class(scores, y, 20, selection=rule, generator=torch.Generator().manual_seed(7))
        b = select_per_class(scores, y, 20, selection=rule, generator=torch.Generator().manual_seed(7))
        c = select_per_class(scores, y, 20, selection=rule, generator=torch.Generator().manual_seed(8))
        assert a.tolist() == b.tolist() and a.tolist() != c.tolist()


def test_share_budget_equals_fromps_rule():
    """M over G groups: ⌊M/G⌋ each, the remainder to the newest (new groups first, then the old from the latest)."""
    quota, new = share_budget([("a", 0), ("a", 1), ("b", 0)], 2, 23)
    assert new == 10 and quota == {("b", 0): 5, ("a", 1): 4, ("a", 0): 4}
    quota, new = share_budget([], 2, 7)
    assert new == 7 and quota == {}


def _task(tid: int, classes: tuple[int, ...], n: int = 30, seed: int = 0) -> Task:
    gen = torch.Generator().manual_seed(seed + tid)
    y = torch.tensor(classes).repeat_interleave(n // len(classes))
    x = torch.randn(y.shape[0], 4, generator=gen, dtype=DT) + y[:, None].to(DT)
    return Task(tid, x, y, x[:4], y[:4], classes, 0, f"t{tid}")


@pytest.mark.parametrize("kernel", ["classwise", "identity"])
def test_fromp_sensitivity_accumulates_the_same_curvature_and_stores_the_chosen_points(kernel):
    """FROMP with ``selection: sensitivity``: the GGN accumulated at each task's end equals the lambda path's (the
    curvature engine's) over two tasks, and the stored points are the per-class top-k of the sensitivity under
    Σ = diag(1 / (F_past + F_task + δ)) (classwise: FROMP's own Σ; identity: the task's own F)."""
    model = _mlp(3, k=4)
    t0, t1 = _task(0, (0, 1)), _task(1, (2, 3))
    sens = FunctionalRegularizer(tau=1.0, n_points=6, kernel=kernel, selection="sensitivity", prior_precision=0.2)
    lam = FunctionalRegularizer(tau=1.0, n_points=6, kernel=kernel, selection="lambda", prior_precision=0.2)
    past = None
    for t in (t0, t1):
        sens.on_task_end(model, t)
        lam.on_task_end(model, t)
        prior = past if kernel == "classwise" else None
        f, s = ggn_diag_and_sensitivity(model, t.x_train, t.y_train, prior_precision=0.2, prior_ggn=prior)
        past = f if past is None else {n: past[n] + f[n] for n in f}
        assert sens.memory[-1].indices.tolist() == select_per_class(s, t.y_train, 6, selection="sensitivity").tolist()
        torch.testing.assert_close(sens.memory[-1].scores, s[sens.memory[-1].indices], **EXACT)
    if kernel == "classwise":
        torch.testing.assert_close(sens.fisher, lam.fisher, **EXACT)
    else:
        assert sens.fisher is None and lam.fisher is None


def test_er_and_derpp_task_end_buffers_share_the_budget_and_keep_prefixes():
    """A task-end rule: nothing enters during a task; after task 0 the buffer holds M examples of its classes
    (the rule's choice), after task 1 each (task, class) group its share, the old ones the first of theirs;
    DER++ stores the logits of the network that ended the task."""
    for name in ("er", "derpp"):
        method = build_method(name, {"memory_size": 10, "selection": "stratified"}, seed=0)
        torch.manual_seed(4)
        model = MLP(4, (6,), 4, n_heads=1).to(DT)
        method.setup(model, None, TrainConfig(batch_size=8))
        t0, t1 = _task(0, (0, 1)), _task(1, (2, 3))
        method.after_step(model, Batch(t0.x_train[:8], t0.y_train[:8], 0), t0)
        assert method.buffer.size == 0
        method.on_task_end(model, t0)
        first = method.buffer.stored()
        assert method.buffer.size == 10 and first[1].tolist() == [0] * 5 + [1] * 5
        x0 = first[0].clone()
        list(model.parameters())[-1].data += 1.0  # another network ends task 1
        method.on_task_end(model, t1)
        x, y, head, task_id, targets = method.buffer.stored()
        assert y.tolist() == [0, 0, 1, 1, 2, 2, 2, 3, 3, 3]  # G = 4: 2 each, the remainder 2 to the new classes
        assert task_id.tolist() == [0] * 4 + [1] * 6
        torch.testing.assert_close(x[:2], x0[:2])  # class 0 kept the first of its list
        torch.testing.assert_close(x[2:4], x0[5:7])  # class 1 too
        if name == "derpp":
            with torch.no_grad():
                torch.testing.assert_close(targets[4:], model(x[4:], head=0), **EXACT)
        else:
            assert targets is None


@pytest.mark.parametrize("make, field", [
    (lambda v: FROMPParams(selection=v), "params.selection"),
    (lambda v: ERParams(selection=v), "params.selection"),
    (lambda v: DERPPParams(selection=v), "params.selection"),
    (lambda v: build_method("fromp-replay", {"selection": v}), "method 'fromp-replay': params.selection"),
    (lambda v: build_method("derpp", {"selection": v}), "method 'derpp': params.selection"),
    (lambda v: select_per_class(torch.zeros(3), torch.zeros(3, dtype=torch.long), 2, selection=v), "selection"),
])
def test_bad_selection_is_a_one_line_value_error_naming_field_and_allowed(make, field):
    with pytest.raises(ValueError) as err:
        make("topk")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{field}: got 'topk'") and "'sensitivity'" in msg
    assert "'stratified'" in msg


def test_other_bad_values_are_one_line_value_errors():
    with pytest.raises(ValueError, match=r"^params\.selection: 'sensitivity' needs a diagonal"):
        FROMPParams(selection="sensitivity", kernel="kron")
    with pytest.raises(ValueError, match=r"^generator: selection 'stratified' needs"):
        select_per_class(torch.zeros(3), torch.zeros(3, dtype=torch.long), 2, selection="stratified")
    with pytest.raises(ValueError, match=r"^params\.prior_precision: must be > 0"):
        ERParams(selection="sensitivity", prior_precision=0.0)
    with pytest.raises(RuntimeError, match="task_end"):
        ReplayBuffer(4, "task_end").add(torch.zeros(2, 1), torch.zeros(2, dtype=torch.long), 0, 0)
    with pytest.raises(ValueError, match=r"^selection: got 'x'; allowed: 'reservoir', 'class_balanced', 'task_end'$"):
        ReplayBuffer(4, "x")
