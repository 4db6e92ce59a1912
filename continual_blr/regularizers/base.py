"""The protocol every regulariser follows: how the past enters the training loss.

The training loop (``continual_blr.loop``) minimises, per minibatch,

    mean_i ℓ(f_θ(x_i), y_i) + Σ_r r.penalty(model, batch, task)

and calls ``on_task_start`` before the first step of a task and ``on_task_end`` after its last step.
Each regulariser documents its own scaling of ``penalty`` relative to the *mean* minibatch loss.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from ..data.stream import Task
from ..types import Batch, ParamDict

__all__ = ["Regularizer", "SumRegularizer"]


@runtime_checkable
class Regularizer(Protocol):
    """How the past enters the loss. ``penalty`` must be differentiable in the model's parameters."""

    def penalty(self, model: nn.Module, batch: Batch, task: Task, params: ParamDict | None = None) -> Tensor:
        """The term added to the mean minibatch loss for the current step.

        With ``params`` the penalty is evaluated at those parameter values (a functional call, so that
        ``torch.func`` transforms such as the BLR's per-example gradients can differentiate it);
        without, at the model's own parameters.
        """
        ...

    def on_task_start(self, model: nn.Module, task: Task) -> None:
        """Called once before training on ``task`` (e.g. FROMP rebuilds its kernels here)."""
        ...

    def on_task_end(self, model: nn.Module, task: Task) -> None:
        """Called once after training on ``task`` (e.g. store the posterior / memorable points)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...


class SumRegularizer:
    """The sum of several regularisers (each keeps its own state)."""

    def __init__(self, *parts: Regularizer) -> None:
        self.parts = list(parts)

    def penalty(self, model: nn.Module, batch: Batch, task: Task, params: ParamDict | None = None) -> Tensor:
        total = torch.zeros((), device=batch.x.device, dtype=batch.x.dtype)
        for r in self.parts:
            total = total + r.penalty(model, batch, task, params)
        return total

    def on_task_start(self, model: nn.Module, task: Task) -> None:
        for r in self.parts:
            r.on_task_start(model, task)

    def on_task_end(self, model: nn.Module, task: Task) -> None:
        for r in self.parts:
            r.on_task_end(model, task)

    def state_dict(self) -> dict[str, Any]:
        return {str(i): r.state_dict() for i, r in enumerate(self.parts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, r in enumerate(self.parts):
            r.load_state_dict(state[str(i)])
