"""L2 to the previous weights: the curvature-free baseline of the weight-space family.

Task t minimises the mean minibatch loss plus

    (λ/2) Σ_j u_j (θ_j − θ*_{t−1,j})²,    u_j = 1 if a past task's loss depends on θ_j, else 0

i.e. an isotropic Gaussian prior centred at the last task's weights (the identity in place of the
Fisher of EWC). The mask u leaves the heads of tasks not yet seen free in the multi-head setting
(they would otherwise be pulled to their random initialisation). Scaling: added to the *mean* loss,
no 1/N. The penalty is the shared :class:`~continual_blr.regularizers.weight_space.GaussianPrior`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..data.stream import TaskStream
from ..regularizers.weight_space import IDENTITY, GaussianPrior
from .base import Method, TrainConfig

__all__ = ["L2Params", "L2Method"]


@dataclass
class L2Params:
    """Parameters of the L2 baseline.

    Attributes:
        lam: λ, the strength of the pull to the previous task's weights (relative to the mean loss).
    """

    lam: float = 1.0

    def __post_init__(self) -> None:
        if not self.lam >= 0:
            raise ValueError(f"params.lam: must be >= 0, got {self.lam}")


class L2Method(Method):
    """Adam on the mean loss + (λ/2) ‖u ∘ (θ − θ*_{t−1})‖² (module docstring)."""

    name = "l2"

    def __init__(self, params: L2Params | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.params = params or L2Params()
        self.regularizer = GaussianPrior(structure="diag", curvature=IDENTITY, mode="online",
                                         scale=self.params.lam, divide_by_n=False)

    def setup(self, model: nn.Module, stream: TaskStream, train: TrainConfig) -> None:
        self.regularizer.setup(model)
