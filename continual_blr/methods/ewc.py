"""Elastic weight consolidation (Kirkpatrick et al. 2017) and online EWC (Schwarz et al. 2018).

After task k the diagonal Fisher of that task, as a *per-example mean*, is stored with the weights:

    F̄_k = (1/N_k) Σ_i diag(C_i(θ*_k))        C_i: per-example Fisher (named by ``fisher``)

and task t minimises the mean minibatch loss plus

    separate:  (λ/2) Σ_{k<t} Σ_j F̄_{k,j} (θ_j − θ*_{k,j})²                         (one term per past task)
    online:    (λ/2) Σ_j F̃_{t−1,j} (θ_j − θ*_{t−1,j})²,   F̃_k = γ F̃_{k−1} + F̄_k      (decayed running sum)

Scaling: the penalty is added to the *mean* loss and uses the *mean* Fisher, so λ = N_{k}/N_t is the
Bayesian (Laplace) weight of a past task; larger λ over-counts the past. Unlike Avalanche's EWCPlugin
the Fisher is built from per-example quantities, never from squared minibatch-mean gradients, and
the penalty carries the ½.

``fisher``: ``"ggn"`` — the exact Fisher of the softmax likelihood, Σ_i J_iᵀ(diag p_i − p_i p_iᵀ)J_i
(= the GGN); ``"empirical_fisher"`` — Σ_i g_i g_iᵀ at the observed labels; ``"mc_fisher"`` — one label
sampled from the model's predictive per example (Kirkpatrick et al.'s estimator).
The penalty is the shared :class:`~continual_blr.regularizers.weight_space.GaussianPrior`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..data.stream import TaskStream
from ..regularizers.weight_space import MODES, GaussianPrior
from ..types import Curvature, parse_enum
from .base import Method, TrainConfig

__all__ = ["EWCParams", "EWCMethod"]


@dataclass
class EWCParams:
    """Parameters of EWC.

    Attributes:
        lam: λ, the penalty strength (relative to the mean loss; see the module docstring).
        mode: ``"separate"`` (one term per past task) or ``"online"`` (decayed running Fisher).
        decay: γ of the online mode (1: plain sum).
        fisher: ``"ggn"`` (exact Fisher), ``"empirical_fisher"`` or ``"mc_fisher"``.
    """

    lam: float = 1000.0
    mode: str = "separate"
    decay: float = 1.0
    fisher: str = "ggn"

    def __post_init__(self) -> None:
        if not self.lam >= 0:
            raise ValueError(f"params.lam: must be >= 0, got {self.lam}")
        if self.mode not in MODES:
            raise ValueError(f"params.mode: got {self.mode!r}; allowed: {', '.join(map(repr, MODES))}")
        if not 0 <= self.decay <= 1:
            raise ValueError(f"params.decay: must be in [0, 1], got {self.decay}")
        f = parse_enum(Curvature, self.fisher, "params.fisher")
        if f == Curvature.HESSIAN:
            raise ValueError("params.fisher: 'hessian' is not a Fisher; allowed: 'ggn', 'empirical_fisher', 'mc_fisher'")


class EWCMethod(Method):
    """EWC: Adam on the mean loss + (λ/2) Σ F̄ (θ − θ*)² (module docstring)."""

    name = "ewc"

    def __init__(self, params: EWCParams | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.params = p = params or EWCParams()
        self.regularizer = GaussianPrior(
            structure="diag", curvature=p.fisher, mode=p.mode, scale=p.lam, divide_by_n=False,
            curvature_scale="mean", decay=p.decay, generator=self.generator,
        )

    def setup(self, model: nn.Module, stream: TaskStream, train: TrainConfig) -> None:
        self.regularizer.setup(model)
