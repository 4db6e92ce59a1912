"""scikit-learn's bundled 8x8 digits: a real image stream that needs no download.

``sklearn.datasets.load_digits`` ships 1,797 grey 8x8 images (values 0..16) of the digits 0-9 inside
the scikit-learn package. Inputs here are float32 ``(1, 8, 8)`` divided by 16, so in [0, 1].

The train/test split is stratified: in every class a fraction ``test_fraction`` (rounded) of the
images, chosen by a ``torch.Generator`` seeded with ``split_seed`` (default 0), is held out. The
split therefore does not change with ``seed``; ``seed`` draws the permutations and subsets.

Streams:

* ``"split_digits"`` — 5 tasks {0,1}, {2,3}, …, {8,9}; scenario ``"task"`` (2-way head per task,
  labels 0/1, head = task id) or ``"class"`` (one 10-way head, global labels).
* ``"permuted_digits"`` — ``n_tasks`` (default 5) tasks of all 10 digits, task 0 unpermuted, the
  others with a fixed pixel permutation each; scenario ``"domain"`` (one 10-way head).
"""

from __future__ import annotations

import numpy as np
import torch

from .arrays import ArraySplits
from .builders import check_scenario, draw_permutations, permuted_tasks, split_tasks, subsample_generator
from .stream import TaskStream

__all__ = ["load_digits_arrays", "split_digits", "permuted_digits", "DIGIT_PAIRS"]

DIGIT_PAIRS = ((0, 1), (2, 3), (4, 5), (6, 7), (8, 9))


def stratified_split(
    y: torch.Tensor, test_fraction: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``(train, test)``, each sorted: per class, ``round(test_fraction * n_c)`` go to test."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction: got {test_fraction}; must be in (0, 1)")
    train, test = [], []
    for c in torch.unique(y).tolist():
        idx = (y == c).nonzero().squeeze(1)
        perm = idx[torch.randperm(idx.numel(), generator=generator)]
        n_test = int(round(test_fraction * idx.numel()))
        test.append(perm[:n_test])
        train.append(perm[n_test:])
    return torch.cat(train).sort().values, torch.cat(test).sort().values


def _bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits as (images ``(1797, 8, 8)`` float64 in 0..16, labels), the arrays
    ``sklearn.datasets.load_digits`` returns. Read straight from the package's ``datasets/data/digits.csv.gz``
    (located without importing scikit-learn, whose import costs about 0.85 s of a 7.6 s default run); through
    ``load_digits`` where that file is not found."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sklearn")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            data = np.loadtxt(path, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits  # fallback: scikit-learn takes about a second to import

    bunch = load_digits()
    return bunch.images, bunch.target


def load_digits_arrays(*, split_seed: int = 0, test_fraction: float = 0.2) -> ArraySplits:
    """The digits as float32 ``(N, 1, 8, 8)`` inputs in [0, 1] and int64 labels, split stratified.

    Args:
        split_seed: seeds the generator that picks the held-out images.
        test_fraction: fraction of every class held out for testing.

    Returns:
        The train and test arrays (about 1,437 / 360 images with the defaults).
    """
    images, target = _bundled_digits()
    x = torch.from_numpy((images / 16.0).astype(np.float32)).unsqueeze(1)
    y = torch.from_numpy(target.astype(np.int64))
    tr, te = stratified_split(y, test_fraction, torch.Generator().manual_seed(int(split_seed)))
    return ArraySplits(x[tr], y[tr], x[te], y[te])


def split_digits(
    *,
    scenario: str = "task",
    seed: int = 0,
    split_seed: int = 0,
    test_fraction: float = 0.2,
    max_per_task: int | None = None,
    max_test_per_task: int | None = None,
) -> TaskStream:
    """Split digits: 5 tasks of two digits each.

    Args:
        scenario: ``"task"`` (multi-head, labels 0/1, head = task id) or ``"class"`` (one head,
            labels 0-9).
        seed: seeds the subsets drawn for ``max_per_task`` / ``max_test_per_task``.
        split_seed: seeds the train/test split (see the module docstring).
        test_fraction: fraction of every class held out.
        max_per_task: keep at most this many training images per task.
        max_test_per_task: keep at most this many test images per task.

    Returns:
        The stream, ``input_shape == (1, 8, 8)``.
    """
    check_scenario("split_digits", scenario, ("task", "class"))
    data = load_digits_arrays(split_seed=split_seed, test_fraction=test_fraction)
    tasks = split_tasks(data, DIGIT_PAIRS, scenario, name="split_digits", max_per_task=max_per_task,
                        max_test_per_task=max_test_per_task, generator=subsample_generator(seed))
    return TaskStream(
        name="split_digits",
        tasks=tasks,
        scenario=scenario,
        input_shape=(1, 8, 8),
        n_outputs=2 if scenario == "task" else 10,
        n_heads=len(tasks) if scenario == "task" else 1,
        meta={"seed": int(seed), "split_seed": int(split_seed), "source": "sklearn.datasets.load_digits"},
    )


def permuted_digits(
    *,
    n_tasks: int = 5,
    scenario: str = "domain",
    seed: int = 0,
    split_seed: int = 0,
    test_fraction: float = 0.2,
    max_per_task: int | None = None,
    max_test_per_task: int | None = None,
) -> TaskStream:
    """Permuted digits: task 0 the plain digits, tasks 1.. with a fixed pixel permutation each.

    Args:
        n_tasks: number of tasks (including the unpermuted first one).
        scenario: only ``"domain"``.
        seed: seeds the ``torch.Generator`` the permutations are drawn from
            (``meta["permutations"]``, shape ``(n_tasks, 64)``, row 0 the identity).
        split_seed: seeds the train/test split.
        test_fraction: fraction of every class held out.
        max_per_task: keep at most this many training images per task.
        max_test_per_task: keep at most this many test images per task.

    Returns:
        The stream: one 10-way head, labels 0-9 in every task.
    """
    check_scenario("permuted_digits", scenario, ("domain",))
    data = load_digits_arrays(split_seed=split_seed, test_fraction=test_fraction)
    perms = draw_permutations(n_tasks, 64, torch.Generator().manual_seed(int(seed)))
    tasks = permuted_tasks(data, perms, name="permuted_digits", max_per_task=max_per_task,
                           max_test_per_task=max_test_per_task, generator=subsample_generator(seed))
    return TaskStream(
        name="permuted_digits",
        tasks=tasks,
        scenario="domain",
        input_shape=(1, 8, 8),
        n_outputs=10,
        n_heads=1,
        meta={"seed": int(seed), "split_seed": int(split_seed), "permutations": perms,
              "source": "sklearn.datasets.load_digits"},
    )
