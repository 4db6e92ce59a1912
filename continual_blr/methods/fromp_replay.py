"""FROMP with replay of its memorable points (``fromp-replay``): one memory of M points in all, used twice.

The memory is FROMP's (:mod:`continual_blr.regularizers.functional`) with a total budget: after each task
the M = ``memory_size`` points are shared over every (task, class) group seen so far
(:meth:`FunctionalRegularizer.share_memory`) and the task's share is chosen per class by ``selection``: by
memorability, the top tr Λ(x) (``lambda``, the default), at random (``random``), by the memory-perturbation
sensitivity ‖J Σ Jᵀ e‖₁ (``sensitivity``, scored in the task-end pass that forms Σ) or stratified over its range
(``stratified``); :mod:`continual_blr.memory`. On class-incremental split MNIST the configs use ``random`` with
``output: logits`` (``docs/replay.md``). The loss adds to
FROMP's functional penalty the negative log-likelihood of the same points' stored labels:

    L(θ) = (1/B) Σ_{i∈batch} ℓ(f_θ(x_i), y_i)
           + γ (1/k) Σ_{j∈replay} ℓ(f_θ(x_j), y_j)                           (replay of the memory's labels)
           + (τ/2) Σ_{s<t} Σ_c Δp_{s,c}ᵀ K_{s,c}⁻¹ Δp_{s,c}                  (FROMP, Pan et al. 2020, Eq. 9)

with γ = ``replay_weight`` and the k replayed points drawn uniformly without replacement from the memory at
every step (k = ``replay_batch_size``; None: all of them, in a fixed order). On a class-incremental stream
(one head over all classes) the label term keeps the old classes' outputs trained where the new task's data
would otherwise push every input to the new classes, and the functional term keeps the old function's
probabilities at those points; on a task-incremental stream each point is replayed on its task's head.

``train.augment``: the label replay's points are augmented afresh at every draw (``replay_augment``, as ``er`` and
``derpp`` replay theirs); FROMP's functional term reads them, and the kernels are built at them, as stored.

Data parallel: the memory, and the generator that draws the replayed points, are the same on every rank, so
the replay term (like FROMP's penalty) enters the all-reduced gradient once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..data.augment import ReplayAugment
from ..data.stream import Task, TaskStream
from ..regularizers.functional import FunctionalRegularizer
from ..types import Batch
from .base import Method, TrainConfig
from .fromp import FunctionalParams, PenaltyLog, functional_loss, memory_store_stats
from .replay import replay_nll

__all__ = ["FROMPReplayParams", "FROMPReplayMethod"]


@dataclass
class FROMPReplayParams(FunctionalParams):
    """Parameters of FROMP with replay; τ, the kernel, the selection and the rest as FROMP's
    (:class:`~continual_blr.methods.fromp.FunctionalParams`).

    Attributes:
        memory_size: M, memorable points in all (shared over the (task, class) groups seen).
        replay_weight: γ, the weight of the replayed points' mean NLL (0: FROMP with a total budget).
        replay_batch_size: k, points replayed per step (None: every stored point at every step).
    """

    memory_size: int = 200
    replay_weight: float = 1.0
    replay_batch_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.memory_size < 1:
            raise ValueError(f"params.memory_size: must be >= 1, got {self.memory_size}")
        if not self.replay_weight >= 0:
            raise ValueError(f"params.replay_weight: must be >= 0, got {self.replay_weight}")
        if self.replay_batch_size is not None and self.replay_batch_size < 1:
            raise ValueError(f"params.replay_batch_size: must be >= 1 or null, got {self.replay_batch_size}")


class FROMPReplayMethod(Method):
    """FROMP's functional penalty plus replay of its memorable points' labels, from one memory of M points."""

    name = "fromp-replay"

    def __init__(self, params: FROMPReplayParams | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.params = params or FROMPReplayParams()
        kw = asdict(self.params)
        for key in ("replay_weight", "replay_batch_size"):
            kw.pop(key)
        kw["n_points"] = kw["memory_size"]
        self.regularizer: FunctionalRegularizer = FunctionalRegularizer(**kw, generator=self.generator)
        self.penalty_log = PenaltyLog()
        self._rebuilt = False
        self.replay_augment = ReplayAugment(seed + 15485863)  # train.augment on the label replay's points

    def setup(self, model: nn.Module, stream: TaskStream, train: TrainConfig) -> None:
        """Start from an empty memory; single-head class-incremental streams may restrict FROMP's columns."""
        super().setup(model, stream, train)
        self.regularizer.reset()
        self.regularizer.class_incremental = stream.scenario == "class"
        self.replay_augment.reset(train.augment)

    def _replay_nll(self, model: nn.Module) -> Tensor | None:
        """(1/k) Σ_j ℓ(f_θ(x_j), y_j) over k memorable points (all of them when replay_batch_size is None)."""
        entries = list(self.regularizer.memory)
        total = sum(len(e) for e in entries)
        if total == 0:
            return None
        k = self.params.replay_batch_size
        if k is None or k >= total:
            picks = [torch.arange(len(e)) for e in entries]
        else:
            chosen = torch.randperm(total, generator=self.generator)[:k]
            starts = torch.tensor([0] + [len(e) for e in entries]).cumsum(0)
            picks = [chosen[(chosen >= starts[i]) & (chosen < starts[i + 1])] - starts[i] for i in range(len(entries))]
        by_head: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
        for e, idx in zip(entries, picks):
            if idx.numel():
                xs, ys = by_head.setdefault(e.head, ([], []))
                xs.append(e.x[idx.to(e.x.device)])
                ys.append(e.y[idx.to(e.y.device)])
        groups = [(self.replay_augment(torch.cat(xs)), torch.cat(ys), head)
                  for head, (xs, ys) in sorted(by_head.items())]
        return replay_nll(model, groups, self.likelihood, self.sigma)

    def on_task_start(self, model: nn.Module, task: Task) -> None:
        """Rebuild the kernels (the regulariser's hook) and start the epoch's penalty log afresh."""
        self.penalty_log.reset()
        self._rebuilt = len(self.regularizer.memory) > 0
        super().on_task_start(model, task)

    def loss(self, model: nn.Module, batch: Batch, task) -> Tensor:
        """The minibatch's mean NLL + γ · the replayed points' mean NLL + FROMP's penalty (module docstring); the
        log's ``data_loss`` holds both NLL terms, ``penalty`` FROMP's."""
        loss, _ = functional_loss(self, self.regularizer, self.penalty_log, model, batch, task)
        if self.params.replay_weight > 0:
            replay = self._replay_nll(model)
            if replay is not None:
                term = self.params.replay_weight * replay
                self.penalty_log.data = self.penalty_log.data + term.detach().float() * batch.y.shape[0]
                loss = loss + term
        return loss

    def epoch_stats(self) -> dict[str, float]:
        """``data_loss``, ``penalty``, ``kernel_dropped``, ``kernel_min_diag`` (``continual_blr.methods.fromp``)."""
        return self.penalty_log.pop(self.regularizer, self._rebuilt)

    def memory_stats(self) -> dict[str, Any]:
        return memory_store_stats(self.regularizer) | {"memory_size": self.params.memory_size}
