"""``laplace``'s GLM predictive (probit) and its marginal-likelihood δ, against brute force and laplace-torch.

1. float64 oracle (always runs): dense Jacobians by one backward per output (tests/oracles.py), dense Σ from the
   posterior, the probit predictive written out by hand; diagonal, Kronecker (one and two terms, a multi-head net with
   an unused head) and full posteriors, and the method's own ``predict_proba`` after a task end.
2. laplace-torch (skipped where it is not installed): the same diagonal GGN posterior (same data, δ, temperature),
   ``pred_type='glm', link_approx='probit'``: probabilities equal to ``LAPLACE_TORCH_TOL``; the δ-dependent part of its
   ``log_marginal_likelihood`` equals ours.
3. marglik δ: on Bayesian linear regression (a conjugate case: the Laplace evidence is exact) δ̂ equals the argmax of
   the exact evidence log N(y; 0, ΦΦᵀ/δ + σ²I) over a fine grid, within one grid step; MacKay's iteration (refit the
   MAP, new δ̂) converges to it. On a small MLP the eigen-structure evidence of diag / Kronecker posteriors equals the
   dense log-determinant, and δ̂ is the grid argmax.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import oracles as O
from conftest import EXACT
from continual_blr.data.stream import Task
from continual_blr.methods import build_method
from continual_blr.models import MLP
from continual_blr.posteriors import DiagPosterior, FullPosterior, KronPosterior
from continual_blr.posteriors.marglik import (curvature_eigenvalues, log_evidence, marglik_prior_precision,
                                              optimal_prior_precision)
from continual_blr.posteriors.predictive import glm_predictive
from continual_blr.curvature import curvature
from continual_blr.types import flatten, params_of

DT = torch.float64
ORACLE_TOL = dict(rtol=0.0, atol=1e-10)  # float64 probabilities, brute force vs torch.func
LAPLACE_TORCH_TOL = 1e-5  # probabilities, ours vs laplace-torch (issue 42)
GRID = torch.logspace(-2, 2, 4001, dtype=DT)  # δ grid for the brute-force evidence maximisation
GRID_TOL = math.log(float(GRID[1] / GRID[0]))  # one grid step in log δ


def _mlp(gen, n_in=4, hidden=(5,), n_out=3, n_heads=1, dtype=DT):
    model = MLP(n_in, hidden, n_out, n_heads).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype))
    return model.eval()


def _task(x, y, n_out=3, head=0):
    return Task(0, x, y, x[:2], y[:2], tuple(range(n_out)), head=head)


def _probit_by_hand(model, x, cov, head=0):
    """softmax_k(f_k / sqrt(1 + π/8 · J_k Σ J_kᵀ)), J dense [N, K, P] by brute force, Σ dense."""
    with torch.no_grad():
        f = model(x, head=head)
    j = O.jacobians(model, x, head=head)
    var = torch.einsum("nkp,pq,nkq->nk", j, cov, j)
    return torch.softmax(f / torch.sqrt(1 + math.pi / 8 * var), dim=-1)


# ----------------------------------------------------------------------------------------------------------------
# 1. float64 brute-force oracle
# ----------------------------------------------------------------------------------------------------------------
def test_glm_probit_diag_equals_brute_force(gen):
    model = _mlp(gen)
    x = torch.randn(9, 4, generator=gen, dtype=DT)
    mean = params_of(model)
    prec = {k: 0.3 + torch.rand(v.shape, generator=gen, dtype=DT) for k, v in mean.items()}
    got = glm_predictive(model, DiagPosterior(mean, prec), x)
    want = _probit_by_hand(model, x, torch.diag(1.0 / flatten(prec)))
    torch.testing.assert_close(got, want, **ORACLE_TOL)
    torch.testing.assert_close(got.sum(-1), torch.ones(9, dtype=DT), **EXACT)


@pytest.mark.parametrize("n_terms", [1, 2])
def test_glm_probit_kron_and_full_equal_brute_force(gen, n_terms):
    """A two-head net: the unused head's layer carries all-zero Kronecker terms (two of them for n_terms=2)."""
    model = _mlp(gen, n_heads=2)
    x = torch.randn(8, 4, generator=gen, dtype=DT)
    c = curvature(model, x, kind="ggn", structure="kron", head=0)
    post = KronPosterior.from_curvature(params_of(model), c, 0.4)
    for _ in range(n_terms - 1):
        post = post.add_precision(curvature(model, x[:5], kind="ggn", structure="kron", head=0), 3.0)
    _, s = post.to_dense()
    for head in (0, 1):
        want = _probit_by_hand(model, x, torch.linalg.inv(s), head=head)
        torch.testing.assert_close(glm_predictive(model, post, x, head=head), want, **ORACLE_TOL)
        full = FullPosterior(params_of(model), s)
        torch.testing.assert_close(glm_predictive(model, full, x, head=head), want, **ORACLE_TOL)


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_method_predict_proba_is_the_glm_predictive_of_its_posterior(gen, structure):
    """``laplace`` with ``predictive: glm`` after a task: Σ = (δI + GGN/T)⁻¹ (diag: of the GGN's diagonal)."""
    delta, temp = 0.7, 0.5
    model = _mlp(gen)
    x = torch.randn(12, 4, generator=gen, dtype=DT)
    y = torch.randint(3, (12,), generator=gen)
    method = build_method("laplace", {"structure": structure, "prior_precision": delta, "temperature": temp,
                                      "predictive": "glm"})
    method.regularizer.setup(model)
    method.on_task_end(model, _task(x, y))
    ggn = O.ggn(model, x)
    prec = ggn / temp + delta * torch.eye(ggn.shape[0], dtype=DT)
    if structure == "diag":
        prec = torch.diag(torch.diagonal(prec))
    xt = torch.randn(6, 4, generator=gen, dtype=DT)
    torch.testing.assert_close(method.predict_proba(model, xt, 0), _probit_by_hand(model, xt, torch.linalg.inv(prec)),
                               **ORACLE_TOL)
    map_method = build_method("laplace", {"structure": structure, "prior_precision": delta, "temperature": temp})
    map_method.regularizer.setup(model)
    map_method.on_task_end(model, _task(x, y))
    with torch.no_grad():
        torch.testing.assert_close(map_method.predict_proba(model, xt, 0), torch.softmax(model(xt), -1), rtol=0, atol=0)


def test_params_validation():
    from continual_blr.methods import MethodParamsError

    for bad, field in (({"predictive": "mc"}, "params.predictive"), ({"marglik": "yes"}, "params.marglik")):
        with pytest.raises((ValueError, MethodParamsError), match=field):
            build_method("laplace", bad)


# ----------------------------------------------------------------------------------------------------------------
# 2. laplace-torch
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_glm_probit_equals_laplace_torch(gen, dtype):
    laplace = pytest.importorskip("laplace")
    from torch.utils.data import DataLoader, TensorDataset
    from laplace.curvature import CurvlinopsGGN

    delta, temp = 0.7, 0.5
    model = _mlp(gen, dtype=dtype)
    x = torch.randn(30, 4, generator=gen, dtype=DT).to(dtype)
    y = torch.randint(3, (30,), generator=gen)
    xt = torch.randn(12, 4, generator=gen, dtype=DT).to(dtype)
    # laplace-torch on a copy (its backends hook into modules)
    la = laplace.Laplace(copy.deepcopy(model), "classification", subset_of_weights="all", hessian_structure="diag",
                         prior_precision=delta, temperature=temp, backend=CurvlinopsGGN)
    la.fit(DataLoader(TensorDataset(x, y), batch_size=10))
    want = la(xt, pred_type="glm", link_approx="probit")
    method = build_method("laplace", {"structure": "diag", "prior_precision": delta, "temperature": temp,
                                      "predictive": "glm"})
    method.regularizer.setup(model)
    method.on_task_end(model, _task(x, y))
    got = method.predict_proba(model, xt, 0)
    assert (got - want).abs().max().item() <= LAPLACE_TORCH_TOL
    if dtype == torch.float64:  # the δ-dependent part of the evidence, and δ̂ maximises laplace-torch's
        post = method.posterior()
        lam = curvature_eigenvalues(post, delta)
        s = float(flatten(post.mean).pow(2).sum())

        def theirs(d):
            return la.log_marginal_likelihood(torch.tensor(d, dtype=DT)).item()

        for d in (0.1, 3.0):
            assert theirs(d) - theirs(1.0) == pytest.approx(log_evidence(d, lam, s) - log_evidence(1.0, lam, s),
                                                            rel=1e-10)
        d_hat = marglik_prior_precision(post, delta)
        assert theirs(d_hat) >= max(theirs(d_hat * 1.01), theirs(d_hat / 1.01))


# ----------------------------------------------------------------------------------------------------------------
# 3. marginal-likelihood δ
# ----------------------------------------------------------------------------------------------------------------
SIGMA = 0.5


def _blr(gen, n=40, d=3):
    x = torch.randn(n, d, generator=gen, dtype=DT)
    y = x @ torch.tensor([0.8, -0.5, 0.3], dtype=DT) + 0.2 + SIGMA * torch.randn(n, generator=gen, dtype=DT)
    phi = torch.cat([x, torch.ones(n, 1, dtype=DT)], 1)
    return phi, y


def _exact_evidence(phi, y, delta):
    cov = phi @ phi.T / delta + SIGMA**2 * torch.eye(phi.shape[0], dtype=DT)
    return torch.distributions.MultivariateNormal(torch.zeros_like(y), cov).log_prob(y)


def _blr_posterior(phi, y, delta):
    h = phi.T @ phi / SIGMA**2
    prec = h + delta * torch.eye(phi.shape[1], dtype=DT)
    theta = torch.linalg.solve(prec, phi.T @ y / SIGMA**2)
    return FullPosterior({"w": theta}, prec)


def test_marglik_delta_is_the_exact_evidence_maximiser_on_bayesian_linear_regression(gen):
    phi, y = _blr(gen)
    values = torch.stack([_exact_evidence(phi, y, float(d)) for d in GRID])
    best = int(torch.argmax(values))
    assert 0 < best < len(GRID) - 1  # an interior maximum
    d_grid = float(GRID[best])
    # at the MAP of δ_grid the stationarity condition of the exact evidence gives back δ_grid
    d_hat = marglik_prior_precision(_blr_posterior(phi, y, d_grid), d_grid)
    assert abs(math.log(d_hat / d_grid)) <= GRID_TOL
    # MacKay's iteration (what ``marglik: use`` does task after task): refit, new δ̂; converges to the optimum
    d = 1e-3
    for _ in range(200):
        d = marglik_prior_precision(_blr_posterior(phi, y, d), d)
    assert abs(math.log(d / d_grid)) <= GRID_TOL


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_marglik_eigen_structure_equals_dense_evidence(gen, structure):
    """Diag / one-term Kronecker: L(δ) from the structure's eigenvalues equals −½δs − ½ log det(I + H/δ) with H dense;
    δ̂ is the argmax of the dense L over the grid."""
    model = _mlp(gen)
    x = torch.randn(10, 4, generator=gen, dtype=DT)
    delta = 0.9
    c = curvature(model, x, kind="ggn", structure=structure)
    mean = params_of(model)
    post = (DiagPosterior(mean, {k: v + delta for k, v in c.items()}) if structure == "diag"
            else KronPosterior.from_curvature(mean, c, delta))
    m, s_dense = post.to_dense()
    eye = torch.eye(s_dense.shape[0], dtype=DT)
    h = s_dense - delta * eye
    scatter = float(m @ m)
    lam = curvature_eigenvalues(post, delta)

    def dense(d):
        return -0.5 * d * scatter - 0.5 * float(torch.logdet(eye + h / d))

    for d in (0.05, 1.0, 20.0):
        assert log_evidence(d, lam, scatter) == pytest.approx(dense(d), rel=1e-10, abs=1e-10)
    values = torch.tensor([dense(float(d)) for d in GRID])
    d_grid = float(GRID[int(torch.argmax(values))])
    assert abs(math.log(marglik_prior_precision(post, delta) / d_grid)) <= GRID_TOL


def test_optimal_prior_precision_degenerate_cases():
    assert optimal_prior_precision(torch.zeros(5, dtype=DT), 1.0) == 0.0  # no curvature: L decreases in δ
    assert optimal_prior_precision(torch.ones(5, dtype=DT), 0.0) == math.inf  # θ* = m₀
    lam = torch.tensor([1e-8, 1.0, 1e8], dtype=DT)
    d = optimal_prior_precision(lam, 0.3)
    assert float((lam / (lam + d)).sum()) == pytest.approx(0.3 * d, rel=1e-10)  # γ(δ̂) = s·δ̂


def test_marglik_reported_per_task_and_used():
    """``report`` records one δ̂ per task and trains exactly as ``off``; ``use`` puts δ̂ in the carried posterior.
    Both survive state_dict / load_state_dict."""
    from continual_blr.data import make_stream
    from continual_blr.loop import run_stream
    from continual_blr.methods.base import TrainConfig
    from continual_blr.models import build_model

    torch.set_num_threads(1)
    stream = make_stream("synthetic", scenario="task", n_tasks=2, n_train=30, n_test=10, n_features=5, seed=3)
    results = {}
    for mode in ("off", "report", "use"):
        model = build_model("mlp", (5,), stream.n_outputs, stream.n_heads, hidden=(6,),
                            generator=torch.Generator().manual_seed(0))
        method = build_method("laplace", {"structure": "diag", "marglik": mode}, seed=0)
        res = run_stream(model, stream, method, TrainConfig(epochs=2, batch_size=16, lr=0.02), progress=False)
        results[mode] = (res, method, model)
    assert "marglik_prior_precision" not in results["off"][1].memory_stats()
    deltas = results["report"][1].memory_stats()["marglik_prior_precision"]
    assert len(deltas) == 2 and all(0 < d < math.inf for d in deltas)
    assert results["report"][0].acc_matrix == results["off"][0].acc_matrix
    assert results["report"][0].train_loss == results["off"][0].train_loss
    _, used, model = results["use"]
    post = used.posterior()
    assert used.delta == used.marglik_deltas[-1]
    assert marglik_prior_precision(post, used.delta) == pytest.approx(used.delta, rel=1e-6)  # a fixed point of L
    fresh = build_method("laplace", {"structure": "diag", "marglik": "use"}, seed=0)
    fresh.load_state_dict(used.state_dict())
    assert fresh.delta == used.delta and fresh.marglik_deltas == used.marglik_deltas
