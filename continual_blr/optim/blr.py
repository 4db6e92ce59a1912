"""Bayesian learning rule (BLR) optimisers whose state is a Gaussian posterior with a Gaussian prior.

The update is the BLR for a Gaussian q = N(m, S⁻¹) with prior N(m₀, S₀⁻¹) (Khan & Rue 2023, eq. 12
and its Newton form eqs. 44–46; Osawa et al. 2019 for VOGN; Shen et al. 2024 for IVON). The posterior
precision is **the prior plus a data part**. With N training examples (or an effective sample size), a
minibatch of B, per-example losses ℓ_i and estimates at θ ~ N(m, (S₀ + D)⁻¹) (or at θ = m: the *delta
method*):

    ĝ = (N/B) Σ_i ∇ℓ_i(θ)            ĥ = (N/B) Σ_i H_i(θ)          (sums scaled to the data set)
    D ← (1 − ρ_t) D + ρ_t ĥ  [+ ½ ρ_t² (D − ĥ)² ⊘ (S₀ + D)]          (the step's precision, eq. 45; [·]: Price)
    D̄ ← (1 − ρ̄_n) D̄ + ρ̄_n ĥ,   ρ̄_n = ρ / (1 − (1 − ρ)ⁿ)              (the carried part: n estimates so far)
    u ← β₁ u + (1 − β₁) (ĝ + S₀ (m − m₀))                              (optional momentum)
    m ← m − α/(1 − β₁ᵗ) · clip_r((S₀ + D + N γ I)⁻¹ u)                (mean, eq. 46)

**Two data parts.** D is the step's: the preconditioner of the mean step and the precision of the
weight samples. It may start at a data-scale value (``init_hess``: D = N h₀ at each task start;
``init_precision``) and with the Price estimator it carries IVON's positivity correction. D̄ is what the
optimiser reports and carries to the next task, q = N(m, S₀ + max(D̄, 0)) (:meth:`posterior`): the
debiased average of the task's estimates alone (ρ̄₁ = 1, so D̄ starts at ĥ₁). No start value and no
positivity correction enter D̄, and a parameter no example touched (ĝ = ĥ = 0) carries exactly its
prior. With a non-negative curvature and the debiased step rate (``debias``) the two are the same
vector and share a buffer.

**Safeguards on the step**, and what each does to the fixed point (``docs/methods_weight_space.md``
lists the tests):

* the *damping* γ ≥ 0 (Levenberg–Marquardt, in per-example curvature units like IVON's ``hess_init``)
  enters the preconditioner and nothing else: where the data curvature of a confident fit vanishes
  (p(1 − p) → 0) the Newton step ĝ/ĥ grows without bound, while (S + Nγ)⁻¹ĝ ≤ ĝ_mean/γ stays an SGD step.
  Any positive definite preconditioner maps E[u] = 0 to a zero mean step: **the fixed point is unchanged**.
* the debiased step rate ρ_t = ρ / (1 − (1 − ρ)ᵗ) (Adam's bias correction applied to D, t counted from
  the task's start) changes ρ's schedule, not the average's limit: **unchanged**. Not for Price, whose
  step keeps IVON's plain rate (a first step at ρ₁ = 1 would set D to one noisy estimate).
* clip_r bounds the preconditioned momentum elementwise to [−r, r] (IVON's ``clip_radius``), before Adam's
  bias correction (IVON: after; in a task's first steps our bound is r/(1 − β₁ᵗ)).
  E[clip(X)] = 0 needs a distribution of X symmetric about 0; a sampled step's is not (the loss is not
  quadratic; the minibatch also sets the preconditioner). **Where the clip binds at the fixed point it
  moves it**: measured 7.3 % on the mean of a 1-D logistic regression at r = 0.02, 3.6–4.6 % of the
  mean on a minibatch linear regression at r = 0.05; a clip that binds only while the mean travels
  leaves no trace. The loop logs the fraction of clipped coordinates per epoch (``clipped_fraction`` in
  ``train_log.csv``, :meth:`pop_clipped_fraction`).
* the Price step's positivity correction (IVON's Alg. 1 line 6 with S₀ + D as IVON's h + δ) keeps
  S₀ + D > 0 (a step at least halves it) and biases D upward: a stationary D satisfies
  D − E[ĥ] = ½ρ E[(D − ĥ)²]/(S₀ + D) ≈ ½ρ ((N/B)·S/H + 2)·E[ĥ] per coordinate (the Price estimate's relative
  variance, see below). At IVON's ρ = 10⁻³ and split MNIST's N/B ≈ 1,900 (ess 20) that is about E[ĥ]
  itself: the step's D ≈ 2 E[ĥ]. The carried D̄ has no such bias; but the samples come from the
  step's narrower Gaussian, so for a non-quadratic loss D̄ = E[ĥ] under that Gaussian, not under q.

**Fixed points.** At a fixed point in expectation E[u] = 0, i.e. E[ĝ] + S₀ (m − m₀) = 0, and D̄ = E[ĥ].
For a quadratic loss (Bayesian linear regression) E[ĥ] does not depend on the sampling Gaussian and
E_q[∇ℓ(θ)] = ∇ℓ(m): the carried posterior is the exact posterior in the full structure and the
mean-field optimum in the diagonal one, for the GGN, Price and IVON's recipe, with minibatches
(``tests/test_blr_fixed_points.py``). With ρ = α = 1, β₁ = 0, γ = 0 and the exact Hessian the step is
Newton's on the negative log joint: one step gives the exact posterior of a quadratic loss, and the
posterior of task t used as the prior of task t+1 reproduces batch Bayes.

**The prior is never lost:** D̄ ⪰ 0 (clamped in the diagonal structure; PSD for every other estimator
but the exact Hessian), so S ⪰ S₀. In the Kronecker structure S₀ (the previous posterior) is kept term by
term and D is one Kronecker term per layer (the nearest Kronecker product to (1 − ρ)D + ρĥ — a
projection at every update, so the Kronecker BLR's fixed point lies among single Kronecker terms).
Weight samples and the preconditioner use S₀ + D itself: exact for one term plus δI, and by
perturb-and-solve and preconditioned conjugate gradients for several
(:meth:`~continual_blr.posteriors.KronPosterior.sample_noise`).

Curvature estimates H_i (named, see ``types.Curvature``):

* ``"price"`` — the reparameterisation (Price / Stein) estimator of E_q[∇²ℓ]: with θ = m + S^{−1/2}ε,
  E_q[∇ℓ(θ)(θ − m)ᵀ] S = E_q[∇²ℓ(θ)], so ĥ = ĝ_data ∘ (θ − m) ∘ s (diagonal; IVON's estimator,
  Shen et al. 2024, eq. 5). One backward pass at the sample, no per-example gradients; unbiased but
  noisy and possibly negative: with ĝ = ĝ(m) + H(θ − m) + …, the minibatch noise of ĝ(m) times ε√S
  gives one estimate a relative variance of about (N/B)·S/H + 2 per coordinate (the first term from
  Var ĝ(m) ≈ (N/B)·H for a log-loss, the second from the quadratic term), so D̄ averaged over ~1/ρ steps
  has a relative standard deviation of about √(ρ/2 · ((N/B)·S/H + 2)). The step keeps IVON's positivity
  correction (Lin et al. 2020; above). Needs weight samples and a start D₀ = N h₀ > 0 (``init_hess``).
* ``"gauss_newton"`` — g_i g_iᵀ from per-example gradients formed by ``torch.func.jacrev`` of any
  closure (VOGN's Gauss–Newton; for the log-loss at the observed label this is the empirical Fisher).
  Diagonal: g_i²; Kronecker: the nearest Kronecker product to Σ_i g_i g_iᵀ per layer (alternating
  least squares on the per-example gradient matrices); full: dense outer products.
* ``"empirical_fisher"``, ``"ggn"``, ``"mc_fisher"`` — the curvature engine
  (:func:`continual_blr.curvature.curvature`) on the minibatch of a :class:`BatchClosure` at θ:
  Σ_i g_i g_iᵀ at the observed labels, the exact generalised Gauss–Newton Σ_i J_iᵀ Λ_i J_i, or the
  Monte-Carlo Fisher (one label drawn per example from the model with the optimiser's generator).
  Diagonal: exact (for Linear layers (g²)ᵀ(a²) per layer); Kronecker: K-FAC factors (A = mean ããᵀ,
  G = Σ g gᵀ); full: dense. The empirical Fisher vanishes like (1 − p)² on examples fitted with
  confidence p, the GGN like p(1 − p) (Kunstner et al. 2019).
* ``"hessian"`` — the exact Hessian of Σ_i ℓ_i (``torch.func.hessian``; small models, diag / full).

The closure contract (torch.optim's ``step(closure)``): ``closure(params)`` receives a ParamDict of the
covered parameters and returns the **per-example** losses ``[B]`` computed with them (for instance
through ``torch.func.functional_call``), or a pair ``(losses, penalty)`` where ``penalty`` is an extra
differentiable term relative to the *mean* loss (e.g. FROMP); the penalty's gradient (times N) enters
ĝ but not ĥ. The engine curvatures also need the minibatch itself: pass a :class:`BatchClosure`
(:mod:`continual_blr.optim.closures`), which is what ``continual_blr.loop`` builds.

**Data parallel** (a ``torch.distributed`` process group of W > 1 processes, IVON's ``sync=True``
pattern): rank r evaluates its b_r of the minibatch's B examples (a :class:`BatchClosure` built with
``data_parallel=True`` over the global batch, or its own batch under Avalanche's ``DistributedHelper``),
forms its part of the estimates with the *global* scale N/B,

    ĝ_r = (N/B) Σ_{i∈r} ∇ℓ_i + N (b_r/B) ∇penalty,   ĥ_r = (N/B) Σ_{i∈r} H_i   (K-FAC: A_r (b_r/B), G_r),

and one all-reduce per weight sample adds (loss, ĝ, ĥ) over the ranks, so ĝ and ĥ are one process's
on the global batch. Every rank draws the **same** weight sample (the optimiser's generator has the
same state everywhere), so a data-parallel step equals one process's step up to the order of
floating-point additions (the test suite checks this); the engine's MC Fisher draws the labels of all
B examples on every rank for the same reason. With ``rank_samples = True`` each rank draws its own
sample instead (IVON's ``sync=True``: seeds ``base · W + rank`` derived from the run's seed), so the
reduced ĝ, ĥ average W samples, each on b_r examples — another unbiased estimate, not one process's;
the ranks still apply the same reduced update, so their posteriors stay identical. ``curvature="gauss_newton"`` in the Kronecker structure
(a nearest-Kronecker fit to the per-example gradients, not a sum) is not available data-parallel.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.func import grad, hessian, jacrev

from .. import distributed
from ..curvature import curvature as engine_curvature
from ..curvature.estimates import curvature_tensors
from ..posteriors import DiagPosterior, FullPosterior, GaussianPosterior, KronPosterior, nearest_kronecker
from ..types import DivergenceError, KronCurvature, ParamDict, Structure, flatten, unflatten
from .closures import BatchClosure
from .diag_state import FlatDiagState, diag_update, fused_diag_update

__all__ = ["BayesianLearningRule", "BatchClosure", "VON", "VOGN", "blr_data_update", "blr_mean_update",
           "diag_update", "assemble_posterior", "data_part", "CURVATURES", "ENGINE_CURVATURES"]

Closure = Callable[[ParamDict], "Tensor | tuple[Tensor, Tensor]"]
ENGINE_CURVATURES = ("empirical_fisher", "ggn", "mc_fisher")
CURVATURES = ("price", "gauss_newton", "hessian") + ENGINE_CURVATURES


# ----------------------------------------------------------------------------------------------
# Pure update functions (one per line of the algorithm in the module docstring)
# ----------------------------------------------------------------------------------------------
def blr_data_update(data: object, h: object, rho: float) -> object:
    """D ← (1 − ρ) D + ρ ĥ, the data part of the precision S = S₀ + D, in its structure.

    ``data`` and ``h`` are ParamDicts (diag), dense matrices (full), or for Kronecker pairs
    ``(blocks, diag)`` with ``blocks[w] = (A, G)`` (a missing layer is a zero term) and a ParamDict for
    parameters outside the layers. The Kronecker result is one term per layer: the nearest Kronecker
    product of (1 − ρ) A_D ⊗ G_D + ρ A_ĥ ⊗ G_ĥ (PSD for PSD terms, so D ⪰ 0 stays true). The diagonal
    step with the Price estimator's positivity correction is :func:`continual_blr.optim.diag_state.diag_update`.
    """
    if isinstance(data, dict):
        assert isinstance(h, dict)
        names = list(data)
        return dict(zip(names, torch._foreach_lerp([data[k] for k in names], [h[k] for k in names], rho)))
    if isinstance(data, Tensor):
        return (1 - rho) * data + rho * h  # type: ignore[operator]
    (d_blocks, d_diag), (h_blocks, h_diag) = data, h  # type: ignore[misc]
    blocks = {}
    for w in set(d_blocks) | set(h_blocks):
        parts = []
        if w in d_blocks:
            parts.append(((1 - rho) * d_blocks[w][0], d_blocks[w][1]))
        if w in h_blocks:
            parts.append((rho * h_blocks[w][0], h_blocks[w][1]))
        # a zero term (a head no example used) adds nothing; with only zero terms the nearest-Kronecker
        # normalisation would divide 0 by 0
        parts = [(a, g) for a, g in parts if bool(a.abs().amax() > 0) and bool(g.abs().amax() > 0)]
        if parts:
            blocks[w] = nearest_kronecker(parts)
    diag = {k: (1 - rho) * v + rho * h_diag[k] if k in h_diag else (1 - rho) * v for k, v in d_diag.items()}
    return blocks, diag


def assemble_posterior(mean: ParamDict, prior: GaussianPosterior, data: object, scale: float = 1.0,
                       extra: float = 0.0) -> GaussianPosterior:
    """N(m, S₀ + scale·D + extra·I) in the prior's structure (``extra``: the step's damping N γ).

    Kronecker: the prior's terms are kept and D is appended as one more term per layer; ``extra`` is
    added to the isotropic δ (so it reaches every parameter).
    """
    if isinstance(prior, DiagPosterior):
        return DiagPosterior(mean, {k: prior.precision[k] + scale * data[k] + extra for k in prior.mean})  # type: ignore[index]
    if isinstance(prior, FullPosterior):
        eye = torch.eye(prior.precision.shape[0], dtype=prior.precision.dtype, device=prior.precision.device)
        return FullPosterior(mean, prior.precision + scale * data + extra * eye)  # type: ignore[operator]
    if isinstance(prior, KronPosterior):
        d_blocks, d_diag = data  # type: ignore[misc]
        blocks = [(w, b, terms + ([(scale * d_blocks[w][0], d_blocks[w][1])] if w in d_blocks else []))
                  for w, b, terms in prior.blocks]
        diag = {k: v + scale * d_diag[k] for k, v in prior.diag.items()}
        return KronPosterior(mean, blocks, diag, prior.delta + extra)
    raise TypeError(f"unsupported posterior type {type(prior).__name__}")


def data_part(prior: GaussianPosterior, start: GaussianPosterior) -> object:
    """D = S_start − S₀ for a starting posterior ``start`` over the prior's parameters (clamped at 0 in
    the diagonal structure; Kronecker: the starting precision's terms beyond the prior's, merged into
    one, plus its excess isotropic part as a term I ⊗ (δ_start − δ₀) I)."""
    if isinstance(prior, DiagPosterior):
        assert isinstance(start, DiagPosterior)
        return {k: (start.precision[k] - prior.precision[k]).clamp_min(0) for k in prior.mean}
    if isinstance(prior, FullPosterior):
        assert isinstance(start, FullPosterior)
        return start.precision - prior.precision
    assert isinstance(prior, KronPosterior) and isinstance(start, KronPosterior)
    n_prior = {w: len(terms) for w, _, terms in prior.blocks}
    extra_delta = max(start.delta - prior.delta, 0.0)
    blocks = {}
    for w, b, terms in start.blocks:
        parts = list(terms[n_prior.get(w, 0):])
        if extra_delta > 0:
            ref = start.mean[w]
            d_in = ref[0].numel() + (b is not None)
            parts.append((extra_delta * torch.eye(d_in, dtype=ref.dtype, device=ref.device),
                          torch.eye(ref.shape[0], dtype=ref.dtype, device=ref.device)))
        if parts:
            blocks[w] = nearest_kronecker(parts)
    diag = {k: (start.diag[k] + start.delta - prior.diag[k] - prior.delta).clamp_min(0) for k in prior.diag}
    return blocks, diag


def _data_like(prior: GaussianPosterior, value: float) -> object:
    """D = value · I in the prior's structure (Kronecker: I ⊗ value·I per layer)."""
    if isinstance(prior, DiagPosterior):
        return {k: torch.full_like(v, value) for k, v in prior.mean.items()}
    if isinstance(prior, FullPosterior):
        return value * torch.eye(prior.precision.shape[0], dtype=prior.precision.dtype, device=prior.precision.device)
    assert isinstance(prior, KronPosterior)
    blocks = {}
    if value > 0:
        for w, b, _ in prior.blocks:
            ref = prior.mean[w]
            d_in = ref[0].numel() + (b is not None)
            blocks[w] = (value * torch.eye(d_in, dtype=ref.dtype, device=ref.device),
                         torch.eye(ref.shape[0], dtype=ref.dtype, device=ref.device))
    return blocks, {k: torch.full_like(prior.mean[k], value) for k in prior.diag}


def blr_mean_update(post: GaussianPosterior, direction: ParamDict, lr: float,
                    clip_radius: float | None = None) -> ParamDict:
    """m ← m − α clip_r(P⁻¹ d) with P the precision of ``post`` (no clipping when ``clip_radius`` is None).

    ``post`` is the preconditioner: the posterior, or the damped N(m, S + Nγ I) (:func:`assemble_posterior`).
    """
    step = post.covariance_matvec(direction)
    if clip_radius is not None:
        step = {k: v.clamp(-clip_radius, clip_radius) for k, v in step.items()}
    return {k: post.mean[k] - lr * step[k] for k in post.mean}


def _kron_from_per_example_grads(g: Tensor, iters: int = 6) -> tuple[Tensor, Tensor]:
    """Nearest Kronecker product A ⊗ G (on Θ ↦ G Θ A) to Σ_i vec(g_i) vec(g_i)ᵀ, g: [B, d_out, d_in].

    Alternating least squares for the leading singular pair of the rearranged matrix, from G = I:
    A ← Σ_i g_iᵀ G g_i / ‖G‖², G ← Σ_i g_i A g_iᵀ / ‖A‖². It converges fast: on rank-one per-example
    gradients of a 100×65 layer (B = 32) the relative error of A ⊗ G to the converged product is
    1e-3 after 2 sweeps, 7e-5 after 3, 2e-7 after 6 — while A ⊗ G itself is ~70 % from Σ_i g_i g_iᵀ.
    """
    d_out, d_in = g.shape[1], g.shape[2]
    tiny = torch.finfo(g.dtype).tiny  # a float32-safe floor (1e-300 underflows to 0 there: 0/0 = NaN)
    flat_in = g.reshape(-1, d_in)  # [B·d_out, d_in]
    gm = torch.eye(d_out, dtype=g.dtype, device=g.device)
    a = flat_in.T @ flat_in / d_out  # Σ_i g_iᵀ I g_i / ‖I‖²
    for _ in range(iters):
        # two-operand contractions (plain matrix products) instead of a three-operand einsum
        gm = torch.einsum("boj,bpj->op", g @ a, g) / (a * a).sum().clamp_min(tiny)
        a = torch.einsum("bpi,bpj->ij", gm @ g, g) / (gm * gm).sum().clamp_min(tiny)
    return a, gm


# ----------------------------------------------------------------------------------------------
# The optimiser
# ----------------------------------------------------------------------------------------------
class BayesianLearningRule(torch.optim.Optimizer):
    """The BLR as a torch optimiser; the model's parameters always hold the posterior mean.

    Algorithm (module docstring; everything scaled to the data set)::

        at a task's first step:        D ← N h₀ I                      (if init_hess is set)
        for each step t = 1, 2, …:
            θ ~ N(m, (S₀ + D)⁻¹)  (or θ = m)
            ĝ, ĥ ← gradient and curvature of (N/B) Σ_i ℓ_i at θ
            D ← (1 − ρ_t) D + ρ_t ĥ  [+ ½ ρ_t² (D − ĥ)²/(S₀ + D) for "price"]     (the step's precision)
            D̄ ← debiased average of the task's ĥ                                  (the carried precision)
            u ← β₁ u + (1 − β₁)(ĝ + S₀(m − m₀))
            m ← m − α/(1 − β₁ᵗ) · clip_r((S₀ + D + N γ I)⁻¹ u)
        posterior() = N(m, S₀ + max(D̄, 0)),  preconditioner() = N(m, S₀ + D)

    Args:
        model: the network; the covered parameters are those named in ``prior.mean``.
        prior: the prior N(m₀, S₀⁻¹) — the previous task's posterior, or an isotropic start. Its
            structure (diag / kron / full) is the posterior's.
        n_data: N, the number of training examples (or an effective sample size) that scales ĝ, ĥ.
        lr: α, the mean step size.
        rho: ρ ∈ (0, 1], the precision rate.
        beta1: momentum β₁ ∈ [0, 1) on the natural-gradient direction (0 turns it off).
        mc_samples: number of weight samples θ ~ q per step; 0 is the delta method (θ = m).
        curvature: ``"price"``, ``"gauss_newton"``, ``"empirical_fisher"``, ``"ggn"``, ``"mc_fisher"`` or
            ``"hessian"`` (see the module docstring; the engine ones need a :class:`BatchClosure`).
        init_precision: the step's starting precision (D = init − S₀; not part of :meth:`posterior`); default
            the prior's (D = 0). Ignored when ``init_hess`` is set.
        generator: the ``torch.Generator`` for weight samples.
        clip_radius: r > 0, the elementwise bound on the preconditioned step; None: no bound.
        debias: use the bias-corrected rate ρ_t = ρ / (1 − (1 − ρ)ᵗ) for the step's D (not for ``"price"``,
            whose step keeps IVON's plain rate); the carried D̄ is always the debiased average.
        damping: γ ≥ 0, added as N γ I to the step's preconditioner only (per-example curvature units).
        init_hess: h₀ > 0: at every task's first step (after construction and after each ``set_prior``)
            the step's D restarts at N h₀ I for every covered parameter, new heads included — a data-scale
            start of the step size (IVON's ``hess_init``) that never reaches :meth:`posterior`; None: D keeps
            its value (``init_precision`` for the first task, then D = 0 since the new prior holds the old
            posterior). Required by ``"price"``.
        curvature_every: k ≥ 1, diagonal structure, not ``"price"``: ĥ is estimated on every k-th step of a
            task only (the first included) and D updated there with the rate 1 − (1 − ρ)ᵏ (debiased over
            the updates made), so D averages over the same number of steps; the other steps cost one
            forward and backward. E[ĥ] and so the fixed point D = E_q[ĥ] are unchanged; the estimate of the
            average uses k times fewer weight samples.
        fused: diagonal structure: run the update after the estimates (:func:`diag_update`) as one
            ``torch.compile``-d kernel instead of about ten eager passes over the parameters (the same
            algebra up to floating-point contraction; the first step compiles, seconds on CPU, and needs a
            C++ compiler there). Other structures ignore it.
    """

    def __init__(
        self,
        model: nn.Module,
        prior: GaussianPosterior,
        n_data: int,
        lr: float = 1.0,
        rho: float = 1.0,
        beta1: float = 0.0,
        mc_samples: int = 0,
        curvature: str = "gauss_newton",
        init_precision: GaussianPosterior | None = None,
        generator: torch.Generator | None = None,
        clip_radius: float | None = None,
        debias: bool = False,
        damping: float = 0.0,
        init_hess: float | None = None,
        fused: bool = False,
        curvature_every: int = 1,
    ) -> None:
        if not isinstance(prior, GaussianPosterior):
            raise TypeError(f"prior: expected a GaussianPosterior, got {type(prior).__name__}")
        if int(n_data) < 1:
            raise ValueError(f"n_data: must be >= 1, got {n_data}")
        if not lr > 0:
            raise ValueError(f"lr: must be > 0, got {lr}")
        if not 0 < rho <= 1:
            raise ValueError(f"rho: must be in (0, 1], got {rho}")
        if not 0 <= beta1 < 1:
            raise ValueError(f"beta1: must be in [0, 1), got {beta1}")
        if int(mc_samples) < 0:
            raise ValueError(f"mc_samples: must be >= 0, got {mc_samples}")
        if clip_radius is not None and not clip_radius > 0:
            raise ValueError(f"clip_radius: must be > 0 or None, got {clip_radius}")
        if not damping >= 0:
            raise ValueError(f"damping: must be >= 0, got {damping}")
        if init_hess is not None and not init_hess > 0:
            raise ValueError(f"init_hess: must be > 0 or None, got {init_hess}")
        if curvature not in CURVATURES:
            raise ValueError(f"curvature: got {curvature!r}; allowed: {', '.join(map(repr, CURVATURES))}")
        if int(curvature_every) < 1:
            raise ValueError(f"curvature_every: must be >= 1, got {curvature_every}")
        if int(curvature_every) > 1 and (prior.structure != Structure.DIAG or curvature == "price"):
            raise ValueError("curvature_every: > 1 is for the diagonal structure with a curvature other than 'price' "
                             "(whose estimate comes free with the gradient)")
        if curvature == "hessian" and prior.structure == Structure.KRON:
            raise ValueError("curvature: 'hessian' is not available for structure 'kron'; use 'gauss_newton'")
        if curvature == "price":
            if prior.structure != Structure.DIAG:
                raise ValueError(f"curvature: 'price' is a diagonal estimator; the prior's structure is "
                                 f"{prior.structure.value!r} (allowed: 'diag')")
            if int(mc_samples) < 1:
                raise ValueError("mc_samples: curvature 'price' estimates E_q[∇²ℓ] from weight samples; must be >= 1")
            if init_hess is None:
                raise ValueError("init_hess: curvature 'price' needs a positive data-scale start h₀ (e.g. 0.1)")
        named = dict(model.named_parameters())
        missing = [k for k in prior.mean if k not in named]
        if missing:
            raise ValueError(f"prior: parameters not in the model: {missing}")
        self.model = model
        self.names = list(prior.mean)
        params = [named[k] for k in self.names]
        self._param_list = params  # the covered parameters in ``names`` order (rebuilt with the optimiser)
        super().__init__(params, dict(lr=lr, rho=rho, beta1=beta1))
        self.prior = prior
        self.n_data = int(n_data)
        self.mc_samples = int(mc_samples)
        self.curvature = curvature
        self.kron_iters = 3  # ALS sweeps per step for the Kronecker Gauss–Newton (see _kron_from_per_example_grads)
        self.generator = generator
        self.clip_radius = clip_radius
        self.debias = bool(debias)
        self.damping = float(damping)
        self.init_hess = init_hess
        self.fused = bool(fused)
        self.curvature_every = int(curvature_every)
        self._data = data_part(prior, init_precision) if init_precision is not None else _data_like(prior, 0.0)
        self._avg: object | None = None  # the carried average D̄ (None: not yet made, or D itself; see _separate)
        self._n_est = 0  # curvature estimates made in this task (the carried average's debiasing count)
        self._momentum: ParamDict | None = None
        self._flat: FlatDiagState | None = None  # the diagonal step's flat buffers (see _flat_state)
        self._t = 0
        self._clip_count: Tensor | None = None
        self._clip_total = 0
        self._dp, self._dp_total, self._dp_empty = False, None, False  # per step (_begin_data_parallel)
        #: data parallel only: each rank draws its own weight sample (IVON's per-rank seeds; see the module docstring)
        self.rank_samples = False
        self._rank_generator: torch.Generator | None = None

    def rebuild(self, model: nn.Module, prior: GaussianPosterior, init_precision: GaussianPosterior) -> None:
        """Re-initialise this optimiser in place over ``prior``'s parameters (e.g. with new heads added),
        keeping every setting (n_data, α, ρ, β₁, samples, curvature, generator, clip_radius, debias,
        damping, init_hess).

        References to the optimiser stay valid; momentum and step count restart, as at a task start.
        """
        group = self.param_groups[0]
        kron_iters = self.kron_iters
        rank_samples, rank_generator = self.rank_samples, self._rank_generator
        BayesianLearningRule.__init__(
            self, model, prior, n_data=self.n_data, lr=group["lr"], rho=group["rho"], beta1=group["beta1"],
            mc_samples=self.mc_samples, curvature=self.curvature, init_precision=init_precision,
            generator=self.generator, clip_radius=self.clip_radius, debias=self.debias, damping=self.damping,
            init_hess=self.init_hess, fused=self.fused, curvature_every=self.curvature_every,
        )
        self.kron_iters = kron_iters
        self.rank_samples, self._rank_generator = rank_samples, rank_generator

    # ----- accessors ---------------------------------------------------------------------------
    def _params(self) -> dict[str, nn.Parameter]:
        return dict(zip(self.names, self._param_list))

    def _current_mean(self) -> ParamDict:
        return {k: p.detach().clone() for k, p in self._params().items()}

    @property
    def _separate(self) -> bool:
        """Whether the carried average D̄ needs a buffer of its own: with the Price estimator's positivity
        correction, or without the debiased rate (then D keeps a share of its start); otherwise D = D̄."""
        return self.curvature == "price" or not self.debias

    def posterior(self, temperature: float = 1.0) -> GaussianPosterior:
        """The current posterior q = N(m, S₀ + D̄/T) (mean = the model's current weights).

        D̄ is the debiased average of this task's curvature estimates (``data_precision``): no start value
        (``init_hess``, ``init_precision``) and no positivity correction enter it, so before the first step
        and on parameters no example touched it is 0 and q is the prior. ``temperature`` T divides it: T = 1
        is the BLR's posterior; T < 1 gives the colder prior a tempered method carries to the next task
        (online Laplace's T; S ⪰ S₀ for every T > 0).
        """
        if not temperature > 0:
            raise ValueError(f"temperature: must be > 0, got {temperature}")
        return assemble_posterior(self._current_mean(), self.prior, self.data_precision, scale=1.0 / temperature)

    def preconditioner(self) -> GaussianPosterior:
        """N(m, S₀ + D): the step's Gaussian (its preconditioner and the one weight samples come from), which
        holds the start value and, with the Price estimator, the positivity correction's upward bias."""
        return assemble_posterior(self._current_mean(), self.prior, self._data)

    @property
    def data_precision(self) -> object:
        """D̄ ⪰ 0, the precision the current task's data added to the prior (structure as in
        :func:`blr_data_update`; diagonal: the average clamped at 0)."""
        if self._n_est == 0:
            return _data_like(self.prior, 0.0)
        avg = self._avg if self._separate else self._data
        if isinstance(avg, dict):
            return {k: v.clamp_min(0) for k, v in avg.items()}
        return avg

    def set_prior(self, prior: GaussianPosterior) -> None:
        """Make ``prior`` the prior (e.g. the posterior of the task just finished).

        The data part restarts: at N h₀ I on the next step when ``init_hess`` is set, else at D = 0 (the
        posterior starts at the new prior, which for a finished task is its posterior: a warm start).
        """
        if set(prior.mean) != set(self.names) or prior.structure != self.prior.structure:
            raise ValueError("set_prior: the new prior must cover the same parameters in the same structure")
        self.prior = prior
        self._data = _data_like(prior, 0.0)
        self._avg = None
        self._n_est = 0
        self._momentum = None
        self._t = 0

    @contextlib.contextmanager
    def sampled_params(self, generator: torch.Generator | None = None) -> Iterator[ParamDict]:
        """Load a weight sample θ ~ q into the model for the duration of the block; the mean is
        restored in ``finally`` even if the block raises."""
        sample = self._sampler(self._current_mean()).sample(generator if generator is not None else self.generator)
        with self._loaded(sample):
            yield sample

    def _sampler(self, mean: ParamDict) -> GaussianPosterior:
        """The Gaussian weight samples are drawn from: the step's N(m, (S₀ + D)⁻¹), in every structure exactly
        (Kronecker blocks with several terms by perturb-and-solve, :meth:`KronPosterior.sample_noise`)."""
        return assemble_posterior(mean, self.prior, self._data)

    # ----- the step ----------------------------------------------------------------------------
    def _estimates(self, closure: Closure, theta: ParamDict, noise: ParamDict | None,
                   s_sample: ParamDict | None) -> tuple[Tensor, ParamDict, object]:
        """(mean loss, ĝ, ĥ) at θ, scaled to the data set (N/B Σ_i)."""
        if self.curvature == "price":
            return self._price_estimates(closure, theta, noise, s_sample)  # type: ignore[arg-type]
        if self.curvature in ENGINE_CURVATURES:
            return self._engine_estimates(closure, theta)

        def losses_fn(p: ParamDict) -> Tensor:
            out = closure(p)
            return out[0] if isinstance(out, tuple) else out

        def penalty_fn(p: ParamDict) -> Tensor:
            out = closure(p)
            return out[1] if isinstance(out, tuple) else torch.zeros((), dtype=out.dtype, device=out.device)

        losses = losses_fn(theta).detach()
        b = losses.shape[0]
        scale, pw = self._scales(b)
        per_ex = jacrev(losses_fn)(theta)  # per-example gradients, [B, *shape] each
        pen_grad = grad(penalty_fn)(theta)
        g = {k: scale * per_ex[k].sum(0) + self.n_data * pw * pen_grad[k] for k in self.names}
        structure = self.prior.structure
        if self.curvature == "hessian":
            flat = flatten(theta)
            hess = hessian(lambda v: losses_fn(unflatten(v, theta)).sum())(flat) * scale
            if structure == Structure.FULL:
                h: object = hess
            else:
                h = unflatten(torch.diagonal(hess).clone(), theta)
        elif structure == Structure.DIAG:
            h = {k: scale * (per_ex[k] ** 2).sum(0) for k in self.names}
        elif structure == Structure.FULL:
            j = torch.cat([per_ex[k].reshape(b, -1) for k in self.names], 1)
            h = scale * j.T @ j
        else:
            assert isinstance(self.prior, KronPosterior)
            if self._dp:
                raise NotImplementedError("curvature 'gauss_newton' with structure 'kron' is a nearest-Kronecker fit "
                                          "to per-example gradients, not a sum over examples: not available "
                                          "data-parallel; use curvature 'ggn' or 'empirical_fisher'")
            blocks = {}
            for w, bias, _ in self.prior.blocks:
                gw = per_ex[w].reshape(b, per_ex[w].shape[1], -1)
                gmat = torch.cat([gw, per_ex[bias].unsqueeze(-1)], -1) if bias is not None else gw
                a, gg = _kron_from_per_example_grads(gmat, iters=self.kron_iters)
                blocks[w] = (scale * a, gg)
            h = (blocks, {k: scale * (per_ex[k] ** 2).sum(0) for k in self.prior.diag})
        return self._mean_loss(losses) + pw * penalty_fn(theta).detach(), g, h

    def _gradients(self, closure: Closure, theta: ParamDict) -> tuple[Tensor, ParamDict, ParamDict, Tensor]:
        """One forward and backward pass at θ: (losses [B], ĝ of the data term, ĝ of everything, penalty).

        ĝ = (N/B) ∇ Σ_i ℓ_i(θ) + N ∇ penalty(θ); the data term's gradient is also returned on its own (a
        second backward, through the penalty only, when there is a penalty).
        """
        leaves = {k: v.detach().requires_grad_(True) for k, v in theta.items()}
        out = closure(leaves)
        losses, penalty = out if isinstance(out, tuple) else (out, None)
        scale, pw = self._scales(losses.shape[0])
        inputs = [leaves[k] for k in self.names]
        data_grads = torch.autograd.grad(scale * losses.sum(), inputs, allow_unused=True,
                                         retain_graph=penalty is not None)
        g_data = {k: (gk if gk is not None else torch.zeros_like(leaves[k])) for k, gk in zip(self.names, data_grads)}
        g = g_data
        pen = torch.zeros((), dtype=losses.dtype, device=losses.device)
        if penalty is not None:
            pen_grads = torch.autograd.grad(self.n_data * pw * penalty, inputs, allow_unused=True)
            g = {k: g_data[k] + pg if pg is not None else g_data[k] for k, pg in zip(self.names, pen_grads)}
            pen = pw * penalty.detach()
        return losses.detach(), g_data, g, pen

    def _price_estimates(self, closure: Closure, theta: ParamDict, noise: ParamDict,
                         s_sample: ParamDict) -> tuple[Tensor, ParamDict, object]:
        """(mean loss, ĝ, ĥ) with the reparameterisation estimate ĥ = ĝ_data ∘ (θ − m) ∘ s (one backward)."""
        losses, g_data, g, pen = self._gradients(closure, theta)
        names = self.names
        h_list = torch._foreach_mul(torch._foreach_mul([g_data[k] for k in names], [noise[k] for k in names]),
                                    [s_sample[k] for k in names])
        return self._mean_loss(losses) + pen, g, dict(zip(names, h_list))

    def _engine_estimates(self, closure: Closure, theta: ParamDict) -> tuple[Tensor, ParamDict, object]:
        """(mean loss, ĝ, ĥ) at θ with ĥ from the curvature engine on the closure's minibatch.

        ĝ = (N/B) ∇ Σ_i ℓ_i(θ) + N ∇ penalty(θ) by one backward pass; ĥ = (N/B) C(θ) with C the named
        curvature (a sum over the B examples) of the model with θ loaded into its parameters.
        """
        if not isinstance(closure, BatchClosure):
            raise ValueError(f"curvature: {self.curvature!r} needs a BatchClosure (the minibatch for the curvature "
                             f"engine); got {type(closure).__name__}. Use curvature='gauss_newton' for other closures")
        losses, _, g, pen = self._gradients(closure, theta)
        scale, pw = self._scales(losses.shape[0])
        structure = self.prior.structure
        # data parallel over a global batch: the engine takes this rank's rows (MC labels drawn for all B)
        # and returns this rank's part (K-FAC's A already weighted b_r/B); the step reduces it
        x, y = (closure.x_global, closure.y_global) if closure.sharded else (closure.x, closure.y)
        # the delta method evaluates at the mean, which the model already holds
        with contextlib.nullcontext() if self.mc_samples == 0 else self._loaded(theta):
            c = engine_curvature(self.model, x, y, kind=self.curvature, structure=structure,
                                 likelihood=closure.likelihood, sigma=closure.sigma, head=closure.head,
                                 param_names=self.names, generator=self.generator, shard=closure.sharded,
                                 reduce=False)
        if closure.sharded:
            scale = self.n_data / closure.batch_size  # an empty part: c is zero already
        a_w = 1.0 if closure.sharded else pw
        if isinstance(c, KronCurvature):
            h: object = ({blk.weight: (scale * a_w * blk.A, blk.G) for blk in c.blocks},
                         {k: scale * v for k, v in c.diag.items()})
        elif isinstance(c, dict):
            h = {k: scale * c[k] for k in self.names}
        else:
            h = scale * c
        return self._mean_loss(losses) + pen, g, h

    # ----- data parallel -------------------------------------------------------------------------
    def _begin_data_parallel(self, closure: Closure) -> None:
        """Per step: whether ĝ, ĥ are all-reduced, and B when the closure knows it (see the module docstring)."""
        self._dp = distributed.is_distributed()
        self._dp_total = None
        self._dp_empty = False
        if self._dp and isinstance(closure, BatchClosure):
            if closure.sharded:
                self._dp_total = closure.batch_size
            if closure.x.shape[0] == 0:  # no examples on this rank: one example's computation, weight 0
                closure.x, closure.y = closure.x_global[:1], closure.y_global[:1]
                self._dp_empty = True

    def _sample_generator(self) -> torch.Generator | None:
        """Where weight samples come from: the optimiser's generator (the same state on every rank), or with
        ``rank_samples`` in a data-parallel run a generator of this rank's own, seeded
        ``base · W + rank`` (:func:`continual_blr.distributed.rank_seed`) with ``base`` drawn once from the
        optimiser's generator (so the seeds derive from the run's seed)."""
        if not (self.rank_samples and self._dp) or self.generator is None:
            return self.generator
        if self._rank_generator is None:
            base = int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator, device=self.generator.device))
            self._rank_generator = torch.Generator(device=self.generator.device).manual_seed(distributed.rank_seed(base))
        return self._rank_generator

    def _scales(self, b: int) -> tuple[float, float]:
        """(N/B, b/B): the data term's scale and the penalty's weight of this rank's b examples (N/b, 1 in
        one process). B is the global batch (all-reduced once per step when the closure does not know it)."""
        if not self._dp:
            return self.n_data / b, 1.0
        if self._dp_total is None:
            self._dp_total = round(distributed.all_reduce_float(b, "batch size"))
        total = max(self._dp_total, 1)
        if self._dp_empty:
            return 0.0, 0.0
        return self.n_data / total, b / total

    def _mean_loss(self, losses: Tensor) -> Tensor:
        """(1/B) Σ_{i∈rank} ℓ_i: this rank's part of the global mean loss (the mean in one process)."""
        if not self._dp:
            return losses.mean()
        return losses.sum() * (self._scales(losses.shape[0])[0] / self.n_data)

    def _reduce_estimates(self, loss: Tensor, g: object, h: object) -> Tensor:
        """All-reduce (loss, ĝ, ĥ) in place with one collective; returns the loss as a tensor (no-op in one process)."""
        if not self._dp:
            return loss
        loss = loss.detach().reshape(1).clone()
        tensors = [loss] + list(g.values()) if isinstance(g, dict) else [loss] + list(g)  # type: ignore[arg-type]
        if isinstance(h, tuple):
            blocks, diag = h
            tensors += [t for pair in blocks.values() for t in pair] + list(diag.values())
        elif isinstance(h, dict):
            tensors += list(h.values())
        elif isinstance(h, list):
            tensors += h
        else:
            tensors += curvature_tensors(h)  # type: ignore[arg-type]
        distributed.all_reduce_sum_(tensors, "blr step")
        return loss[0]

    @contextlib.contextmanager
    def _loaded(self, theta: ParamDict) -> Iterator[None]:
        """The model's covered parameters hold ``theta`` inside the block (restored in ``finally``)."""
        params = self._params()
        saved = {k: p.detach().clone() for k, p in params.items()}
        try:
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(theta[k])
            yield
        finally:
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(saved[k])

    @torch.no_grad()
    def step(self, closure: Closure) -> Tensor:  # type: ignore[override]
        """One BLR step. Returns the mean minibatch loss (averaged over MC samples)."""
        if closure is None:
            raise ValueError("closure: the BLR needs a closure(params) -> per-example losses")
        self._begin_data_parallel(closure)
        group = self.param_groups[0]
        lr, rho, beta1 = group["lr"], group["rho"], group["beta1"]
        if self._t == 0 and self.init_hess is not None:  # a data-scale start for every parameter
            self._data = _data_like(self.prior, self.n_data * self.init_hess)
        if isinstance(self.prior, DiagPosterior):
            return self._diag_step(closure, lr, rho, beta1)
        params = self._params()
        mean = {k: p.detach() for k, p in params.items()}
        sampler = self._sampler(mean) if self.mc_samples > 0 else None
        n_mc = max(1, self.mc_samples)
        loss_sum, g_sum, h_sum = 0.0, None, None
        with torch.enable_grad():
            for _ in range(n_mc):
                if self.mc_samples == 0:
                    noise, theta = None, mean
                else:
                    noise = sampler.sample_noise(self._sample_generator())  # type: ignore[union-attr]
                    theta = {k: mean[k] + noise[k] for k in self.names}
                loss, g, h = self._estimates(closure, theta, noise, None)
                loss = self._reduce_estimates(loss, g, h)
                loss_sum = loss_sum + loss
                g_sum = g if g_sum is None else {k: g_sum[k] + g[k] for k in g}
                h_sum = h if h_sum is None else _add_curv(h_sum, h)
        g_avg = g_sum if n_mc == 1 else {k: v / n_mc for k, v in g_sum.items()}  # type: ignore[union-attr]
        h_avg = _scale_curv(h_sum, 1.0 / n_mc)
        self._check_finite(loss_sum, g_avg, h_avg)
        # natural-gradient direction ĝ + S₀ (m − m₀)
        prior_term = self.prior.precision_matvec({k: mean[k] - self.prior.mean[k] for k in self.names})
        d = {k: g_avg[k] + prior_term[k] for k in self.names}
        self._t += 1
        if beta1 > 0:
            prev = self._momentum if self._momentum is not None else {k: torch.zeros_like(v) for k, v in d.items()}
            self._momentum = d = {k: beta1 * prev[k] + (1 - beta1) * d[k] for k in d}
            lr = lr / (1 - beta1**self._t)  # the bias correction after the clip, as in the diagonal step
        rho_step, rho_avg = self._rates(rho)
        self._n_est += 1
        self._data = blr_data_update(self._data, h_avg, rho_step)
        if self._separate:
            avg = self._avg if self._avg is not None else _data_like(self.prior, 0.0)
            self._avg = blr_data_update(avg, h_avg, rho_avg)
        precond = assemble_posterior(mean, self.prior, self._data, extra=self.n_data * self.damping)
        new_mean = blr_mean_update(precond, d, lr, self.clip_radius)
        for k, p in params.items():
            p.copy_(new_mean[k])
        return loss_sum / n_mc  # type: ignore[return-value]

    def _check_finite(self, loss: Tensor, g: object, h: object) -> None:
        """DivergenceError naming the first non-finite quantity (one synchronisation; runs before any state changes)."""
        bad = _first_bad(loss, g, h)
        if bad is not None:
            raise DivergenceError(f"BLR step {self._t + 1}: the minibatch {bad} is not finite (loss {float(loss)}); "
                                  "lower lr (α), or bound the step with damping or clip_radius")

    def _flat_state(self, mean: list[Tensor]) -> FlatDiagState:
        """The diagonal step's flat buffers, rebuilt only when the prior, D, D̄ or the momentum were replaced
        (``set_prior``, ``load_state_dict``, ``rebuild``, the ``init_hess`` start)."""
        flat = self._flat
        if flat is None or flat.prior is not self.prior or flat.numels != [m.numel() for m in mean]:
            if len({(m.dtype, m.device) for m in mean}) != 1:
                raise ValueError("the diagonal BLR step needs every covered parameter in one dtype and on one "
                                 f"device; got {sorted({(str(m.dtype), str(m.device)) for m in mean})}")
            prior = self.prior
            assert isinstance(prior, DiagPosterior)
            flat = FlatDiagState(prior, self.names, [m.numel() for m in mean], [m.shape for m in mean])
            self._flat = flat
        if self._separate and self._avg is None:
            self._avg = _data_like(self.prior, 0.0)  # type: ignore[assignment]
        flat.sync(self._data, self._avg if self._separate else None, self._momentum)  # type: ignore[arg-type]
        self._data, self._avg = flat.data_views, flat.avg_views  # type: ignore[assignment]
        self._momentum = flat.mom_views
        return flat

    def _diag_step(self, closure: Closure, lr: float, rho: float, beta1: float) -> Tensor:
        """The diagonal step on flat vectors (:mod:`continual_blr.optim.diag_state`): one kernel per line of
        the algorithm over all parameters (with ``fused`` one compiled kernel, :func:`fused_diag_update`).

        Weight samples are drawn from the step's Gaussian N(m, (S₀ + D)⁻¹) (IVON's); the carried D̄ averages
        the estimates made at them.
        """
        mean_list = [p.detach() for p in self._param_list]
        mean = torch.cat([m.reshape(-1) for m in mean_list])
        flat = self._flat_state(mean_list)
        n_mc = max(1, self.mc_samples)
        fresh = self._t % self.curvature_every == 0  # estimate ĥ on this step (every step unless curvature_every)
        if flat.s is None:  # S = S₀ + D (kept from the last update while neither was replaced)
            flat.s = flat.s0 + flat.data
        price = self.curvature == "price"
        loss_sum, g_sum, h_sum = 0.0, None, None
        with torch.enable_grad():
            for _ in range(n_mc):
                if self.mc_samples == 0:
                    eps, r, theta = None, None, mean
                else:  # θ = m + ε / √S, one draw for all parameters
                    eps = torch.randn(mean.shape, generator=self._sample_generator(), dtype=mean.dtype,
                                      device=mean.device)
                    r = torch.rsqrt(flat.s)
                    theta = torch.addcmul(mean, eps, r)
                theta_d = flat.views(theta)
                if price:  # ĥ = ĝ_data ∘ (θ − m) ∘ S = ĝ_data ∘ ε ∘ √S, one backward pass
                    losses, g_data_d, g_d, pen = self._gradients(closure, theta_d)
                    loss = self._mean_loss(losses) + pen
                    g_data = flat.cat(g_data_d)
                    g = g_data if g_d is g_data_d else flat.cat(g_d)
                    # one sample in one process: ĥ is formed inside the update (diag_update's h_from_sample)
                    h = g_data if n_mc == 1 and not self._dp else torch.mul(g_data, eps).div_(r)  # type: ignore[arg-type]
                elif fresh:
                    loss, g_d, h_d = self._estimates(closure, theta_d, None, None)
                    g, h = flat.cat(g_d), flat.cat(h_d)  # type: ignore[arg-type]
                else:  # a step without a curvature estimate (curvature_every): the gradient only
                    losses, _, g_d, pen = self._gradients(closure, theta_d)
                    loss, g, h = self._mean_loss(losses) + pen, flat.cat(g_d), None
                loss = self._reduce_estimates(loss, [g], [h] if h is not None else [])
                loss_sum = loss_sum + loss
                if g_sum is None:
                    g_sum, h_sum = g, h
                else:
                    g_sum.add_(g)
                    if h is not None:
                        h_sum.add_(h)  # type: ignore[union-attr]
        assert g_sum is not None
        if n_mc > 1:
            g_sum.div_(n_mc)
            if h_sum is not None:
                h_sum.div_(n_mc)
        h_from_sample = price and n_mc == 1 and not self._dp
        t = self._t + 1
        rho_step, rho_avg = self._rates(rho, fresh)
        use_mom = beta1 > 0
        if use_mom and flat.mom is None:  # u₀ = 0: the first average is (1 − β₁) d
            flat.mom = torch.zeros_like(mean)
        unbias = 1 / (1 - beta1**t) if use_mom else 1.0
        scalars = (1 - beta1, rho_step, rho_avg, unbias, lr, self.clip_radius or 0.0, self.n_data * self.damping)
        update = fused_diag_update() if self.fused else diag_update
        if self.fused:
            scalars = tuple(torch.tensor(v, dtype=mean.dtype, device=mean.device) for v in scalars)
        separate = flat.avg is not None
        new_mean, mom, data, avg, s, check, n_clip = update(
            g_sum, h_sum if h_sum is not None else g_sum, mean, flat.m0, flat.s0, flat.data,
            flat.avg if separate else mean, flat.mom if use_mom else g_sum, eps if h_from_sample else mean,
            r if h_from_sample else mean, *scalars, positivity=price, h_from_sample=h_from_sample,
            momentum=use_mom, clip=self.clip_radius is not None, damping=self.damping > 0,
            fresh=h_sum is not None, separate=separate)
        if not bool(torch.isfinite(check + loss_sum)):  # nothing kept yet: name the culprit and stop
            h_d = flat.views(h_sum * eps / r if h_from_sample else h_sum if h_sum is not None else 0 * g_sum)  # type: ignore[operator]
            self._check_finite(loss_sum, flat.views(g_sum), h_d)  # type: ignore[arg-type]
            raise DivergenceError(f"BLR step {t}: the update is not finite; lower lr (α), or bound the "
                                  "step with damping or clip_radius")
        self._t = t
        if h_sum is not None:
            self._n_est += 1
        flat.data, flat.s = data, s
        flat.data_views = self._data = flat.views(data)
        if separate:
            flat.avg = avg
            flat.avg_views = self._avg = flat.views(avg)
        if use_mom:
            flat.mom = mom
            flat.mom_views = self._momentum = flat.views(mom)
        if self.clip_radius is not None:
            self._count_clipped(n_clip, mean.numel())
        torch._foreach_copy_(mean_list, [v.view_as(m) for v, m in zip(flat.split(new_mean), mean_list)])
        return loss_sum / n_mc  # type: ignore[return-value]

    def _rates(self, rho: float, fresh: bool = True) -> tuple[float, float]:
        """(ρ_t of the step's D, ρ̄_t of the carried average D̄) for the step about to be made.

        With ``curvature_every`` k > 1 the rate per estimate is 1 − (1 − ρ)ᵏ, so that D still averages over
        ~1/ρ steps; debiasing counts the estimates made in the task (n), so ρ̄₁ = 1: D̄ starts at ĥ₁.
        """
        k = self.curvature_every
        if k > 1:
            rho = 1 - (1 - rho) ** k
        n = self._n_est + (1 if fresh else 0)
        debiased = rho / (1 - (1 - rho) ** max(n, 1))
        # the Price step keeps IVON's plain rate: debiased, its first step would set D to one noisy estimate
        step_debiased = self.debias and self.curvature != "price"
        return (debiased if step_debiased else rho), debiased

    def _count_clipped(self, n_clip: Tensor, numel: int) -> None:
        """Accumulate the number of clipped coordinates (read by :meth:`pop_clipped_fraction`; no sync here)."""
        self._clip_count = n_clip if self._clip_count is None else self._clip_count + n_clip
        self._clip_total += numel

    def pop_clipped_fraction(self) -> float | None:
        """The fraction of coordinates whose preconditioned step the clip bounded since the last call (None
        without a clip or before any step), and reset the count. The clip moves the fixed point when
        weights are sampled (see the module docstring), so the loop logs this per epoch."""
        if self._clip_count is None or self._clip_total == 0:
            return None
        frac = float(self._clip_count) / self._clip_total
        self._clip_count, self._clip_total = None, 0
        return frac

    # ----- persistence -------------------------------------------------------------------------
    def state_dict(self) -> dict:  # type: ignore[override]
        return {
            "prior": self.prior.state_dict(),
            "data": self._data,
            "average": self._avg,
            "n_estimates": self._n_est,
            "t": self._t,
            "momentum": self._momentum,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
        }

    def load_state_dict(self, state: dict) -> None:  # type: ignore[override]
        from ..posteriors import load_posterior

        self.prior = load_posterior(state["prior"])
        self._data = state["data"]
        self._t = state["t"]
        self._avg = state.get("average", None if self.debias and self.curvature != "price" else state["data"])
        self._n_est = state.get("n_estimates", (self._t - 1) // self.curvature_every + 1 if self._t else 0)
        self._momentum = state["momentum"]
        for g, saved in zip(self.param_groups, state["param_groups"]):
            g.update(saved)


def _add_curv(a: object, b: object) -> object:
    if isinstance(a, dict):
        return {k: a[k] + b[k] for k in a}  # type: ignore[index]
    if isinstance(a, tuple):
        (ba, da), (bb, db) = a, b  # type: ignore[misc]
        blocks = {w: (ba[w][0] + bb[w][0], ba[w][1]) if torch.equal(ba[w][1], bb[w][1]) else nearest_kronecker([ba[w], bb[w]]) for w in ba}
        return blocks, {k: da[k] + db[k] for k in da}
    return a + b  # type: ignore[operator]


def _finite_flags(a: object) -> list[Tensor]:
    """One 0-d bool tensor per tensor in a ParamDict, a (blocks, diag) Kronecker estimate or a tensor."""
    if isinstance(a, dict):
        return [f for v in a.values() for f in _finite_flags(v)]
    if isinstance(a, tuple):
        return [f for v in a for f in _finite_flags(v)]
    if isinstance(a, Tensor):
        return [torch.isfinite(a).all()]
    return []


def _first_bad(loss: Tensor, g: object, h: object) -> str | None:
    """The first of "loss", "gradient", "curvature" holding a non-finite number, or None (one device
    synchronisation for all three)."""
    groups = [_finite_flags(loss), _finite_flags(g), _finite_flags(h)]
    flags = torch.stack([torch.stack(f).all() for f in groups]).tolist()
    for name, ok in zip(("loss", "gradient", "curvature"), flags):
        if not ok:
            return name
    return None


def _scale_curv(a: object, s: float) -> object:
    if s == 1.0:
        return a
    if isinstance(a, dict):
        return {k: s * v for k, v in a.items()}
    if isinstance(a, tuple):
        blocks, diag = a
        return {w: (s * x, y) for w, (x, y) in blocks.items()}, {k: s * v for k, v in diag.items()}
    return s * a  # type: ignore[operator]


class VON(BayesianLearningRule):
    """Variational Online Newton: the BLR's Newton form (Khan & Rue 2023, eq. 12) for any structure.

    Defaults are the deterministic Newton-like update: ρ = α = 1, no momentum, the delta method
    (``mc_samples=0``) and the exact Hessian. With these, on a quadratic loss each step is exact.
    """

    def __init__(self, model: nn.Module, prior: GaussianPosterior, n_data: int, lr: float = 1.0, rho: float = 1.0,
                 mc_samples: int = 0, curvature: str = "hessian", **kwargs) -> None:
        super().__init__(model, prior, n_data, lr=lr, rho=rho, mc_samples=mc_samples, curvature=curvature, **kwargs)


class VOGN(BayesianLearningRule):
    """Variational Online Gauss–Newton (Osawa et al. 2019; Khan & Rue 2023, eqs. 45–46).

    Diagonal posterior, weight-perturbed (``mc_samples ≥ 1`` samples θ ~ q per step), curvature from
    squared per-example gradients, momentum β₁ on the mean direction and precision rate ρ = 1 − β₂.
    """

    def __init__(self, model: nn.Module, prior: GaussianPosterior, n_data: int, lr: float = 1e-3, rho: float = 1e-3,
                 beta1: float = 0.9, mc_samples: int = 1, **kwargs) -> None:
        if prior.structure != Structure.DIAG:
            raise ValueError(f"prior: VOGN needs a diagonal prior, got structure {prior.structure.value!r}")
        if int(mc_samples) < 1:
            raise ValueError(f"mc_samples: VOGN samples weights; must be >= 1, got {mc_samples}")
        kwargs.setdefault("curvature", "gauss_newton")
        super().__init__(model, prior, n_data, lr=lr, rho=rho, beta1=beta1, mc_samples=mc_samples, **kwargs)
