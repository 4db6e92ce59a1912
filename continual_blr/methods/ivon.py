"""IVON (Shen et al. 2024) with a carried prior: our own IVON-form BLR, not the ``ivon-opt`` package.

IVON is the BLR with a diagonal Gaussian, one weight sample per step, the reparameterisation (Price)
curvature estimate ĥ = ĝ ∘ (θ − m) ∘ s from the same backward pass, IVON's positivity correction of
the Hessian average, a data-scale start ``hess_init`` and an elementwise clip of the step (Shen et al.
2024, Alg. 1). Its only limitation for continual learning is the prior: ``ivon-opt`` fixes it at
N(0, 1/(λ w)) inside the update, so a previous posterior N(m₀, diag s₀⁻¹) can only enter as a loss term,
and the package's Hessian state, counters and sampling do not survive a task boundary or a growing
model (see ``docs/methods_weight_space.md``). We therefore run IVON's recipe *inside*
:class:`~continual_blr.optim.blr.BayesianLearningRule`, where the prior's natural parameters replace IVON's
weight decay exactly (Khan & Rue 2023, eq. 46): with λ = ess_factor · N_t,

    D ← (1 − ρ) D + ρ ĥ + ½ ρ² (D − ĥ)² / (s₀ + D),    ρ = 1 − β₂,   D₀ = λ h₀ at each task start
    m ← m − α clip_r((s₀ + D)⁻¹ (ĝ + s₀ ∘ (m − m₀)))                 (with β₁-momentum on the direction)

which is IVON's Alg. 1 with s₀ in the place of its weight decay δ (the correction's denominator h + δ
there). D is the step's precision; what is carried is the debiased average D̄ of the task's estimates
ĥ alone, so q_t = N(m, s₀ + max(D̄, 0) / T) is the next prior: neither the start λ h₀ nor the correction's
upward bias ½ρE[(D − ĥ)²]/(s₀ + D) reaches it, and a head no example touched keeps its prior exactly
(:mod:`continual_blr.optim.blr`).

What this costs and buys (measured, ``benchmarks/results/perf/perf_blr.md`` and ``split_digits.md``): a step
is one forward and backward pass plus elementwise work, like IVON's; but a one-sample Price estimate of a
task's curvature is noisy (its spread is ~√N·|ĝ|/√h times the signal), so within the few hundred steps
of a task its D̄ is a much noisier carried precision than the GGN of the ``blr`` method (relative standard
deviation about √(ρ/2 · (N/B)·S/H) per coordinate).
"""

from __future__ import annotations

from dataclasses import dataclass

from .blr import BLRMethod, BLRParams

__all__ = ["IVONParams", "IVONMethod"]


@dataclass
class IVONParams:
    """Parameters of IVON with a carried prior (names as IVON's).

    Defaults: IVON's step (β₂ 0.999, h₀ 0.01, δ 100, clip 0.3) with ``carry: ggn``, T = 0.001 and ess 50, chosen
    on validation splits of split digits in the README quickstart's form
    (``benchmarks/results/search/search_defaults_split_digits.md``; ess 50 over 20 in the redone search,
    ``search_defaults_redo.md``): the carried average of one-sample Price estimates,
    clamped at 0 and divided by T, is precision that no data asked for (no T of the grid beat ``none`` in the
    task scenario with it); the GGN carry did, in both scenarios.

    Attributes:
        lr: α, IVON's learning rate (the mean step).
        ess_factor: λ = ess_factor · N_t, IVON's effective sample size.
        hess_init: h₀, the per-example curvature the data part starts from at every task (D₀ = λ h₀).
        beta1: momentum of the gradient.
        beta2: decay of the Hessian estimate (ρ = 1 − β₂).
        debias: the bias-corrected rate ρ_t = ρ / (1 − β₂ᵗ). Off, as in IVON: with ρ_t ≈ 1/t the first,
            noisiest one-sample Price estimates get the largest weights and the positivity correction
            ½ρ_t²(D − ĥ)²/D inflates D (measured: a 2-task synthetic stream's second task stays at chance).
        prior_precision: δ of the first prior N(0, δ⁻¹ I).
        temperature: T of the carried prior, S₀ ← S₀ + D / T (λ = 1/T as EWC's strength).
        clip_radius: IVON's elementwise clip of the preconditioned step.
        mc_samples: weight samples per step.
        predict_samples: MC samples at prediction (0: the mean network).
        fused_step: the update as one compiled loop (BLRParams.fused_step).
        carry: the next prior's data part: ``"average"`` (the Price estimates' average D̄), ``"ggn"`` (the
            diagonal GGN of the task's data at the mean) or ``"kfac"`` (a Kronecker-factored carried prior from
            the task's K-FAC GGN at the mean; ``BLRParams.carry``).
        carry_examples: examples of the ``"ggn"`` / ``"kfac"`` carry (None: all of the task's).
        kfac_terms, coupling_every, coupling_rank, coupling_correction_rank: the ``"kfac"`` carry's terms per
            layer (``"all"`` or ``"merged"``), the steps between recomputations of its coupling, the input factors'
            rank in it and in the correction between recomputations (``BLRParams``' fields of these names).
        noise, noise_refresh: the weight samples' ε, ``"gaussian"`` or ``"pooled"`` (``BLRParams.noise``).
    """

    lr: float = 0.03
    ess_factor: float = 50.0
    hess_init: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    debias: bool = False
    prior_precision: float = 100.0
    temperature: float = 0.001
    clip_radius: float | None = 0.3
    mc_samples: int = 1
    predict_samples: int = 0
    fused_step: bool = False
    carry: str = "ggn"
    carry_examples: int | None = None
    noise: str = "gaussian"
    noise_refresh: int = 64
    kfac_terms: str = "all"
    coupling_every: int = 1
    coupling_rank: int | None = None
    coupling_correction_rank: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.beta2 < 1:
            raise ValueError(f"params.beta2: must be in [0, 1), got {self.beta2}")
        self.blr_params()  # validates every other field with BLRParams' one-line errors

    def blr_params(self) -> BLRParams:
        """The BLR settings this IVON runs with."""
        return BLRParams(
            structure="diag", prior_precision=self.prior_precision, init_precision=None, lr=self.lr,
            rho=1.0 - self.beta2, beta1=self.beta1, mc_samples=self.mc_samples, ess_factor=self.ess_factor,
            predict_samples=self.predict_samples, temperature=self.temperature, clip_radius=self.clip_radius,
            curvature="price", precision_debias=self.debias, damping=0.0, init_hess=self.hess_init,
            fused_step=self.fused_step, carry=self.carry, carry_examples=self.carry_examples, noise=self.noise,
            noise_refresh=self.noise_refresh, kfac_terms=self.kfac_terms, coupling_every=self.coupling_every,
            coupling_rank=self.coupling_rank, coupling_correction_rank=self.coupling_correction_rank,
        )


class IVONMethod(BLRMethod):
    """IVON's recipe in the BLR with the previous posterior as its prior (module docstring)."""

    name = "ivon"

    def __init__(self, params: IVONParams | None = None, seed: int = 0) -> None:
        self.ivon_params = params or IVONParams()
        super().__init__(self.ivon_params.blr_params(), seed=seed)
