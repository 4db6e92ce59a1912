"""The BLR with a Kronecker-factored carried prior (``BLRParams.carry = "kfac"``) against exact oracles in float64.

Oracles.

* ``KronPosterior.precision_diag``: the diagonal of the dense precision ``to_dense`` builds term by term.
* The coupled diagonal step (``BayesianLearningRule.set_prior(prior, coupling)``): for a quadratic loss (Bayesian
  linear regression, Gaussian likelihood) under a prior N(m₀, S̃₀⁻¹) with a full Kronecker S̃₀, the mean-field BLR's
  fixed point has the exact posterior mean (S̃₀ + H)⁻¹(S̃₀m₀ + Jᵀy/σ²) and the precision diag(S̃₀) + diag(H). The
  delta method (no weight samples), ρ = 1 and full batches make the iteration deterministic, so the exact tier of
  a converged linear solve applies (``SOLVE``).
* The method's carry: for a linear model with one output and a Gaussian likelihood, K-FAC is exact (G is 1 × 1),
  so with ess factor e and temperature T the carried precision after tasks 1..t is δI + (e/T) Σ_s X̃_sᵀX̃_s/σ² as a
  full matrix, and with e = T = 1 the mean after task 2 is the batch posterior mean of all the data.

* ``coupling_every`` k: the coupling recomputed on every k-th step and reused between leaves the fixed point
  where it is, since at the fixed point m no longer moves: the same exact posterior mean, with k times fewer calls.
* ``kfac_terms: merged``: after two tasks each layer's single term is the best Frobenius rank-one A ⊗ G of the
  terms the ``"all"`` carry keeps, found by an SVD of the rearranged dense sum (Van Loan & Pitsianis 1993), an
  oracle independent of ``nearest_kronecker``'s Gram-matrix route; with one output (G scalar) the merge is exact.

Planted (once each): the coupling left out of ``_diag_update`` fails the step test and the method's mean test
(the mean lands on the uncoupled solution, checked to be far from the exact one); ``precision_diag`` built from
the first term only fails its test; the carry's scale without 1/T fails the carried-precision test.
"""

import pytest
import torch

from conftest import EXACT
from continual_blr.data.synthetic import linear_regression_stream
from continual_blr.loop import run_stream
from continual_blr.methods import BLRParams, TrainConfig, build_method
from continual_blr.models import MLP, build_model
from continual_blr.optim.blr import BatchClosure, BayesianLearningRule
from continual_blr.posteriors import DiagPosterior, KronPosterior
from continual_blr.types import flatten

DT = torch.float64
SOLVE = dict(rtol=1e-8, atol=1e-10)  # a converged deterministic iteration on a well-conditioned linear system


def _psd(n: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    a = torch.randn(n, n, generator=gen, dtype=DT)
    return scale * (a @ a.T / n + 0.1 * torch.eye(n, dtype=DT))


def test_precision_diag_is_the_diagonal_of_the_dense_precision(gen):
    """Two blocks (with and without bias), three terms in one, a diagonal part elsewhere: every coordinate equals
    the dense precision's diagonal, in ``flatten(mean)`` order."""
    mean = {"a.weight": torch.randn(3, 4, generator=gen, dtype=DT), "a.bias": torch.randn(3, generator=gen, dtype=DT),
            "b.weight": torch.randn(2, 3, generator=gen, dtype=DT), "scale": torch.randn(5, generator=gen, dtype=DT)}
    blocks = [("a.weight", "a.bias", [(_psd(5, gen), _psd(3, gen)) for _ in range(3)]),
              ("b.weight", None, [(_psd(3, gen), _psd(2, gen))])]
    post = KronPosterior(mean, blocks, {"scale": torch.rand(5, generator=gen, dtype=DT)}, delta=0.7)
    _, dense = post.to_dense()
    torch.testing.assert_close(flatten(post.precision_diag()), torch.diagonal(dense), **EXACT)


def _linear_problem(gen, n=120, d=3, outputs=2, sigma=0.5):
    """x, y [n, outputs], σ, the model f(x) = Wx + b (float64), and the dense design: J_i [outputs, P] in the
    model's flatten order [W.flatten(), b], so that H = Σ J_iᵀJ_i/σ², b = Σ J_iᵀy_i/σ²."""
    mix = torch.eye(d, dtype=DT) + 0.6 * torch.randn(d, d, generator=gen, dtype=DT)
    x = torch.randn(n, d, generator=gen, dtype=DT) @ mix
    y = torch.randn(n, outputs, generator=gen, dtype=DT)
    return x, y, sigma, *_normal_equations(x, y, sigma)


def _normal_equations(x, y, sigma):
    """H = Σ J_iᵀJ_i/σ², b = Σ J_iᵀy_i/σ² of f(x) = Wx + b, J_i [outputs, P] in the flatten order [W.flatten(), b]."""
    (n, d), outputs = x.shape, y.shape[1]
    jac = torch.zeros(n, outputs, outputs * d + outputs, dtype=DT)
    for o in range(outputs):
        jac[:, o, o * d:(o + 1) * d] = x
        jac[:, o, outputs * d + o] = 1.0
    return torch.einsum("nop,noq->pq", jac, jac) / sigma**2, torch.einsum("nop,no->p", jac, y) / sigma**2


def test_the_coupled_step_reaches_the_exact_posterior_mean_under_a_kronecker_prior(gen):
    """Mean-field BLR (GGN, delta method, ρ = 1, full batches) under a Kronecker prior with two terms: the mean
    converges to the exact posterior mean and the precision is diag(S̃₀) + diag(H); without the coupling the same
    iteration converges elsewhere (by more than 100 × the tolerance)."""
    x, y, sigma, h, rhs = _linear_problem(gen)
    d, outputs, n = x.shape[1], y.shape[1], x.shape[0]
    model = MLP(d, (), outputs, 1).to(DT)
    m0 = {"heads.0.weight": torch.randn(outputs, d, generator=gen, dtype=DT),
          "heads.0.bias": torch.randn(outputs, generator=gen, dtype=DT)}
    terms = [(_psd(d + 1, gen, 30.0), _psd(outputs, gen)), (_psd(d + 1, gen, 10.0), _psd(outputs, gen))]
    kron = KronPosterior(m0, [("heads.0.weight", "heads.0.bias", terms)], None, delta=2.0)
    diag = kron.precision_diag()

    def coupling(v):
        full = kron.precision_matvec(v)
        return {k: full[k] - diag[k] * v[k] for k in full}

    _, s0 = kron.to_dense()
    z0 = flatten(m0)
    exact = torch.linalg.solve(s0 + h, s0 @ z0 + rhs)
    uncoupled = torch.linalg.solve(torch.diag(torch.diagonal(s0)) + h, torch.diagonal(s0) * z0 + rhs)
    assert float((exact - uncoupled).abs().max()) > 100 * 1e-6  # the coupling matters in this problem

    closure = BatchClosure(model, x, y, head=0, likelihood="regression", sigma=sigma)
    opt = BayesianLearningRule(model, DiagPosterior(m0, 1.0), n_data=n, lr=0.3, rho=1.0, mc_samples=0,
                               curvature="ggn", debias=True)
    opt.set_prior(DiagPosterior(m0, diag), coupling)
    for _ in range(3000):
        opt.step(closure)
    post = opt.posterior()
    torch.testing.assert_close(flatten(post.mean), exact, **SOLVE)
    torch.testing.assert_close(flatten(post.precision), torch.diagonal(s0) + torch.diagonal(h), **EXACT)


def test_a_coupling_needs_a_diagonal_prior(gen):
    model = MLP(3, (), 2, 1).to(DT)
    m0 = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    kron = KronPosterior.isotropic(m0, 1.0, [("heads.0.weight", "heads.0.bias")])
    opt = BayesianLearningRule(model, kron, n_data=10, curvature="ggn")
    with pytest.raises(ValueError, match="coupling is for a diagonal prior"):
        opt.set_prior(kron, lambda v: v)


def test_kfac_carry_needs_the_diagonal_structure():
    with pytest.raises(ValueError, match=r"^params.carry: 'kfac' needs structure 'diag'"):
        BLRParams(carry="kfac", structure="kron")


SIGMA, DELTA = 0.5, 3.0


def _stream(n_train=150):
    return linear_regression_stream(n_tasks=2, n_features=3, n_train=n_train, n_test=20, sigma=SIGMA,
                                    input_shift=0.5, seed=3, scenario="domain", dtype=DT)


def _design(task) -> torch.Tensor:
    return torch.cat([task.x_train, torch.ones(task.n_train, 1, dtype=DT)], 1)


def _run(params: dict, stream, epochs: int) -> tuple[list[torch.Tensor], list[torch.Tensor], object]:
    """Full-batch run; (the carried Kronecker prior's dense precision, the mean) after each task's end."""
    method = build_method("blr", params, seed=0)
    method.use_likelihood("regression", SIGMA)
    precs, means = [], []
    original = method.on_task_end

    def on_task_end(model, task, optimizer=None):
        original(model, task, optimizer)
        if method.kron_prior is not None:
            precs.append(method.kron_prior.to_dense()[1].clone())
        means.append(torch.cat([model.heads[0].weight.detach().reshape(-1), model.heads[0].bias.detach()]).clone())

    method.on_task_end = on_task_end
    model = build_model("linear", stream.input_shape, stream.n_outputs, stream.n_heads,
                        generator=torch.Generator().manual_seed(0)).to(DT)
    run_stream(model, stream, method, TrainConfig(epochs=epochs, batch_size=stream.tasks[0].n_train), progress=False)
    return precs, means, method


BASE = {"curvature": "ggn", "mc_samples": 0, "rho": 1.0, "lr": 0.3, "clip_radius": None, "beta1": 0.0,
        "prior_precision": DELTA}


@pytest.mark.parametrize("ess, temperature", [(1.0, 1.0), (2.0, 0.25)])
def test_the_kfac_carry_is_the_exact_precision_of_bayesian_linear_regression(ess, temperature):
    """After every task the carried precision is δI + (e/T) Σ_s X̃_sᵀX̃_s/σ², the full matrix (off-diagonals
    included), to the exact tier; the optimiser's prior is its diagonal."""
    stream = _stream()
    precs, _, method = _run(BASE | {"carry": "kfac", "ess_factor": ess, "temperature": temperature}, stream, 5)
    exact = DELTA * torch.eye(4, dtype=DT)
    for t, task in enumerate(stream.tasks):
        x = _design(task)
        exact = exact + (ess / temperature) * x.T @ x / SIGMA**2
        # to_dense's order is [w₁..w₃, b], the design's too
        torch.testing.assert_close(precs[t], exact, **EXACT)
    prior = method.optimizer.prior.precision
    torch.testing.assert_close(torch.cat([prior["heads.0.weight"].reshape(-1), prior["heads.0.bias"]]),
                               torch.diagonal(exact), **EXACT)


def test_with_e_and_t_1_the_kfac_carry_gives_the_batch_posterior_mean():
    """e = T = 1, the delta method, full batches: after task 2 the mean is the exact posterior mean of both tasks'
    data under N(0, δ⁻¹I) (sequential Bayes is exact here: K-FAC is exact and the mean-field fixed point has the
    exact mean); the diagonal carry of the same run lands elsewhere."""
    stream = _stream()
    _, means, _ = _run(BASE | {"carry": "kfac", "ess_factor": 1.0, "temperature": 1.0}, stream, 2000)
    x = torch.cat([_design(t) for t in stream.tasks])
    y = torch.cat([t.y_train for t in stream.tasks])
    exact = torch.linalg.solve(DELTA * torch.eye(4, dtype=DT) + x.T @ x / SIGMA**2, x.T @ y / SIGMA**2)
    torch.testing.assert_close(means[-1], exact, **SOLVE)
    _, diag_means, _ = _run(BASE | {"carry": "average", "ess_factor": 1.0, "temperature": 1.0}, stream, 2000)
    assert float((diag_means[-1] - exact).abs().max()) > 1e-3


def _coupled_problem(gen):
    x, y, sigma, h, rhs = _linear_problem(gen)
    d, outputs, n = x.shape[1], y.shape[1], x.shape[0]
    model = MLP(d, (), outputs, 1).to(DT)
    m0 = {"heads.0.weight": torch.randn(outputs, d, generator=gen, dtype=DT),
          "heads.0.bias": torch.randn(outputs, generator=gen, dtype=DT)}
    kron = KronPosterior(m0, [("heads.0.weight", "heads.0.bias", [(_psd(d + 1, gen, 30.0), _psd(outputs, gen))])],
                         None, delta=2.0)
    closure = BatchClosure(model, x, y, head=0, likelihood="regression", sigma=sigma)
    opt = BayesianLearningRule(model, DiagPosterior(m0, 1.0), n_data=n, lr=0.3, rho=1.0, mc_samples=0,
                               curvature="ggn", debias=True)
    _, s0 = kron.to_dense()
    exact = torch.linalg.solve(s0 + h, s0 @ flatten(m0) + rhs)
    return model, kron, closure, opt, exact


def test_a_coupling_that_names_a_subset_pulls_only_those_parameters(gen):
    """``set_prior``'s docstring: the coupling may name a subset of the parameters, the others get none. One step
    with a coupling that returns the weight only equals one step with a coupling that returns the bias's entry as
    zeros, and differs from a step without coupling (so the weight's pull was applied)."""
    model, kron, closure, opt, _ = _coupled_problem(gen)
    diag = kron.precision_diag()

    def full(v):
        pulled = kron.precision_matvec(v)
        return {k: pulled[k] - diag[k] * v[k] for k in pulled}

    start = {k: p.detach().clone() for k, p in model.named_parameters()}
    after = {}
    for name, coupling in {"subset": lambda v: {"heads.0.weight": full(v)["heads.0.weight"]},
                           "zeros": lambda v: full(v) | {"heads.0.bias": torch.zeros_like(v["heads.0.bias"])},
                           "none": None}.items():
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(start[k])
        opt.set_prior(DiagPosterior(kron.mean, diag), coupling)
        opt.step(closure)
        after[name] = {k: p.detach().clone() for k, p in model.named_parameters()}
    for k in start:
        torch.testing.assert_close(after["subset"][k], after["zeros"][k], **EXACT)
    assert float((after["subset"]["heads.0.weight"] - after["none"]["heads.0.weight"]).abs().max()) > 1e-6


def test_rebuild_keeps_the_coupling(gen):
    """``rebuild`` (new heads under Avalanche) keeps every setting, the coupling included: rebuilt halfway, the
    iteration still reaches the exact posterior mean. Planted once: a rebuild that drops the coupling fails it."""
    model, kron, closure, opt, exact = _coupled_problem(gen)
    diag = kron.precision_diag()
    opt.set_prior(DiagPosterior(kron.mean, diag),
                  lambda v: {k: t - diag[k] * v[k] for k, t in kron.precision_matvec(v).items()})
    for _ in range(200):
        opt.step(closure)
    opt.rebuild(model, DiagPosterior(kron.mean, diag), DiagPosterior(kron.mean, diag))
    for _ in range(3000):
        opt.step(closure)
    torch.testing.assert_close(flatten(opt.posterior().mean), exact, **SOLVE)


def test_a_state_from_another_carry_is_refused():
    """A kfac method loading a diagonal-carry state after a task (it would go on without the past tasks'
    correlations), and a diagonal method loading a kfac state, fail with one line naming ``params.carry``."""
    stream = _stream(n_train=30)
    states = {}
    for carry in ("kfac", "average"):
        _, _, method = _run(BASE | {"carry": carry}, stream, 1)
        states[carry] = method.state_dict()
    for carry, other in (("kfac", "average"), ("average", "kfac")):
        _, _, method = _run(BASE | {"carry": carry}, stream, 1)
        with pytest.raises(ValueError, match=r"^params.carry: the saved state was made with carry"):
            method.load_state_dict(states[other])
        method.load_state_dict(states[carry])  # the matching state loads


@pytest.mark.parametrize("every", [2, 5])
def test_a_coupling_reused_between_recomputations_keeps_the_exact_fixed_point(gen, every):
    """``coupling_every`` k: the iteration of the coupled-step test still reaches the exact posterior mean (the
    staleness vanishes at the fixed point), and the coupling ran on one step in k. Planted once each: a cache never
    refreshed (the first step's R·0 reused) lands on the uncoupled mean; a cache never used calls it every step."""
    model, kron, closure, _, exact = _coupled_problem(gen)
    opt = BayesianLearningRule(model, DiagPosterior(kron.mean, 1.0), n_data=closure.x.shape[0], lr=0.3, rho=1.0,
                               mc_samples=0, curvature="ggn", debias=True, coupling_every=every)
    diag = kron.precision_diag()
    calls = []

    def coupling(v):
        calls.append(1)
        return {k: t - diag[k] * v[k] for k, t in kron.precision_matvec(v).items()}

    opt.set_prior(DiagPosterior(kron.mean, diag), coupling)
    steps = 3000
    for _ in range(steps):
        opt.step(closure)
    torch.testing.assert_close(flatten(opt.posterior().mean), exact, **SOLVE)
    assert len(calls) == -(-steps // every)


def _corrected_run(gen_seed: int, every: int, correction: str | None, steps: int, beta1: float = 0.9,
                   save_at: int | None = None):
    """The coupled regression with ρ 0.5 and momentum (a trajectory that moves), ``coupling_every`` k, and a
    correction that is the exact coupling (``"exact"``) or the rank-1 cut (``"cut"``: a ``KronCoupling``, which the
    step applies in its flat form; ``"cut_dict"``: the same called on parameter dicts); the flat mean after ``steps``
    (with ``save_at``: saved there and loaded into a fresh optimiser, then the rest of the steps)."""
    model, kron, closure, _, exact = _coupled_problem(torch.Generator().manual_seed(gen_seed))
    diag = kron.precision_diag()
    start = {k: v.clone() for k, v in kron.mean.items()}  # the start m₀ (the model's own init is not seeded)

    def coupling(v):
        return {k: t - diag[k] * v[k] for k, t in kron.precision_matvec(v).items()}

    cut = kron.coupling(1)
    corr = {"exact": coupling, "cut": cut, "cut_dict": lambda v: cut(v), None: None}[correction]

    def fresh():
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(start[k])
        opt = BayesianLearningRule(model, DiagPosterior(kron.mean, 1.0), n_data=closure.x.shape[0], lr=0.3,
                                   rho=0.5, mc_samples=0, curvature="ggn", debias=True, beta1=beta1,
                                   coupling_every=every)
        opt.set_prior(DiagPosterior(kron.mean, diag), coupling, corr)
        return opt

    opt = fresh()
    for i in range(steps):
        if save_at is not None and i == save_at:
            state, weights = opt.state_dict(), {k: p.detach().clone() for k, p in model.named_parameters()}
            opt = fresh()
            with torch.no_grad():
                for k, p in model.named_parameters():
                    p.copy_(weights[k])
            opt.load_state_dict(state)
        opt.step(closure)
    return flatten(opt.posterior().mean), exact


def test_a_corrected_coupling_follows_the_every_step_coupling_and_keeps_the_fixed_point():
    """``set_prior``'s ``correction`` R̃ with ``coupling_every`` 5: with R̃ = R the pull R(m_s − m₀) + R(m − m_s) is
    R(m − m₀), so 40 steps follow the every-step coupling to round-off (the reused one, uncorrected, is more than
    1e-6 away: the check can fail); with the rank-1 cut as R̃ the iteration still reaches the exact posterior mean
    (the docstring's fixed point). Planted once each: the correction ignored fails the first; the correction
    applied to m − m₀ instead of m − m_s fails the second."""
    every_step, _ = _corrected_run(0, 1, None, 40)
    corrected, _ = _corrected_run(0, 5, "exact", 40)
    stale, _ = _corrected_run(0, 5, None, 40)
    torch.testing.assert_close(corrected, every_step, rtol=1e-12, atol=1e-12)  # float64 sums regrouped
    assert float((stale - every_step).abs().max()) > 1e-6
    mean, exact = _corrected_run(0, 5, "cut", 3000, beta1=0.0)
    torch.testing.assert_close(mean, exact, **SOLVE)


def test_the_flat_correction_steps_as_its_parameter_dict_form():
    """The step applies a ``KronCoupling`` correction through its flat operator (``_correction_term``, buffers reused
    from step to step) and any other callable through parameter dicts: 60 steps of both, with the rank-1 cut of the
    same prior, agree to round-off, and differ from the uncorrected run by more than 1e-6 (the correction matters
    here). Planted once each: the flat operator reading m − m₀ instead of m − m_s, and a bias offset shifted by one
    entry, failed."""
    flat_form, _ = _corrected_run(1, 5, "cut", 60)
    dict_form, _ = _corrected_run(1, 5, "cut_dict", 60)
    uncorrected, _ = _corrected_run(1, 5, None, 60)
    torch.testing.assert_close(flat_form, dict_form, rtol=1e-12, atol=1e-12)  # float64, the same products
    assert float((uncorrected - dict_form).abs().max()) > 1e-6


def test_a_correction_needs_a_coupling(gen):
    model, kron, _, opt, _ = _coupled_problem(gen)
    with pytest.raises(ValueError, match=r"^set_prior: a correction needs a coupling$"):
        opt.set_prior(DiagPosterior(kron.mean, kron.precision_diag()), None, kron.coupling(1))


@pytest.mark.parametrize("correction", [None, "cut"])
def test_an_optimiser_state_saved_between_recomputations_carries_the_reused_coupling(correction):
    """Saved after 5 steps with ``coupling_every`` 3 (the 6th step reuses the 4th's coupling, corrected by
    R̃(m − m_4) with the rank-1 correction) and loaded into a fresh optimiser, 4 more steps give the uninterrupted 9
    steps' mean bit for bit. Planted once each: a load that drops the saved coupling (recomputed at the 6th step),
    and one that drops the anchor m_s (the 6th step reuses without correcting), failed."""
    straight, _ = _corrected_run(1, 3, correction, 9)
    resumed, _ = _corrected_run(1, 3, correction, 9, save_at=5)
    assert torch.equal(resumed, straight)


def _classification_run(kfac_terms: str, **extra) -> object:
    """Two tasks of a 3-class linear softmax model (float64, delta method, full batches), carry kfac; the method."""
    from continual_blr.data.synthetic import synthetic_stream

    stream = synthetic_stream(n_tasks=2, n_classes_per_task=3, n_features=4, n_train=60, n_test=10,
                              scenario="domain", seed=1)
    for t in stream.tasks:
        t.x_train, t.x_test = t.x_train.to(DT), t.x_test.to(DT)
    method = build_method("blr", BASE | {"carry": "kfac", "kfac_terms": kfac_terms, "ess_factor": 1.0,
                                         "temperature": 0.5} | extra, seed=0)
    model = build_model("linear", stream.input_shape, stream.n_outputs, stream.n_heads,
                        generator=torch.Generator().manual_seed(0)).to(DT)
    run_stream(model, stream, method, TrainConfig(epochs=30, batch_size=60), progress=False)
    return method


def test_the_merged_kfac_carry_is_the_nearest_kronecker_product_of_the_kept_terms():
    """After two tasks the ``"all"`` carry holds two terms; the ``"merged"`` one holds one, equal (to the solve tier)
    to the SVD's best rank-one approximation of their sum; the merge is not the identity here (the two terms'
    sum is more than 1e-3 away from it)."""
    kept = _classification_run("all").kron_prior
    merged = _classification_run("merged").kron_prior
    ((_, _, terms),) = kept.blocks
    ((_, _, (one,)),) = merged.blocks
    assert len(terms) == 2
    total = sum(torch.einsum("jk,pq->jkpq", a, g) for a, g in terms)
    n_in, n_out = total.shape[0], total.shape[2]
    u, sv, vh = torch.linalg.svd(total.reshape(n_in * n_in, n_out * n_out))
    oracle = (sv[0] * torch.outer(u[:, 0], vh[0])).reshape(total.shape)
    torch.testing.assert_close(torch.einsum("jk,pq->jkpq", *one), oracle, **SOLVE)
    assert float((total - oracle).abs().max()) > 1e-3


@pytest.mark.parametrize("ess, temperature", [(1.0, 1.0), (2.0, 0.25)])
def test_with_one_output_the_merged_kfac_carry_is_the_exact_precision(ess, temperature):
    """One output (G is 1 × 1): Σ_t A_t ⊗ g_t = (Σ_t g_t A_t) ⊗ 1 is itself a Kronecker product, so the merged carry
    equals δI + (e/T) Σ_s X̃_sᵀX̃_s/σ² to the exact tier, one term per layer."""
    stream = _stream()
    precs, _, method = _run(BASE | {"carry": "kfac", "kfac_terms": "merged", "ess_factor": ess,
                                    "temperature": temperature}, stream, 5)
    exact = DELTA * torch.eye(4, dtype=DT) + (ess / temperature) * sum(
        _design(t).T @ _design(t) for t in stream.tasks) / SIGMA**2
    torch.testing.assert_close(precs[-1], exact, **EXACT)
    assert all(len(terms) == 1 for _, _, terms in method.kron_prior.blocks)


def _rank_cut_dense(post: KronPosterior, rank: int) -> torch.Tensor:
    """The dense S_r of ``KronPosterior.coupling(rank)``'s docstring, built independently in numpy float64: per
    term G ⊗ A_r + Diag(diag(G) ⊗ diag(A − A_r)), A_r from numpy's eigh (largest ``rank`` eigenpairs), the
    blocks on the diagonal in ``flatten`` order (weights then bias: the Θ = [W | b] layout permuted), + δI."""
    import numpy as np

    sizes = {k: v.numel() for k, v in post.mean.items()}
    offset = dict(zip(sizes, np.cumsum([0] + list(sizes.values()))[:-1]))
    dense = np.diag(np.full(sum(sizes.values()), post.delta))
    for w, b, terms in post.blocks:
        d_out = post.mean[w].shape[0]
        d_in = post.mean[w][0].numel() + (b is not None)
        # index of Θ[o, j] in flatten order
        idx = np.array([[offset[w] + o * (d_in - (b is not None)) + j if j < d_in - (b is not None)
                         else offset[b] + o for j in range(d_in)] for o in range(d_out)]).reshape(-1)
        block = np.zeros((d_out * d_in, d_out * d_in))
        for a, g in terms:
            a, g = a.numpy(), g.numpy()
            lam, u = np.linalg.eigh(a)
            a_r = (u[:, -rank:] * lam[-rank:]) @ u[:, -rank:].T if rank < a.shape[0] else a
            block += np.kron(g, a_r) + np.diag(np.kron(np.diag(g), np.diag(a - a_r)))
        dense[np.ix_(idx, idx)] += block
    return torch.from_numpy(dense)


@pytest.mark.parametrize("rank", [1, 2, 5])
def test_the_rank_cut_coupling_is_the_off_diagonal_of_its_dense_precision(gen, rank):
    """``KronPosterior.coupling(r)`` applied to every unit vector (one batched call) gives S_r − diag(S_r) of the
    dense oracle above; S_r is PSD with diag(S_r) = diag(S) (``precision_diag``), and with r ≥ every d_in
    (here 5) S_r = S (the exact coupling). Rank 1 and 2 cut the 5 × 5 and 4 × 4 input factors for real: their
    S_r is checked to differ from S. The flat form (``KronCoupling.flat``) gives the same rows. Planted once each:
    the smallest eigenpairs kept instead of the largest, and the subtracted diagonal taken from A instead of A_r,
    failed; in the flat form, a second term added to the first's output of the previous call (not overwritten)
    failed."""
    mean = {"a.weight": torch.randn(3, 4, generator=gen, dtype=DT), "a.bias": torch.randn(3, generator=gen, dtype=DT),
            "b.weight": torch.randn(2, 4, generator=gen, dtype=DT), "scale": torch.randn(2, generator=gen, dtype=DT)}
    blocks = [("a.weight", "a.bias", [(_psd(5, gen), _psd(3, gen)) for _ in range(2)]),
              ("b.weight", None, [(_psd(4, gen), _psd(2, gen))])]
    post = KronPosterior(mean, blocks, {"scale": torch.rand(2, generator=gen, dtype=DT)}, delta=0.7)
    s_r = _rank_cut_dense(post, rank)
    _, s = post.to_dense()
    s_r[-2:, -2:] = s[-2:, -2:]  # the diagonal parameters ("scale", last in flatten order) as the posterior holds them
    p = s.shape[0]
    eye = torch.eye(p, dtype=DT)
    units = {}
    start = 0
    for k, v in mean.items():
        units[k] = eye[:, start:start + v.numel()].reshape(p, *v.shape)
        start += v.numel()
    columns = post.coupling(rank)(units)
    r = torch.cat([columns[k].reshape(p, -1) for k in mean], 1)  # row i: R e_i
    torch.testing.assert_close(r, s_r - torch.diag(torch.diagonal(s_r)), **EXACT)
    # the flat form, one unit vector at a time into one reused output (never zeroed between calls: each call must
    # overwrite the blocks' entries, and leave the diagonal parameter's entries as they were, zero)
    op = post.coupling(rank).flat(list(mean), [v.numel() for v in mean.values()])
    out = torch.zeros(p, dtype=DT)
    rows = torch.stack([op(eye[i].clone(), out).clone() for i in range(p)])
    torch.testing.assert_close(rows, s_r - torch.diag(torch.diagonal(s_r)), **EXACT)
    torch.testing.assert_close(torch.diagonal(s_r), torch.diagonal(s), **EXACT)
    assert float(torch.linalg.eigvalsh(s_r).min()) > 0
    if rank < 4:
        assert float((s_r - s).abs().max()) > 1e-2
    else:
        torch.testing.assert_close(s_r, s, **EXACT)


def test_the_rank_cut_coupling_reaches_the_exact_posterior_mean_under_its_own_prior(gen):
    """``BLRParams.coupling_rank``'s docstring: the coupled step with the rank-1 cut coupling converges to the exact
    posterior mean under S̃_r (the dense oracle above), (S̃_r + H)⁻¹(S̃_r m₀ + Jᵀy/σ²), which here is more than 100 ×
    the tolerance away from the mean under S̃₀. Planted once: the exact coupling in its place failed."""
    _, kron, closure, opt, _ = _coupled_problem(gen)
    z0 = flatten(kron.mean)
    s_r = _rank_cut_dense(kron, 1)
    _, s0 = kron.to_dense()
    h, rhs = _normal_equations(closure.x, closure.y, closure.sigma)
    exact_r = torch.linalg.solve(s_r + h, s_r @ z0 + rhs)
    exact_0 = torch.linalg.solve(s0 + h, s0 @ z0 + rhs)
    assert float((exact_r - exact_0).abs().max()) > 100 * 1e-6
    opt.set_prior(DiagPosterior(kron.mean, kron.precision_diag()), kron.coupling(1))
    for _ in range(3000):
        opt.step(closure)
    torch.testing.assert_close(flatten(opt.posterior().mean), exact_r, **SOLVE)


def test_the_method_couples_through_the_rank_cut_prior():
    """``coupling_rank`` 1 (the 5 × 5 input factor cut) on the two-task classification run: the optimiser's
    coupling after task 1 is the carried prior's ``coupling(1)``, which differs from the exact one. Planted once:
    the option ignored in ``_install_kron_prior`` failed."""
    method = _classification_run("merged", coupling_rank=1)
    gen = torch.Generator().manual_seed(5)
    v = {k: torch.randn(m.shape, generator=gen, dtype=DT) for k, m in method.kron_prior.mean.items()}
    got = flatten(method.optimizer.prior_coupling(v))
    torch.testing.assert_close(got, flatten(method.kron_prior.coupling(1)(v)), **EXACT)
    assert float((got - flatten(method.kron_prior.coupling()(v))).abs().max()) > 1e-3


def test_the_method_corrects_through_the_rank_cut_coupling():
    """``coupling_every`` 2 with ``coupling_correction_rank`` 1 on the two-task classification run: after task 1 the
    optimiser's correction is the carried prior's ``coupling(1)`` and its coupling the exact one. Planted once: the
    correction not passed to ``set_prior`` failed."""
    method = _classification_run("merged", coupling_every=2, coupling_correction_rank=1)
    gen = torch.Generator().manual_seed(6)
    v = {k: torch.randn(m.shape, generator=gen, dtype=DT) for k, m in method.kron_prior.mean.items()}
    opt = method.optimizer
    assert opt.prior_correction is not None
    torch.testing.assert_close(flatten(opt.prior_correction(v)), flatten(method.kron_prior.coupling(1)(v)), **EXACT)
    torch.testing.assert_close(flatten(opt.prior_coupling(v)), flatten(method.kron_prior.coupling()(v)), **EXACT)


@pytest.mark.parametrize("params, message", [
    ({"carry": "kfac", "kfac_terms": "some"}, r"^params.kfac_terms: got 'some'; allowed: 'all', 'merged'$"),
    ({"carry": "kfac", "coupling_every": 0}, r"^params.coupling_every: must be an integer >= 1, got 0$"),
    ({"carry": "ggn", "kfac_terms": "merged"}, r"^params.kfac_terms: applies to carry 'kfac' only \(carry is 'ggn'\)$"),
    ({"coupling_every": 4}, r"^params.coupling_every: applies to carry 'kfac' only \(carry is 'average'\)$"),
    ({"carry": "kfac", "coupling_rank": 0}, r"^params.coupling_rank: must be an integer >= 1 or null, got 0$"),
    ({"coupling_rank": 8}, r"^params.coupling_rank: applies to carry 'kfac' only \(carry is 'average'\)$"),
    ({"carry": "kfac", "coupling_every": 4, "coupling_correction_rank": 0},
     r"^params.coupling_correction_rank: must be an integer >= 1 or null, got 0$"),
    ({"coupling_correction_rank": 8},
     r"^params.coupling_correction_rank: applies to carry 'kfac' only \(carry is 'average'\)$"),
    ({"carry": "kfac", "coupling_correction_rank": 8},
     r"^params.coupling_correction_rank: corrects the steps between recomputations; needs coupling_every > 1 "
     r"\(got 1\)$"),
])
def test_bad_kfac_settings_are_one_line_errors(params, message):
    with pytest.raises(ValueError, match=message):
        BLRParams(**params)


def test_the_flat_coupling_names_a_parameter_missing_from_the_layout(gen):
    mean = {"a.weight": torch.randn(3, 4, generator=gen, dtype=DT), "a.bias": torch.randn(3, generator=gen, dtype=DT)}
    post = KronPosterior(mean, [("a.weight", "a.bias", [(_psd(5, gen), _psd(3, gen))])], {}, delta=0.7)
    with pytest.raises(ValueError, match=r"^KronCoupling.flat: parameter 'a.bias' is not in the layout with its 3 "
                                         r"entries$"):
        post.coupling(2).flat(["a.weight", "a.bias"], [12, 4])


def test_the_flat_coupling_overwrites_every_entry_of_its_output(gen):
    """``KronCoupling.flat`` sets the entries of parameters outside the blocks to zero, whatever ``out`` held: the
    step adds the exact pull to the returned buffer in place and passes the same buffer again, so an entry left
    alone would accumulate. Planted once: the zeroing left out, the check of the "extra" entries failed."""
    mean = {"a.weight": torch.randn(3, 4, generator=gen, dtype=DT), "a.bias": torch.randn(3, generator=gen, dtype=DT),
            "extra": torch.randn(2, generator=gen, dtype=DT)}
    post = KronPosterior(mean, [("a.weight", "a.bias", [(_psd(5, gen), _psd(3, gen))])],
                         {"extra": torch.rand(2, generator=gen, dtype=DT)}, delta=0.7)
    cut = post.coupling(2)
    op = cut.flat(list(mean), [v.numel() for v in mean.values()])
    v = torch.randn(17, generator=gen, dtype=DT)
    out = torch.full((17,), 5.0, dtype=DT)
    got = op(v, out)
    want = flatten(cut({k: t.view_as(mean[k]) for k, t in zip(mean, v.split([12, 3, 2]))}))
    torch.testing.assert_close(got[-2:], torch.zeros(2, dtype=DT), rtol=0, atol=0)
    torch.testing.assert_close(got, want, **EXACT)
