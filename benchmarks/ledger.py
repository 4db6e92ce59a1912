"""The test-evaluation ledger: every evaluation of a table's row on test data, superseded ones included.

Run:

    python benchmarks/ledger.py --recover      # once: earlier versions of committed records, from git, into superseded/
    python benchmarks/ledger.py                # print every row's evaluations

Every run on test data leaves a record (``reproduce.py``). When a row is run again (another config, a method
change, a stale library), the record it replaces is **moved**, not overwritten, to
``<folder>/superseded/<method>_seed<k>@<when>.json`` (``supersede``), so each test evaluation stays a record.
``--recover`` rebuilds the superseded records that earlier sessions overwrote from the git history of the record
files (each committed version that differs from today's, named by the commit that added it). Evaluations made
before run records existed, known only from a table of their time, are listed in ``benchmarks/records/
unrecorded_evaluations.json`` (row, date, seeds, figure, and the commit whose table shows it).

An **evaluation** is one set of records of a row made together: the current records are one; superseded records
are grouped by the commit that added them (or, for records with timestamps, by the day they ended and their
config). ``reproduce.write_report`` shows, per row, the number of evaluations and lists the earlier ones with their
date, method parameters and mean ± std; the list is generated, like the rest of the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import records as run_records  # noqa: E402

SUPERSEDED = "superseded"
UNRECORDED = "unrecorded_evaluations.json"


def supersede(path: Path) -> Path | None:
    """Move the record at ``path`` (about to be replaced by a new run) to ``superseded/``; returns where it went."""
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    when = (rec.get("ended") or rec.get("commit") or "unknown")[:19].replace(":", "").replace("-", "")
    dest = path.parent / SUPERSEDED / f"{path.stem}@{when}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    k = 1
    while dest.exists():
        k += 1
        dest = dest.with_name(f"{path.stem}@{when}-{k}.json")
    path.replace(dest)
    return dest


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout


def _same_evaluation(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) for k in ("acc_matrix", "seed", "library_hash")) and _methods(a) == _methods(b)


def _methods(rec: dict[str, Any]) -> Any:
    config = rec.get("config")
    return config.get("methods") if isinstance(config, dict) else config


def recover(records_dir: Path) -> int:
    """Write every committed earlier version of each test record that differs from today's into ``superseded/``,
    named ``<stem>@<commit>.json``, with ``superseded_by_commit`` / ``committed`` (the commit that added it and
    its date). Returns how many were written."""
    n = 0
    for path in sorted(Path(records_dir).rglob("*_seed*.json")):
        rel = path.relative_to(ROOT).as_posix()
        if SUPERSEDED in path.parts or "/search/" in rel or "_validation" in path.parent.name:
            continue
        if path.parent.name == "table":  # split_digits.py has always moved what it replaced to superseded/
            continue
        today = path.read_text()
        for line in _git("log", "--format=%H %cI", "--", rel).splitlines():
            commit, date = line.split()
            old = _git("show", f"{commit}:{rel}")
            if not old.strip():
                continue
            if _same_evaluation(json.loads(old), json.loads(today)):
                continue  # the same run, its metadata edited since (a fingerprint added, a field renamed)
            dest = path.parent / SUPERSEDED / f"{path.stem}@{commit[:8]}.json"
            if dest.exists():
                continue
            rec = json.loads(old) | {"committed": {"commit": commit, "date": date}}
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(json.dumps(rec, indent=2))
            n += 1
    for path in sorted(Path(records_dir).rglob("superseded/*.json")):  # split digits' own: date them once, from git
        rec = json.loads(path.read_text())
        if rec.get("committed") or rec.get("ended"):
            continue
        line = _git("log", "--diff-filter=A", "--format=%H %cI", "-1", "--", str(path.relative_to(ROOT))).strip()
        if line:
            commit, date = line.split()
            rec["committed"] = {"commit": commit, "date": date, "note": "the commit that moved it to superseded/"}
            path.write_text(json.dumps(rec, indent=2))
            n += 1
    return n


def _when(rec: dict[str, Any], path: Path) -> tuple[str, str]:
    """(date, group key) of a record's evaluation: the commit that added a recovered version; the end time of a
    record that has one; else the library it ran on ("?" for the date). No git is read: the tables built from these
    must be the same on any clone."""
    if rec.get("committed"):
        return rec["committed"]["date"][:16].replace("T", " "), "commit " + rec["committed"]["commit"][:8]
    if rec.get("ended"):
        date = rec["ended"][:10]
        return date, f"{date} {json.dumps(_methods(rec), sort_keys=True)}"
    return "?", f"library {(rec.get('library_hash') or '?')[:8]} {json.dumps(_methods(rec), sort_keys=True)}"


def evaluations(folder: Path, method: str, records_dir: Path | None = None) -> list[dict[str, Any]]:
    """The earlier (superseded) test evaluations of one row, oldest first: date, seeds, accuracies, method params,
    the library and commit; plus the row's unrecorded ones. Reruns that gave the same numbers with the same
    settings (a record redone because its library changed) are one entry, with ``reruns`` saying how many."""
    groups: dict[str, list[dict]] = {}
    for path in sorted((folder / SUPERSEDED).glob(f"{method}_seed*.json")):
        if path.stem.split("@")[0].split("__")[0].rpartition("_seed")[0] != method:
            continue
        rec = json.loads(path.read_text())
        date, key = _when(rec, path)
        groups.setdefault(key, []).append(rec | {"_date": date})
    merged: dict[str, dict[str, Any]] = {}
    for key, recs in groups.items():
        recs = sorted(recs, key=lambda r: r["seed"])
        accs = [100 * r["avg_acc"] for r in recs]
        methods = _methods(recs[0])
        method_cfg = methods[0] if isinstance(methods, list) and methods else {}
        e = {"date": recs[0]["_date"], "group": key.split(' "')[0].split(" {")[0].split(" [")[0], "seeds": [r["seed"] for r in recs], "accs": accs,
             "params": method_cfg.get("params"), "train": method_cfg.get("train"),
             "library": (recs[0].get("library_hash") or "?")[:8], "reruns": 1}
        same = json.dumps([e["params"], e["train"], e["seeds"], accs], sort_keys=True)
        if same in merged:
            first = merged[same]
            first["reruns"] += 1
            if e["date"] < first["date"]:
                e["reruns"] = first["reruns"]
                merged[same] = e
        else:
            merged[same] = e
    out = list(merged.values())
    records_dir = Path(records_dir or run_records.RECORDS_DIR)
    extra = records_dir / UNRECORDED
    if extra.is_file():
        rel = folder.relative_to(records_dir).as_posix() if folder.is_relative_to(records_dir) else None
        for e in json.loads(extra.read_text())["evaluations"]:
            if e["folder"] == rel and e["method"] == method:
                out.append(e | {"group": "unrecorded"})
    return sorted(out, key=lambda e: (e["date"], e["group"]))


def mean_std(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.fmean(xs):.2f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.2f}"


def describe(e: dict[str, Any]) -> str:
    """One line of the generated list under a table."""
    if e["group"] == "unrecorded":
        return (f"{e['date']}: {e['figure']} (seeds {e['seeds']}; no records: {e['source']})")
    seeds = ",".join(map(str, e["seeds"]))
    params = json.dumps(e["params"], sort_keys=True) if e["params"] else "{}"
    train = f", train {json.dumps(e['train'], sort_keys=True)}" if e.get("train") else ""
    again = f"; rerun {e['reruns'] - 1} more time(s) with the same numbers" if e.get("reruns", 1) > 1 else ""
    return (f"{e['date']} ({e['group']}, library {e['library']}): {mean_std(e['accs'])} on seeds {seeds}; "
            f"params {params}{train}{again}")


def fix_commits(records_dir: Path) -> int:
    """Records whose named commit does not hold the library they ran (``records.commit_check``: a hand-typed
    commit, or a run on uncommitted changes) get the commit that does: the named one if a unique prefix of it
    does, else the oldest commit whose library hashes as the record's. The record keeps what it claimed under
    ``commit_fixed``. Returns how many were fixed."""
    by_library: dict[str, str] = {}
    for commit in _git("log", "--format=%H").split():  # newest first: the last one written is the oldest
        lib = run_records.commit_library_hash(commit)
        if lib:
            by_library[lib] = commit
    n = 0
    for path in sorted(Path(records_dir).rglob("*_seed*.json")):
        if "/search/" in path.as_posix():
            continue
        rec = json.loads(path.read_text())
        check = run_records.commit_check(rec)
        if check in ("ok", "no commit"):
            continue
        prefix = _git("rev-parse", "--verify", "-q", (rec["commit"] or "")[:7] + "^{commit}").strip()
        fixed = prefix if prefix and run_records.commit_library_hash(prefix) == rec.get("library_hash") else \
            by_library.get(rec.get("library_hash"))
        if fixed is None:
            continue
        rec["commit_fixed"] = {"claimed": rec["commit"], "claimed_dirty": rec.get("dirty"), "check": check,
                               "how": "unique prefix of the claimed commit" if fixed == prefix
                               else "oldest commit whose library hashes as the record's", "date": run_records.now_utc()}
        rec["commit"], rec["dirty"] = fixed, False
        path.write_text(json.dumps(rec, indent=2))
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records-dir", default=str(run_records.RECORDS_DIR))
    ap.add_argument("--recover", action="store_true", help="rebuild superseded records from the git history")
    ap.add_argument("--fix-commits", action="store_true", help="name the commit that holds each record's library")
    args = ap.parse_args(argv)
    records_dir = Path(args.records_dir)
    if args.fix_commits:
        print(f"ledger: {fix_commits(records_dir)} records now name the commit that holds their library")
        return 0
    if args.recover:
        print(f"ledger: {recover(records_dir)} earlier record versions written to superseded/")
        return 0
    for folder in sorted({p.parent for p in records_dir.rglob("*_seed*.json") if SUPERSEDED not in p.parts}):
        for method in sorted({p.stem.rpartition("_seed")[0] for p in folder.glob("*_seed*.json")}):
            earlier = evaluations(folder, method, records_dir)
            if earlier:
                print(f"{folder.relative_to(records_dir)} {method}: {len(earlier) + 1} evaluations")
                for e in earlier:
                    print("   ", describe(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
