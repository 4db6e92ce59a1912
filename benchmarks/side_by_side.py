"""Carry run records over a library change by comparing the old and the new library side by side, on this machine.

Run:

    python benchmarks/side_by_side.py --status                 # every row: current, or which code changed
    python benchmarks/side_by_side.py                          # probe every stale row; declare the equal ones
    python benchmarks/side_by_side.py --data-dir DIR           # the probes' data root (default $CONTINUAL_BLR_DATA)
    python benchmarks/side_by_side.py --backfill f181ee3       # fingerprint records made before fingerprints

A record is current while its config and the code it executed are unchanged (``records.currency``). When executed
code did change, this script runs, for the lowest seed of each stale row (records folder × method):

1. the record's library — a git worktree of the commit it ran on (``record_commit``), under ``--worktrees`` — and
   today's library, each in its own process, on the same short deterministic probe of the record's config
   (``probe.py``), under each CPU kernel path of ``KERNEL_PATHS`` (the default dispatch, and
   ``ATEN_CPU_CAPABILITY=default``, torch's plain C++ kernels);
2. it declares the row equivalent only if every probe pair agrees **bit for bit** (accuracy matrix and per-task
   training losses) and today's probe executed every changed entry (a probe that never reaches the changed code
   proves nothing about it: refused, the record needs a full rerun).

A record made on a GPU is refused without a probe when a changed entry is in :data:`DEVICE_NUMERICS` (the
precision policy, e.g. whether CUDA convolutions run in TF32): the CPU probe runs none of what it changes.

An equivalent row's changed entries are appended, old hash → new hash, to ``<records>/equivalent_code.json`` for
that folder and row, and the entries today's probe executed that the records lack are added to their fingerprints
(``carried_over`` in each record says when and from which probe), so a later edit of moved code stales them too.
When the new library is a clean commit (a worktree of it, ``--new-root``), each record is rebased onto it: its
fingerprint takes the new hashes and ``compare_commit`` names that commit, which the next check compares with.
No CPU is named: the old library runs here, so a record made on an AMD EPYC is carried over on an Intel Xeon.

``--backfill COMMIT``: records made before fingerprints existed (no ``fingerprint``) get one from a probe of their
row on a worktree of ``COMMIT``, for the rows that are current there by the library-hash rule; the record says
``fingerprint_source``. The probe traces every call; a branch that only the full run takes (a GPU-only path, a
late-epoch event) may be missing from a backfilled fingerprint.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import fingerprint  # noqa: E402
import records as run_records  # noqa: E402

ROOT = HERE.parent
KERNEL_PATHS = ("", "default")
PARALLEL = int(os.environ.get("SIDE_BY_SIDE_JOBS", "2"))  # probe processes at once (each one thread)
TABLE_FOLDER = re.compile(r"^((full|quick)(_validation[0-9.]+)?|table(_validation[0-9.]+)?)$")  # ATEN_CPU_CAPABILITY: "" = the machine's default dispatch


def rows(records_dir: Path) -> dict[tuple[str, str], list[Path]]:
    """(records folder relative to ``records_dir``, method) → its record files, lowest seed first."""
    out: dict[tuple[str, str], list[Path]] = {}
    for path in sorted(Path(records_dir).rglob("*_seed*.json")):
        if "superseded" in path.parts or path.relative_to(records_dir).parts[0] == "search":
            continue  # searches choose settings on validation; no table stands on their currency
        if not TABLE_FOLDER.match(path.parent.name):
            continue  # a scratch folder (an old check's reruns), not a table's records
        method, _, seed = path.stem.rpartition("_seed")
        if not seed.isdigit():
            continue
        out.setdefault((path.parent.relative_to(records_dir).as_posix(), method), []).append(path)
    return {k: sorted(v, key=lambda p: int(p.stem.rpartition("_seed")[2])) for k, v in out.items()}


def probe(record_paths: list[Path], root: Path, out: Path, kernel: str = "", extra: list[str] | None = None) -> list[dict]:
    """Run ``probe.py`` on the records' configs, one after the other, with the library under ``root`` in one fresh
    process (``kernel``: its ``ATEN_CPU_CAPABILITY``, "" for the machine's default)."""
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    env.pop("ATEN_CPU_CAPABILITY", None)
    if kernel:
        env["ATEN_CPU_CAPABILITY"] = kernel
    cmd = [sys.executable, str(HERE / "probe.py"), "--record", *map(str, record_paths), "--root", str(root),
           "--out", str(out), *(extra or [])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        raise RuntimeError(f"probe of {', '.join(p.name for p in record_paths)} on {root} failed: {tail}")
    return json.loads(out.read_text())


def worktree(commit: str, where: Path) -> Path:
    """A git worktree of ``commit`` under ``where`` (made once, reused)."""
    path = Path(where) / f"wt-{commit[:12]}"
    if not (path / "continual_blr").is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(path), commit], cwd=ROOT, check=True,
                       capture_output=True)
    return path


def record_commit(record: dict[str, Any]) -> str | None:
    """The commit whose library the record ran: a backfilled fingerprint's commit, else the record's own commit
    when it was clean (a dirty run's library is no commit's)."""
    if record.get("compare_commit"):  # carried over to a later library (declare)
        return record["compare_commit"]
    source = record.get("fingerprint_source") or {}
    if source.get("commit"):
        return source["commit"]
    return record.get("commit") if record.get("dirty") is False else None


def compare(items: list[tuple[Path, list[str]]], old_root: Path, new_root: Path,
            kernels: tuple[str, ...] = KERNEL_PATHS, extra: list[str] | None = None) -> list[dict[str, Any]]:
    """Probe each (record, its changed entries) on both libraries under each kernel path — one process per library
    and kernel path for all of them — and give each its verdict and evidence."""
    paths = [p for p, _ in items]
    pairs: list[list[dict]] = [[] for _ in items]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        jobs = {(kernel, side): pool.submit(probe, paths, root, Path(tmp) / f"{side}{kernel}.json", kernel, extra)
                for kernel in kernels for side, root in (("old", old_root), ("new", new_root))}
        for kernel in kernels:
            old, new = jobs[(kernel, "old")].result(), jobs[(kernel, "new")].result()
            for i, (o, n) in enumerate(zip(old, new)):
                same = o["acc_matrix"] == n["acc_matrix"] and o["train_loss"] == n["train_loss"]
                pairs[i].append({"kernel": kernel or "machine default", "equal": same, "fingerprint": n["fingerprint"],
                                 "train_loss_old": o["train_loss"], "train_loss_new": n["train_loss"]})
    out = []
    for (_, changed), ps in zip(items, pairs):
        reached = set().union(*(p.pop("fingerprint") for p in ps))
        fp = {e: h for e, h in fingerprint.source_hashes(reached, new_root).items()}
        gone = {e for e, h in fingerprint.source_hashes(set(changed), new_root).items() if h == "missing"}
        unreached = sorted(set(changed) - reached - gone)  # removed code cannot be reached; the numbers must agree
        equal = all(p["equal"] for p in ps)
        reason = "" if equal and not unreached else (
            "probe numbers differ" if not equal else "the probe does not execute " + ", ".join(unreached))
        out.append({"equivalent": equal and not unreached, "reason": reason, "pairs": ps, "unreached": unreached,
                    "probe_fingerprint": fp})
    return out


def declare(records_dir: Path, folder: str, method: str, paths: list[Path], record: dict[str, Any], changed: list[str],
            verdict: dict[str, Any], new_root: Path) -> None:
    """Append the changed entries' old → new hashes for (folder, method) and extend the row's fingerprints."""
    today = fingerprint.source_hashes(set(changed), new_root)
    file = Path(records_dir) / run_records.EQUIVALENT_CODE
    data = json.loads(file.read_text()) if file.is_file() else {"declarations": []}
    when = run_records.now_utc()
    for entry in changed:
        data["declarations"].append({"entry": entry, "from": record["fingerprint"][entry], "to": today[entry],
                                     "folder": folder, "methods": [method], "date": when,
                                     "probe_record": paths[0].name,
                                     "kernels": [p["kernel"] for p in verdict["pairs"]],
                                     "device": run_records.cpu_model()})
    file.write_text(json.dumps(data, indent=1) + "\n")
    added = {e: h for e, h in verdict["probe_fingerprint"].items()}
    commit = clean_commit(new_root)
    for path in paths:
        rec = json.loads(path.read_text())
        new_entries = {e: h for e, h in added.items() if e not in rec["fingerprint"]}
        rec["fingerprint"].update(new_entries)
        if commit:  # rebased: the record now names the checked library, whose hashes its fingerprint holds
            rec["fingerprint"].update({e: today[e] for e in changed})
            rec["compare_commit"] = commit
        rec.setdefault("carried_over", []).append({"date": when, "changed": changed, "added": sorted(new_entries),
                                                    "probe_record": paths[0].name, "to_commit": commit})
        path.write_text(json.dumps(rec, indent=2))


DEVICE_NUMERICS = ("continual_blr/mixed_precision.py",)  # the precision policy: autocast, TF32 on CUDA


def made_on_gpu(record: dict[str, Any]) -> bool:
    """Whether the record's run computed on a CUDA device (``--device cuda`` in its command, or a GPU named)."""
    return "--device cuda" in str(record.get("command", "")) or str(record.get("device", "")).startswith("NVIDIA")


def clean_commit(root: Path) -> str | None:
    """The commit checked out at ``root`` if its library and configs are exactly that commit's, else None."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "continual_blr", "configs"],
                           cwd=root, capture_output=True, text=True)
    if head.returncode or dirty.returncode or dirty.stdout.strip():
        return None
    return head.stdout.strip()


def stale_row(records_dir: Path, folder: str, method: str, paths: list[Path], worktrees: Path,
              new_root: Path = ROOT, old_root: Path | None = None) -> tuple[str, dict | None, list[str], Path | None]:
    """(verdict so far, the row's first record, its changed entries, the old library to compare with); the
    verdict is "" when the row needs a side-by-side probe."""
    record = json.loads(paths[0].read_text())
    if record.get("fingerprint") is None:
        return "no fingerprint (run --backfill, or rerun the row)", None, [], None
    if run_records.config_changes(record, new_root):
        return "config changed: rerun the row", None, [], None
    eq = run_records.equivalent_code(folder, method, records_dir, new_root)
    changed = fingerprint.changed_entries(record["fingerprint"], new_root, eq)
    if not changed:
        return "current", None, [], None
    device_bound = [e for e in changed if e.split("::")[0] in DEVICE_NUMERICS]
    if device_bound and made_on_gpu(record):
        return (f"stale: made on a GPU and {device_bound[0]} changed, which sets how CUDA computes (a CPU probe "
                "cannot show the GPU's numbers unchanged); rerun the row on a GPU"), None, [], None
    if old_root is None:
        commit = record_commit(record)
        if commit is None:
            return "stale: the record names no clean commit to compare with; rerun the row", None, [], None
        old_root = worktree(commit, worktrees)
    old_hashes = fingerprint.source_hashes(set(changed), old_root)
    if any(old_hashes[e] != record["fingerprint"][e] for e in changed):
        return ("stale: the library at the record's commit is not the one its fingerprint names; rerun the row",
                None, [], None)
    return "", record, changed, old_root


def settle(records_dir: Path, folder: str, method: str, paths: list[Path], record: dict, changed: list[str],
           verdict: dict[str, Any], new_root: Path, write: bool = True) -> str:
    """Declare an equal row (``write``) and say what happened, in one line."""
    if not verdict["equivalent"]:
        return f"stale ({verdict['reason']}): rerun the row"
    if write:
        declare(records_dir, folder, method, paths, record, changed, verdict, new_root)
    return f"carried over: {len(changed)} changed entries equal under {len(verdict['pairs'])} kernel paths"


def check_row(records_dir: Path, folder: str, method: str, paths: list[Path], worktrees: Path,
              new_root: Path = ROOT, old_root: Path | None = None, write: bool = True,
              extra: list[str] | None = None) -> str:
    """Probe one stale row side by side and declare it if equal; returns a one-line verdict."""
    said, record, changed, old = stale_row(records_dir, folder, method, paths, worktrees, new_root, old_root)
    if said:
        return said
    verdict = compare([(paths[0], changed)], old, new_root, extra=extra)[0]
    return settle(records_dir, folder, method, paths, record, changed, verdict, new_root, write)


def backfill(records_dir: Path, commit: str, worktrees: Path, extra: list[str] | None = None) -> None:
    """Give every record without a fingerprint that is current at ``commit`` (library-hash rule, that commit's
    declarations) a fingerprint from one probe of its row on that commit's library."""
    old_root = worktree(commit, worktrees)
    base_hash = run_records.library_hash(old_root)
    base_records = old_root / "benchmarks" / "records"
    for (folder, method), paths in rows(records_dir).items():
        todo = []
        for path in paths:
            rec = json.loads(path.read_text())
            if rec.get("fingerprint") is None and run_records.is_current_by_library(rec, base_hash, folder, base_records):
                todo.append(path)
        if not todo:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            try:
                got = probe([todo[0]], old_root, Path(tmp) / "p.json", "", extra)[0]
            except RuntimeError as err:
                print(f"{folder} {method}: {err}")
                continue
        source = {"kind": "probe", "commit": subprocess.run(["git", "rev-parse", commit], cwd=ROOT, text=True,
                                                             capture_output=True).stdout.strip(),
                  "library_hash": base_hash, "date": run_records.now_utc(), "probe_record": todo[0].name}
        for path in todo:
            rec = json.loads(path.read_text())
            rec["fingerprint"], rec["fingerprint_source"] = got["fingerprint"], source
            path.write_text(json.dumps(rec, indent=2))
        print(f"{folder} {method}: {len(todo)} records fingerprinted ({len(got['fingerprint'])} entries)")


def check_data(records: list[Path], data_dir: str | None) -> None:
    """Refuse in one line, before any probe, when a stale row's dataset is not on this machine: the probes of
    one library run in one process, so a missing MNIST would otherwise end a carry-over minutes in, with a
    traceback.

    Raises:
        SystemExit: naming the record, the data root looked in and how to give one.
    """
    import probe as probe_script
    from continual_blr.config import RunConfig, from_dict
    from continual_blr.data.paths import DataNotFoundError
    from continual_blr.runner import build_stream

    seen: set[tuple[str, str]] = set()
    for path in records:
        cfg = probe_script.run_config_of(json.loads(path.read_text()), ROOT, from_dict, RunConfig)
        cfg.stream.data_dir = data_dir or cfg.stream.data_dir
        key = (cfg.stream.name, str(cfg.stream.data_dir))
        if key in seen:
            continue
        seen.add(key)
        try:
            build_stream(cfg)
        except DataNotFoundError as err:
            raise SystemExit(f"side_by_side: {path.name} needs {cfg.stream.name}: {err}; give --data-dir or set "
                             "CONTINUAL_BLR_DATA") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records-dir", default=str(run_records.RECORDS_DIR))
    ap.add_argument("--worktrees", default=os.path.join(tempfile.gettempdir(), "continual_blr_worktrees"))
    ap.add_argument("--status", action="store_true", help="say which rows are current; probe nothing")
    ap.add_argument("--backfill", metavar="COMMIT", help="fingerprint records made before fingerprints existed")
    ap.add_argument("--only", nargs="*", default=None, help="records folders (or folder/method) to check")
    ap.add_argument("--new-root", default=str(ROOT), help="the library to check the records against (default: this "
                    "checkout; another folder holding continual_blr/ and configs/, e.g. to time a planted change)")
    ap.add_argument("--dry-run", action="store_true", help="say what would be carried over; write nothing")
    ap.add_argument("--data-dir", default=os.environ.get("CONTINUAL_BLR_DATA"),
                    help="data root for the probes (default: $CONTINUAL_BLR_DATA, else each record's own)")
    ap.add_argument("--probe", nargs=argparse.REMAINDER, default=None,
                    help="arguments for probe.py (e.g. --probe --train 256 --test 128); must come last")
    args = ap.parse_args(argv)
    records_dir, new_root = Path(args.records_dir), Path(args.new_root).resolve()
    if args.backfill:
        backfill(records_dir, args.backfill, Path(args.worktrees))
        return 0
    bad, todo = 0, {}
    for (folder, method), paths in rows(records_dir).items():
        if args.only is not None and folder not in args.only and f"{folder}/{method}" not in args.only:
            continue
        if args.status:
            states = [run_records.currency(json.loads(p.read_text()), folder, records_dir, new_root) for p in paths]
            stale = [p.stem.rpartition("_seed")[2] for p, (ok, _) in zip(paths, states) if not ok]
            why = next((w for ok, w in states if not ok), "")
            print(f"{folder} {method}: {len(paths)} records, " + (f"stale seeds {stale} ({why})" if stale else "current"))
            continue
        said, record, changed, old = stale_row(records_dir, folder, method, paths, Path(args.worktrees), new_root)
        if said:
            bad += said != "current"
            print(f"{folder} {method}: {said}", flush=True)
        else:
            todo.setdefault(old, []).append((folder, method, paths, record, changed))
    check_data([paths[0] for group in todo.values() for _, _, paths, _, _ in group], args.data_dir)
    extra = (["--data-dir", args.data_dir] if args.data_dir else []) + (args.probe or [])
    for old, group in todo.items():  # one probe process per library and kernel path for all rows of that library
        verdicts = compare([(paths[0], changed) for _, _, paths, _, changed in group], old, new_root,
                           extra=extra)
        for (folder, method, paths, record, changed), verdict in zip(group, verdicts):
            said = settle(records_dir, folder, method, paths, record, changed, verdict, new_root, not args.dry_run)
            bad += said.startswith("stale")
            print(f"{folder} {method}: {said}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
