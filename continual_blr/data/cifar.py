"""CIFAR streams: split CIFAR-10 and FROMP's split CIFAR (CIFAR-10 then CIFAR-100 classes 0-49).

Where the arrays are looked for (first match wins), for CIFAR-10 (CIFAR-100 alike):

1. ``cifar10_path=...``: a direct path to an ``.npz`` (format: :mod:`continual_blr.data.arrays`);
2. ``<root>/cifar10/cifar10.npz`` (``<root>/cifar100/cifar100.npz``);
3. torchvision's layout ``<root>/cifar-10-batches-py/`` (``<root>/cifar-100-python/``), read
   directly (no md5 check, so re-packed copies work too);
4. with ``download=True`` (the default), torchvision's ``CIFAR10`` / ``CIFAR100`` download into
   ``<root>``, then 3.

``<root>`` is resolved by :func:`~continual_blr.data.paths.resolve_data_dir`. Preprocessing is
ToTensor only: float32 ``(3, 32, 32)`` in [0, 1], no augmentation, no normalisation (FROMP).

Streams:

* ``"split_cifar10"`` — 5 tasks {0,1}, …, {8,9}; ``"task"`` (2-way heads) or ``"class"`` (one
  10-way head).
* ``"split_cifar"`` — FROMP's protocol, ``"task"`` scenario, one 10-way head per task: task 0 is all
  of CIFAR-10, task ``t = 1..5`` is CIFAR-100 classes ``10(t-1) .. 10(t-1)+9`` renumbered 0-9,
  ``head == t``. ``Task.classes`` lives in a joint 110-class space (CIFAR-10 class ``c`` → ``c``,
  CIFAR-100 class ``c`` → ``10 + c``), so task ``t`` covers ``10t .. 10t+9``.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import torch

from .arrays import ArraySplits, read_npz
from .builders import check_scenario, split_tasks, subsample_generator
from .digits import DIGIT_PAIRS
from .paths import DataNotFoundError, no_litter, resolve_data_dir
from .stream import TaskStream

__all__ = ["load_cifar10", "load_cifar100", "split_cifar10", "split_cifar"]

_LAYOUTS = {
    # name: (npz under root, torchvision folder, train files, test files, label key, torchvision class)
    "cifar10": ("cifar10/cifar10.npz", "cifar-10-batches-py",
                tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",), "labels", "CIFAR10"),
    "cifar100": ("cifar100/cifar100.npz", "cifar-100-python", ("train",), ("test",), "fine_labels", "CIFAR100"),
}

_NUMPY_GLOBALS = {"_reconstruct", "ndarray", "dtype", "_frombuffer", "scalar"}


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles CIFAR's batch files but refuses any global other than numpy's array constructors."""

    def find_class(self, module: str, name: str):  # noqa: D401 - pickle API
        if module.startswith("numpy.core") and hasattr(np, "_core"):
            module = "numpy._core" + module[len("numpy.core"):]
        if (module.startswith("numpy") and name in _NUMPY_GLOBALS) or (module, name) == ("_codecs", "encode"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR batch file")


def _read_batches(folder: Path, names: tuple[str, ...], label_key: str) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = [], []
    for n in names:
        with open(folder / n, "rb") as f:
            d = _ArrayUnpickler(f, encoding="latin1").load()
        d = {k.decode() if isinstance(k, bytes) else k: v for k, v in d.items()}
        xs.append(np.asarray(d["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        ys.append(np.asarray(d[label_key], dtype=np.int64))
    return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))


def _load(kind: str, data_dir: str | os.PathLike[str] | None, path: str | os.PathLike[str] | None,
          download: bool) -> ArraySplits:
    npz_rel, tv_folder, train_files, test_files, label_key, tv_class = _LAYOUTS[kind]
    if path is not None:
        if not Path(path).is_file():
            raise DataNotFoundError(
                f"{kind}: no file at {path} (expected an .npz with x_train, y_train, x_test, y_test)"
            )
        return read_npz(path, as_float=False)
    root = resolve_data_dir(data_dir)
    if (root / npz_rel).is_file():
        return read_npz(root / npz_rel, as_float=False)
    folder = root / tv_folder
    has_layout = all((folder / n).is_file() for n in train_files + test_files)
    why = "download=False"
    if not has_layout and download:
        import torchvision.datasets  # imported here: torchvision is slow to import

        try:
            with no_litter(root):  # a failed download leaves no empty folders behind
                getattr(torchvision.datasets, tv_class)(str(root), train=True, download=True)
            has_layout = True
        except Exception as err:  # network errors surface as RuntimeError, URLError or OSError
            text = " ".join(str(err).split())
            why = f"download failed: {text[:200]}"
    if not has_layout:
        raise DataNotFoundError(
            f"{kind} not found in {root}: expected {root / npz_rel} (arrays x_train, y_train, x_test, y_test) "
            f"or torchvision's {folder}/ ({', '.join(train_files + test_files)}); pass data_dir (--data-dir), "
            f"set CONTINUAL_BLR_DATA or give {kind}_path ({why})"
        )
    x_train, y_train = _read_batches(folder, train_files, label_key)
    x_test, y_test = _read_batches(folder, test_files, label_key)
    return ArraySplits(x_train, y_train, x_test, y_test)


def load_cifar10(data_dir: str | os.PathLike[str] | None = None, *, path: str | os.PathLike[str] | None = None,
                 download: bool = True) -> ArraySplits:
    """Read CIFAR-10 as uint8 images ``(N, 3, 32, 32)`` and int64 labels (see the module docstring).

    Args:
        data_dir: the data root; resolved by ``resolve_data_dir``.
        path: a direct path to an ``.npz``; wins over ``data_dir``.
        download: let torchvision try to download when nothing is found.

    Raises:
        DataNotFoundError: no readable copy was found and none could be downloaded.
    """
    return _load("cifar10", data_dir, path, download)


def load_cifar100(data_dir: str | os.PathLike[str] | None = None, *, path: str | os.PathLike[str] | None = None,
                  download: bool = True) -> ArraySplits:
    """Read CIFAR-100 (fine labels 0-99) like :func:`load_cifar10`."""
    return _load("cifar100", data_dir, path, download)


def split_cifar10(
    data_dir: str | os.PathLike[str] | None = None,
    *,
    scenario: str = "task",
    seed: int = 0,
    download: bool = True,
    cifar10_path: str | os.PathLike[str] | None = None,
    max_per_task: int | None = None,
    max_test_per_task: int | None = None,
) -> TaskStream:
    """Split CIFAR-10: 5 tasks of two classes each.

    Args:
        data_dir: the data root (see the module docstring).
        scenario: ``"task"`` (labels 0/1, head = task id) or ``"class"`` (one head, labels 0-9).
        seed: seeds the subsets drawn for ``max_per_task`` / ``max_test_per_task``.
        download: let torchvision try to download when nothing is found.
        cifar10_path: a direct path to a CIFAR-10 ``.npz``.
        max_per_task: keep at most this many training images per task.
        max_test_per_task: keep at most this many test images per task.

    Returns:
        The stream, ``input_shape == (3, 32, 32)``.
    """
    check_scenario("split_cifar10", scenario, ("task", "class"))
    data = load_cifar10(data_dir, path=cifar10_path, download=download)
    tasks = split_tasks(data, DIGIT_PAIRS, scenario, name="split_cifar10", max_per_task=max_per_task,
                        max_test_per_task=max_test_per_task, generator=subsample_generator(seed))
    return TaskStream(
        name="split_cifar10",
        tasks=tasks,
        scenario=scenario,
        input_shape=(3, 32, 32),
        n_outputs=2 if scenario == "task" else 10,
        n_heads=len(tasks) if scenario == "task" else 1,
        meta={"seed": int(seed)},
    )


def split_cifar(
    data_dir: str | os.PathLike[str] | None = None,
    *,
    n_tasks: int = 6,
    scenario: str = "task",
    seed: int = 0,
    download: bool = True,
    cifar10_path: str | os.PathLike[str] | None = None,
    cifar100_path: str | os.PathLike[str] | None = None,
    max_per_task: int | None = None,
    max_test_per_task: int | None = None,
) -> TaskStream:
    """FROMP's split CIFAR: all of CIFAR-10, then CIFAR-100 in tasks of 10 classes.

    Args:
        data_dir: the data root (see the module docstring).
        n_tasks: 6 in FROMP (CIFAR-10 + 5 CIFAR-100 tasks covering classes 0-49); 1 to 11.
        scenario: only ``"task"``.
        seed: seeds the subsets drawn for ``max_per_task`` / ``max_test_per_task``.
        download: let torchvision try to download when nothing is found.
        cifar10_path: a direct path to a CIFAR-10 ``.npz``.
        cifar100_path: a direct path to a CIFAR-100 ``.npz``.
        max_per_task: keep at most this many training images per task.
        max_test_per_task: keep at most this many test images per task.

    Returns:
        The stream: ``n_tasks`` heads of 10 outputs, ``input_shape == (3, 32, 32)``.
    """
    check_scenario("split_cifar", scenario, ("task",))
    if not 1 <= n_tasks <= 11:
        raise ValueError(
            f"split_cifar: n_tasks must be in 1..11 (CIFAR-10 + up to 10 CIFAR-100 tasks); got {n_tasks}"
        )
    gen = subsample_generator(seed)
    limits = {"max_per_task": max_per_task, "max_test_per_task": max_test_per_task, "generator": gen}
    tasks = []
    if n_tasks > 1:  # CIFAR-100 first: the one more likely to be missing fails before CIFAR-10 is read
        c100 = load_cifar100(data_dir, path=cifar100_path, download=download)
        groups = [tuple(range(10 * k, 10 * k + 10)) for k in range(n_tasks - 1)]
        tasks = split_tasks(c100, groups, "task", name="split_cifar/cifar100", first_task_id=1,
                            class_offset=10, **limits)
        del c100
    c10 = load_cifar10(data_dir, path=cifar10_path, download=download)
    tasks = split_tasks(c10, [tuple(range(10))], "task", name="split_cifar/cifar10", **limits) + tasks
    return TaskStream(
        name="split_cifar",
        tasks=tasks,
        scenario="task",
        input_shape=(3, 32, 32),
        n_outputs=10,
        n_heads=n_tasks,
        meta={"seed": int(seed), "class_space": "CIFAR-10 class c -> c, CIFAR-100 class c -> 10 + c"},
    )
