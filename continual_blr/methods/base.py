"""What a continual-learning method is: a posterior / regulariser / optimiser choice plugged into the
one training loop (``continual_blr.loop``).

A method is *not* a training loop. It answers the loop's questions:

* ``make_optimizer`` — which optimiser trains this task (Adam by default; a BLR optimiser whose
  prior is the previous posterior for Bayesian methods);
* ``regularizer`` — how the past enters the loss (``penalty``), refreshed by ``on_task_start`` /
  ``on_task_end``;
* ``loss`` — the minibatch objective (mean cross-entropy + penalty by default);
* ``train_tasks`` — which tasks' data are trained on now (just the current one, or all seen ones
  for the joint-training upper bound);
* ``predict_proba`` — how predictions are made (the network's softmax, or a Monte-Carlo average
  under the posterior).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..data.stream import Task, TaskStream
from ..regularizers.base import Regularizer
from ..types import Batch

__all__ = ["Method", "TrainConfig", "make_torch_optimizer", "OPTIMIZERS"]

OPTIMIZERS = ("adam", "sgd")


@dataclass
class TrainConfig:
    """How each task is trained.

    Attributes:
        epochs: passes over each task's training data.
        batch_size: minibatch size.
        lr: learning rate of the (non-BLR) optimiser.
        optimizer: ``"adam"`` or ``"sgd"``.
        grad_clip: clip the gradient norm to this value (None: off).
        eval_batch_size: minibatch size for evaluation.
    """

    epochs: int = 10
    batch_size: int = 32
    lr: float = 1e-3
    optimizer: str = "adam"
    grad_clip: float | None = None
    eval_batch_size: int = 1024

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "eval_batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"train.{name}: must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"train.lr: must be > 0, got {self.lr}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"train.optimizer: got {self.optimizer!r}; allowed: {', '.join(map(repr, OPTIMIZERS))}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"train.grad_clip: must be > 0 or null, got {self.grad_clip}")


def make_torch_optimizer(params, train: TrainConfig) -> torch.optim.Optimizer:
    """Adam or SGD over ``params`` with ``train.lr``."""
    if train.optimizer == "adam":
        return torch.optim.Adam(params, lr=train.lr)
    return torch.optim.SGD(params, lr=train.lr)


class Method:
    """Fine-tuning: no regulariser, the network's own predictions (the ``"none"`` baseline).

    Subclasses override the hooks they need. ``self.generator`` is the method's own random stream.
    """

    name = "none"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed + 7919)
        self.regularizer: Regularizer | None = None

    # called once by run_stream before the first task
    def setup(self, model: nn.Module, stream: TaskStream, train: TrainConfig) -> None:
        """Prepare state that depends on the model (e.g. an initial prior)."""

    def make_optimizer(self, model: nn.Module, task: Task, train: TrainConfig) -> torch.optim.Optimizer:
        """The optimiser for ``task`` (fresh Adam/SGD by default)."""
        return make_torch_optimizer(model.parameters(), train)

    def train_tasks(self, task: Task, seen: list[Task]) -> list[Task]:
        """Tasks whose training data are used now (``seen`` includes ``task``)."""
        return [task]

    def loss(self, model: nn.Module, batch: Batch, task: Task) -> Tensor:
        """Mean cross-entropy of the minibatch plus the regulariser's penalty."""
        loss = F.cross_entropy(model(batch.x, head=batch.head), batch.y)
        if self.regularizer is not None:
            loss = loss + self.regularizer.penalty(model, batch, task)
        return loss

    def on_task_start(self, model: nn.Module, task: Task) -> None:
        if self.regularizer is not None:
            self.regularizer.on_task_start(model, task)

    def on_task_end(self, model: nn.Module, task: Task, optimizer: torch.optim.Optimizer | None = None) -> None:
        if self.regularizer is not None:
            self.regularizer.on_task_end(model, task)

    @torch.no_grad()
    def predict_proba(self, model: nn.Module, x: Tensor, head: int) -> Tensor:
        """Class probabilities for inputs ``x`` on output ``head``."""
        return torch.softmax(model(x, head=head), dim=-1)

    def state_dict(self) -> dict[str, Any]:
        return {"regularizer": self.regularizer.state_dict() if self.regularizer is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.regularizer is not None and state.get("regularizer") is not None:
            self.regularizer.load_state_dict(state["regularizer"])
