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

The stream also names its likelihood (``TaskStream.likelihood``, checked by
:func:`continual_blr.curvature.likelihoods.check_likelihood`): ``"classification"`` (softmax
cross-entropy on int64 labels, the default) or ``"regression"`` (a Gaussian with noise standard
deviation ``TaskStream.sigma`` on float targets ``y`` of shape [N] or [N, K]). Every method trains and
is evaluated with it (see ``continual_blr.methods.base`` and ``continual_blr.loop``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..curvature.likelihoods import check_likelihood

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
        """A copy with inputs on ``device`` (and cast to ``dtype`` if given); integer labels stay int64,
        real regression targets are cast like the inputs."""
        cast = (lambda t: t.to(device=device, dtype=dtype)) if dtype else (lambda t: t.to(device))
        target = lambda t: cast(t) if t.is_floating_point() else t.to(device)  # noqa: E731
        return Task(
            self.task_id,
            cast(self.x_train),
            target(self.y_train),
            cast(self.x_test),
            target(self.y_test),
            self.classes,
            self.head,
            self.name,
        )


@dataclass
class TaskStream:
    """A sequence of tasks plus what a model needs to know to be built for it.

    Attributes:
        likelihood: ``"classification"`` (ℓ = −log softmax(f)_y) or ``"regression"``
            (ℓ = ‖f − y‖²/(2σ²) + const); see :mod:`continual_blr.curvature.likelihoods`.
        sigma: σ, the Gaussian noise standard deviation (regression; ignored for classification).
    """

    name: str
    tasks: list[Task]
    scenario: str
    input_shape: tuple[int, ...]
    n_outputs: int  # outputs per head
    n_heads: int
    meta: dict = field(default_factory=dict)
    likelihood: str = "classification"
    sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            raise ValueError(f"scenario: got {self.scenario!r}; allowed: {', '.join(SCENARIOS)}")
        check_likelihood(self.likelihood, self.sigma)

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self):
        return iter(self.tasks)

    @property
    def multi_head(self) -> bool:
        return self.n_heads > 1

    def describe(self) -> dict:
        """What a trained network needs to know of this stream, without its data (JSON-ready): name, scenario,
        input shape, the range of the training inputs, outputs per head, heads, likelihood, σ, and per task its
        id, classes, head, name and size.
        A run stores it in ``results.json`` so that prediction needs no dataset (:meth:`skeleton`)."""
        xs = [t.x_train for t in self.tasks if t.x_train.numel()]
        rng = [min(float(x.min()) for x in xs), max(float(x.max()) for x in xs)] if xs else None
        return {"name": self.name, "scenario": self.scenario, "input_shape": list(self.input_shape),
                "input_range": rng,
                "n_outputs": self.n_outputs, "n_heads": self.n_heads, "likelihood": self.likelihood,
                "sigma": self.sigma, "tasks": [{"task_id": t.task_id, "classes": list(t.classes), "head": t.head,
                                                "name": t.name, "n_train": t.n_train} for t in self.tasks]}

    @classmethod
    def skeleton(cls, info: dict) -> "TaskStream":
        """A stream with :meth:`describe`'s structure and no examples (every task's tensors are empty): enough to
        build the network and set a method up for prediction. ``meta["skeleton"]`` is True."""
        shape = tuple(int(d) for d in info["input_shape"])
        regression = info.get("likelihood", "classification") == "regression"

        def empty_targets() -> Tensor:
            return torch.zeros(0) if regression else torch.zeros(0, dtype=torch.int64)

        tasks = [Task(int(t["task_id"]), torch.zeros(0, *shape), empty_targets(), torch.zeros(0, *shape),
                      empty_targets(), tuple(int(c) for c in t["classes"]), head=int(t.get("head", 0)),
                      name=str(t.get("name", ""))) for t in info["tasks"]]
        return cls(str(info["name"]), tasks, str(info["scenario"]), shape, int(info["n_outputs"]),
                   int(info["n_heads"]), meta={"skeleton": True, "input_range": info.get("input_range")},
                   likelihood=info.get("likelihood", "classification"),
                   sigma=float(info.get("sigma", 1.0)))
