"""Run records: what every benchmark run leaves behind, small enough to commit (kilobytes, no weights, no data).

A record is one JSON file per (benchmark, scenario, mode, method, seed) under ``benchmarks/records/`` holding the
run's ``StreamResult`` (accuracy matrix, metrics, the run config), its cost (``wall_s``, ``cpu_s``, threads, load at
start) and its provenance (:func:`provenance`):

* ``commit`` — ``git rev-parse HEAD`` of the checkout, and ``dirty`` — whether tracked files under
  ``continual_blr/``, ``configs/`` or ``benchmarks/`` differed from that commit when the run started. Where
  ``CONTINUAL_BLR_COMMIT`` (and ``CONTINUAL_BLR_DIRTY``, ``0``/``1``) is set, it wins over git: a copy sent to a
  GPU machine may carry an older checkout's ``.git``, and the sender knows which commit it sent. The record says
  where the commit came from (``commit_source``: ``git`` or ``env``);
* ``library_hash`` — the SHA-256 of every ``continual_blr/**/*.py`` file's path and bytes (:func:`library_hash`);
* ``versions`` — Python, torch, numpy, scikit-learn; ``device`` — the CPU model (or the CUDA device's name);
* ``resolved_params`` — the method's parameters with every default filled in.

Staleness. A record is **current** while ``library_hash`` equals the hash of the library as it is now: any change
to any module of the package makes every record stale (a deliberately coarse rule: a change anywhere in the package
may change a number, and a finer rule would have to know which modules a run imported). ``reproduce.py`` reuses a
stored record only while it is current and made with the same method settings; otherwise it runs again. Tables are
generated from records alone (current or not), and state, per row, whether its records are current.

**Checked equivalence.** A library change that should not move any number (a faster path computing the same
operations, a new CLI flag) would still make every record stale. ``benchmarks/check_equivalence.py`` tests that
claim instead of trusting it: for one records folder (one table) it reruns, on the library as it is now, the lowest
seed of every row made on an older library A, and only if every rerun gives the **same accuracy matrix to the last
bit** and the same resolved parameters does it declare, in ``<records>/equivalent_libraries.json``, that A's
records of that row and folder give the current library's numbers (the rows that differ, or whose config changed,
are left out and stay stale). A record made on A then counts as current (:func:`is_current` with ``folder``);
declarations chain (A → B → C). The check is a sample (one seed per row), so the declaration says which runs were
compared; a row whose checked run changed is never declared.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECORDS_DIR = ROOT / "benchmarks" / "records"


_PROCESS_HASH: dict[Path, str] = {}


def process_library_hash(root: Path = ROOT) -> str:
    """:func:`library_hash` as it was at this process's first call — the code a long-running command imported, even
    if the files change while it runs (``provenance`` uses this, so a record names the code that made it)."""
    if root not in _PROCESS_HASH:
        _PROCESS_HASH[root] = library_hash(root)
    return _PROCESS_HASH[root]


def library_hash(root: Path = ROOT) -> str:
    """SHA-256 over the sorted relative paths and bytes of the library's sources, ``continual_blr/**/*.py`` and the
    C source of the native update (``*.c``) (first 16 hex digits)."""
    h = hashlib.sha256()
    pkg = root / "continual_blr"
    for p in sorted(q for q in pkg.rglob("*") if q.suffix in (".py", ".c") and "__pycache__" not in q.parts):
        h.update(str(p.relative_to(root)).encode())
        h.update(b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def cpu_model() -> str:
    """The CPU's model name (``lscpu``, else /proc/cpuinfo, else ``platform.processor()``)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(device: str = "cpu") -> dict[str, Any]:
    """Commit, dirty flag, library hash, package versions and device of a run starting now."""
    import numpy
    import torch

    try:
        import sklearn

        sk = sklearn.__version__
    except ImportError:  # pragma: no cover - an extra
        sk = None
    status = _git("status", "--porcelain", "--untracked-files=no", "--", "continual_blr", "configs", "benchmarks")
    commit, source = _git("rev-parse", "HEAD"), "git"
    dirty = None if status is None else bool(status)
    if os.environ.get("CONTINUAL_BLR_COMMIT"):  # the sender knows; a copied .git may be an older checkout's
        commit, source = os.environ["CONTINUAL_BLR_COMMIT"], "env"
        flag = os.environ.get("CONTINUAL_BLR_DIRTY")
        dirty = None if flag not in ("0", "1") else flag == "1"
    dev = cpu_model()
    if str(device).startswith("cuda") and torch.cuda.is_available():
        dev = torch.cuda.get_device_name(torch.device(device))
    return {"commit": commit, "dirty": dirty, "commit_source": source if commit else None,
            "library_hash": process_library_hash(),
            "versions": {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
                         "scikit-learn": sk},
            "device": dev}


EQUIVALENCES = "equivalent_libraries.json"  # under a records folder's root (RECORDS_DIR for the committed records)


def declarations(records_dir: Path = RECORDS_DIR) -> list[dict[str, Any]]:
    """The checked equivalence declarations of ``records_dir`` (see the module docstring); [] if none."""
    path = Path(records_dir) / EQUIVALENCES
    return json.loads(path.read_text())["declarations"] if path.is_file() else []


def _covers(decl: dict[str, Any], folder: str, method: str | None) -> bool:
    """Whether a declaration covers ``folder`` and, if it names rows, ``method`` (None: any row)."""
    if folder not in decl["folders"]:
        return False
    rows = (decl.get("methods") or {}).get(folder)
    return rows is None or method is None or method in rows


def equivalent_hashes(current: str, folder: str, records_dir: Path = RECORDS_DIR, method: str | None = None) -> set[str]:
    """``current`` and every library hash declared, directly or through a chain, to give the same numbers as
    ``current`` for the records folder ``folder`` (``<benchmark>/<scenario>/<mode>``, relative to ``records_dir``)
    and, if given, the row ``method`` (a declaration names the rows it checked)."""
    decls = [d for d in declarations(records_dir) if _covers(d, folder, method)]
    out, grew = {current}, True
    while grew:
        grew = False
        for d in decls:
            if d["to"] in out and d["from"] not in out:
                out.add(d["from"])
                grew = True
    return out


def is_current(record: dict[str, Any], current_hash: str | None = None, folder: str | None = None,
               records_dir: Path = RECORDS_DIR) -> bool:
    """Whether ``record`` ran on the library as it is now, or (with ``folder``, the records folder it lies in) on
    a library checked to give the same numbers for that folder (see the module docstring)."""
    current = current_hash or library_hash()
    if record.get("library_hash") == current:
        return True
    method = record.get("method_name") or record.get("method") or ""
    return folder is not None and record.get("library_hash") in equivalent_hashes(current, folder, records_dir, method)
