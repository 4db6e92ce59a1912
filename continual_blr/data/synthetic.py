"""A tiny Gaussian-blob stream for tests and smoke runs (stream name ``"synthetic"``).

Each task has ``n_classes_per_task`` classes; class ``j`` of task ``t`` is an isotropic unit Gaussian
around a mean drawn as ``separation * N(0, I)``. With the default separation of 3 in 10 dimensions
the class means are ~13 standard deviations apart, so every task is (nearly) linearly separable.
Examples are interleaved by class (labels ``0, 1, …, k-1, 0, 1, …``), so every prefix is balanced.

Every number is drawn from one ``torch.Generator`` seeded with ``seed``; the global RNG is untouched.
"""

from __future__ import annotations

import torch

from .builders import check_scenario
from .stream import SCENARIOS, Task, TaskStream

__all__ = ["synthetic_stream"]


def synthetic_stream(
    n_tasks: int = 3,
    n_classes_per_task: int = 2,
    n_features: int = 10,
    n_train: int = 200,
    n_test: int = 100,
    scenario: str = "task",
    seed: int = 0,
    *,
    separation: float = 3.0,
) -> TaskStream:
    """Build the synthetic stream.

    Args:
        n_tasks: number of tasks.
        n_classes_per_task: classes per task (``k``).
        n_features: input dimension; inputs have shape ``(n_features,)``.
        n_train: training examples per task (split evenly over its classes, remainder to the first).
        n_test: test examples per task.
        scenario: ``"task"`` (labels 0..k-1, head = task id, ``n_heads = n_tasks``), ``"class"``
            (global labels ``t*k + j``, one head of ``n_tasks*k`` outputs) or ``"domain"``
            (labels 0..k-1 in every task, one head of ``k`` outputs, new blobs per task).
        seed: seeds the ``torch.Generator`` all draws come from.
        separation: scale of the class means relative to the unit noise.

    Returns:
        The stream; ``classes`` holds the global class ids ``t*k .. t*k + k-1`` (in the
        ``"domain"`` scenario ``0..k-1``).

    Examples:
        >>> s = synthetic_stream(n_tasks=2, scenario="class")
        >>> len(s), s.n_outputs, s.n_heads, s.tasks[1].classes
        (2, 4, 1, (2, 3))
    """
    check_scenario("synthetic", scenario, SCENARIOS)
    for arg, v in (("n_tasks", n_tasks), ("n_classes_per_task", n_classes_per_task), ("n_features", n_features),
                   ("n_train", n_train), ("n_test", n_test)):
        if v < 1:
            raise ValueError(f"synthetic: {arg} must be at least 1; got {v}")
    g = torch.Generator().manual_seed(int(seed))
    k = n_classes_per_task
    tasks = []
    for t in range(n_tasks):
        means = separation * torch.randn(k, n_features, generator=g)
        parts = []
        for n in (n_train, n_test):
            local = torch.arange(n) % k
            x = means[local] + torch.randn(n, n_features, generator=g)
            parts += [x, local + t * k if scenario == "class" else local]
        classes = tuple(range(k)) if scenario == "domain" else tuple(range(t * k, (t + 1) * k))
        head = t if scenario == "task" else 0
        tasks.append(Task(t, parts[0], parts[1], parts[2], parts[3], classes, head, f"synthetic/{t}"))
    return TaskStream(
        name="synthetic",
        tasks=tasks,
        scenario=scenario,
        input_shape=(n_features,),
        n_outputs=n_tasks * k if scenario == "class" else k,
        n_heads=n_tasks if scenario == "task" else 1,
        meta={"seed": int(seed), "separation": float(separation)},
    )
