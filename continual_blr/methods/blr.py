"""The BLR method: a VOGN / Kronecker BLR optimiser whose prior is the previous task's posterior.

Task t minimises the BLR objective E_q[Σ_i ℓ_i(θ)] + KL(q ‖ q_{t−1}) (Khan & Rue 2023, eq. 1 with
the prior p = q_{t−1}); the optimiser's natural-gradient update is in ``continual_blr.optim.blr``.
At the end of task t the optimiser's posterior becomes its prior: sequential Bayes under the
Gaussian approximation. With a diagonal posterior and weight sampling this is the natural-gradient
form of VCL (Nguyen et al. 2018).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..curvature import curvature as curvature_of
from ..data.stream import Task, TaskStream
from ..optim.blr import CURVATURES, BayesianLearningRule
from ..optim.noise import NOISES
from ..posteriors import DiagPosterior, GaussianPosterior, KronPosterior, kron_layers, load_posterior
from ..types import Structure, parse_enum
from .base import Method, TrainConfig

__all__ = ["BLRParams", "BLRMethod", "CARRIES", "KFAC_TERMS", "TASK_START_MEANS", "redraw_layers"]

CARRIES = ("average", "ggn", "kfac")
KFAC_TERMS = ("all", "merged")
TASK_START_MEANS = ("carry", "reinit")


@dataclass
class BLRParams:
    """Parameters of the BLR method.

    Attributes:
        structure: ``"diag"`` (VOGN) or ``"kron"`` (Kronecker BLR, Gauss–Newton projected per layer).
        prior_precision: δ of the first task's prior N(0, δ⁻¹ I).
        init_precision: the first task's starting precision of the step (a float; None: δ); a step-size device,
            not part of the carried posterior.
        lr: α, the mean step size.
        rho: ρ, the precision rate (1 − β₂ in VOGN's notation).
        beta1: momentum on the mean direction.
        mc_samples: weight samples per step (≥ 1).
        ess_factor: the effective sample size is ess_factor · N (> 1: the likelihood counts more, a colder
            posterior, as a tempered likelihood; < 1: a wider one).
        predict_samples: Monte-Carlo samples for predictions (0: the posterior mean).
        temperature: T of the carried prior. At the end of task t the precision the task added to its
            prior (the optimiser's carried data part D̄ ⪰ 0) is divided by T before it becomes the next prior,
            S₀⁽ᵗ⁺¹⁾ = S₀⁽ᵗ⁾ + D_t / T, as online Laplace's temperature (T = 1: plain sequential Bayes; T < 1:
            a colder, stronger memory; λ = 1/T is its EWC-like strength). Every structure: D/T of a
            Kronecker term is a Kronecker term.
        clip_radius: elementwise bound r on the preconditioned step (None: no bound). Where it binds at the
            fixed point it moves it (sampled steps are not symmetric); ``train_log.csv`` logs the clipped
            fraction per epoch. See :mod:`continual_blr.optim.blr`.
        curvature: ĥ of the step (named as in :mod:`continual_blr.optim.blr`): ``"ggn"`` (the exact
            Gauss–Newton JᵀΛJ), ``"price"`` (IVON's reparameterisation estimate from the same backward
            pass; diag only), ``"empirical_fisher"`` (VOGN's squared per-example gradients), ``"mc_fisher"``,
            or ``"gauss_newton"`` (the empirical Fisher through ``jacrev`` per-example gradients: the same
            diagonal, slower; Kronecker: nearest Kronecker product instead of K-FAC).
        precision_debias: the bias-corrected rate ρ_t = ρ / (1 − (1 − ρ)ᵗ) for the step's precision, t counted
            from the task's start: each task's first step sets D = ĥ (not with ``"price"``, whose step keeps the
            plain rate). The carried precision is always the debiased average of the task's estimates.
        damping: γ, added as N γ to the step's preconditioner only (per-example curvature units); the
            carried posterior and the fixed point do not depend on it.
        init_hess: h₀, the step's start D = N h₀ at every task's start, for every parameter (new heads
            included; per-example curvature units, like IVON's ``hess_init``); a step-size device that does
            not reach the carried posterior. None: keep ``init_precision``'s start for task 1 and D = 0 after.
        fused_step: diagonal structure: the update after the estimates as one compiled loop
            (``BayesianLearningRule(fused=True)``: the same algebra, fewer passes over memory; the Price
            step on CPU uses the native C loop of :mod:`continual_blr.optim.native`, built once per machine,
            else inductor, seconds per process; both need a C compiler). Off by default.
        carry: what becomes the next prior's data part at the end of a task: ``"average"`` (the optimiser's
            carried D̄, the debiased average of the step's estimates ĥ) or ``"ggn"`` (the diagonal GGN of the
            task's data at the posterior mean, D_t = (λ/n) Σ_{i∈subset} diag(J_iᵀ Λ_i J_i) with λ = ess_factor·N_t
            (``carry_examples`` n of the task's examples, drawn without replacement; all if None): the
            delta-method estimate of λ E_q[H] that a GGN-BLR's D̄ averages, with no sampling noise. With the
            one-sample Price estimate, D̄'s noise, clamped at 0 and divided by T, becomes precision that no
            data asked for; ``"ggn"`` replaces it by one pass over (a subset of) the data. Diagonal structure.
            ``"kfac"``: a **Kronecker-factored carried prior** under a diagonal step. The prior becomes
            S̃₀⁽ᵗ⁺¹⁾ = S̃₀⁽ᵗ⁾ + (λ/n) C_t / T with C_t the K-FAC GGN of the task's examples at the mean, per
            Linear / Conv2d layer A ⊗ G (A = mean ããᵀ, G = Σ_i Σ_c g_ic g_icᵀ; Martens & Grosse 2015; Ritter et
            al. 2018's online Laplace term), kept term by term (:class:`~continual_blr.posteriors.KronPosterior`),
            m₀ = m. Task t + 1 then runs the BLR of a mean-field q under that prior
            (``BayesianLearningRule.set_prior``'s ``coupling``): the mean's direction is ĝ + S̃₀(m − m₀), the
            precision and the weight samples diag(S̃₀) + D. What the diagonal carry loses — the correlations
            within a layer that let one task's weights move along directions another task does not use — is
            kept; the step's cost grows by one S̃₀ v per step (K Kronecker products per layer after K tasks).
            Diagonal structure.
        carry_examples: n, the examples of the ``"ggn"`` / ``"kfac"`` carry (None: all of the task's training
            data).
        kfac_terms: the ``"kfac"`` carry's terms per layer: ``"all"`` (each task's A_t ⊗ G_t kept, so the coupling
            costs K Kronecker products per layer per step after K tasks) or ``"merged"`` (after every task a
            layer's terms are replaced by their nearest Kronecker product in Frobenius norm,
            argmin ‖Σ_t A_t ⊗ G_t − A ⊗ G‖_F (:meth:`~continual_blr.posteriors.KronPosterior.merged`; Van Loan &
            Pitsianis 1993): one product per layer per step whatever the number of tasks — a different Gaussian
            prior, exact while a layer holds one term).
        coupling_every: k: the ``"kfac"`` coupling R(m − m₀) is recomputed on every k-th step of a task and reused
            on the others (``BayesianLearningRule(coupling_every=k)``): the pull is at most k − 1 steps stale, and
            at a fixed point, where m stops moving, it is the exact one, so the fixed point is unchanged; the
            coupling's cost is divided by k. The trajectory within a finite budget is not the same: a pull frozen
            for k − 1 steps is a delayed feedback, and on permuted MNIST k = 4 let the old tasks drift
            (``docs/methods_weight_space.md``).
        coupling_rank: r: the ``"kfac"`` coupling uses each input factor's r largest eigenpairs, the rest of the
            factor kept on the diagonal only (:meth:`~continual_blr.posteriors.KronPosterior.coupling`): the
            prior is then a different PSD precision S̃_r with the same diagonal diag(S̃₀) (so the same weight
            samples and precision), and the same fixed point as the exact coupling under S̃_r. The product costs
            O(d_out d_in r) instead of O(d_out d_in²); None (default): exact (S̃_r = S̃₀, as for r ≥ d_in).
        coupling_correction_rank: r (with ``coupling_every`` k > 1): on the steps between two recomputations the
            pull is R(m_s − m₀) + R_r(m − m_s), m_s the mean at the last recomputation and R_r the rank-r cut
            coupling (as ``coupling_rank``), instead of the stale R(m_s − m₀) (``BayesianLearningRule.set_prior``'s
            ``correction``): the cut errs on the change since m_s only, and at a fixed point (m = m_s) the pull
            is exact, so the fixed point is that of the recomputed coupling. None (default): reuse as it is.
        curvature_every: k: estimate ĥ on every k-th step only (diagonal structure, not ``"price"``), D updated
            there at the rate 1 − (1 − ρ)ᵏ; the other steps cost a forward and backward
            (``BayesianLearningRule(curvature_every=k)``; the fixed point is unchanged).
        noise: the weight samples' ε (diagonal structure): ``"gaussian"`` (a fresh N(0, I) draw per step) or
            ``"pooled"`` (a sign-randomised shift of a Gaussian pool redrawn every ``noise_refresh`` steps: 32 ×
            fewer generator draws, the same conditional mean and covariance; :mod:`continual_blr.optim.noise`).
        noise_refresh: steps between redraws of the ``"pooled"`` noise's pool.
        task_start_mean: where the mean m starts each task after the first (the prior is the same either way):
            ``"carry"`` (the previous task's posterior mean, m = m₀: a warm start) or ``"reinit"`` (the VOGN
            continual-learning reference's recipe: the weights of every covered Linear / Conv2d layer are drawn
            afresh, W_ij, b_i ~ U(−1/√fan_in, 1/√fan_in), PyTorch's default bound, from the method's generator,
            while the prior N(m₀, S₀⁻¹) stays the previous posterior). Task t still minimises
            E_q[Σ_i ℓ_i] + KL(q ‖ q_{t−1}); only the optimisation's starting point moves, so on a convex loss the
            fixed point is the same, and on a network's loss another one may be reached. Parameters of other
            layers keep their values. See :meth:`BLRMethod.on_task_start`.
    """

    structure: str = "diag"
    prior_precision: float = 100.0
    init_precision: float | None = None
    lr: float = 0.03
    rho: float = 0.05
    beta1: float = 0.9
    mc_samples: int = 1
    ess_factor: float = 20.0
    predict_samples: int = 0
    temperature: float = 0.01
    clip_radius: float | None = 0.3
    curvature: str = "ggn"
    precision_debias: bool = True
    damping: float = 0.0
    init_hess: float | None = None
    fused_step: bool = False
    curvature_every: int = 1
    carry: str = "average"
    carry_examples: int | None = None
    noise: str = "gaussian"
    noise_refresh: int = 64
    task_start_mean: str = "carry"
    kfac_terms: str = "all"
    coupling_every: int = 1
    coupling_rank: int | None = None
    coupling_correction_rank: int | None = None

    def __post_init__(self) -> None:
        s = parse_enum(Structure, self.structure, "params.structure")
        if self.task_start_mean not in TASK_START_MEANS:
            raise ValueError(f"params.task_start_mean: got {self.task_start_mean!r}; allowed: "
                             f"{', '.join(map(repr, TASK_START_MEANS))}")
        if self.noise not in NOISES:
            raise ValueError(f"params.noise: got {self.noise!r}; allowed: {', '.join(map(repr, NOISES))}")
        if self.noise == "pooled" and s != Structure.DIAG:
            raise ValueError("params.noise: 'pooled' needs structure 'diag'")
        if not (isinstance(self.noise_refresh, int) and self.noise_refresh >= 1):
            raise ValueError(f"params.noise_refresh: must be an integer >= 1, got {self.noise_refresh!r}")
        if self.carry not in CARRIES:
            raise ValueError(f"params.carry: got {self.carry!r}; allowed: {', '.join(map(repr, CARRIES))}")
        if self.carry in ("ggn", "kfac") and s != Structure.DIAG:
            raise ValueError(f"params.carry: {self.carry!r} needs structure 'diag'")
        if self.carry_examples is not None and not (isinstance(self.carry_examples, int) and self.carry_examples >= 1):
            raise ValueError(f"params.carry_examples: must be an integer >= 1 or null, got {self.carry_examples!r}")
        if self.kfac_terms not in KFAC_TERMS:
            raise ValueError(f"params.kfac_terms: got {self.kfac_terms!r}; allowed: {', '.join(map(repr, KFAC_TERMS))}")
        if not (isinstance(self.coupling_every, int) and not isinstance(self.coupling_every, bool)
                and self.coupling_every >= 1):
            raise ValueError(f"params.coupling_every: must be an integer >= 1, got {self.coupling_every!r}")
        if self.coupling_rank is not None and not (isinstance(self.coupling_rank, int)
                                                   and not isinstance(self.coupling_rank, bool)
                                                   and self.coupling_rank >= 1):
            raise ValueError(f"params.coupling_rank: must be an integer >= 1 or null, got {self.coupling_rank!r}")
        if self.coupling_correction_rank is not None and not (isinstance(self.coupling_correction_rank, int)
                                                              and not isinstance(self.coupling_correction_rank, bool)
                                                              and self.coupling_correction_rank >= 1):
            raise ValueError("params.coupling_correction_rank: must be an integer >= 1 or null, got "
                             f"{self.coupling_correction_rank!r}")
        if self.carry != "kfac" and (self.kfac_terms != "all" or self.coupling_every != 1
                                     or self.coupling_rank is not None or self.coupling_correction_rank is not None):
            field = ("kfac_terms" if self.kfac_terms != "all" else "coupling_every" if self.coupling_every != 1
                     else "coupling_rank" if self.coupling_rank is not None else "coupling_correction_rank")
            raise ValueError(f"params.{field}: applies to carry 'kfac' only (carry is {self.carry!r})")
        if self.coupling_correction_rank is not None and self.coupling_every == 1:
            raise ValueError("params.coupling_correction_rank: corrects the steps between recomputations; needs "
                             "coupling_every > 1 (got 1)")
        if self.curvature not in CURVATURES or self.curvature == "hessian":
            allowed = ", ".join(repr(c) for c in CURVATURES if c != "hessian")
            raise ValueError(f"params.curvature: got {self.curvature!r}; allowed: {allowed}")
        if s == Structure.FULL:
            raise ValueError("params.structure: 'full' is for small models; allowed here: 'diag', 'kron'")
        if not self.prior_precision > 0:
            raise ValueError(f"params.prior_precision: must be > 0, got {self.prior_precision}")
        if self.init_precision is not None and not self.init_precision > 0:
            raise ValueError(f"params.init_precision: must be > 0, got {self.init_precision}")
        if not self.ess_factor > 0:
            raise ValueError(f"params.ess_factor: must be > 0, got {self.ess_factor}")
        if not self.temperature > 0:
            raise ValueError(f"params.temperature: must be > 0, got {self.temperature}")
        if not self.damping >= 0:
            raise ValueError(f"params.damping: must be >= 0, got {self.damping}")
        if self.init_hess is not None and not self.init_hess > 0:
            raise ValueError(f"params.init_hess: must be > 0 or null, got {self.init_hess}")
        if self.curvature == "price":
            if s != Structure.DIAG:
                raise ValueError("params.curvature: 'price' is a diagonal estimator; allowed with structure 'diag'")
            if self.mc_samples < 1 or self.init_hess is None:
                raise ValueError("params.curvature: 'price' needs mc_samples >= 1 and init_hess > 0")
        if not (isinstance(self.curvature_every, int) and self.curvature_every >= 1):
            raise ValueError(f"params.curvature_every: must be an integer >= 1, got {self.curvature_every!r}")
        if self.curvature_every > 1 and (s != Structure.DIAG or self.curvature == "price"):
            raise ValueError("params.curvature_every: > 1 needs structure 'diag' and a curvature other than 'price'")
        if self.clip_radius is not None and not self.clip_radius > 0:
            raise ValueError(f"params.clip_radius: must be > 0 or null, got {self.clip_radius}")
        if self.predict_samples < 0:
            raise ValueError(f"params.predict_samples: must be >= 0, got {self.predict_samples}")


class BLRMethod(Method):
    """Bayesian learning rule over the stream, posterior → prior at every task boundary."""

    name = "blr"

    def __init__(self, params: BLRParams | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.params = params or BLRParams()
        self.optimizer: BayesianLearningRule | None = None
        self.kron_prior: KronPosterior | None = None  # the structured carried prior of ``carry: kfac``
        self.tasks_done = 0  # tasks whose posterior became the prior (on_task_end); saved with the method's state

    def _initial(self, model: nn.Module, precision: float) -> GaussianPosterior:
        zeros = {k: torch.zeros_like(p) for k, p in model.named_parameters() if p.requires_grad}
        if self.params.structure == "kron":
            return KronPosterior.isotropic(zeros, precision, kron_layers(model))
        return DiagPosterior(zeros, precision)

    def setup(self, model: nn.Module, stream: TaskStream, train: TrainConfig) -> None:
        p = self.params
        prior = self._initial(model, p.prior_precision)
        init = self._initial(model, p.init_precision) if p.init_precision is not None else None
        self.optimizer = BayesianLearningRule(
            model, prior, n_data=1, lr=p.lr, rho=p.rho, beta1=p.beta1, mc_samples=p.mc_samples,
            curvature=p.curvature, init_precision=init, generator=self.generator, clip_radius=p.clip_radius,
            debias=p.precision_debias, damping=p.damping, init_hess=p.init_hess, fused=p.fused_step,
            curvature_every=p.curvature_every, noise=p.noise, noise_refresh=p.noise_refresh,
            coupling_every=p.coupling_every,
        )
        if p.carry == "kfac":  # task 1's prior N(0, δ⁻¹ I) in Kronecker form (no terms: no coupling yet)
            names = list(self.optimizer.names)
            zeros = {k: torch.zeros_like(v) for k, v in prior.mean.items()}
            self.kron_prior = KronPosterior.isotropic(zeros, p.prior_precision, kron_layers(model, names))

    def make_optimizer(self, model: nn.Module, task: Task, train: TrainConfig) -> torch.optim.Optimizer:
        assert self.optimizer is not None, "setup() must run first"
        self.optimizer.n_data = max(1, round(self.params.ess_factor * task.n_train))
        return self.optimizer

    def on_task_start(self, model: nn.Module, task: Task) -> None:
        """With ``params.task_start_mean == "reinit"`` and a task after the first (``tasks_done`` ≥ 1), re-draw the
        mean: every covered Linear / Conv2d layer's weight and bias ~ U(−1/√fan_in, 1/√fan_in) from the method's
        generator (:func:`redraw_layers`). The prior N(m₀, S₀⁻¹) (the previous posterior) is not touched. With
        ``"carry"`` (the default) nothing happens and the mean starts at m₀."""
        super().on_task_start(model, task)
        if self.params.task_start_mean == "reinit" and self.tasks_done > 0:
            assert self.optimizer is not None, "setup() must run first"
            redraw_layers(model, set(self.optimizer.names), self.generator)

    def on_task_end(self, model: nn.Module, task: Task, optimizer=None) -> None:
        """The posterior becomes the next prior, its data part divided by T: S₀ ← S₀ + D / T, m₀ ← m."""
        super().on_task_end(model, task, optimizer)
        assert self.optimizer is not None
        self.tasks_done += 1
        if self.params.carry == "ggn":
            self.optimizer.set_prior(self.ggn_carry(model, task))
        elif self.params.carry == "kfac":
            self.kron_prior = self.kfac_carry(model, task)
            self._install_kron_prior()
        else:
            self.optimizer.set_prior(self.optimizer.posterior(temperature=self.params.temperature))

    def ggn_carry(self, model: nn.Module, task: Task) -> DiagPosterior:
        """N(m, S₀ + D_t / T) with D_t = (λ/n) Σ_{i∈subset} diag(J_iᵀ Λ_i J_i) at the mean m, λ = ess_factor·N_t
        (``params.carry``), Λ_i the output Hessian of the method's likelihood (``self.likelihood``, ``self.sigma``:
        diag(p_i) − p_i p_iᵀ for the softmax, I/σ² for a Gaussian). The subset is drawn with the method's generator (the same on every rank); under
        data parallel the engine shards it and sums over ranks."""
        assert self.optimizer is not None
        prior = self.optimizer.prior
        assert isinstance(prior, DiagPosterior)
        n = task.n_train
        x, y = task.x_train, task.y_train
        k = self.params.carry_examples
        if k is not None and k < n:
            idx = torch.randperm(n, generator=self.generator)[:k].to(x.device)
            x, y = x[idx], y[idx]
        names = list(self.optimizer.names)
        # the method's likelihood (Λ_i = I/σ² for a Gaussian stream; the softmax Hessian for classification):
        # without it a regression head's single output gets the softmax Λ = 0 and only the prior is carried
        c = curvature_of(model, x, y, kind="ggn", structure="diag", likelihood=self.likelihood, sigma=self.sigma,
                         head=task.head, param_names=names)
        scale = self.params.ess_factor * n / x.shape[0] / self.params.temperature
        mean = {k: p.detach().clone() for k, p in model.named_parameters() if k in prior.mean}
        return DiagPosterior(mean, {k: prior.precision[k] + scale * c[k] for k in prior.mean})  # type: ignore[index]

    def kfac_carry(self, model: nn.Module, task: Task) -> KronPosterior:
        """N(m, S̃₀ + (λ/n) C / T): the Kronecker carried prior with this task's K-FAC GGN C (``params.carry``) of n
        examples (all, or ``carry_examples`` drawn with the method's generator) at the mean m, λ = ess_factor·N_t,
        Λ_i the method's likelihood (as :meth:`ggn_carry`). Layers the old prior did not hold (new heads) start
        from its δ. With ``kfac_terms: merged`` each layer's terms become their nearest Kronecker product."""
        assert self.optimizer is not None and self.kron_prior is not None
        old = self.kron_prior
        names = list(self.optimizer.names)
        x, y = task.x_train, task.y_train
        n = task.n_train
        k = self.params.carry_examples
        if k is not None and k < n:
            idx = torch.randperm(n, generator=self.generator)[:k].to(x.device)
            x, y = x[idx], y[idx]
        c = curvature_of(model, x, y, kind="ggn", structure="kron", likelihood=self.likelihood, sigma=self.sigma,
                         head=task.head, param_names=names)
        scale = self.params.ess_factor * n / x.shape[0] / self.params.temperature
        mean = {k: p.detach().clone() for k, p in model.named_parameters() if k in names}
        terms = {w: t for w, _, t in old.blocks}
        blocks = [(w, b, terms.get(w, [])) for w, b in kron_layers(model, names)]
        in_blocks = {w for w, _, _ in blocks} | {b for _, b, _ in blocks if b is not None}
        diag = {k: old.diag[k] if k in old.diag else torch.zeros_like(mean[k]) for k in names if k not in in_blocks}
        carried = KronPosterior(mean, blocks, diag, old.delta).add_precision(c, scale)
        return carried.merged() if self.params.kfac_terms == "merged" else carried

    def _install_kron_prior(self) -> None:
        """The optimiser's prior becomes the Kronecker prior's diagonal, N(m₀, diag(S̃₀)⁻¹), with the coupling
        v ↦ (S̃₀ − diag(S̃₀)) v (``BayesianLearningRule.set_prior``); nothing to couple while it has no terms."""
        assert self.optimizer is not None and self.kron_prior is not None
        prior = self.kron_prior
        diag = prior.precision_diag()
        coupled = any(terms for _, _, terms in prior.blocks)
        coupling = prior.coupling(self.params.coupling_rank) if coupled else None  # exact, or S̃_r's (coupling_rank)
        r = self.params.coupling_correction_rank
        correction = prior.coupling(r) if coupled and r is not None else None
        self.optimizer.set_prior(DiagPosterior(dict(prior.mean), diag), coupling, correction)

    def epoch_stats(self) -> dict[str, float]:
        """``clipped_fraction``: the share of coordinate-steps the clip bounded in the epoch (with a clip only).
        The clip moves the fixed point where it binds once the mean has settled (see
        :mod:`continual_blr.optim.blr`), so the log shows how often it does."""
        if self.optimizer is None or self.optimizer.clip_radius is None:
            return {}
        frac = self.optimizer.pop_clipped_fraction()
        return {} if frac is None else {"clipped_fraction": frac}

    def posterior(self, model: nn.Module | None = None) -> GaussianPosterior:
        """The optimiser's posterior (its mean is the model's weights; ``model`` is accepted so that every
        method's ``posterior`` can be called the same way, as VCL's and IVON's need it)."""
        assert self.optimizer is not None
        return self.optimizer.posterior()

    @torch.no_grad()
    def predict_proba(self, model: nn.Module, x: Tensor, head: int) -> Tensor:
        if self.params.predict_samples == 0 or self.optimizer is None:
            return super().predict_proba(model, x, head)
        post = self.optimizer.posterior()
        probs = 0.0
        for _ in range(self.params.predict_samples):
            theta = post.sample(self.generator)
            probs = probs + torch.softmax(torch.func.functional_call(model, theta, (x,), {"head": head}), -1)
        return probs / self.params.predict_samples  # type: ignore[return-value]

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.optimizer is not None:
            state["posterior"] = self.optimizer.posterior().state_dict()
        state["tasks_done"] = self.tasks_done
        if self.kron_prior is not None:
            state["kron_prior"] = self.kron_prior.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the carried prior. A state and a method that disagree on ``carry: kfac`` are refused (one line):
        without its Kronecker prior a kfac run would go on from the diagonal alone, silently dropping the past
        tasks' correlations, and a diagonal method would silently start coupling."""
        kfac_state = "kron_prior" in state
        if kfac_state != (self.params.carry == "kfac") and (
                kfac_state or int(state.get("tasks_done", 1 if "posterior" in state else 0)) > 0):
            raise ValueError(f"params.carry: the saved state was made with carry "
                             f"{'kfac' if kfac_state else 'average or ggn'}, this method has {self.params.carry!r}")
        super().load_state_dict(state)
        if self.optimizer is not None and "posterior" in state:
            self.optimizer.set_prior(load_posterior(state["posterior"]))
        if self.optimizer is not None and "kron_prior" in state:
            self.kron_prior = KronPosterior.from_state_dict(state["kron_prior"])
            self._install_kron_prior()
        # states saved before the count existed were saved at a task's end, after at least one task
        self.tasks_done = int(state.get("tasks_done", 1 if "posterior" in state else 0))


def redraw_layers(model: nn.Module, names: set[str], generator: torch.Generator) -> list[str]:
    """Re-draw, in place, the weight and bias of every Linear / Conv2d layer whose weight is named in ``names``:
    W_ij, b_i ~ U(−1/√fan_in, 1/√fan_in), fan_in = W[0].numel() (PyTorch's default bound, the one
    :func:`continual_blr.models.build_model` draws from), from ``generator`` (no global RNG is read). Returns the
    names of the parameters drawn, in module order."""
    drawn: list[str] = []
    with torch.no_grad():
        for prefix, m in model.named_modules():
            if not isinstance(m, (nn.Linear, nn.Conv2d)) or f"{prefix}.weight" not in names:
                continue
            bound = 1.0 / math.sqrt(m.weight[0].numel())
            m.weight.uniform_(-bound, bound, generator=generator)
            drawn.append(f"{prefix}.weight")
            if m.bias is not None and f"{prefix}.bias" in names:
                m.bias.uniform_(-bound, bound, generator=generator)
                drawn.append(f"{prefix}.bias")
    return drawn
