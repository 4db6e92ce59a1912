"""Online Laplace (Ritter et al. 2018): the Laplace posterior after task t is the prior of task t+1.

With S_0 = δ I, m_0 = 0, and C_t the GGN of the summed loss Σ_i ℓ_i of task t at its MAP θ*_t:

    task t:   θ*_t = argmin_θ  (1/N_t) Σ_i ℓ_i(θ) + (1/(2 N_t)) (θ − m_{t−1})ᵀ S_{t−1} (θ − m_{t−1})
    then:     m_t = θ*_t,      S_t = S_{t−1} + C_t / T

The penalty is the negative log prior divided by N_t because the loop minimises the *mean* loss (so
the objective is (1/N_t) × the negative log joint and its minimiser is the MAP). T is a tempering
factor on the curvature: T = 1 is sequential Bayes under the Laplace approximation; T < 1 sharpens
the carried posterior (Ritter et al.'s λ = 1/T). Structures of S (``structure``):

* ``diag``: S = δI + Σ_t diag(C_t)/T — the exact diagonal of the GGN, off-diagonals dropped.
* ``kron``: per Linear/Conv2d layer S = δI + Σ_t (A_t ⊗ G_t)/T with K-FAC factors
  A_t = (1/N_t) Σ_i ã_i ã_iᵀ, G_t = Σ_i Σ_c g_ic g_icᵀ (``continual_blr.curvature``); the sum over tasks
  is kept term by term (the penalty only needs S v), cross-layer blocks are dropped. Exact for one
  example through a layer; otherwise K-FAC's E[ããᵀ ⊗ ggᵀ] ≈ E[ããᵀ] ⊗ E[ggᵀ].
* ``full``: S = δI + Σ_t C_t/T dense — exact, for small models or ``subset: last_layer``.

``subset: last_layer`` keeps the Gaussian over the output layer only (all heads of a multi-head
network); the body is then trained without a penalty. The penalty is the shared
:class:`~continual_blr.regularizers.weight_space.GaussianPrior`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..data.stream import TaskStream
from ..posteriors import GaussianPosterior
from ..regularizers.weight_space import GaussianPrior
from ..types import Curvature, Structure, parse_enum
from .base import Method, TrainConfig

__all__ = ["LaplaceParams", "LaplaceMethod", "SUBSETS"]

SUBSETS = ("all", "last_layer")


@dataclass
class LaplaceParams:
    """Parameters of online Laplace.

    Defaults: δ = 1e-6 and T = 0.01, chosen on validation splits of split digits in the README quickstart's form
    (``benchmarks/results/search/search_defaults_split_digits.md``): the only T of the grid above ``none`` in both the
    task and the class scenario. A δ of order 1 is not harmless under Adam: once a task's data gradient has
    vanished, Adam rescales the prior's small pull toward 0 into steps of size lr (δ = 1: 88.9 against none's 95.9
    in the task scenario, with no carried curvature at all).

    Attributes:
        structure: ``"diag"``, ``"kron"`` (K-FAC) or ``"full"`` (small models / last layer).
        prior_precision: δ of the first prior N(0, δ⁻¹ I).
        temperature: T; the carried precision adds C_t / T (T < 1: a colder, stronger prior).
        curvature: ``"ggn"`` (default), ``"empirical_fisher"`` or ``"mc_fisher"``.
        subset: ``"all"`` parameters or the ``"last_layer"``.
    """

    structure: str = "kron"
    prior_precision: float = 1e-6
    temperature: float = 0.01
    curvature: str = "ggn"
    subset: str = "all"

    def __post_init__(self) -> None:
        parse_enum(Structure, self.structure, "params.structure")
        if not self.prior_precision > 0:
            raise ValueError(f"params.prior_precision: must be > 0, got {self.prior_precision}")
        if not self.temperature > 0:
            raise ValueError(f"params.temperature: must be > 0, got {self.temperature}")
        c = parse_enum(Curvature, self.curvature, "params.curvature")
        if c == Curvature.HESSIAN:
            raise ValueError("params.curvature: allowed: 'ggn', 'empirical_fisher', 'mc_fisher'")
        if self.subset not in SUBSETS:
            raise ValueError(f"params.subset: got {self.subset!r}; allowed: {', '.join(map(repr, SUBSETS))}")


class LaplaceMethod(Method):
    """Online Laplace: Adam on (1/N_t)·(negative log joint); posterior → prior (module docstring)."""

    name = "laplace"

    def __init__(self, params: LaplaceParams | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.params = p = params or LaplaceParams()
        self.regularizer = GaussianPrior(
            structure=p.structure, curvature=p.curvature, mode="online", scale=1.0, divide_by_n=True,
            curvature_scale=1.0 / p.temperature, prior_precision=p.prior_precision,
            param_names="last_layer" if p.subset == "last_layer" else None, generator=self.generator,
        )

    def setup(self, model: nn.Module, stream: TaskStream, train: TrainConfig) -> None:
        self.regularizer.setup(model)

    def posterior(self, model: nn.Module | None = None) -> GaussianPosterior | None:
        """The carried Laplace posterior N(m_t, S_t⁻¹) (``model`` unused; see :meth:`BLRMethod.posterior`)."""
        return self.regularizer.posterior()
