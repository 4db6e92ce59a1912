"""BLR optimisers against exact oracles: conjugate Bayesian linear regression and the Laplace
approximation of logistic regression (float64)."""

import pytest
import torch
from torch import nn

import oracles as O
from oracles import Linear
from oracles import quadratic_closure as _closure
from continual_blr.models import MLP
from continual_blr.optim import VOGN, VON, BayesianLearningRule
from continual_blr.optim.blr import BatchClosure
from continual_blr.posteriors import DiagPosterior, FullPosterior, KronPosterior
from continual_blr.types import flatten

DT = torch.float64
REL_CONJUGATE = 1e-8  # sequential vs batch Bayes, exact up to round-off
LAPLACE_TOL = dict(rtol=1e-6, atol=1e-9)


def _regression_data(g, n=250, d=6, sigma=0.3):
    x = torch.randn(n, d, generator=g, dtype=DT)
    w_true = torch.randn(d, generator=g, dtype=DT)
    y = x @ w_true + sigma * torch.randn(n, generator=g, dtype=DT)
    return x, y, sigma


def _batch_posterior(x, y, sigma, delta, m0):
    prec = x.T @ x / sigma**2 + delta * torch.eye(x.shape[1], dtype=DT)
    mean = torch.linalg.solve(prec, x.T @ y / sigma**2 + delta * m0)
    return mean, prec


def _rel(a, b):
    return (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()


@pytest.mark.parametrize("n_tasks", [1, 5])
def test_conjugate_sequential_equals_batch(gen, n_tasks):
    """Full structure, ρ = 1: posterior of task t as prior of task t+1 reproduces batch Bayes."""
    x, y, sigma = _regression_data(gen)
    d, delta = x.shape[1], 2.0
    model = Linear(d)
    m0 = torch.randn(d, generator=gen, dtype=DT)
    with torch.no_grad():
        model.w.copy_(torch.randn(d, generator=gen, dtype=DT))  # start away from anything special
    prior = FullPosterior({"w": m0}, delta)
    for xs, ys in zip(x.chunk(n_tasks), y.chunk(n_tasks)):
        opt = VON(model, prior, n_data=len(ys), lr=1.0, rho=1.0)
        opt.step(_closure(model, xs, ys, sigma))
        prior = opt.posterior()
    mean, prec = _batch_posterior(x, y, sigma, delta, m0)
    m_seq, s_seq = prior.to_dense()
    assert _rel(m_seq, mean) < REL_CONJUGATE
    assert _rel(s_seq, prec) < REL_CONJUGATE


def test_gauss_newton_precision_is_sum_of_per_example_outer_products(gen):
    """For one example per step, Σ g gᵀ is rank one and differs from the Hessian: the delta-method
    Gauss–Newton precision equals the analytic Σ_i r_i² x_i x_iᵀ/σ⁴ (checked by hand)."""
    x, y, sigma = _regression_data(gen, n=20, d=3)
    model = Linear(3)
    prior = FullPosterior({"w": torch.zeros(3, dtype=DT)}, 1.0)
    opt = VON(model, prior, n_data=20, curvature="gauss_newton", rho=1.0, lr=1.0)
    opt.step(_closure(model, x, y, sigma))
    r = y  # residuals at w = 0
    expected = (x * (r**2)[:, None]).T @ x / sigma**4 + torch.eye(3, dtype=DT)
    torch.testing.assert_close(opt.posterior().to_dense()[1], expected, rtol=1e-10, atol=1e-12)


def test_von_logistic_regression_converges_to_laplace(gen):
    n, d, delta = 200, 4, 0.5
    x = torch.randn(n, d, generator=gen, dtype=DT)
    y = (torch.rand(n, generator=gen, dtype=DT) < torch.sigmoid(x @ torch.tensor([1.5, -2.0, 0.5, 1.0], dtype=DT))).to(DT)
    model = Linear(d)

    def closure(params):
        f = torch.func.functional_call(model, params, (x,))
        return nn.functional.binary_cross_entropy_with_logits(f, y, reduction="none")

    prior = FullPosterior({"w": torch.zeros(d, dtype=DT)}, delta)
    opt = VON(model, prior, n_data=n)
    for _ in range(30):
        opt.step(closure)
    w = model.w.detach()
    # MAP: gradient of the negative log joint vanishes
    p = torch.sigmoid(x @ w)
    grad_map = x.T @ (p - y) + delta * w
    assert torch.linalg.norm(grad_map) < 1e-10
    # Laplace precision: Hessian of the negative log joint at the MAP
    hess = (x * (p * (1 - p))[:, None]).T @ x + delta * torch.eye(d, dtype=DT)
    torch.testing.assert_close(opt.posterior().to_dense()[1], hess, **LAPLACE_TOL)


def test_diag_von_hessian_on_separable_quadratic(gen):
    """Diagonal VON with the exact Hessian is exact when the Hessian is diagonal (orthogonal design)."""
    q, _ = torch.linalg.qr(torch.randn(40, 5, generator=gen, dtype=DT))
    x = q * torch.tensor([3.0, 2.0, 1.0, 0.5, 4.0], dtype=DT)  # XᵀX diagonal
    y = torch.randn(40, generator=gen, dtype=DT)
    model = Linear(5)
    prior = DiagPosterior({"w": torch.zeros(5, dtype=DT)}, 0.7)
    opt = VON(model, prior, n_data=40)
    opt.step(_closure(model, x, y, 1.0))
    mean, prec = _batch_posterior(x, y, 1.0, 0.7, torch.zeros(5, dtype=DT))
    assert _rel(model.w.detach(), mean) < REL_CONJUGATE
    assert _rel(torch.diag(opt.posterior().to_dense()[1]), torch.diagonal(prec)) < REL_CONJUGATE


def test_kron_von_on_single_linear_layer_one_example(gen):
    """For one example the per-example gradient is rank one (g = δ aᵀ) and its Kronecker projection
    is exact: the precision becomes (a aᵀ) ⊗ (δ δᵀ) scaled + prior."""
    lin = nn.Linear(3, 2).double()
    x = torch.randn(1, 3, generator=gen, dtype=DT)
    t = torch.randn(1, 2, generator=gen, dtype=DT)
    mean = {k: v.detach().clone() for k, v in lin.named_parameters()}
    prior = KronPosterior.isotropic(mean, 0.5, [("weight", "bias")])
    opt = VON(lin, prior, n_data=1, curvature="gauss_newton")

    def closure(params):
        out = torch.func.functional_call(lin, params, (x,))
        return 0.5 * ((out - t) ** 2).sum(-1)

    with torch.no_grad():
        r = lin(x) - t  # δ = residual
    opt.step(closure)
    a = torch.cat([x[0], torch.ones(1, dtype=DT)])
    dense_expected = torch.kron(torch.outer(r[0], r[0]), torch.outer(a, a)) + 0.5 * torch.eye(8, dtype=DT)
    perm = [o * 4 + j for o in range(2) for j in range(3)] + [o * 4 + 3 for o in range(2)]
    torch.testing.assert_close(opt.posterior().to_dense()[1], dense_expected[perm][:, perm], rtol=1e-9, atol=1e-12)


def test_sampled_params_restores_mean_even_on_error(gen):
    model = Linear(3)
    prior = DiagPosterior({"w": torch.zeros(3, dtype=DT)}, 1.0)
    opt = VOGN(model, prior, n_data=10, generator=gen)
    before = model.w.detach().clone()
    with pytest.raises(RuntimeError):
        with opt.sampled_params() as s:
            assert not torch.equal(model.w.detach(), before)
            assert torch.equal(model.w.detach(), s["w"])
            raise RuntimeError("boom")
    assert torch.equal(model.w.detach(), before)


def test_vogn_seeded_and_learns(gen):
    x = torch.randn(64, 3, generator=gen, dtype=DT)
    y = x @ torch.tensor([1.0, -1.0, 2.0], dtype=DT)
    runs = []
    for _ in range(2):
        model = Linear(3)
        opt = VOGN(model, DiagPosterior({"w": torch.zeros(3, dtype=DT)}, 1.0), n_data=64, lr=0.1, rho=0.1,
                   generator=torch.Generator().manual_seed(0))
        losses = [opt.step(_closure(model, x, y, 1.0)).item() for _ in range(60)]
        runs.append((model.w.detach().clone(), losses))
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1][-1] < 0.1 * runs[0][1][0]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n_data=0), "n_data"),
        (dict(lr=0.0), "lr"),
        (dict(rho=1.5), "rho"),
        (dict(beta1=1.0), "beta1"),
        (dict(mc_samples=-1), "mc_samples"),
        (dict(curvature="fisherish"), "curvature"),
        (dict(clip_radius=0.0), "clip_radius"),
    ],
)
def test_validation_names_the_field(kwargs, field):
    model = Linear(2)
    prior = DiagPosterior({"w": torch.zeros(2, dtype=DT)}, 1.0)
    args = dict(n_data=10) | kwargs
    with pytest.raises(ValueError, match=field):
        VON(model, prior, **args)


def test_validation_other_branches():
    model = Linear(2)
    with pytest.raises(TypeError, match="prior"):
        VON(model, "not a prior", n_data=3)
    with pytest.raises(ValueError, match="not in the model"):
        VON(model, DiagPosterior({"v": torch.zeros(2, dtype=DT)}, 1.0), n_data=3)
    with pytest.raises(ValueError, match="diagonal"):
        VOGN(model, FullPosterior({"w": torch.zeros(2, dtype=DT)}, 1.0), n_data=3)
    with pytest.raises(ValueError, match="mc_samples"):
        VOGN(model, DiagPosterior({"w": torch.zeros(2, dtype=DT)}, 1.0), n_data=3, mc_samples=0)
    lin = nn.Linear(2, 2).double()
    kp = KronPosterior.isotropic({k: v.detach() for k, v in lin.named_parameters()}, 1.0, [("weight", "bias")])
    with pytest.raises(ValueError, match="hessian"):
        VON(lin, kp, n_data=3, curvature="hessian")
    opt = VON(model, DiagPosterior({"w": torch.zeros(2, dtype=DT)}, 1.0), n_data=3)
    with pytest.raises(ValueError, match="closure"):
        opt.step(None)


def test_mean_update_clips_the_preconditioned_step_elementwise():
    """m ← m − α clip_r(S⁻¹d): entries of S⁻¹d beyond ±r are cut to ±r, the others are untouched."""
    from continual_blr.optim.blr import blr_mean_update

    post = DiagPosterior({"w": torch.tensor([1.0, -2.0, 0.5], dtype=DT)},
                         {"w": torch.tensor([0.5, 4.0, 10.0], dtype=DT)})
    d = {"w": torch.tensor([2.0, -4.0, 0.1], dtype=DT)}  # S⁻¹d = [4, -1, 0.01]
    alpha, r = 0.5, 0.3
    plain = blr_mean_update(post, d, alpha)
    clipped = blr_mean_update(post, d, alpha, clip_radius=r)
    torch.testing.assert_close(plain["w"], torch.tensor([1.0 - 2.0, -2.0 + 0.5, 0.5 - 0.005], dtype=DT))
    torch.testing.assert_close(clipped["w"], torch.tensor([1.0 - alpha * r, -2.0 + alpha * r, 0.5 - 0.005], dtype=DT))


# ----------------------------------------------------------------------------------------------
# Curvature-engine estimates inside the BLR step (a BatchClosure exposes the minibatch)
# ----------------------------------------------------------------------------------------------
ENGINE_VS_JACREV = dict(rtol=1e-10, atol=1e-12)  # the same sums in another order, float64


def _mlp_and_batch(gen):
    torch.manual_seed(0)  # MLP's default init only; the data come from ``gen``
    model = MLP(6, (7, 5), 3, n_heads=2).double()
    x = torch.randn(16, 6, generator=gen, dtype=DT)
    y = torch.randint(0, 3, (16,), generator=gen)
    return model, x, y


def _run_blr(model, x, y, curvature, structure="diag", steps=3, mc_samples=1):
    zeros = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    prior = DiagPosterior(zeros, 2.0) if structure == "diag" else FullPosterior(zeros, 2.0)
    opt = BayesianLearningRule(model, prior, n_data=100, lr=0.1, rho=0.5, beta1=0.9, mc_samples=mc_samples,
                               curvature=curvature, generator=torch.Generator().manual_seed(3))
    for _ in range(steps):
        opt.step(BatchClosure(model, x, y, head=1))
    return opt.posterior()


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_engine_empirical_fisher_equals_per_example_gauss_newton(gen, structure):
    """The engine's empirical Fisher (no per-example gradients for Linear layers in diag) and the jacrev
    per-example Gauss–Newton are the same Σ g gᵀ: three sampled steps give the same posterior."""
    model, x, y = _mlp_and_batch(gen)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    a = _run_blr(model, x, y, "gauss_newton", structure)
    model.load_state_dict(state)
    b = _run_blr(model, x, y, "empirical_fisher", structure)
    for k in a.mean:
        torch.testing.assert_close(b.mean[k], a.mean[k], **ENGINE_VS_JACREV)
    torch.testing.assert_close(b.to_dense()[1], a.to_dense()[1], **ENGINE_VS_JACREV)


def test_engine_ggn_step_adds_brute_force_ggn(gen):
    """Delta method, ρ = 1: S = (N/B) diag(Σ_i J_iᵀ Λ_i J_i) + S₀ with the GGN from a float64 autograd
    loop (tests/oracles.py), on the batch's head only."""
    model, x, y = _mlp_and_batch(gen)
    expected = torch.diagonal(O.ggn(model, x, head=1)) * (100 / x.shape[0]) + 2.0
    zeros = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    opt = BayesianLearningRule(model, DiagPosterior(zeros, 2.0), n_data=100, lr=0.1, rho=1.0, mc_samples=0,
                               curvature="ggn")
    opt.step(BatchClosure(model, x, y, head=1))
    torch.testing.assert_close(flatten(opt.posterior().precision), expected, rtol=1e-10, atol=1e-12)


def test_engine_curvature_needs_batch_closure(gen):
    model, x, y = _mlp_and_batch(gen)
    zeros = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    opt = BayesianLearningRule(model, DiagPosterior(zeros, 2.0), n_data=100, curvature="ggn")

    def closure(params):
        return nn.functional.cross_entropy(torch.func.functional_call(model, params, (x,), {"head": 1}), y,
                                           reduction="none")

    with pytest.raises(ValueError, match="needs a BatchClosure"):
        opt.step(closure)
    with pytest.raises(ValueError, match="curvature: got 'fisher'"):
        BayesianLearningRule(model, DiagPosterior(zeros, 2.0), n_data=100, curvature="fisher")


def test_blr_method_curvature_is_validated_and_reaches_the_optimiser():
    from continual_blr.methods import build_method

    with pytest.raises(ValueError, match=r"params.curvature: got 'hessian'; allowed: 'price', 'gauss_newton', 'empirical_fisher'"):
        build_method("blr", {"curvature": "hessian"})
    model = MLP(4, (3,), 2)
    method = build_method("blr", {"curvature": "ggn"})
    method.setup(model, None, None)
    assert method.optimizer.curvature == "ggn"


def test_a_non_finite_loss_stops_the_blr_step_before_the_posterior_changes(gen):
    from continual_blr.types import DivergenceError

    model, x, y = _mlp_and_batch(gen)
    zeros = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    opt = BayesianLearningRule(model, DiagPosterior(zeros, 2.0), n_data=100, curvature="empirical_fisher")
    before = opt.posterior()
    with torch.no_grad():
        model.heads[1].weight.fill_(float("inf"))
    with pytest.raises(DivergenceError, match="BLR step 1: the minibatch loss is not finite"):
        opt.step(BatchClosure(model, x, y, head=1))
    torch.testing.assert_close(opt.posterior().precision["body.1.weight"], before.precision["body.1.weight"])


DEBIAS_TOL = dict(rtol=1e-12, atol=0.0)  # the same sums in float64


@pytest.mark.parametrize("init", [1e-3, 1e4])
def test_debiased_precision_is_the_bias_corrected_average_of_the_curvatures(gen, init):
    """With ``debias``, S_t = Σ_k ρ(1−ρ)^{t−k} (ĥ_k + S₀) / (1 − (1−ρ)^t) whatever the starting precision,
    and a new prior restarts the count (its first step sets S = ĥ + S₀). Oracle: the exact Hessian of
    a squared loss on each minibatch, ĥ_k = (N/B) diag(X_kᵀX_k)/σ², written out here."""
    x, y, sigma = _regression_data(gen, n=40, d=5)
    n, rho, s0 = 40, 0.3, 0.7
    model = Linear(5)
    prior = DiagPosterior({"w": torch.zeros(5, dtype=DT)}, s0)
    init_post = DiagPosterior({"w": torch.zeros(5, dtype=DT)}, init)
    opt = BayesianLearningRule(model, prior, n_data=n, lr=0.1, rho=rho, curvature="hessian", init_precision=init_post,
                               debias=True)
    batches = list(zip(x.chunk(4), y.chunk(4)))
    hs = [n / len(yb) * (xb**2).sum(0) / sigma**2 for xb, yb in batches]
    for t, (xb, yb) in enumerate(batches, start=1):
        opt.step(_closure(model, xb, yb, sigma))
        weights = [rho * (1 - rho) ** (t - k) for k in range(1, t + 1)]
        expected = sum(w * (h + s0) for w, h in zip(weights, hs)) / (1 - (1 - rho) ** t)
        torch.testing.assert_close(opt.posterior().precision["w"], expected, **DEBIAS_TOL)
    # the next task: prior = this posterior; its first step forgets the warm-start precision
    new_prior = opt.posterior()
    opt.set_prior(new_prior)
    xb, yb = batches[0]
    opt.step(_closure(model, xb, yb, sigma))
    torch.testing.assert_close(opt.posterior().precision["w"], hs[0] + new_prior.precision["w"], **DEBIAS_TOL)


def test_without_debias_the_precision_keeps_its_start(gen):
    """The plain rate: the step's precision S_1 = (1 − ρ) S_init + ρ (ĥ + S₀) keeps its start (so the debias test
    above can fail), while the carried posterior holds none of it: S₀ + ĥ, the average of one estimate."""
    x, y, sigma = _regression_data(gen, n=10, d=3)
    model = Linear(3)
    prior = DiagPosterior({"w": torch.zeros(3, dtype=DT)}, 0.7)
    opt = BayesianLearningRule(model, prior, n_data=10, lr=0.1, rho=0.3, curvature="hessian",
                               init_precision=DiagPosterior({"w": torch.zeros(3, dtype=DT)}, 50.0))
    opt.step(_closure(model, x, y, sigma))
    h = (x**2).sum(0) / sigma**2
    torch.testing.assert_close(opt.preconditioner().precision["w"], 0.7 * 50.0 + 0.3 * (h + 0.7), **DEBIAS_TOL)
    torch.testing.assert_close(opt.posterior().precision["w"], h + 0.7, **DEBIAS_TOL)


def test_blr_method_precision_debias_reaches_the_optimiser():
    from continual_blr.methods import build_method

    model = MLP(4, (3,), 2)
    method = build_method("blr", {"precision_debias": False})
    method.setup(model, None, None)
    assert method.optimizer.debias is False  # the default is True: the setting must reach the optimiser
