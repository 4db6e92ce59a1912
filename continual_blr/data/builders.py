"""Cut a whole dataset (:class:`~continual_blr.data.arrays.ArraySplits`) into tasks.

Two constructions cover every stream in this package:

* :func:`split_tasks` — one task per group of classes (split MNIST, split CIFAR). In the ``"task"``
  scenario labels are renumbered by their position in the group and ``head == task_id``; in the
  ``"class"`` scenario labels stay the global class ids and ``head == 0``.
* :func:`permuted_tasks` — the same classes in every task, the inputs' pixels shuffled by one fixed
  permutation per task, the first task unpermuted (``"domain"`` scenario, ``head == 0``).

Both keep the examples in their original order and convert only the kept examples to float. With
``max_per_task`` (and ``max_test_per_task``) a random subset of that size is kept, drawn from the
given ``torch.Generator``.

:func:`hold_out_validation` turns any built stream into a *validation stream*: a fraction of every
task's training data is held out (stratified by label) and becomes that task's evaluation set, the
test set is dropped. Hyper-parameters are chosen on such streams, never on test data.
"""

from __future__ import annotations

from collections.abc import Sequence

import dataclasses
import math

import torch
from torch import Tensor

from .arrays import ArraySplits, to_float
from .stream import Task, TaskStream

__all__ = ["check_scenario", "subsample_generator", "split_tasks", "permuted_tasks", "draw_permutations",
           "check_validation", "validation_generator", "stratified_holdout", "hold_out_validation"]


def check_scenario(stream: str, scenario: str, allowed: Sequence[str]) -> str:
    """Return ``scenario`` if ``stream`` supports it, else raise a one-line ``ValueError``."""
    if scenario not in allowed:
        raise ValueError(f"{stream}: scenario {scenario!r} not supported; allowed: {', '.join(allowed)}")
    return scenario


def subsample_generator(seed: int) -> torch.Generator:
    """The generator that draws ``max_per_task`` subsets: seeded from ``seed`` but a different stream
    of draws than a generator seeded with ``seed`` itself (so subsets do not mirror permutations)."""
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + 7919) % (2**63 - 1))


def _limit(idx: Tensor, max_n: int | None, generator: torch.Generator | None) -> Tensor:
    """Keep ``max_n`` of the indices ``idx`` at random (in their original order); all if ``None``."""
    if max_n is None or idx.numel() <= max_n:
        return idx
    if max_n < 1:
        raise ValueError(f"max_per_task: got {max_n}; must be at least 1")
    keep = torch.randperm(idx.numel(), generator=generator)[:max_n].sort().values
    return idx[keep]


def _splits(data: ArraySplits, max_train: int | None, max_test: int | None):
    """``(x, y, limit)`` for the train and then the test split."""
    return ((data.x_train, data.y_train, max_train), (data.x_test, data.y_test, max_test))


def _class_index(y: Tensor, classes: Sequence[int]) -> Tensor:
    return torch.isin(y, torch.as_tensor(list(classes), dtype=y.dtype)).nonzero().squeeze(1)


def _label(classes: tuple[int, ...]) -> str:
    """``"2-3"`` for few classes, ``"10..19"`` for a longer contiguous run."""
    if len(classes) > 4 and classes == tuple(range(classes[0], classes[0] + len(classes))):
        return f"{classes[0]}..{classes[-1]}"
    return "-".join(str(c) for c in classes)


def split_tasks(
    data: ArraySplits,
    class_groups: Sequence[Sequence[int]],
    scenario: str,
    *,
    name: str = "split",
    max_per_task: int | None = None,
    max_test_per_task: int | None = None,
    generator: torch.Generator | None = None,
    first_task_id: int = 0,
    class_offset: int = 0,
) -> list[Task]:
    """One task per group of classes.

    Args:
        data: the whole dataset (labels are the dataset's class ids).
        class_groups: the classes of each task, e.g. ``[(0, 1), (2, 3), ...]``. In the ``"task"``
            scenario label ``group[j]`` becomes ``j``.
        scenario: ``"task"`` (renumbered labels, ``head = task_id``) or ``"class"`` (global labels,
            ``head = 0``).
        name: prefix of each task's name.
        max_per_task: keep at most this many training examples per task (random subset).
        max_test_per_task: the same for the test examples.
        generator: draws the subsets (only used when a maximum is set).
        first_task_id: the ``task_id`` (and, in the ``"task"`` scenario, head) of the first group;
            used when a stream is assembled from several datasets.
        class_offset: added to the dataset's class ids to form ``Task.classes`` and, in the
            ``"class"`` scenario, the labels (places several datasets in one class space).

    Returns:
        The tasks, in the order of ``class_groups``.

    Raises:
        ValueError: unknown scenario, a class listed twice in a group, or a task without examples.
    """
    check_scenario(name, scenario, ("task", "class"))
    tasks = []
    for i, group in enumerate(class_groups):
        group = tuple(int(c) for c in group)
        if len(set(group)) != len(group):
            raise ValueError(f"{name}: class group {group} lists a class twice")
        task_id = first_task_id + i
        parts = []
        for x, y, limit in _splits(data, max_per_task, max_test_per_task):
            idx = _limit(_class_index(y, group), limit, generator)
            if idx.numel() == 0:
                raise ValueError(f"{name}: no examples of classes {group} in a split of the data")
            y_sel = y[idx].to(torch.int64)
            if scenario == "task":
                lut = torch.full((max(group) + 1,), -1, dtype=torch.int64)
                lut[list(group)] = torch.arange(len(group))
                y_sel = lut[y_sel]
            else:
                y_sel = y_sel + class_offset
            parts += [to_float(x[idx]), y_sel]
        classes = tuple(c + class_offset for c in group)
        tasks.append(
            Task(
                task_id=task_id,
                x_train=parts[0],
                y_train=parts[1],
                x_test=parts[2],
                y_test=parts[3],
                classes=classes,
                head=task_id if scenario == "task" else 0,
                name=f"{name}/{_label(classes)}",
            )
        )
    return tasks


def draw_permutations(n_tasks: int, n_pixels: int, generator: torch.Generator) -> Tensor:
    """``(n_tasks, n_pixels)`` index permutations: row 0 the identity, rows 1.. drawn in order from
    ``generator`` with ``torch.randperm``."""
    if n_tasks < 1:
        raise ValueError(f"n_tasks: got {n_tasks}; must be at least 1")
    rows = [torch.arange(n_pixels)]
    rows += [torch.randperm(n_pixels, generator=generator) for _ in range(n_tasks - 1)]
    return torch.stack(rows)


def permuted_tasks(
    data: ArraySplits,
    permutations: Tensor,
    *,
    name: str = "permuted",
    max_per_task: int | None = None,
    max_test_per_task: int | None = None,
    generator: torch.Generator | None = None,
) -> list[Task]:
    """One task per pixel permutation, every task with all classes and the same labels.

    Task ``t``'s inputs are ``x.reshape(N, -1)[:, permutations[t]].reshape(x.shape)``.

    Args:
        data: the whole dataset; its labels are used as they are.
        permutations: ``(n_tasks, D)`` indices, ``D`` the number of input values per example
            (see :func:`draw_permutations`).
        name: prefix of each task's name.
        max_per_task: keep at most this many training examples per task (a fresh random subset
            for every task).
        max_test_per_task: the same for the test examples.
        generator: draws the subsets (only used when a maximum is set).

    Returns:
        The tasks, ``head == 0`` and ``classes`` the sorted label set of the training data.
    """
    n_pixels = data.x_train[0].numel()
    if permutations.ndim != 2 or permutations.shape[1] != n_pixels:
        raise ValueError(
            f"{name}: permutations must have shape (n_tasks, {n_pixels}); got {tuple(permutations.shape)}"
        )
    classes = tuple(int(c) for c in torch.unique(data.y_train).tolist())
    tasks = []
    for t, perm in enumerate(permutations):
        parts = []
        for x, y, limit in _splits(data, max_per_task, max_test_per_task):
            idx = _limit(torch.arange(y.shape[0]), limit, generator)
            xs = x[idx] if idx.numel() < y.shape[0] else x
            if t > 0:  # permute before the float conversion: moving uint8 is 4x less memory traffic
                xs = xs.reshape(xs.shape[0], -1)[:, perm].reshape(xs.shape)
            parts += [to_float(xs), y[idx].to(torch.int64)]
        tasks.append(Task(t, parts[0], parts[1], parts[2], parts[3], classes, head=0, name=f"{name}/{t}"))
    return tasks


# ----------------------------------------------------------------------------- validation streams


def check_validation(fraction: float) -> float:
    """Return ``fraction`` as a float if it is in [0, 1), else raise a one-line ``ValueError``."""
    ok = isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and math.isfinite(fraction)
    if not ok or not 0.0 <= fraction < 1.0:
        raise ValueError(f"validation: got {fraction!r}; allowed: a fraction in [0, 1) (0: no validation split)")
    return float(fraction)


def validation_generator(seed: int) -> torch.Generator:
    """The generator that draws validation hold-outs: seeded from ``seed`` but a different stream of
    draws than both a generator seeded with ``seed`` and :func:`subsample_generator` (``seed``)."""
    return torch.Generator().manual_seed((int(seed) * 999_983 + 104_729) % (2**63 - 1))


def stratified_holdout(y: Tensor, fraction: float, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Indices ``(keep, held_out)`` of ``y``, each sorted: per label ``c`` with ``n_c`` examples,
    ``min(round(fraction * n_c), n_c - 1)`` drawn at random are held out (every label keeps at least
    one example). Labels are visited in ascending order, one ``torch.randperm`` each."""
    keep, held = [], []
    for c in torch.unique(y).tolist():
        idx = (y == c).nonzero().squeeze(1)
        perm = idx[torch.randperm(idx.numel(), generator=generator)]
        n_held = min(int(round(fraction * idx.numel())), idx.numel() - 1)
        held.append(perm[:n_held])
        keep.append(perm[n_held:])
    return torch.cat(keep).sort().values, torch.cat(held).sort().values


def hold_out_validation(stream: TaskStream, fraction: float, generator: torch.Generator) -> TaskStream:
    """A validation stream: every task's evaluation set is a held-out part of its training data.

    For every task in order, :func:`stratified_holdout` draws ``fraction`` of the task's training
    examples (per label) from ``generator``; they become the task's ``x_test`` / ``y_test`` and are
    removed from its training data. The task's own test set is dropped unread, so a run on the
    returned stream (``loop.run_stream`` unchanged) reports validation accuracy and never sees test
    data. The stream's name gains ``[validation <fraction>]``, each task's name ``[validation]``, and
    ``meta`` gets ``validation`` (the fraction) and ``evaluates_on = "validation"``.

    Args:
        stream: a built stream (not modified; its tensors are indexed, not changed).
        fraction: the held-out fraction of every task's training data, in [0, 1); 0 returns
            ``stream`` itself.
        generator: draws the held-out examples (see :func:`validation_generator`).

    Returns:
        The validation stream (same scenario, heads, shapes and classes).

    Raises:
        ValueError: ``fraction`` outside [0, 1), or a task whose hold-out would be empty.
    """
    fraction = check_validation(fraction)
    if fraction == 0.0:
        return stream
    tasks = []
    for task in stream.tasks:
        keep, held = stratified_holdout(task.y_train, fraction, generator)
        if held.numel() == 0:
            raise ValueError(f"validation: {fraction:g} of task {task.name or task.task_id}'s {task.n_train} "
                             "training examples holds out none; allowed: a larger fraction")
        tasks.append(dataclasses.replace(
            task, x_train=task.x_train[keep], y_train=task.y_train[keep],
            x_test=task.x_train[held], y_test=task.y_train[held], name=f"{task.name}[validation]"))
    meta = dict(stream.meta) | {"validation": fraction, "evaluates_on": "validation"}
    return dataclasses.replace(stream, name=f"{stream.name}[validation {fraction:g}]", tasks=tasks, meta=meta)
