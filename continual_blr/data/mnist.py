"""MNIST streams: split MNIST and permuted MNIST (FROMP / VCL protocols).

Data is read with ``torchvision.datasets.MNIST`` from ``<root>/MNIST/raw/`` where ``<root>`` is
resolved by :func:`~continual_blr.data.paths.resolve_data_dir`. The four idx files
(``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
``t10k-labels-idx1-ubyte``) may be present extracted or as ``.gz``; gzipped files are extracted
beside themselves, or into a temporary folder when the data folder is read-only. When they are
missing, ``download=True`` (the default) lets torchvision try to fetch them; any failure ends in a
:class:`~continual_blr.data.paths.DataNotFoundError` naming the folder and the expected files.

Inputs are float32 ``(1, 28, 28)`` pixels divided by 255.

Streams:

* ``"split_mnist"`` — 5 tasks {0,1}, …, {8,9}; ``"task"`` scenario (2-way head per task, labels
  0/1, head = task id; FROMP's protocol) or ``"class"`` (one 10-way head, labels 0-9).
* ``"permuted_mnist"`` — ``n_tasks`` (default 10) tasks, task 0 unpermuted, ``"domain"`` scenario
  with one 10-way head; permutations drawn from a ``torch.Generator`` seeded with ``seed``.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from .arrays import ArraySplits
from .builders import check_scenario, draw_permutations, permuted_tasks, split_tasks, subsample_generator
from .digits import DIGIT_PAIRS
from .paths import DataNotFoundError, no_litter, resolve_data_dir
from .stream import TaskStream

__all__ = ["MNIST_FILES", "load_mnist", "split_mnist", "permuted_mnist"]

MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 200 else text[:197] + "..."


def _not_found(raw: Path, why: str) -> DataNotFoundError:
    files = ", ".join(f"{f}[.gz]" for f in MNIST_FILES[1:])
    return DataNotFoundError(
        f"MNIST not found in {raw}: expected {raw / MNIST_FILES[0]}[.gz] and {files} there; "
        f"pass data_dir (--data-dir) or set CONTINUAL_BLR_DATA to the folder holding MNIST/raw ({why})"
    )


def _gunzip(src: Path, dst: Path) -> None:
    """Extract ``src`` to ``dst`` through a temporary name, so readers never see a partial file."""
    part = dst.with_name(f"{dst.name}.part{os.getpid()}")
    try:
        with gzip.open(src, "rb") as fin, open(part, "wb") as fout:
            shutil.copyfileobj(fin, fout)
        os.replace(part, dst)
    finally:
        with contextlib.suppress(OSError):
            part.unlink()


def _extract_in_place(raw: Path, names: list[str]) -> bool:
    """Extract ``<name>.gz`` beside itself for every name; ``False`` if the folder is not writable."""
    try:
        for f in names:
            _gunzip(raw / f"{f}.gz", raw / f)
    except OSError:
        return False
    return True


@contextlib.contextmanager
def _readable_root(root: Path, download: bool) -> Iterator[Path]:
    """A root under which ``MNIST/raw`` holds the four extracted files (see the module docstring)."""
    raw = root / "MNIST" / "raw"
    missing = [f for f in MNIST_FILES if not (raw / f).is_file()]
    if missing and all((raw / f"{f}.gz").is_file() for f in missing):
        if not _extract_in_place(raw, missing):  # read-only data folder: a temporary copy
            with tempfile.TemporaryDirectory(prefix="continual_blr_mnist_") as tmp:
                tmp_raw = Path(tmp) / "MNIST" / "raw"
                tmp_raw.mkdir(parents=True)
                for f in MNIST_FILES:
                    if f in missing:
                        _gunzip(raw / f"{f}.gz", tmp_raw / f)
                    else:
                        os.symlink((raw / f).resolve(), tmp_raw / f)
                yield Path(tmp)
            return
    elif missing and not download:
        raise _not_found(raw, "download=False")
    elif missing:
        from torchvision.datasets import MNIST

        try:
            with no_litter(raw):  # a failed download leaves no empty MNIST/raw behind
                MNIST(str(root), train=True, download=True)
        except Exception as err:  # network errors surface as RuntimeError, URLError or OSError
            raise _not_found(raw, f"download failed: {_one_line(err)}") from err
    yield root


def load_mnist(data_dir: str | os.PathLike[str] | None = None, *, download: bool = True) -> ArraySplits:
    """Read MNIST as uint8 images ``(N, 1, 28, 28)`` and int64 labels (60,000 train / 10,000 test).

    Args:
        data_dir: the data root (holding ``MNIST/raw``); resolved by ``resolve_data_dir``.
        download: let torchvision try to download missing files.

    Returns:
        The arrays; images stay uint8 (tasks divide them by 255 when they are built).

    Raises:
        DataNotFoundError: the files are missing and could not be downloaded.
    """
    from torchvision.datasets import MNIST  # imported here: torchvision is slow to import

    root = resolve_data_dir(data_dir)
    with _readable_root(root, download) as readable:
        train = MNIST(str(readable), train=True, download=False)
        test = MNIST(str(readable), train=False, download=False)
        return ArraySplits(train.data.unsqueeze(1), train.targets.to(torch.int64),
                           test.data.unsqueeze(1), test.targets.to(torch.int64))


def split_mnist(
    data_dir: str | os.PathLike[str] | None = None,
    *,
    scenario: str = "task",
    seed: int = 0,
    download: bool = True,
    max_per_task: int | None = None,
    max_test_per_task: int | None = None,
) -> TaskStream:
    """Split MNIST: 5 tasks of two digits each.

    Args:
        data_dir: the data root (see :func:`load_mnist`).
        scenario: ``"task"`` (multi-head, labels 0/1, head = task id) or ``"class"`` (one head,
            labels 0-9).
        seed: seeds the subsets drawn for ``max_per_task`` / ``max_test_per_task``.
        download: let torchvision try to download missing files.
        max_per_task: keep at most this many training images per task.
        max_test_per_task: keep at most this many test images per task.

    Returns:
        The stream, ``input_shape == (1, 28, 28)``.
    """
    check_scenario("split_mnist", scenario, ("task", "class"))
    data = load_mnist(data_dir, download=download)
    tasks = split_tasks(data, DIGIT_PAIRS, scenario, name="split_mnist", max_per_task=max_per_task,
                        max_test_per_task=max_test_per_task, generator=subsample_generator(seed))
    return TaskStream(
        name="split_mnist",
        tasks=tasks,
        scenario=scenario,
        input_shape=(1, 28, 28),
        n_outputs=2 if scenario == "task" else 10,
        n_heads=len(tasks) if scenario == "task" else 1,
        meta={"seed": int(seed)},
    )


def permuted_mnist(
    data_dir: str | os.PathLike[str] | None = None,
    *,
    n_tasks: int = 10,
    scenario: str = "domain",
    seed: int = 0,
    download: bool = True,
    max_per_task: int | None = None,
    max_test_per_task: int | None = None,
) -> TaskStream:
    """Permuted MNIST: task 0 plain MNIST, tasks 1.. with a fixed pixel permutation each.

    Memory: every task holds its own float32 copy (about 220 MB per task on full MNIST).

    Args:
        data_dir: the data root (see :func:`load_mnist`).
        n_tasks: number of tasks, including the unpermuted first one.
        scenario: only ``"domain"``.
        seed: seeds the ``torch.Generator`` the permutations are drawn from
            (``meta["permutations"]``, shape ``(n_tasks, 784)``, row 0 the identity).
        download: let torchvision try to download missing files.
        max_per_task: keep at most this many training images per task.
        max_test_per_task: keep at most this many test images per task.

    Returns:
        The stream: one 10-way head, labels 0-9 in every task.
    """
    check_scenario("permuted_mnist", scenario, ("domain",))
    data = load_mnist(data_dir, download=download)
    perms = draw_permutations(n_tasks, 28 * 28, torch.Generator().manual_seed(int(seed)))
    tasks = permuted_tasks(data, perms, name="permuted_mnist", max_per_task=max_per_task,
                           max_test_per_task=max_test_per_task, generator=subsample_generator(seed))
    return TaskStream(
        name="permuted_mnist",
        tasks=tasks,
        scenario="domain",
        input_shape=(1, 28, 28),
        n_outputs=10,
        n_heads=1,
        meta={"seed": int(seed), "permutations": perms},
    )
