"""Replay baselines: experience replay (``er``) and DER++ (``derpp``) from a fixed-size buffer.

Both keep a :class:`~continual_blr.replay_buffer.ReplayBuffer` of M = ``memory_size`` examples in all,
filled during training from every minibatch (after the step: :meth:`Method.after_step`), by reservoir or
class-balanced reservoir sampling, and add replay terms to the minibatch loss:

* **ER** (experience replay; Chaudhry et al. 2019, "On tiny episodic memories", Sec. 3; Mammoth's ``er``):

      L(θ) = (1/B) Σ_{i∈batch} ℓ(f_θ(x_i), y_i) + α (1/k) Σ_{j∈replay} ℓ(f_θ(x_j), y_j),

  with k = ``replay_batch_size`` stored examples drawn uniformly without replacement at every step.
  α = 1 with k = B is the paper's update on the concatenated batch up to the 1/(B + k) normalisation.
* **DER++** (Buzzega et al., NeurIPS 2020, Eq. 6): the buffer also keeps the logits z = f_θ(x) the network
  gave each stored example when it was stored, and

      L(θ) = (1/B) Σ_i ℓ(f_θ(x_i), y_i) + α (1/(kK)) Σ_{j∈replay₁} ‖f_θ(x_j) − z_j‖² + β (1/k) Σ_{j∈replay₂} ℓ(f_θ(x_j), y_j),

  two independent replay draws of k examples (K outputs per head; the squared error is averaged over
  examples and outputs as ``F.mse_loss`` does). With β = 0 this is DER (Eq. 4).

Stored logits. The paper stores the logits of the training forward, before the step; here they are
computed (``no_grad``, the model's training mode) for the examples the buffer keeps, right after the step
on that minibatch — the same network up to one optimiser step, and only the kept examples are evaluated.

Multi-head streams: each stored example keeps its head, and a replay draw runs one forward per head.

Data parallel (``continual_blr.distributed``): ``train_step`` hands :meth:`after_step` the global minibatch on
every rank, and the buffer's generator is in the same state on every rank, so every rank keeps an identical
buffer and draws identical replay examples. The replay terms are then the same on every rank, like a penalty:
with the loop's weights b_r / B summing to one they enter the all-reduced gradient exactly once (each rank
evaluates them in full; they are not sharded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..data.stream import Task, TaskStream
from ..replay_buffer import BUFFER_SELECTIONS, ReplayBuffer
from ..types import Batch
from .base import Method, TrainConfig, mean_nll

__all__ = ["ERParams", "DERPPParams", "ERMethod", "DERPPMethod", "replay_nll"]


def replay_nll(model: nn.Module, groups: list[tuple[Tensor, Tensor, int]], likelihood: str = "classification",
               sigma: float = 1.0) -> Tensor | None:
    """(1/n) Σ_j ℓ(f_θ(x_j), y_j) over the stored examples of ``groups`` — ``(x, y, head)`` triples, one forward per
    group — n examples in all; None when there are none."""
    n = sum(int(y.shape[0]) for _, y, _ in groups)
    if n == 0:
        return None
    return sum(mean_nll(model(x, head=head), y, likelihood, sigma) * (y.shape[0] / n) for x, y, head in groups)


@dataclass
class ERParams:
    """Experience replay.

    Attributes:
        memory_size: M, stored examples in all (over every task).
        selection: ``"reservoir"`` | ``"class_balanced"`` — which examples the buffer keeps.
        replay_batch_size: k, stored examples replayed per step (None: the training batch size).
        alpha: α, the weight of the replay term.
    """

    memory_size: int = 200
    selection: str = "reservoir"
    replay_batch_size: int | None = None
    alpha: float = 1.0

    def __post_init__(self) -> None:
        if self.memory_size < 1:
            raise ValueError(f"params.memory_size: must be >= 1, got {self.memory_size}")
        if self.selection not in BUFFER_SELECTIONS:
            raise ValueError(f"params.selection: got {self.selection!r}; allowed: "
                             f"{', '.join(map(repr, BUFFER_SELECTIONS))}")
        if self.replay_batch_size is not None and self.replay_batch_size < 1:
            raise ValueError(f"params.replay_batch_size: must be >= 1 or null, got {self.replay_batch_size}")
        if not self.alpha >= 0:
            raise ValueError(f"params.alpha: must be >= 0, got {self.alpha}")


@dataclass
class DERPPParams(ERParams):
    """DER++: replay of stored logits (weight α) and stored labels (weight β).

    Attributes:
        alpha: α, the weight of the logit-matching term (the DER paper's α).
        beta: β, the weight of the label term (0: DER).
    """

    alpha: float = 0.3
    beta: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.beta >= 0:
            raise ValueError(f"params.beta: must be >= 0, got {self.beta}")


class ERMethod(Method):
    """Experience replay from a reservoir (or class-balanced) buffer of ``memory_size`` examples."""

    name = "er"
    keeps_logits = False

    def __init__(self, params: ERParams | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.params = params or ERParams()
        self.buffer = self._new_buffer()
        self._batch_size = 32

    def _new_buffer(self) -> ReplayBuffer:
        return ReplayBuffer(self.params.memory_size, self.params.selection, seed=self.seed + 104729)

    def setup(self, model: nn.Module, stream: TaskStream, train: TrainConfig) -> None:
        """Start from an empty buffer; the replay batch defaults to the training batch size."""
        super().setup(model, stream, train)
        self.buffer = self._new_buffer()
        self._batch_size = int(train.batch_size)

    @property
    def replay_batch_size(self) -> int:
        return int(self.params.replay_batch_size or self._batch_size)

    def _replay_nll(self, model: nn.Module, k: int) -> Tensor | None:
        """(1/k) Σ_j ℓ(f_θ(x_j), y_j) over k stored examples (None while the buffer is empty)."""
        return replay_nll(model, [(d.x, d.y, d.head) for d in self.buffer.sample(k)], self.likelihood, self.sigma)

    def loss(self, model: nn.Module, batch: Batch, task: Task) -> Tensor:
        """The minibatch's mean NLL plus α times the replayed examples' mean NLL (module docstring)."""
        loss = super().loss(model, batch, task)
        if self.params.alpha > 0:
            replay = self._replay_nll(model, self.replay_batch_size)
            if replay is not None:
                loss = loss + self.params.alpha * replay
        return loss

    @torch.no_grad()
    def after_step(self, model: nn.Module, batch: Batch, task: Task) -> None:
        """Offer the (global) minibatch to the buffer; DER++ also stores the kept examples' logits."""
        def logits(idx: Tensor) -> Tensor:
            return model(batch.x[idx], head=batch.head).detach()

        self.buffer.add(batch.x, batch.y, batch.head, task.task_id, logits if self.keeps_logits else None)

    def memory_stats(self) -> dict[str, Any]:
        return {"stored_examples": self.buffer.size, "stored_bytes": self.buffer.nbytes(),
                "memory_size": self.params.memory_size, "selection": self.params.selection}

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"buffer": self.buffer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state.get("buffer") is not None:
            self.buffer.load_state_dict(state["buffer"])


class DERPPMethod(ERMethod):
    """DER++: replay of stored logits (α) and labels (β) from a reservoir buffer."""

    name = "derpp"
    keeps_logits = True
    params: DERPPParams

    def __init__(self, params: DERPPParams | None = None, seed: int = 0) -> None:
        super().__init__(params or DERPPParams(), seed)

    def loss(self, model: nn.Module, batch: Batch, task: Task) -> Tensor:
        """Mean NLL + α · mean squared logit error + β · mean replayed NLL (module docstring, DER++ Eq. 6)."""
        loss = Method.loss(self, model, batch, task)
        k = self.replay_batch_size
        if self.params.alpha > 0:
            draws = self.buffer.sample(k)
            n = sum(int(d.y.shape[0]) for d in draws)
            for d in draws:
                assert d.targets is not None
                err = F.mse_loss(model(d.x, head=d.head), d.targets)
                loss = loss + self.params.alpha * err * (d.y.shape[0] / n)
        if self.params.beta > 0:
            replay = self._replay_nll(model, k)
            if replay is not None:
                loss = loss + self.params.beta * replay
        return loss
