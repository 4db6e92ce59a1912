"""Engine quantities pinned against independent float64 computations (issue 42, item 0's planted bugs).

Each test checks one quantity of one step, not an accuracy after training, and none shares the code it checks:

* the Kronecker ``"gauss_newton"`` estimate is (N/B) times the nearest Kronecker product to Σ_i vec(g_i) vec(g_i)ᵀ,
  the oracle an SVD of the rearranged matrix of autograd per-example gradients (Van Loan & Pitsianis 1993), with
  N/B = 5;
* the damping enters the preconditioner as N γ: the new mean of one step on Bayesian linear regression is
  m − α (S₀ + ĥ + N γ I)⁻¹ (ĝ + S₀(m − m₀)) with ĝ, ĥ in closed form (diagonal and full structure);
* the Kronecker data part forgets: after three steps at rate ρ, D = Σ_t ρ(1 − ρ)^{T−t} ĥ_t and the carried D̄ is the
  debiased average, with ĥ_t = (N/B) X̃_tᵀX̃_t ⊗ I/σ² the exact Gaussian GGN of each batch (Kronecker-exact for a
  Linear layer, so the recursion must hold to round-off);
* the native C Price step (``optim/native.py``) equals the closed form of IVON's update with a prior on a step where
  the Price estimate ĥ = ĝ_data ∘ ε ∘ √S is as large as the step's D, and equals the Python step.

Planted once each, every test here failed (see the commit message); the tolerances are the exact tier.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import EXACT
from continual_blr.models import build_model
from continual_blr.optim import native
from continual_blr.optim.blr import BayesianLearningRule
from continual_blr.optim.closures import BatchClosure
from continual_blr.optim.precision import blr_data_update
from continual_blr.posteriors import DiagPosterior, FullPosterior, KronPosterior, kron_layers

DT = torch.float64
W, B = "heads.0.weight", "heads.0.bias"


def _linear(d_in: int, d_out: int, seed: int = 0) -> torch.nn.Module:
    return build_model("linear", (d_in,), d_out, 1, generator=torch.Generator().manual_seed(seed)).to(DT)


def _kron_dense(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A ⊗ G as the 4-tensor T[j, k, p, q] = A[j, k] G[p, q] (columns j, k; rows p, q of Θ = [W | b])."""
    return torch.einsum("jk,pq->jkpq", a, g)


def _nearest_kronecker_svd(t: torch.Tensor) -> torch.Tensor:
    """The best Frobenius rank-one A ⊗ G to a 4-tensor T[j, k, p, q], by an SVD of its rearrangement R[(j,k), (p,q)]."""
    n_in, n_out = t.shape[0], t.shape[2]
    u, s, vh = torch.linalg.svd(t.reshape(n_in * n_in, n_out * n_out))
    return (s[0] * torch.outer(u[:, 0], vh[0])).reshape(n_in, n_in, n_out, n_out)


# ------------------------------------------------------------------------- Kronecker gauss_newton: N/B


def test_kron_gauss_newton_is_the_nearest_kronecker_product_scaled_by_n_over_b():
    """One delta-method step at ρ = 1 sets D = ĥ = (N/B) · argmin ‖A ⊗ G − Σ_i vec(g_i)vec(g_i)ᵀ‖ with g_i = [∇_W ℓ_i |
    ∇_b ℓ_i] from autograd, one example at a time; N = 60, B = 12 (N/B = 5)."""
    gen = torch.Generator().manual_seed(0)
    model = _linear(3, 4)
    x = torch.randn(12, 3, generator=gen, dtype=DT)
    y = torch.randint(0, 4, (12,), generator=gen)
    n_data = 60
    prior = KronPosterior.isotropic({k: torch.zeros_like(p) for k, p in model.named_parameters()}, 1.0,
                                    kron_layers(model))
    # the oracle at the weights of the step (delta method: ĥ at the mean before the step)
    t = torch.zeros(4, 4, 4, 4, dtype=DT)  # Σ_i vec(g_i) vec(g_i)ᵀ rearranged, Θ = [W | b] of shape [4, 3 + 1]
    for i in range(12):
        loss = torch.nn.functional.cross_entropy(model(x[i:i + 1], head=0), y[i:i + 1])
        gw, gb = torch.autograd.grad(loss, [model.heads[0].weight, model.heads[0].bias])
        gi = torch.cat([gw, gb[:, None]], 1)  # [d_out, d_in + 1]
        t += torch.einsum("pj,qk->jkpq", gi, gi)
    expected = (n_data / 12) * _nearest_kronecker_svd(t)
    opt = BayesianLearningRule(model, prior, n_data=n_data, lr=0.1, rho=1.0, beta1=0.0, mc_samples=0,
                               curvature="gauss_newton", generator=torch.Generator().manual_seed(1))
    opt.kron_iters = 200  # alternating least squares run to convergence (3 sweeps: 7e-5 of the product)
    opt.step(BatchClosure(model, x, y, head=0))
    blocks, diag = opt.data_precision
    a, g = blocks[W]
    torch.testing.assert_close(_kron_dense(a, g), expected, rtol=1e-7, atol=1e-10)
    assert diag == {}


# ------------------------------------------------------------------------- damping: N γ in the preconditioner


def _regression(gen, n: int, d: int, sigma: float):
    x = torch.randn(n, d, generator=gen, dtype=DT)
    y = x @ torch.randn(d, generator=gen, dtype=DT) + sigma * torch.randn(n, generator=gen, dtype=DT)
    return x, y


class _Lin(torch.nn.Module):
    def __init__(self, d: int, gen: torch.Generator) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d, generator=gen, dtype=DT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_damping_enters_the_preconditioner_as_n_gamma(structure):
    """Bayesian linear regression, one delta-method step with the exact Hessian, ρ = 1, no momentum or clip:
    m' = m − α (S₀ + ĥ + N γ I)⁻¹ (ĝ + S₀(m − m₀)), ĝ = (N/B) Xᵀ(Xm − y)/σ², ĥ = (N/B) XᵀX/σ² (its diagonal for
    ``diag``). N γ = 40 against γ = 0.4: a damping taken as γ moves m' by O(1)."""
    gen = torch.Generator().manual_seed(2)
    d, b, n_data, sigma, gamma, lr = 4, 10, 100, 0.5, 0.4, 0.7
    x, y = _regression(gen, b, d, sigma)
    model = _Lin(d, gen)
    m = model.w.detach().clone()
    m0 = torch.randn(d, generator=gen, dtype=DT)
    s0 = torch.rand(d, generator=gen, dtype=DT) + 0.5
    if structure == "diag":
        prior = DiagPosterior({"w": m0}, {"w": s0})
        s0_mat = torch.diag(s0)
    else:
        root = torch.randn(d, d, generator=gen, dtype=DT)
        s0_mat = root @ root.T + torch.eye(d, dtype=DT)
        prior = FullPosterior({"w": m0}, s0_mat)
    opt = BayesianLearningRule(model, prior, n_data=n_data, lr=lr, rho=1.0, beta1=0.0, mc_samples=0,
                               curvature="hessian", damping=gamma, clip_radius=None,
                               generator=torch.Generator().manual_seed(1))
    opt.step(lambda p: 0.5 * (y - torch.func.functional_call(model, p, (x,))) ** 2 / sigma**2)
    g = (n_data / b) * x.T @ (x @ m - y) / sigma**2
    h = (n_data / b) * x.T @ x / sigma**2
    if structure == "diag":
        h = torch.diag(torch.diagonal(h))
    precond = s0_mat + h + n_data * gamma * torch.eye(d, dtype=DT)
    expected = m - lr * torch.linalg.solve(precond, g + s0_mat @ (m - m0))
    torch.testing.assert_close(model.w.detach(), expected, **EXACT)


# ------------------------------------------------------------------------- Kronecker D forgets at rate ρ


def test_kron_data_part_is_the_exponential_average_of_the_batch_ggns():
    """Three delta-method steps on three batches of Gaussian regression through a Linear layer (2 outputs), ρ = 0.3
    without debiasing: D = ρĥ₃ + ρ(1 − ρ)ĥ₂ + ρ(1 − ρ)²ĥ₁ (from D = 0) and the carried D̄ = the same weights
    normalised to sum to 1, with ĥ_t = (N/B) X̃_tᵀX̃_t ⊗ I/σ², built here from the data alone."""
    gen = torch.Generator().manual_seed(3)
    sigma, n_data, b, rho = 0.5, 90, 6, 0.3
    model = _linear(3, 2)
    prior = KronPosterior.isotropic({k: torch.zeros_like(p) for k, p in model.named_parameters()}, 2.0,
                                    kron_layers(model))
    opt = BayesianLearningRule(model, prior, n_data=n_data, lr=1e-3, rho=rho, beta1=0.0, mc_samples=0,
                               curvature="ggn", debias=False, generator=torch.Generator().manual_seed(1))
    hs = []
    for _ in range(3):
        x = torch.randn(b, 3, generator=gen, dtype=DT) + torch.randn(3, generator=gen, dtype=DT)
        y = torch.randn(b, 2, generator=gen, dtype=DT)
        xt = torch.cat([x, torch.ones(b, 1, dtype=DT)], 1)
        hs.append((n_data / b) * _kron_dense(xt.T @ xt, torch.eye(2, dtype=DT) / sigma**2))
        opt.step(BatchClosure(model, x, y, head=0, likelihood="regression", sigma=sigma))
    weights = [rho * (1 - rho) ** 2, rho * (1 - rho), rho]
    d_expected = sum(w * h for w, h in zip(weights, hs))
    avg_expected = d_expected / sum(weights)
    (d_blocks, _), (avg_blocks, _) = opt._data, opt.data_precision
    torch.testing.assert_close(_kron_dense(*d_blocks[W]), d_expected, **EXACT)
    torch.testing.assert_close(_kron_dense(*avg_blocks[W]), avg_expected, **EXACT)


def test_kron_blr_data_update_is_the_nearest_kronecker_product_of_the_recursion():
    """The pure update on terms with different G: D' = nearest Kronecker product of (1 − ρ) A_D ⊗ G_D + ρ A_ĥ ⊗ G_ĥ,
    the oracle an SVD; the parameters outside layers: (1 − ρ) D + ρ ĥ."""
    gen = torch.Generator().manual_seed(4)

    def psd(n):
        r = torch.randn(n, n, generator=gen, dtype=DT)
        return r @ r.T + 0.1 * torch.eye(n, dtype=DT)

    rho = 0.25
    d_term, h_term = (psd(5), psd(3)), (psd(5), psd(3))
    d_diag, h_diag = torch.rand(7, generator=gen, dtype=DT), torch.rand(7, generator=gen, dtype=DT)
    (blocks, diag) = blr_data_update(({W: d_term}, {"x": d_diag}), ({W: h_term}, {"x": h_diag}), rho)
    expected = _nearest_kronecker_svd((1 - rho) * _kron_dense(*d_term) + rho * _kron_dense(*h_term))
    torch.testing.assert_close(_kron_dense(*blocks[W]), expected, **EXACT)
    torch.testing.assert_close(diag["x"], (1 - rho) * d_diag + rho * h_diag, **EXACT)


# ------------------------------------------------------------------------- the native Price step


NATIVE = native.native_update(DT, torch.device("cpu"), **dict.fromkeys(native.FLAGS, False)) is not None


@pytest.mark.skipif(not NATIVE, reason="no C compiler for the native update on this machine")
def test_the_native_price_step_is_ivons_update_with_a_nonzero_price_estimate():
    """One fused Price step on the module path (the native C loop, float64) on Gaussian regression, against the
    closed form with ε replayed from the optimiser's generator: θ = m + ε ∘ r, r = (S₀ + D₀)^{-1/2},
    ĝ = (N/B) ∇ Σ_i ℓ_i(θ) (autograd), ĥ = ĝ ∘ ε / r,

        D̄ = ĥ (the debiased average's first estimate),   D = D₀ − ρ(D₀ − ĥ) + ½ρ²(D₀ − ĥ)²/(S₀ + D₀),
        m' = m − α (ĝ + S₀ ∘ (m − m₀)) / (S₀ + D).

    ρ = 0.5 and a small start h₀, so that |ĥ| is of the order of D: a zeroed ĥ moves D̄ and D by O(1). The Python step
    (``fused=False``) gives the same numbers."""
    gen = torch.Generator().manual_seed(5)
    sigma, n_data, b, rho, lr, h0 = 0.5, 40, 8, 0.5, 0.05, 0.05
    x = torch.randn(b, 3, generator=gen, dtype=DT)
    y = torch.randn(b, 1, generator=gen, dtype=DT)
    base = _linear(3, 1)
    names = [k for k, _ in base.named_parameters()]
    m0 = {k: 0.1 * torch.randn(p.shape, generator=gen, dtype=DT) for k, p in base.named_parameters()}
    s0 = {k: torch.rand(p.shape, generator=gen, dtype=DT) + 1.0 for k, p in base.named_parameters()}
    prior = DiagPosterior(m0, s0)
    results = {}
    for fused in (True, False):
        model = copy.deepcopy(base)
        opt = BayesianLearningRule(model, prior, n_data=n_data, lr=lr, rho=rho, beta1=0.0, mc_samples=1,
                                   curvature="price", init_hess=h0, clip_radius=None, debias=False, fused=fused,
                                   generator=torch.Generator().manual_seed(7))
        replay = torch.Generator().set_state(opt.generator.get_state())
        opt.step(BatchClosure(model, x, y, head=0, likelihood="regression", sigma=sigma))
        if fused:
            assert opt._flat_weights is not None, "the native path did not run"
        flat = lambda d: torch.cat([d[k].reshape(-1) for k in names])  # noqa: E731
        results[fused] = (flat(dict(model.named_parameters())).detach(), flat(opt._data), flat(opt._avg))
    # the closed form
    m, m0f, s0f = flat(dict(base.named_parameters())).detach(), flat(m0), flat(s0)
    d0 = torch.full_like(m, n_data * h0)
    eps = torch.randn(m.numel(), generator=replay, dtype=DT)
    r = torch.rsqrt(s0f + d0)
    theta = (m + eps * r).requires_grad_(True)
    w_, b_ = theta[:3].reshape(1, 3), theta[3:]
    loss = (0.5 * ((x @ w_.T + b_ - y) ** 2).sum(1) / sigma**2).sum() * (n_data / b)
    (g,) = torch.autograd.grad(loss, theta)
    h = g * eps / r
    d = d0 - rho * (d0 - h) + 0.5 * rho**2 * (d0 - h) ** 2 / (s0f + d0)
    mean = m - lr * (g + s0f * (m - m0f)) / (s0f + d)
    assert float(h.abs().min()) > 0.1 * float(d0[0])  # the Price estimate matters on every coordinate
    for fused, (got_m, got_d, got_avg) in results.items():
        torch.testing.assert_close(got_avg, h, **EXACT, msg=lambda s: f"D̄ (fused={fused}): {s}")
        torch.testing.assert_close(got_d, d, **EXACT, msg=lambda s: f"D (fused={fused}): {s}")
        torch.testing.assert_close(got_m, mean, **EXACT, msg=lambda s: f"mean (fused={fused}): {s}")
