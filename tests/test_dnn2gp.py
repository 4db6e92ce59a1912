"""DNN2GP (continual_blr.dnn2gp) against exact references, float64.

* A linear model: exact Bayesian linear regression — posterior predictive in weight space, the same in
  GP form k*(K + σ²I)⁻¹y, and the evidence log N(y; 0, ΦΦᵀ/δ + σ²I).
* A small network: the Laplace-GGN linearised predictive J Σ Jᵀ with the GGN, Jacobians and Σ formed
  densely by brute force (tests/oracles.py), in full, diagonal and Kronecker structure, for logits and
  probabilities (Λ J Σ Jᵀ Λ), and the regression evidence of the linearised model.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.distributions import MultivariateNormal

import oracles as O
from conftest import EXACT
from continual_blr.curvature import curvature
from continual_blr.dnn2gp import DNN2GP
from continual_blr.models import MLP
from continual_blr.posteriors import DiagPosterior, KronPosterior
from continual_blr.types import flatten, params_of

DT = torch.float64
DELTA, SIGMA = 0.7, 0.4


def _features(x):
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=DT)], 1)  # nn.Linear's [W | b] order


def _blr_fixture(gen, n=25, d=3):
    x = torch.randn(n, d, generator=gen, dtype=DT)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=DT) + 0.3 + SIGMA * torch.randn(n, generator=gen, dtype=DT)
    phi = _features(x)
    prec = phi.T @ phi / SIGMA**2 + DELTA * torch.eye(d + 1, dtype=DT)
    mean = torch.linalg.solve(prec, phi.T @ y / SIGMA**2)
    model = nn.Linear(d, 1).to(DT)
    with torch.no_grad():
        model.weight.copy_(mean[:d].unsqueeze(0))
        model.bias.copy_(mean[d:])
    return model, x, y, phi, prec, mean


def test_linear_model_equals_exact_bayesian_linear_regression(gen):
    model, x, y, phi, prec, mean = _blr_fixture(gen)
    gp = DNN2GP.laplace(model, x, prior_precision=DELTA, likelihood="regression", noise_std=SIGMA,
                        structure="full")
    xs = torch.randn(7, 3, generator=gen, dtype=DT)
    phis = _features(xs)
    cov = torch.linalg.inv(prec)
    m, v = gp.predict(xs)
    torch.testing.assert_close(m[:, 0], phis @ mean, **EXACT)
    torch.testing.assert_close(v[:, 0], torch.einsum("np,pq,nq->n", phis, cov, phis), **EXACT)
    _, vy = gp.predict(xs, include_noise=True)
    torch.testing.assert_close(vy[:, 0], v[:, 0] + SIGMA**2, **EXACT)
    # the same predictive in GP (function-space) form with the prior kernel Φ Φᵀ / δ
    k = phi @ phi.T / DELTA
    ks = phis @ phi.T / DELTA
    a = torch.linalg.solve(k + SIGMA**2 * torch.eye(len(y), dtype=DT), torch.cat([y[:, None], ks.T], 1))
    torch.testing.assert_close(m[:, 0], ks @ a[:, 0], **EXACT)
    torch.testing.assert_close(v[:, 0], (phis @ phis.T / DELTA).diagonal() - (ks * a[:, 1:].T).sum(1), **EXACT)
    # cross-kernel: the GP posterior covariance between test points
    torch.testing.assert_close(gp.kernel(xs, xs[:3]), phis @ cov @ phis[:3].T, **EXACT)


def test_linear_model_marginal_likelihood_and_delta_selection(gen):
    model, x, y, phi, _, _ = _blr_fixture(gen)
    gp = DNN2GP.laplace(model, x, prior_precision=DELTA, likelihood="regression", noise_std=SIGMA,
                        structure="full")
    def exact(delta):
        cov = phi @ phi.T / delta + SIGMA**2 * torch.eye(len(y), dtype=DT)
        return MultivariateNormal(torch.zeros(len(y), dtype=DT), cov).log_prob(y)
    torch.testing.assert_close(gp.log_marginal_likelihood(x, y), exact(DELTA), **EXACT)
    grid = [1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0]
    best, values = gp.select_prior_precision(x, y, grid)
    ref = torch.stack([exact(d) for d in grid])
    torch.testing.assert_close(values, ref, **EXACT)
    assert best == grid[int(ref.argmax())]


def _net(gen, k=3, d=4):
    model = MLP(d, (5,), k, n_heads=2).to(DT)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=DT))
    x = torch.randn(15, d, generator=gen, dtype=DT)
    xs = torch.randn(6, d, generator=gen, dtype=DT)
    return model, x, xs


def _blocks(mat, k):
    n = mat.shape[0] // k
    m4 = mat.reshape(n, k, n, k)
    return torch.stack([m4[i, :, i, :] for i in range(n)])


@pytest.mark.parametrize("output", ["logits", "probs"])
@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
def test_small_network_predictive_equals_dense_laplace_ggn(gen, structure, output):
    model, x, xs = _net(gen)
    head = 1
    names = [n for n, _ in model.named_parameters()]
    if structure == "full":
        ggn = O.ggn(model, x, head=head)
        sigma = torch.linalg.inv(ggn + DELTA * torch.eye(ggn.shape[0], dtype=DT))
    elif structure == "diag":
        ggn = O.ggn(model, x, head=head)
        sigma = torch.diag(1.0 / (ggn.diagonal() + DELTA))
    else:  # the Kronecker posterior's dense precision, inverted densely
        kc = curvature(model, x, structure="kron", head=head)
        _, prec = KronPosterior.from_curvature(params_of(model), kc, DELTA).to_dense()
        sigma = torch.linalg.inv(prec)
    gp = DNN2GP.laplace(model, x, prior_precision=DELTA, structure=structure, head=head, output=output)
    fn = (lambda f: f.softmax(-1)) if output == "probs" else None
    j = O.jacobians(model, xs, head=head, output_fn=fn)  # [N, K, P]
    expect = O.kernel(j, sigma, blockwise=False)
    mean, cov = gp.predict(xs, full_cov=True)
    with torch.no_grad():
        f = model(xs, head=head)
    torch.testing.assert_close(mean, f.softmax(-1) if output == "probs" else f, **EXACT)
    torch.testing.assert_close(cov, _blocks(expect, 3), rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(gp.kernel(xs), expect, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(gp.kernel(xs, blockwise=True), O.kernel(j, sigma, blockwise=True),
                               rtol=1e-7, atol=1e-10)
    assert names == list(gp.param_names)


def test_probability_kernel_is_lambda_j_sigma_jt_lambda(gen):
    """Λ(x) J(x) Σ J(x')ᵀ Λ(x') with Λ = diag(p) − ppᵀ and logit Jacobians J."""
    model, x, xs = _net(gen)
    var = {n: torch.rand(p.shape, generator=gen, dtype=DT) for n, p in model.named_parameters()}
    gp_p = DNN2GP(model, var, output="probs")
    gp_f = DNN2GP(model, var, output="logits")
    with torch.no_grad():
        p = model(xs).softmax(-1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    big = torch.block_diag(*lam)
    torch.testing.assert_close(gp_p.kernel(xs), big @ gp_f.kernel(xs) @ big, rtol=1e-7, atol=1e-12)


def test_vogn_style_diag_posterior_and_mean_check(gen):
    model, x, xs = _net(gen)
    prec = {n: 1.0 + torch.rand(p.shape, generator=gen, dtype=DT) for n, p in model.named_parameters()}
    post = DiagPosterior(params_of(model), prec)
    gp = DNN2GP(model, post, output="logits")
    j = O.jacobians(model, xs)
    sigma = torch.diag(1.0 / flatten(prec))
    _, v = gp.predict(xs)
    torch.testing.assert_close(v, torch.einsum("nkp,pq,nkq->nk", j, sigma, j), **EXACT)
    shifted = DiagPosterior({n: t + 1 for n, t in params_of(model).items()}, prec)
    with pytest.raises(ValueError, match="mean"):
        DNN2GP(model, shifted)


def test_small_network_regression_evidence_equals_linearised_model(gen):
    model = MLP(2, (6,), 2).to(DT)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=DT))
    x = torch.randn(10, 2, generator=gen, dtype=DT)
    y = torch.randn(10, 2, generator=gen, dtype=DT)
    gp = DNN2GP.laplace(model, x, prior_precision=DELTA, likelihood="regression", noise_std=SIGMA)
    j = O.jacobians(model, x).reshape(20, -1)  # rows n·K + k
    with torch.no_grad():
        f = model(x).reshape(-1)
    yt = y.reshape(-1) - f + j @ flatten(params_of(model))
    cov = j @ j.T / DELTA + SIGMA**2 * torch.eye(20, dtype=DT)
    expect = MultivariateNormal(torch.zeros(20, dtype=DT), cov).log_prob(yt)
    torch.testing.assert_close(gp.log_marginal_likelihood(x, y), expect, **EXACT)
    assert math.isfinite(float(expect))


def test_argument_errors(gen):
    model, x, _ = _net(gen)
    var = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="likelihood"):
        DNN2GP(model, var, likelihood="poisson")
    with pytest.raises(ValueError, match="output"):
        DNN2GP(model, var, likelihood="regression", output="probs")
    with pytest.raises(ValueError, match="regression"):
        DNN2GP(model, var).log_marginal_likelihood(x, torch.zeros(15, 3, dtype=DT), 1.0)
    with pytest.raises(ValueError, match="include_noise"):
        DNN2GP(model, var).predict(x, include_noise=True)
    with pytest.raises(TypeError, match="posterior"):
        DNN2GP(model, [1, 2])
