"""Tiny synthetic streams for tests and smoke runs: Gaussian blobs (classification, stream name
``"synthetic"``) and a linear-Gaussian continual regression (:func:`linear_regression_stream`).

Each task has ``n_classes_per_task`` classes; class ``j`` of task ``t`` is an isotropic unit Gaussian
around a mean drawn as ``separation * N(0, I)``. With the default separation of 3 in 10 dimensions
the class means are ~13 standard deviations apart, so every task is (nearly) linearly separable.
Examples are interleaved by class (labels ``0, 1, …, k-1, 0, 1, …``), so every prefix is balanced.

The regression stream draws y = w_tᵀx + b_t + σ ε (ε ~ N(0, 1)) with inputs x ~ N(c_t, I) whose centre
c_t moves from task to task; see :func:`linear_regression_stream`.

Every number is drawn from one ``torch.Generator`` seeded with ``seed``; the global RNG is untouched.
"""

from __future__ import annotations

import torch

from .builders import check_scenario
from .stream import SCENARIOS, Task, TaskStream

__all__ = ["synthetic_stream", "linear_regression_stream"]


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


def linear_regression_stream(
    n_tasks: int = 3,
    n_features: int = 4,
    n_train: int = 50,
    n_test: int = 50,
    scenario: str = "domain",
    seed: int = 0,
    *,
    sigma: float = 0.5,
    input_shift: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> TaskStream:
    """A continual linear-Gaussian regression: the oracle stream for Bayesian linear regression.

    Task t draws inputs x ~ N(c_t, I) with c_t = ``input_shift`` · N(0, I) (a new centre per task, so
    the tasks cover different parts of input space) and targets

        y = wᵀx + b + σ ε,     ε ~ N(0, 1),     (w, b) ~ N(0, I)

    ``"domain"``: one (w, b) for every task and one head — sequential Bayes over the tasks ends at the
    batch posterior of all their data. ``"task"``: a fresh (w_t, b_t) and head per task.
    With a linear model (``build_model("linear", ...)``) and prior N(0, δ⁻¹ I) the posterior after the
    data X (rows [xᵢᵀ, 1]), y is Gaussian with precision δI + XᵀX/σ² and mean (δI + XᵀX/σ²)⁻¹ Xᵀy/σ².

    Args:
        n_tasks: number of tasks.
        n_features: input dimension; inputs have shape ``(n_features,)``.
        n_train: training examples per task.
        n_test: test examples per task.
        scenario: ``"domain"`` (shared weights, one head) or ``"task"`` (own weights and head per task).
        seed: seeds the ``torch.Generator`` all draws come from.
        sigma: σ > 0, the noise standard deviation (also the stream's likelihood parameter).
        input_shift: scale of the task centres c_t.
        dtype: floating dtype of inputs and targets.

    Returns:
        The stream (``likelihood="regression"``, ``n_outputs=1``, targets of shape [N]); ``meta`` holds
        the true weights (``"weights"``: one [n_features + 1] vector (w, b) per task).

    Examples:
        >>> s = linear_regression_stream(n_tasks=2)
        >>> s.likelihood, s.n_outputs, s.n_heads, s.tasks[0].y_train.shape
        ('regression', 1, 1, torch.Size([50]))
    """
    check_scenario("linear_regression", scenario, ("domain", "task"))
    for arg, v in (("n_tasks", n_tasks), ("n_features", n_features), ("n_train", n_train), ("n_test", n_test)):
        if v < 1:
            raise ValueError(f"linear_regression: {arg} must be at least 1; got {v}")
    if not sigma > 0:
        raise ValueError(f"linear_regression: sigma must be > 0; got {sigma}")
    g = torch.Generator().manual_seed(int(seed))
    d = n_features
    shared = torch.randn(d + 1, generator=g, dtype=torch.float64)
    tasks, weights = [], []
    for t in range(n_tasks):
        wb = shared if scenario == "domain" else torch.randn(d + 1, generator=g, dtype=torch.float64)
        centre = input_shift * torch.randn(d, generator=g, dtype=torch.float64)
        parts = []
        for n in (n_train, n_test):
            x = centre + torch.randn(n, d, generator=g, dtype=torch.float64)
            y = x @ wb[:d] + wb[d] + sigma * torch.randn(n, generator=g, dtype=torch.float64)
            parts += [x.to(dtype), y.to(dtype)]
        head = t if scenario == "task" else 0
        tasks.append(Task(t, parts[0], parts[1], parts[2], parts[3], (), head, f"linear_regression/{t}"))
        weights.append(wb.to(dtype))
    return TaskStream(
        name="linear_regression",
        tasks=tasks,
        scenario=scenario,
        input_shape=(d,),
        n_outputs=1,
        n_heads=n_tasks if scenario == "task" else 1,
        meta={"seed": int(seed), "weights": weights, "input_shift": float(input_shift)},
        likelihood="regression",
        sigma=float(sigma),
    )
