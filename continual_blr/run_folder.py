"""Run folders: where a run's files go, written atomically and only by the main process.

Every file a run writes goes through :class:`RunFolder`, which

* writes nothing unless ``continual_blr.distributed.is_main_process()`` (rank 0 of a data-parallel run);
* writes whole files atomically: a temporary file in the same folder, then ``os.replace``, so a run
  killed at any moment leaves each file either as it was or complete, never half-written.

Layout (see ``docs/runs.md``):

    <run>/results.json              config + every method's StreamResult so far + progress per method
    <run>/results.md                the table of final accuracies (so far)
    <run>/accuracy_matrix.png       heatmaps of R[i, j] (so far)
    <run>/<method>/checkpoint.pt    the last finished task boundary (model, method, RNG, accuracy rows)
    <run>/<method>/model.pt         the trained network (written when the method has finished)
    <run>/<method>/method.pt        the method's state (idem)
    <run>/<method>/train_log.csv    task, epoch, mean training loss
    <run>/<method>/accuracy.csv     after_task, task, accuracy
    <run>/tensorboard/<method>/     TensorBoard events (with ``--tensorboard``)

Folder policy (no silent overwrite): :func:`new_run_dir` makes a fresh time-stamped folder and points
``<root>/latest`` at it; a folder that already holds a run (``results.json``) is refused by
:func:`check_out_dir` unless the caller overwrites (:func:`clear_run`) or resumes it.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .distributed import broadcast_object, is_main_process

__all__ = ["RunFolder", "RunExistsError", "RunInUseError", "RunNotFoundError", "RunFileError", "hold_lock", "run_lock",
           "read_json", "load_torch", "load_weights", "check_writable", "new_run_dir", "check_out_dir", "clear_run",
           "find_generators", "generator_states", "load_generator_states", "deferred_interrupts", "RESULTS"]

RESULTS = "results.json"
LOCK = ".lock"  # held (flock) by the process writing the folder: run_lock
CHECKPOINT = "checkpoint.pt"


class RunExistsError(ValueError):
    """The output folder already holds a run and neither overwriting nor resuming was asked for."""


class RunNotFoundError(ValueError):
    """A folder given to resume holds no run (no ``results.json``)."""


class RunInUseError(RunExistsError):
    """Another process holds the folder's lock (:func:`run_lock`)."""


class RunFileError(ValueError):
    """A file of a run folder cannot be read (truncated, empty, not what the run writes), or a place to write
    is not writable: one line naming the file (or the option) and what is expected."""


def read_json(path: str | Path) -> Any:
    """The parsed JSON file ``path``.

    Raises:
        RunFileError: the file is not valid JSON (one line with the file's name, line and column).
    """
    p = Path(path)
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise RunFileError(f"{p}: not valid JSON ({err.msg}, line {err.lineno} column {err.colno}); the file is "
                           "truncated or was not written by continual-blr") from None
    except UnicodeDecodeError:
        raise RunFileError(f"{p}: not a text file; expected the JSON continual-blr writes") from None


def load_torch(path: str | Path, map_location: Any = "cpu") -> Any:
    """``torch.load`` of a run's own file (``weights_only=True`` first, the full unpickler for method states
    holding other objects: a run folder is trusted input).

    Raises:
        RunFileError: the file is empty, truncated or not a ``torch.save`` file (one line naming it).
    """
    p = Path(path)
    try:
        return torch.load(p, map_location=map_location, weights_only=True)
    except Exception:  # noqa: BLE001 - a state with non-tensor objects, or a broken file: try the full unpickler
        pass
    try:
        return torch.load(p, map_location=map_location, weights_only=False)
    except Exception as err:  # noqa: BLE001 - every way a damaged file fails to unpickle
        size = p.stat().st_size if p.is_file() else 0
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise RunFileError(f"{p}: cannot be read ({size} bytes; {type(err).__name__}: {first[:120]}); the file is "
                           "empty, truncated or not written by continual-blr") from None


def load_weights(model: nn.Module, state: dict[str, Any], what: str) -> None:
    """``model.load_state_dict(state)`` with a one-line error when the weights do not fit the network.

    Raises:
        RunFileError: missing, unexpected or differently shaped weights (the first of them named).
    """
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        detail = next((ln.strip() for ln in str(err).splitlines()[1:] if ln.strip()), str(err).splitlines()[0])
        raise RunFileError(f"{what}: the saved weights do not fit the network its config builds ({detail[:160]}); "
                           "was the run folder's config edited, or a file copied from another run?") from None


def check_writable(path: str | Path, option: str, *, folder: bool = True) -> None:
    """Refuse a place to write that cannot be written, before any work: ``path`` (a folder, or with
    ``folder=False`` a file whose parent folder is checked) must be creatable. The missing folders are
    created to try and removed again, so nothing is left behind.

    Raises:
        RunFileError: one line naming ``option``, the path and the reason.
    """
    p = Path(path)
    if folder and p.exists() and not p.is_dir():
        raise RunFileError(f"{option}: {p} is a file; allowed: a folder (new or holding a run)")
    if not folder and p.is_dir():
        raise RunFileError(f"{option}: {p} is a folder; allowed: a file name")
    target = p if folder else p.parent
    created = []
    try:
        probe = target
        missing = []
        while not probe.exists():
            missing.append(probe)
            probe = probe.parent
        if not probe.is_dir():
            raise NotADirectoryError(f"{probe} is a file")
        for d in reversed(missing):
            d.mkdir()
            created.append(d)
        fd, tmp = tempfile.mkstemp(dir=target, prefix=".write-test-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as err:
        reason = err.strerror or str(err)
        raise RunFileError(f"{option}: cannot write to {p} ({reason})") from None
    finally:
        for d in reversed(created):
            with contextlib.suppress(OSError):
                d.rmdir()


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path`` (same suffix), then rename it onto ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the permissions open() would
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class RunFolder:
    """The one writer of a run folder (atomic files; nothing written off the main process).

    Args:
        path: the run folder.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def writes(self) -> bool:
        """True when this process writes (rank 0)."""
        return is_main_process()

    def write_text(self, rel: str, text: str) -> None:
        """Write ``text`` to ``<run>/<rel>`` atomically."""
        if self.writes:
            _atomic_write(self.path / rel, lambda p: p.write_text(text))

    def write_json(self, rel: str, obj: Any) -> None:
        """Write ``obj`` as indented JSON to ``<run>/<rel>`` atomically."""
        self.write_text(rel, json.dumps(obj, indent=2))

    def save_torch(self, rel: str, obj: Any) -> None:
        """``torch.save`` ``obj`` to ``<run>/<rel>`` atomically."""
        if self.writes:
            _atomic_write(self.path / rel, lambda p: torch.save(obj, p))

    def keep_copy(self, rel: str, copy_rel: str) -> None:
        """Keep the file ``<run>/<rel>`` as it is now under ``<run>/<copy_rel>`` too: a hard link (no bytes
        written; a later atomic rewrite of ``rel`` leaves the copy as it was), else a byte copy where the file
        system has no hard links. An existing ``copy_rel`` is replaced."""
        if not self.writes:
            return
        src, dst = self.path / rel, self.path / copy_rel

        def link(tmp: Path) -> None:
            tmp.unlink()
            try:
                os.link(src, tmp)
            except OSError:
                shutil.copyfile(src, tmp)

        _atomic_write(dst, link)

    def save_figure(self, rel: str, draw: Callable[[Path], Any]) -> None:
        """``draw(path)`` writes a figure; it is given a temporary path with the same suffix."""
        if self.writes:
            _atomic_write(self.path / rel, draw)

    def write_csv(self, rel: str, header: list[str], rows: list[list[Any]]) -> None:
        """Write a whole CSV file atomically (header + rows)."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(header)
        w.writerows(rows)
        self.write_text(rel, buf.getvalue())

    def append_csv(self, rel: str, header: list[str], row: list[Any]) -> None:
        """Append one row to a CSV log (the header first when the file is new). Appends are not atomic:
        a log may lose its last row when killed; :meth:`trim_csv` cleans up on resume."""
        if not self.writes:
            return
        p = self.path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        new = not p.is_file()
        with p.open("a", newline="") as f:
            w = csv.writer(f, lineterminator="\n")
            if new:
                w.writerow(header)
            w.writerow(row)

    def trim_csv(self, rel: str, keep: Callable[[dict[str, str]], bool]) -> None:
        """Keep only the rows of ``<run>/<rel>`` for which ``keep(row)`` (e.g. finished tasks on resume)."""
        p = self.path / rel
        if not self.writes or not p.is_file():
            return
        with p.open(newline="") as f:
            reader = csv.DictReader(f)
            header = list(reader.fieldnames or [])
            rows = [[r[h] for h in header] for r in reader if _complete(r, header) and keep(r)]
        self.write_csv(rel, header, rows)

    def remove(self, rel: str) -> None:
        """Delete ``<run>/<rel>`` (file or folder) if present."""
        if not self.writes:
            return
        p = self.path / rel
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()

    def read_results(self) -> dict[str, Any] | None:
        """The parsed ``results.json``, or None when there is none."""
        p = self.path / RESULTS
        return read_json(p) if p.is_file() else None


def _complete(row: dict[str, str | None], header: list[str]) -> bool:
    return all(row.get(h) not in (None, "") for h in header)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def new_run_dir(root: str | Path, stream: str, methods: list[str], now: float | None = None) -> Path:
    """Create ``<root>/<stream>-<methods>-<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ... when taken) and point
    ``<root>/latest`` at it (a symbolic link; a text file holding the folder's name where links fail).

    Only the main process chooses the name and creates anything; under ``torch.distributed`` the other
    ranks receive its choice (:func:`continual_blr.distributed.broadcast_object`).
    """
    root = Path(root)
    path = None
    if is_main_process():
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
        names = "+".join(methods) if len(methods) <= 3 else f"{'+'.join(methods[:3])}+{len(methods) - 3}more"
        base = _slug(f"{stream}-{names}-{stamp}")
        path, k = root / base, 1
        while path.exists():
            k += 1
            path = root / f"{base}-{k}"
        path.mkdir(parents=True)
        _point_latest(root, path.name)
    return Path(broadcast_object(None if path is None else str(path)))


def _point_latest(root: Path, name: str) -> None:
    latest = root / "latest"
    if latest.exists() and not latest.is_symlink() and latest.is_dir():
        return  # a real folder called "latest": leave it alone
    tmp = root / f".latest.{os.getpid()}"
    with contextlib.suppress(OSError):
        tmp.unlink()
    try:
        os.symlink(name, tmp)
        os.replace(tmp, latest)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        _atomic_write(latest, lambda p: p.write_text(name + "\n"))


@contextlib.contextmanager
def hold_lock(lock_file: str | Path, option: str = "--out", folder: str | Path | None = None) -> Iterator[None]:
    """Hold ``lock_file`` exclusively while the block runs, so that two processes never write one run
    (``folder``: the run it guards, for the message; default the lock file's folder).

    An advisory ``fcntl.flock`` on the file, taken without waiting: the operating system releases it when the
    holder exits, also on a crash or ``kill -9``, so a stale file never blocks a later run. The file keeps the
    holder's pid, host and start time for the refusal's message; it is removed (still locked) when the block ends,
    and a process that locked a file already removed opens the new one instead. Only the main process of a ``torch.distributed``
    run takes it (the others write nothing); where ``fcntl`` is missing (Windows) nothing is locked.

    Raises:
        RunInUseError: another process holds it (one line naming ``option``, the holder and what to do).
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        fcntl = None
    if fcntl is None or not is_main_process():
        yield
        return
    path = Path(lock_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "a process"
            f.close()
            raise RunInUseError(f"{option}: {folder or path.parent} is being written by another run ({holder}); wait "
                                f"for it to end, or choose another {option}") from None
        # the holder before us removes the file as it releases it: locked a file no longer at `path`? open it anew
        try:
            same = os.path.samestat(os.fstat(f.fileno()), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        f.close()
    try:
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {os.uname().nodename if hasattr(os, 'uname') else '?'}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # while still held, so the folder keeps no trace of a finished run
        f.close()  # releases the lock


@contextlib.contextmanager
def run_lock(path: str | Path, option: str = "--out") -> Iterator[None]:
    """:func:`hold_lock` on ``<path>/.lock`` for a run folder (``option``: the flag that named it, for the message).
    A folder this call created is removed again if the run left nothing in it but the lock (bad input leaves no
    folder behind)."""
    p = Path(path)
    if is_main_process():
        check_writable(p, option)  # a file, no permission: its own one-line refusal, before anything is created
    created = not p.exists()
    try:
        with hold_lock(p / LOCK, option):
            yield
    finally:
        if created and p.is_dir() and not any(p.iterdir()):
            with contextlib.suppress(OSError):
                p.rmdir()


def check_out_dir(path: str | Path, *, overwrite: bool = False) -> None:
    """Refuse a folder that holds a run unless ``overwrite``, and one that cannot be written (a file, no
    permission, a read-only file system).

    Under ``torch.distributed`` only the main process looks and every rank receives its verdict (a collective:
    every rank calls this at the same point). Otherwise a slower rank could find the ``results.json`` the main
    process had just begun writing and refuse the run it is part of (the torchrun ``--out`` race).

    Raises:
        RunExistsError: ``path`` holds a ``results.json`` and ``overwrite`` is False, or cannot be written
            (one line naming ``--out``).
    """
    p = Path(path)
    refusal = None
    if is_main_process():
        if (p / RESULTS).is_file() and not overwrite:
            refusal = (f"--out: {p} already holds a run (results.json); pass --overwrite to replace it, "
                       f"--resume {p} to continue it, or choose another --out")
        else:
            try:
                check_writable(p, "--out")
            except RunFileError as err:
                refusal = str(err)
    refusal = broadcast_object(refusal)
    if refusal is not None:
        raise RunExistsError(refusal)


def clear_run(path: str | Path) -> None:
    """Delete what a run wrote in ``path`` (its files and its methods' folders); other files are kept."""
    folder = RunFolder(path)
    payload = folder.read_results() or {}
    methods = [m.get("name") for m in payload.get("config", {}).get("methods", []) if isinstance(m, dict)]
    for rel in [RESULTS, "results.md", "accuracy_matrix.png", "tensorboard", *[m for m in methods if m]]:
        folder.remove(rel)


# ----- RNG state -------------------------------------------------------------------------------------


def find_generators(obj: Any, prefix: str = "", _seen: set[int] | None = None) -> dict[str, torch.Generator]:
    """Every ``torch.Generator`` reachable from ``obj`` through attributes, dicts, lists and tuples of
    this library's objects, by attribute path (``generator``, ``optimizer.generator``, ...), each object once.

    A method's own ``state_dict`` may leave its generators out; saving these next to it makes a resumed
    run draw the same random numbers (weight samples, Monte-Carlo labels, coreset choices) as an
    uninterrupted one.
    """
    seen = set() if _seen is None else _seen
    found: dict[str, torch.Generator] = {}
    if id(obj) in seen:
        return found
    seen.add(id(obj))
    if isinstance(obj, torch.Generator):
        found[prefix or "generator"] = obj
        return found
    if isinstance(obj, dict):
        items = [(str(k), v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(obj)]
    elif isinstance(obj, (nn.Module, torch.Tensor)):
        return found  # networks and tensors hold no generators; don't walk their internals
    elif type(obj).__module__.startswith(("continual_blr", "torch.optim")) and hasattr(obj, "__dict__"):
        items = list(vars(obj).items())
    else:
        return found
    for key, value in items:
        found.update(find_generators(value, f"{prefix}.{key}" if prefix else key, seen))
    return found


SAVED_BY_THE_BASE = ("regularizer", "generator", "likelihood", "sigma", "seed", "name", "params", "optimizer")
"""Attributes of a method that ``Method.state_dict`` saves, the loop sets again, or that are its settings (the
optimiser's state is checkpointed on its own)."""


def _same(a: Any, b: Any) -> bool:
    """Whether two attribute values hold the same state (tensors by value, modules by their state_dicts)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a.detach().cpu(), b.detach().cpu())))
    if isinstance(a, nn.Module) or isinstance(b, nn.Module):
        return isinstance(a, nn.Module) and isinstance(b, nn.Module) and _same(a.state_dict(), b.state_dict())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object without a usable ==: count it as changed
        return a is b


def unsaved_state(method: Any, fresh: Any) -> list[str]:
    """Attributes of ``method`` that changed since it was built (against ``fresh``, the same method built anew)
    and that its ``state_dict`` does not save: state a resumed run would lose.

    Only a method whose class keeps the base ``Method.state_dict`` is examined (one that defines its own is
    trusted to save what it carries: ``docs/own_method.md``); the base saves the regulariser and the generator.

    Returns:
        The attribute names, sorted (empty: a checkpoint of the method is complete).
    """
    from .methods.base import Method

    if type(method).state_dict is not Method.state_dict:
        return []
    now, then = vars(method), vars(fresh)
    return sorted(k for k in now if k not in SAVED_BY_THE_BASE and (k not in then or not _same(now[k], then[k])))


def generator_states(obj: Any) -> dict[str, torch.Tensor]:
    """``{path: generator.get_state()}`` for :func:`find_generators`."""
    return {k: g.get_state() for k, g in find_generators(obj).items()}


def load_generator_states(obj: Any, states: dict[str, torch.Tensor]) -> list[str]:
    """Set the generators of ``obj`` found at the saved paths; returns the saved paths not found."""
    gens = find_generators(obj)
    missing = []
    for k, s in states.items():
        if k in gens:
            gens[k].set_state(s)
        else:
            missing.append(k)
    return missing


# ----- interrupts ------------------------------------------------------------------------------------


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT / SIGTERM while a block runs (e.g. a checkpoint and the results written after a task),
    then raise ``KeyboardInterrupt`` if one arrived. Outside the main thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in old:
        signal.signal(s, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if got:
        raise KeyboardInterrupt
