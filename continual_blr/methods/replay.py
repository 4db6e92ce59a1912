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

Task-end selection (``selection`` one of :data:`TASK_END_SELECTIONS`, a buffer policy apart from the stream
rules): the buffer takes nothing during a task; when task t ends its M slots are shared over every (task, class)
group seen (⌊M/G⌋ each, the remainder to the newest groups, as FROMP's ``share_memory``), each old group keeps the
first examples of its list, and the task's classes get their share chosen from all of its training data by the
rule of :func:`continual_blr.memory.select_per_class`: ``lambda`` (top tr Λ), ``random`` (uniform per class),
``sensitivity`` (top memory-perturbation sensitivity ‖J Σ Jᵀ e‖₁) or ``stratified`` (one random draw per stratum
of the sensitivity range). The sensitivity's Σ = diag(1 / (F + δ)) is the task's diagonal Laplace–GGN posterior
(F of the task's data at its end, δ = ``prior_precision``): one diagonal GGN pass over the task's data, which also
gives the per-example J Σ Jᵀ (:mod:`continual_blr.curvature.prediction_covariance`). During task t the replay
draws come from tasks < t only. DER++ stores each chosen example's logits at the task's end (the network that
finished the task, in its current mode, as ``after_step`` does).

Stored logits. The paper stores the logits of the training forward, before the step; here they are
computed (``no_grad``, the model's training mode) for the examples the buffer keeps, right after the step
on that minibatch — the same network up to one optimiser step, and only the kept examples are evaluated.

Multi-head streams: each stored example keeps its head, and a replay draw runs one forward per head.

``train.augment`` (:mod:`continual_blr.data.augment`): the buffer stores the minibatch's images as drawn (the loop
hands :meth:`after_step` the un-augmented batch, as the DER code stores its non-augmented inputs) and every replay
draw is augmented afresh from the method's own generator (``replay_augment``; checkpoints keep its state).

Data parallel (``continual_blr.distributed``): ``train_step`` hands :meth:`after_step` the global minibatch on
every rank, and the buffer's generator is in the same state on every rank, so every rank keeps an identical
buffer and draws identical replay examples. The replay terms are then the same on every rank, like a penalty:
with the loop's weights b_r / B summing to one they enter the all-reduced gradient exactly once (each rank
evaluates them in full; they are not sharded).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..data.augment import ReplayAugment
from ..data.stream import Task, TaskStream
from ..memory import SELECTIONS, select_per_class, selection_scores, share_budget
from ..replay_buffer import BUFFER_SELECTIONS, ReplayBuffer, ReplaySample
from ..types import Batch
from .base import Method, TrainConfig, mean_nll

__all__ = ["ERParams", "DERPPParams", "ERMethod", "DERPPMethod", "replay_nll", "TASK_END_SELECTIONS",
           "REPLAY_SELECTIONS"]

TASK_END_SELECTIONS = tuple(s for s in SELECTIONS if s != "lowest")
"""Buffer rules applied when a task ends, by measured value or at random per class (module docstring)."""
REPLAY_SELECTIONS = BUFFER_SELECTIONS + TASK_END_SELECTIONS
"""Every ``selection`` of ``er`` / ``derpp``: the stream rules (reservoir, class-balanced) and the task-end ones."""


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
        selection: which examples the buffer keeps — from the stream: ``"reservoir"`` | ``"class_balanced"``; at
            each task's end (module docstring): ``"lambda"`` | ``"random"`` | ``"sensitivity"`` | ``"stratified"``.
        replay_batch_size: k, stored examples replayed per step (None: the training batch size).
        alpha: α, the weight of the replay term.
        prior_precision: δ of the sensitivity's Σ = diag(1 / (F + δ)) (``"sensitivity"`` / ``"stratified"`` only).
    """

    memory_size: int = 200
    selection: str = "reservoir"
    replay_batch_size: int | None = None
    alpha: float = 1.0
    prior_precision: float = 1e-3

    def __post_init__(self) -> None:
        if self.memory_size < 1:
            raise ValueError(f"params.memory_size: must be >= 1, got {self.memory_size}")
        if self.selection not in REPLAY_SELECTIONS:
            raise ValueError(f"params.selection: got {self.selection!r}; allowed: "
                             f"{', '.join(map(repr, REPLAY_SELECTIONS))}")
        if not self.prior_precision > 0:
            raise ValueError(f"params.prior_precision: must be > 0, got {self.prior_precision}")
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
        self.replay_augment = ReplayAugment(seed + 15485863)  # train.augment on the replayed draws

    def _new_buffer(self) -> ReplayBuffer:
        policy = "task_end" if self.task_end else self.params.selection
        return ReplayBuffer(self.params.memory_size, policy, seed=self.seed + 104729)

    @property
    def task_end(self) -> bool:
        """Whether the buffer is written at each task's end (a task-end selection) instead of from the stream."""
        return self.params.selection in TASK_END_SELECTIONS

    def setup(self, model: nn.Module, stream: TaskStream, train: TrainConfig) -> None:
        """Start from an empty buffer; the replay batch defaults to the training batch size."""
        super().setup(model, stream, train)
        self.buffer = self._new_buffer()
        self._batch_size = int(train.batch_size)
        self.replay_augment.reset(train.augment)

    @property
    def replay_batch_size(self) -> int:
        return int(self.params.replay_batch_size or self._batch_size)

    def _draw(self, k: int) -> list[ReplaySample]:
        """k stored examples drawn for replay, their inputs augmented under ``train.augment`` (stored as drawn)."""
        draws = self.buffer.sample(k)
        if self.replay_augment.mode == "off":
            return draws
        return [replace(d, x=self.replay_augment(d.x)) for d in draws]

    def _replay_nll(self, model: nn.Module, k: int) -> Tensor | None:
        """(1/k) Σ_j ℓ(f_θ(x_j), y_j) over k stored examples (None while the buffer is empty)."""
        return replay_nll(model, [(d.x, d.y, d.head) for d in self._draw(k)], self.likelihood, self.sigma)

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
        if self.task_end:
            return

        def logits(idx: Tensor) -> Tensor:
            return model(batch.x[idx], head=batch.head).detach()

        self.buffer.add(batch.x, batch.y, batch.head, task.task_id, logits if self.keeps_logits else None)

    def on_task_end(self, model: nn.Module, task: Task, optimizer: torch.optim.Optimizer | None = None) -> None:
        """A task-end selection rewrites the buffer: the old (task, class) groups shrink to their share of M, the
        task's classes get theirs, chosen by the rule (module docstring); stream rules do nothing here."""
        super().on_task_end(model, task, optimizer)
        if not self.task_end:
            return
        old = self.buffer.stored()
        groups: list[tuple[int, int]] = []
        if old is not None:
            keys = list(zip(old[3].tolist(), old[1].reshape(old[1].shape[0], -1)[:, 0].tolist()))
            groups = list(dict.fromkeys(keys))  # in stored order: tasks, then classes
        new_classes = sorted(int(c) for c in torch.unique(task.y_train).tolist())
        quota, share_new = share_budget(groups, len(new_classes), self.params.memory_size)
        parts: list[tuple[Tensor, ...]] = []
        if old is not None:
            keep = []
            for grp in groups:
                pos = [i for i, k in enumerate(keys) if k == grp][: quota[grp]]
                keep += pos
            k_idx = torch.tensor(keep, dtype=torch.long, device=old[0].device)
            parts.append(tuple(None if t is None else t[k_idx] for t in old))
        if share_new > 0:
            scores, _ = selection_scores(model, task.x_train, task.y_train, selection=self.params.selection,
                                         head=task.head, prior_precision=self.params.prior_precision)
            idx = select_per_class(scores, task.y_train.to(scores.device), share_new,
                                   selection=self.params.selection, generator=self.buffer.generator)
            idx = idx.to(task.x_train.device)
            x, y = task.x_train[idx], task.y_train[idx]
            n = int(idx.numel())
            targets = None
            if self.keeps_logits:
                with torch.no_grad():
                    targets = torch.cat([model(x[s:s + 1024], head=task.head).detach() for s in range(0, n, 1024)])
            parts.append((x, y, torch.full((n,), int(task.head), dtype=torch.long),
                          torch.full((n,), int(task.task_id), dtype=torch.long), targets))
        if not parts:
            return
        dev = parts[0][0].device
        cat = [torch.cat([p[j].to(dev) for p in parts]) if parts[0][j] is not None else None for j in range(5)]
        self.buffer.assign(*cat)

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
            draws = self._draw(k)
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
