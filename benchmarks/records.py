"""Run records: what every benchmark run leaves behind, small enough to commit (kilobytes, no weights, no data).

A record is one JSON file per (benchmark, scenario, mode, method, seed) under ``benchmarks/records/`` holding the
run's ``StreamResult`` (accuracy matrix, metrics, the run config), its cost (``wall_s``, ``cpu_s``, threads, load at
start) and its provenance (:func:`provenance`):

* ``commit`` — ``git rev-parse HEAD`` of the checkout, and ``dirty`` — whether tracked files under
  ``continual_blr/``, ``configs/`` or ``benchmarks/`` (not its ``records/`` and ``results/``, which runs write)
  differed from that commit when the run started. Where
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


DIRTY_STATUS = ("status", "--porcelain", "--untracked-files=no", "--", "continual_blr", "configs", "benchmarks",
                ":(exclude)benchmarks/records", ":(exclude)benchmarks/results")
"""The ``git`` call behind ``dirty``: tracked code and configs that differ from the commit. What runs write (records,
tables, reports) is left out, so that the second run in one checkout is not marked dirty by the first one's records."""


def provenance(device: str = "cpu") -> dict[str, Any]:
    """Commit, dirty flag, library hash, package versions and device of a run starting now."""
    import numpy
    import torch

    try:
        import sklearn

        sk = sklearn.__version__
    except ImportError:  # pragma: no cover - an extra
        sk = None
    status = _git(*DIRTY_STATUS)
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
               records_dir: Path = RECORDS_DIR, root: Path | None = None) -> bool:
    """Whether ``record`` is current (:func:`currency`): its config and the code it executed are unchanged (a record
    with a fingerprint), or it ran on today's library or one checked equivalent for ``folder`` (a record without).
    ``current_hash`` is kept for callers of the old rule and is only used for records without a fingerprint."""
    root = Path(root or ROOT)
    if record.get("fingerprint") is None and current_hash is not None:
        return not config_changes(record, root) and is_current_by_library(record, current_hash, folder, records_dir)
    return currency(record, folder, records_dir, root)[0]


# --------------------------------------------------------------------------------------------------------------------
# Currency from the code a run executed (the rule since issue 39; the library-hash rule above is kept for records
# made before it, which carry no fingerprint).
#
# A record made now holds ``fingerprint`` (``fingerprint.py``: every function / class body / module body of the
# imported package that ran, with the hash of its syntax tree) and its resolved ``config``. It is **current** while
# (1) its config resolves the same today (:func:`config_changes`: the YAML it names, read again) and (2) every entry
# of its fingerprint hashes the same in today's sources, or was checked side by side to give the same numbers
# (``check_equivalence.py --side-by-side`` writes ``equivalent_code.json``). An edit to code the run never executed,
# or to comments and docstrings anywhere, stales nothing, and no CPU is named in the rule: a record made on one CPU
# stays current on any other. A record with no fingerprint falls back to the library-hash rule.
# --------------------------------------------------------------------------------------------------------------------

import datetime as _dt  # noqa: E402

import fingerprint as _fingerprint  # noqa: E402

EQUIVALENT_CODE = "equivalent_code.json"  # under a records folder's root, beside EQUIVALENCES
# RunConfig fields set by the command or the machine, not by the config file: a record's folder and file name
# (scenario, mode, seed) or its machine (data root, device) say them, so they are not compared.
COMMAND_FIELDS = {"seed", "device", "out", "progress", "quick", "imports", "method", "train_used"}  # the last two: derived
COMMAND_STREAM_FIELDS = {"data_dir", "validation", "scenario"}
# how the steps execute, not what they compute (to round-off, as the device): reproduce.py --compile
COMMAND_TRAIN_FIELDS = {"compile"}
_START: dict[str, Any] = {}


def now_utc() -> str:
    """The time now, UTC, ISO 8601 to the second."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def process_start() -> dict[str, Any]:
    """Commit, dirty flag and their source, and the time, read once at this process's first call (call it when the
    process starts: a checkout that moves while a long command runs does not change what its records say)."""
    if not _START:
        status = _git(*DIRTY_STATUS)
        commit, source = _git("rev-parse", "HEAD"), "git"
        dirty = None if status is None else bool(status)
        if os.environ.get("CONTINUAL_BLR_COMMIT"):  # a GPU machine's copy: the sender knows what it sent
            commit, source = os.environ["CONTINUAL_BLR_COMMIT"], "env"
            flag = os.environ.get("CONTINUAL_BLR_DIRTY")
            dirty = None if flag not in ("0", "1") else flag == "1"
        _START.update(commit=commit, dirty=dirty, commit_source=source if commit else None, process_started=now_utc())
    return dict(_START)


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma", "sse4_2")


def device_info(device: str = "cpu") -> dict[str, Any]:
    """The CPU's model and its vector flags (those of ``CPU_FLAGS`` it has), and the GPU's name for a CUDA run."""
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = [f for f in CPU_FLAGS if f in have]
                break
    except OSError:
        pass
    gpu = None
    if str(device).startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(torch.device(device))
    return {"cpu": cpu_model(), "cpu_flags": flags, "gpu": gpu}


def imported_package_dir() -> Path:
    """The folder of the ``continual_blr`` package this process imports (not necessarily this checkout's)."""
    import continual_blr

    return Path(continual_blr.__file__).resolve().parent


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one dict of dotted keys (lists and other values kept whole)."""
    if not isinstance(d, dict) or not d:
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    config = {k: v for k, v in config.items() if k not in COMMAND_FIELDS}
    if isinstance(config.get("stream"), dict):
        config["stream"] = {k: v for k, v in config["stream"].items() if k not in COMMAND_STREAM_FIELDS}
    if isinstance(config.get("train"), dict):
        config["train"] = {k: v for k, v in config["train"].items() if k not in COMMAND_TRAIN_FIELDS}
    return config


_CONFIG_CACHE: dict[tuple[str, str], tuple[dict[str, Any], dict[str, Any]] | None] = {}


def resolved_config(config_file: str, root: Path = ROOT) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(the config file's run config with every default filled in, the keys the file sets itself) as the library
    under ``root`` reads it today; None if the file is gone."""
    key = (str(root), config_file)
    if key not in _CONFIG_CACHE:
        path = Path(root) / config_file
        if not path.is_file():
            _CONFIG_CACHE[key] = None
        else:
            import dataclasses

            from continual_blr.config import RunConfig, from_dict, yaml_load

            raw = yaml_load(path.read_text()) or {}
            _CONFIG_CACHE[key] = (dataclasses.asdict(from_dict(RunConfig, raw)), raw)
    return _CONFIG_CACHE[key]


def config_changes(record: dict[str, Any], root: Path = ROOT) -> list[str]:
    """The fields in which the record's run config differs from what its config file gives today (``[]``: the
    same). Fields the command or machine sets (``COMMAND_FIELDS``) are not compared. A field the library added
    since the record counts as unchanged unless the file sets it; ``["config_file"]`` if the file is gone; a
    record that names no config file is compared on nothing."""
    if not record.get("config_file") or not isinstance(record.get("config"), dict):
        return []
    now = resolved_config(record["config_file"], root)
    if now is None:
        return ["config_file"]
    resolved, raw = now
    old, new = _flatten(_comparable(record["config"])), _flatten(_comparable(resolved))
    methods_old, methods_new = old.pop("methods", None), new.pop("methods", None)
    set_by_file = set(_flatten(_comparable(raw)))
    out = [k for k in sorted(set(old) | set(new))
           if (k in old and k in new and old[k] != new[k]) or (k in old) != (k in new) and (k in old or k in set_by_file)]
    if methods_old != methods_new:
        out.append("methods")
    return out


def code_declarations(records_dir: Path = RECORDS_DIR) -> list[dict[str, Any]]:
    """Side-by-side equivalence declarations (``check_equivalence.py --side-by-side``): each says that, for the rows
    it names, the code entry ``entry`` hashing ``to`` gives the numbers of the same entry hashing ``from``."""
    path = Path(records_dir) / EQUIVALENT_CODE
    return json.loads(path.read_text())["declarations"] if path.is_file() else []


def equivalent_code(folder: str | None, method: str | None, records_dir: Path = RECORDS_DIR,
                    root: Path = ROOT) -> dict[str, set[str]]:
    """entry → the old hashes declared (directly or through a chain) to give the numbers of its hash today, for the
    records folder ``folder`` and row ``method``."""
    decls = [d for d in code_declarations(records_dir)
             if folder is not None and d["folder"] == folder and (not d.get("methods") or method in d["methods"])]
    if not decls:
        return {}
    today = _fingerprint.source_hashes({d["entry"] for d in decls}, root)
    out: dict[str, set[str]] = {}
    for entry, now in today.items():
        seen, grew = {now}, True
        while grew:
            grew = False
            for d in decls:
                if d["entry"] == entry and d["to"] in seen and d["from"] not in seen:
                    seen.add(d["from"])
                    grew = True
        out[entry] = seen - {now}
    return out


def currency(record: dict[str, Any], folder: str | None = None, records_dir: Path = RECORDS_DIR,
             root: Path = ROOT) -> tuple[bool, str]:
    """(whether ``record`` is current, why not): see the comment above. ``folder`` is the records folder it lies in
    relative to ``records_dir`` (declarations are per folder)."""
    changed = config_changes(record, root)
    if changed:
        return False, "config changed: " + ", ".join(changed)
    fp = record.get("fingerprint")
    if fp is None:
        ok = is_current_by_library(record, library_hash(root), folder, records_dir)
        return ok, "" if ok else f"no fingerprint, library {record.get('library_hash')} is not today's"
    method = record.get("method_name") or record.get("method")
    changed = _fingerprint.changed_entries(fp, root, equivalent_code(folder, method, records_dir, root))
    return (not changed), ("" if not changed else "code changed: " + ", ".join(changed))


def is_current_by_library(record: dict[str, Any], current_hash: str, folder: str | None,
                          records_dir: Path = RECORDS_DIR) -> bool:
    """The rule for records without a fingerprint: the library hash is today's or declared equivalent to it."""
    if record.get("library_hash") == current_hash:
        return True
    method = record.get("method_name") or record.get("method") or ""
    return folder is not None and record.get("library_hash") in equivalent_hashes(current_hash, folder, records_dir,
                                                                                  method)


def run_provenance(device: str = "cpu") -> dict[str, Any]:
    """What a record made now holds about where it ran: :func:`process_start` (commit, dirty flag, read at process
    start), the hash of the package actually imported, versions and :func:`device_info`."""
    import numpy
    import torch

    try:
        import sklearn

        sk = sklearn.__version__
    except ImportError:  # pragma: no cover - an extra
        sk = None
    pkg = imported_package_dir()
    info = device_info(device)
    return process_start() | {
        "library_hash": process_library_hash(pkg.parent),
        "package_dir_is_checkout": pkg.parent == ROOT,
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
                     "scikit-learn": sk},
        "device": info["gpu"] or info["cpu"], "device_info": info}


_COMMIT_LIBRARY: dict[str, str | None] = {}


def commit_library_hash(commit: str) -> str | None:
    """:func:`library_hash` of the library as committed at ``commit`` (read from git, no checkout); None if the
    commit does not exist here."""
    if commit not in _COMMIT_LIBRARY:
        listing = _git("ls-tree", "-r", commit, "--", "continual_blr")
        if listing is None:
            _COMMIT_LIBRARY[commit] = None
            return None
        files = []
        for line in listing.splitlines():
            meta, path = line.split("\t", 1)
            if Path(path).suffix in (".py", ".c") and "__pycache__" not in path:
                files.append((path, meta.split()[2]))
        h = hashlib.sha256()
        blobs = subprocess.run(["git", "cat-file", "--batch"], cwd=ROOT, capture_output=True,
                               input="".join(f"{sha}\n" for _, sha in sorted(files)).encode()).stdout
        pos = 0
        for path, sha in sorted(files):
            header_end = blobs.index(b"\n", pos)
            size = int(blobs[pos:header_end].split()[2])
            data = blobs[header_end + 1: header_end + 1 + size]
            pos = header_end + 1 + size + 1
            h.update(path.encode())
            h.update(b"\0")
            h.update(data)
            h.update(b"\0")
        _COMMIT_LIBRARY[commit] = h.hexdigest()[:16]
    return _COMMIT_LIBRARY[commit]


def commit_check(record: dict[str, Any]) -> str:
    """Whether the commit a record names holds the library it ran: ``ok``, ``dirty`` (it ran on uncommitted
    changes of that commit), ``unknown commit`` (no such commit here: typed by hand), ``library differs`` (the
    commit's library is not the record's), or ``no commit``."""
    commit = record.get("commit")
    if not commit:
        return "no commit"
    lib = commit_library_hash(commit)
    if lib is None:
        return "unknown commit"
    if lib == record.get("library_hash"):
        return "ok"
    return "dirty" if record.get("dirty") else "library differs"


class TracedRun:
    """The tracing every record-writing script shares: ``with TracedRun(cfg) as t: run_config(cfg, on_epoch=t.on_epoch)``
    then ``record |= t.fields()``: start and end time and the fingerprint of the code the run executed (the hook is
    gated by the epochs of ``cfg``'s first method, ``fingerprint.ExecutedCode.epoch_hook``)."""

    def __init__(self, cfg: Any) -> None:
        from continual_blr.runner import _train_for

        self.executed = _fingerprint.ExecutedCode(imported_package_dir())
        self.on_epoch = self.executed.epoch_hook(_train_for(cfg, cfg.methods[0].train).epochs)
        self.started = now_utc()

    def __enter__(self) -> "TracedRun":
        self.executed.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.executed.__exit__(*exc)

    def fields(self, entries: set[str] | None = None, started: str | None = None) -> dict[str, Any]:
        """``started``, ``ended`` and ``fingerprint`` for the record (``entries``: the code several processes
        executed, for a resumed run; default this process's)."""
        entries = self.executed.entries() if entries is None else entries
        return {"started": started or self.started, "ended": now_utc(),
                "fingerprint": _fingerprint.source_hashes(entries, imported_package_dir().parent),
                "fingerprint_format": "3.11"}
