"""A method of your own, outside the package: weight decay toward zero on top of the mean loss.

Name this file in a run config's ``imports: [my_methods.py]`` (or ``continual-blr run --import my_methods.py``);
the run records it, so ``--resume``, ``predict`` and ``inspect`` import it again. See ``docs/own_method.md``.
"""

from dataclasses import dataclass

from torch import Tensor, nn

from continual_blr.data.stream import Task
from continual_blr.methods import Method, register
from continual_blr.types import Batch


@dataclass
class L2DecayParams:
    """Parameters of ``l2-decay``.

    Attributes:
        decay: c, the weight of c · Σ θ² added to the mean loss (no pull toward the past: a baseline).
    """

    decay: float = 1e-3

    def __post_init__(self) -> None:
        if not self.decay >= 0:
            raise ValueError(f"params.decay: must be >= 0, got {self.decay}")


class L2DecayMethod(Method):
    """Adam on the mean loss + c · Σ θ² (weight decay toward zero; forgets like fine-tuning)."""

    name = "l2-decay"

    def __init__(self, params: L2DecayParams | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.params = params or L2DecayParams()

    def loss(self, model: nn.Module, batch: Batch, task: Task) -> Tensor:
        penalty = sum((p**2).sum() for p in model.parameters() if p.requires_grad)
        return super().loss(model, batch, task) + self.params.decay * penalty


register("l2-decay", L2DecayMethod, L2DecayParams)
