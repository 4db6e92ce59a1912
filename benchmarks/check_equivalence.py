"""Check that the library as it is now gives the same numbers as the one older records ran on, and say so.

Run:

    python benchmarks/check_equivalence.py split_mnist/task/full --data-dir $CONTINUAL_BLR_DATA
    python benchmarks/check_equivalence.py --all --data-dir $CONTINUAL_BLR_DATA      # every reproduce folder

For each records folder named (``<benchmark>/<scenario>/<mode>`` under ``benchmarks/records/``) and each older
library hash A its records ran on (not current and not yet declared equivalent), the lowest seed of every row
(method) made on A is run again on the current library, with the same config file, into a scratch folder (the
committed record is not touched). For the rows whose rerun gives the same accuracy matrix **bit for bit** and the
same resolved parameters (a parameter added to the library since counts as the same at its default), a declaration ``A → current`` for that folder and those rows is appended to
``benchmarks/records/equivalent_libraries.json`` with the runs it compared; their records made on A are then
current (``benchmarks/records.py``). Each rerun uses the record's torch thread count (``threads``) unless
``--threads`` is given: at another count matrix products round differently (measured 2026-11-26: split MNIST's
class-incremental rows rerun at 2 threads differed from their 1-thread records in the second decimal). A row that differs, whose config changed or that needs a device this machine
lacks is printed and left stale. Split digits' tables (their own records layout) and searches are not covered.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts (benchmarks/ is not a package)
import records as run_records  # noqa: E402
import reproduce  # noqa: E402
import tables  # noqa: E402


def folders(records_dir: Path) -> dict[str, tuple[str, str, bool, float]]:
    """Every reproduce records folder (``<benchmark>/<scenario>/<mode>``) holding records, with what
    ``tables.tables`` reads from it: (benchmark, scenario, quick, validation)."""
    return {reproduce._runs_folder(records_dir, *t).relative_to(records_dir).as_posix(): t
            for t in tables.tables(records_dir)}


def same_params(new: dict | None, old: dict | None, method_name: str | None) -> tuple[bool, list[str]]:
    """Whether a rerun's resolved parameters are the record's: equal, or the record's all unchanged and every key
    it lacks a parameter added to the library since, at that parameter's default (the record's code had no such
    setting; the bitwise-equal accuracy matrix is the evidence that the default reproduces it). Returns (ok, the
    added keys)."""
    if new == old:
        return True, []
    if not isinstance(new, dict) or not isinstance(old, dict) or any(k not in new or new[k] != v
                                                                      for k, v in old.items()):
        return False, []
    added = sorted(set(new) - set(old))
    import dataclasses

    from continual_blr.methods import build_method

    defaults = getattr(build_method(method_name, {}), "params", None) if method_name else None
    default = dataclasses.asdict(defaults) if dataclasses.is_dataclass(defaults) else {}
    ok = all(k in default and default[k] == new[k] for k in added)
    return ok, added if ok else []


def append_declaration(records_dir: Path, decl: dict) -> None:
    """Add one declaration to ``equivalent_libraries.json`` at once (read, append, write under a lock: two checks may
    run side by side), so that an interrupted check keeps every row it verified."""
    path = records_dir / run_records.EQUIVALENCES
    with open(records_dir / (run_records.EQUIVALENCES + ".lock"), "w") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:  # not POSIX: no concurrent checks there
            pass
        decls = run_records.declarations(records_dir) + [decl]
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"declarations": decls}, indent=1) + "\n")
        tmp.replace(path)


def check_folder(records_dir: Path, folder: str, where: tuple[str, str, bool, float], args: argparse.Namespace,
                 current: str) -> list[dict]:
    """The declarations this folder earns, one per verified row (older library hash, folder, row), each saved as soon
    as its rerun matched (:func:`append_declaration`)."""
    benchmark, scenario, quick, validation = where
    recs = [json.loads(p.read_text()) | {"_name": p.stem} for p in sorted((records_dir / folder).glob("*_seed*.json"))]
    def row(r: dict) -> str:
        return r.get("method_name") or r["method"]

    # records neither made on the current library nor already declared equivalent for their row
    todo = [r for r in recs if r.get("library_hash") and not run_records.is_current(r, current, folder, records_dir)]
    made = []
    for old in sorted({r["library_hash"] for r in todo}):
        rows: dict[str, dict] = {}
        for r in sorted((r for r in todo if r["library_hash"] == old), key=lambda r: r["seed"]):
            rows.setdefault(row(r), r)
        checked = []
        for method, rec in sorted(rows.items()):
            if args.methods and method not in args.methods:
                continue
            if str((rec.get("config") or {}).get("device", "cpu")).startswith("cuda") and args.device == "cpu":
                print(f"{folder} {method}: ran on {rec.get('device')}; not rerun here (--device)")
                continue
            ns = argparse.Namespace(configs_dir=args.configs_dir, scenario=scenario, data_dir=args.data_dir,
                                    validation=validation, device=args.device, quick=quick, no_progress=True,
                                    force=True)
            threads = args.threads or rec.get("threads")  # the record's torch threads: GEMM rounding depends on them
            if threads:
                import torch

                torch.set_num_threads(int(threads))
            with tempfile.TemporaryDirectory() as tmp:
                new = reproduce.run_one(benchmark, method, rec["seed"], ns, Path(tmp), "check_equivalence")
            same_config = (new.get("config") or {}).get("method") == (rec.get("config") or {}).get("method")
            params_ok, added = same_params(new.get("resolved_params"), rec.get("resolved_params"),
                                           ((rec.get("config") or {}).get("method") or {}).get("name"))
            same = same_config and new["acc_matrix"] == rec["acc_matrix"] and params_ok
            print(f"{folder} {method} seed {rec['seed']}: {'same' if same else 'DIFFERENT'} "
                  f"({100 * rec['avg_acc']:.2f} on {old[:8]}, {100 * new['avg_acc']:.2f} now"
                  f"{'' if same_config else '; the config changed'}"
                  f"{'' if params_ok else '; the resolved parameters changed'}"
                  f"{'; new parameters at their defaults: ' + ', '.join(added) if added else ''})", flush=True)
            if same:
                decl = {"from": old, "to": current, "folders": [folder], "methods": {folder: [method]},
                        "checked": {folder: [f"{method}_seed{rec['seed']}"]},
                        "date": datetime.date.today().isoformat(), "commit": run_records.provenance()["commit"]}
                append_declaration(records_dir, decl)
                made.append(decl)
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folders", nargs="*", help="records folders, <benchmark>/<scenario>/<mode>")
    ap.add_argument("--all", action="store_true", help="every reproduce records folder")
    ap.add_argument("--records-dir", default=str(run_records.RECORDS_DIR))
    ap.add_argument("--configs-dir", default=str(reproduce.ROOT / "configs"))
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--methods", nargs="+", default=None, help="check only these rows (default: every row)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of every rerun (default: each record's own, else torch's default); matrix "
                         "products round differently with another thread count, so a rerun compares only at the "
                         "record's")
    args = ap.parse_args(argv)
    records_dir = Path(args.records_dir)
    known = folders(records_dir)
    names = known if args.all else args.folders
    if not names:
        ap.error("name records folders or give --all; folders here: " + (", ".join(known) or "none"))
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"no records folder {unknown[0]!r}; allowed: {', '.join(known) or 'none'}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    current = run_records.library_hash()
    made = []
    for folder in names:
        made += check_folder(records_dir, folder, known[folder], args, current)
    if made:
        print(f"declared {len(made)} equivalence(s) in {records_dir / run_records.EQUIVALENCES}")
    else:
        print("declared nothing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
