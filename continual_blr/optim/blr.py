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

from ..mixed_precision import full_precision
from ..posteriors import DiagPosterior, GaussianPosterior
from ..types import DivergenceError, ParamDict, Structure
from .closures import BatchClosure
from .noise import NOISES, PooledNoise
from .diag_state import diag_update
from .diag_step import DiagStepMixin
from .estimators import CURVATURES, ENGINE_CURVATURES, Closure, engine_estimates, per_example_estimates
from .parallel import DataParallelStep
from .precision import (add_curv, assemble_posterior, blr_data_update, blr_mean_update, data_like, data_part,
                        first_bad, scale_curv)

Coupling = Callable[[ParamDict], ParamDict]  # v ↦ R v, the off-diagonal part of a structured prior (set_prior)

__all__ = ["BayesianLearningRule", "Coupling", "BatchClosure", "VON", "VOGN", "blr_data_update", "blr_mean_update",
           "diag_update", "assemble_posterior", "data_part", "CURVATURES", "ENGINE_CURVATURES"]



def _check_settings(prior: GaussianPosterior, n_data: int, lr: float, rho: float, beta1: float, mc_samples: int,
                    clip_radius: float | None, damping: float, init_hess: float | None, curvature: str,
                    curvature_every: int) -> None:
    """One-line errors naming the bad argument and what is allowed (``BayesianLearningRule``'s arguments)."""
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


# ----------------------------------------------------------------------------------------------
# The optimiser
# ----------------------------------------------------------------------------------------------
class BayesianLearningRule(DiagStepMixin, torch.optim.Optimizer):
    """The BLR as a torch optimiser; the model's parameters always hold the posterior mean.

    Algorithm (module docstring; everything scaled to the data set):

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
        fused: diagonal structure: run the update after the estimates (:func:`diag_update`) as one loop
            instead of about ten eager passes over the parameters (the same algebra up to floating-point
            contraction). The Price step's module path on CPU runs the native C loop, in place
            (:mod:`continual_blr.optim.native`; compiled once per machine, about a second); elsewhere, or
            without a C compiler, inductor compiles the update (``fused_diag_update``; seconds in every
            fresh process, and a C++ compiler on CPU). Other structures ignore it.
        noise: where the diagonal step's ε comes from (:mod:`continual_blr.optim.noise`): ``"gaussian"``, a
            fresh N(0, I) draw per step, or ``"pooled"``, a sign-randomised shift of a standardised Gaussian
            pool redrawn every ``noise_refresh`` steps (32 × fewer generator draws; the same first and second
            moments given the past, so the same fixed point on a quadratic loss). Diagonal structure.
        noise_refresh: R ≥ 1, steps between redraws of the ``"pooled"`` noise's pool.
        coupling_every: k ≥ 1: a structured prior's coupling R(m − m₀) (:meth:`set_prior`) is computed on every
            k-th step of a task (the first included) and the same vector reused on the steps between: a pull at
            most k − 1 steps stale, the same at a fixed point (where m no longer moves), so the fixed point is
            unchanged, at 1/k of the coupling's cost. With a ``correction`` (:meth:`set_prior`) the vector is
            not reused as it is but corrected on the steps between.
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
        noise: str = "gaussian",
        noise_refresh: int = 64,
        coupling_every: int = 1,
    ) -> None:
        _check_settings(prior, n_data, lr, rho, beta1, mc_samples, clip_radius, damping, init_hess, curvature,
                        curvature_every)
        if noise not in NOISES:
            raise ValueError(f"noise: got {noise!r}; allowed: {', '.join(map(repr, NOISES))}")
        if noise == "pooled" and prior.structure != Structure.DIAG:
            raise ValueError(f"noise: 'pooled' is for the diagonal structure, got {prior.structure.value!r}")
        if not (isinstance(coupling_every, int) and not isinstance(coupling_every, bool) and coupling_every >= 1):
            raise ValueError(f"coupling_every: must be an integer >= 1, got {coupling_every!r}")
        named = dict(model.named_parameters())
        missing = [k for k in prior.mean if k not in named]
        if missing:
            raise ValueError(f"prior: parameters not in the model: {missing}")
        self.model = model
        self.names = list(prior.mean)
        params = [named[k] for k in self.names]
        self._param_list = params  # the covered parameters in ``names`` order (rebuilt with the optimiser)
        # the module path of the diagonal Price step needs every trainable weight covered (diag_step)
        self._covers_all = {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in params}
        self.module_step = True  # False: always evaluate samples with functional_call (the two paths agree exactly)
        super().__init__(params, dict(lr=lr, rho=rho, beta1=beta1))
        self.prior = prior
        self.n_data = int(n_data)
        self.mc_samples = int(mc_samples)
        self.curvature = curvature
        self.kron_iters = 3  # ALS sweeps per step for the Kronecker Gauss–Newton (estimators.kron_from_per_example_grads)
        self.generator = generator
        self.clip_radius = clip_radius
        self.debias = bool(debias)
        self.damping = float(damping)
        self.init_hess = init_hess
        self.fused = bool(fused)
        self.curvature_every = int(curvature_every)
        self.noise = noise
        self._pool = PooledNoise(noise_refresh) if noise == "pooled" else None  # None: fresh draws
        self._data = data_part(prior, init_precision) if init_precision is not None else data_like(prior, 0.0)
        self._avg: object | None = None  # the carried average D̄ (None: not yet made, or D itself; see _separate)
        self._n_est = 0  # curvature estimates made in this task (the carried average's debiasing count)
        self._momentum: ParamDict | None = None
        self._flat = None  # the diagonal step's flat buffers (DiagStepMixin._flat_state)
        self._t = 0
        self._clip_count: Tensor | int | None = None
        self._clip_total = 0
        self._parallel = DataParallelStep()  # per-step data-parallel scales (rank_samples lives there)
        self.prior_coupling: Coupling | None = None  # R = S₀ − diag(S₀) of a structured prior (set_prior)
        self.coupling_every = coupling_every
        self._coupling_cache: Tensor | None = None  # the last R(m − m₀), flat (reused for coupling_every − 1 steps)
        self.prior_correction: Coupling | None = None  # a cheap R̃ for the steps between recomputations (set_prior)
        self._correction_flat = None  # R̃'s flat operator and buffers (DiagStepMixin._correction_term)
        self._coupling_anchor: Tensor | None = None  # the flat mean m_s the cached R(m_s − m₀) was computed at

    def rebuild(self, model: nn.Module, prior: GaussianPosterior, init_precision: GaussianPosterior) -> None:
        """Re-initialise this optimiser in place over ``prior``'s parameters (e.g. with new heads added),
        keeping every setting (n_data, α, ρ, β₁, samples, curvature, generator, clip_radius, debias,
        damping, init_hess).

        References to the optimiser stay valid; momentum and step count restart, as at a task start.
        """
        group = self.param_groups[0]
        kron_iters = self.kron_iters
        parallel = self._parallel
        pool = self._pool
        coupling, correction = self.prior_coupling, self.prior_correction
        BayesianLearningRule.__init__(
            self, model, prior, n_data=self.n_data, lr=group["lr"], rho=group["rho"], beta1=group["beta1"],
            mc_samples=self.mc_samples, curvature=self.curvature, init_precision=init_precision,
            generator=self.generator, clip_radius=self.clip_radius, debias=self.debias, damping=self.damping,
            init_hess=self.init_hess, fused=self.fused, curvature_every=self.curvature_every,
            noise=self.noise, noise_refresh=pool.refresh if pool is not None else 64,
            coupling_every=self.coupling_every,
        )
        self.kron_iters = kron_iters
        self._parallel = parallel
        self._pool = pool  # the noise stream goes on
        self.prior_coupling = coupling  # parameters it does not name get no coupling (new heads)
        self.prior_correction = correction

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
            return data_like(self.prior, 0.0)
        avg = self._avg if self._separate else self._data
        if isinstance(avg, dict):
            return {k: v.clamp_min(0) for k, v in avg.items()}
        return avg

    def set_prior(self, prior: GaussianPosterior, coupling: Coupling | None = None,
                  correction: Coupling | None = None) -> None:
        """Make ``prior`` the prior (e.g. the posterior of the task just finished).

        The data part restarts: at N h₀ I on the next step when ``init_hess`` is set, else at D = 0 (the
        posterior starts at the new prior, which for a finished task is its posterior: a warm start).

        ``coupling`` (diagonal structure only): v ↦ R v with R = S̃₀ − diag(S̃₀), the off-diagonal part of a
        structured prior precision S̃₀ whose diagonal is ``prior``'s (e.g. a Kronecker-factored one,
        :meth:`~continual_blr.posteriors.KronPosterior.precision_diag`). The step is then the BLR of a mean-field
        q under the prior N(m₀, S̃₀⁻¹) (Khan & Rue 2023, eq. 12 with E_q[∇(−log p)] = S̃₀(m − m₀) and the
        diagonal of E_q[∇²(−log p)] = diag(S̃₀)): the mean's direction gains R(m − m₀), taken at the mean (exact,
        no sampling noise), while the precision and the weight samples keep diag(S̃₀) + D. For a quadratic loss
        the fixed point's mean is the exact posterior mean under S̃₀ (``tests/test_blr_structured_prior.py``).
        The coupling may name a subset of the parameters (the others get none); None: no coupling.

        ``correction`` (with ``coupling_every`` k > 1): a cheaper operator R̃ ≈ R (e.g. a rank-cut coupling,
        :meth:`~continual_blr.posteriors.KronPosterior.coupling`). On the steps between two recomputations the pull
        is R(m_s − m₀) + R̃(m − m_s), with m_s the mean of the last recomputation, instead of R(m_s − m₀) alone:
        the error is (R − R̃)(m − m_s), on the change since m_s only. At a fixed point m = m_s, so the pull is
        the exact R(m − m₀) and the fixed point is unchanged; with R̃ = R the pull is R(m − m₀) on every step.
        """
        if set(prior.mean) != set(self.names) or prior.structure != self.prior.structure:
            raise ValueError("set_prior: the new prior must cover the same parameters in the same structure")
        if coupling is not None and prior.structure != Structure.DIAG:
            raise ValueError(f"set_prior: a coupling is for a diagonal prior, got {prior.structure.value!r}")
        if correction is not None and coupling is None:
            raise ValueError("set_prior: a correction needs a coupling")
        self.prior_coupling = coupling
        self.prior_correction = correction
        self._correction_flat = None
        self._coupling_cache = None
        self._coupling_anchor = None
        self.prior = prior
        self._data = data_like(prior, 0.0)
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
        (Kronecker blocks with several terms by perturb-and-solve, :meth:`~continual_blr.posteriors.KronPosterior.sample_noise`)."""
        return assemble_posterior(mean, self.prior, self._data)

    # ----- the step ----------------------------------------------------------------------------
    def _estimates(self, closure: Closure, theta: ParamDict) -> tuple[Tensor, ParamDict, object]:
        """(mean loss, ĝ, ĥ) at θ, scaled to the data set (N/B Σ_i): :mod:`continual_blr.optim.estimators`."""
        if self.curvature in ENGINE_CURVATURES:
            return engine_estimates(closure, theta, self.names, self.n_data, self._parallel, self.curvature,
                                    self.prior.structure, self.model, self.generator,
                                    None if self.mc_samples == 0 else self._loaded)
        return per_example_estimates(closure, theta, self.names, self.n_data, self._parallel, self.curvature,
                                     self.prior, self.kron_iters)

    @property
    def rank_samples(self) -> bool:
        """Data parallel only: each rank draws its own weight sample (IVON's per-rank seeds; module docstring)."""
        return self._parallel.rank_samples

    @rank_samples.setter
    def rank_samples(self, value: bool) -> None:
        self._parallel.rank_samples = bool(value)

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
    @full_precision
    def step(self, closure: Closure) -> Tensor:  # type: ignore[override]
        """One BLR step. Returns the mean minibatch loss (averaged over MC samples).

        Precision: the step's algebra (weight samples, ĝ, ĥ, the precision and mean updates) is fp32 even inside
        an active ``torch.autocast``; only a :class:`BatchClosure` built with ``autocast_dtype`` runs its
        forward in bf16 (see :mod:`continual_blr.optim.estimators`).
        """
        if closure is None:
            raise ValueError("closure: the BLR needs a closure(params) -> per-example losses")
        self._parallel.begin(closure)
        group = self.param_groups[0]
        lr, rho, beta1 = group["lr"], group["rho"], group["beta1"]
        if self._t == 0 and self.init_hess is not None:  # a data-scale start for every parameter
            self._data = data_like(self.prior, self.n_data * self.init_hess)
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
                    noise = sampler.sample_noise(self._parallel.sample_generator(self.generator))  # type: ignore[union-attr]
                    theta = {k: mean[k] + noise[k] for k in self.names}
                loss, g, h = self._estimates(closure, theta)
                loss = self._parallel.reduce(loss, g, h)
                loss_sum = loss_sum + loss
                g_sum = g if g_sum is None else {k: g_sum[k] + g[k] for k in g}
                h_sum = h if h_sum is None else add_curv(h_sum, h)
        g_avg = g_sum if n_mc == 1 else {k: v / n_mc for k, v in g_sum.items()}  # type: ignore[union-attr]
        h_avg = scale_curv(h_sum, 1.0 / n_mc)
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
            avg = self._avg if self._avg is not None else data_like(self.prior, 0.0)
            self._avg = blr_data_update(avg, h_avg, rho_avg)
        precond = assemble_posterior(mean, self.prior, self._data, extra=self.n_data * self.damping)
        new_mean = blr_mean_update(precond, d, lr, self.clip_radius)
        for k, p in params.items():
            p.copy_(new_mean[k])
        return loss_sum / n_mc  # type: ignore[return-value]

    def _check_finite(self, loss: Tensor, g: object, h: object) -> None:
        """DivergenceError naming the first non-finite quantity (one synchronisation; runs before any state changes)."""
        bad = first_bad(loss, g, h)
        if bad is not None:
            raise DivergenceError(f"BLR step {self._t + 1}: the minibatch {bad} is not finite (loss {float(loss)}); "
                                  "lower lr (α), or bound the step with damping or clip_radius")

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

    # ----- persistence -------------------------------------------------------------------------
    def state_dict(self) -> dict:  # type: ignore[override]
        """The optimiser's state, its tensors copied: the native diagonal step (``optim/native.py``) updates D, D̄
        and u in place, and a state held in memory must not follow later steps."""
        return {
            "prior": self.prior.state_dict(),
            "data": _copied(self._data),
            "average": _copied(self._avg),
            "n_estimates": self._n_est,
            "t": self._t,
            "momentum": _copied(self._momentum),
            "noise": self._pool.state_dict() if self._pool is not None else None,
            "coupling": None if self._coupling_cache is None else self._coupling_cache.clone(),
            "coupling_anchor": None if self._coupling_anchor is None else self._coupling_anchor.clone(),
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
        if self._pool is not None and state.get("noise") is not None:
            self._pool.load_state_dict(state["noise"])
        self._coupling_cache = state.get("coupling")  # absent (older states): recomputed on the next step
        self._coupling_anchor = state.get("coupling_anchor")
        for g, saved in zip(self.param_groups, state["param_groups"]):
            g.update(saved)


def _copied(state: object) -> object:
    """A ParamDict's tensors cloned (other state, e.g. a Kronecker data part, as it is)."""
    if isinstance(state, dict):
        return {k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items()}
    return state


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
