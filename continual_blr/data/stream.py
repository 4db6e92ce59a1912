"""Task streams: the in-memory form every benchmark is turned into.

A stream is a list of :class:`Task` s. Each task holds its train and test tensors already
preprocessed (float inputs, int64 labels), the output head it uses and the original classes it covers.

Label conventions by scenario:

* ``"task"`` (task-incremental, multi-head): one head per task, labels renumbered 0..k-1 inside the
  task, ``head == task_id``.
* ``"class"`` (class-incremental, single-head): one head over all classes, labels are the global
  class ids, ``head == 0``.
* ``"domain"`` (domain-incremental, e.g. permuted MNIST): one head, the same label set in every task,
  ``head == 0``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["Task", "TaskStream", "SCENARIOS"]

SCENARIOS = ("task", "class", "domain")


@dataclass
class Task:
    """One task of a stream."""

    task_id: int
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    classes: tuple[int, ...]
    head: int = 0
    name: str = ""

    @property
    def n_train(self) -> int:
        return int(self.y_train.shape[0])

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "Task":
        """A copy with inputs on ``device`` (and cast to ``dtype`` if given); labels stay int64."""
        cast = (lambda t: t.to(device=device, dtype=dtype)) if dtype else (lambda t: t.to(device))
        return Task(
            self.task_id,
            cast(self.x_train),
            self.y_train.to(device),
            cast(self.x_test),
            self.y_test.to(device),
            self.classes,
            self.head,
            self.name,
        )


@dataclass
class TaskStream:
    """A sequence of tasks plus what a model needs to know to be built for it."""

    name: str
    tasks: list[Task]
    scenario: str
    input_shape: tuple[int, ...]
    n_outputs: int  # outputs per head
    n_heads: int
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            raise ValueError(f"scenario: got {self.scenario!r}; allowed: {', '.join(SCENARIOS)}")

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self):
        return iter(self.tasks)

    @property
    def multi_head(self) -> bool:
        return self.n_heads > 1
