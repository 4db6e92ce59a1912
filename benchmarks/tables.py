"""Rebuild every results table that has run records, from the records alone; ``--check`` compares instead.

Run:

    python benchmarks/tables.py            # rewrite benchmarks/results/<table>.md from benchmarks/records/
    python benchmarks/tables.py --check    # exit 1 if a committed table differs from what its records give
    python benchmarks/tables.py --status   # which records are stale (ran on another version of the library)

Split digits' table (``split_digits.md``, and ``split_digits_validation.md``) comes from its own records,
``<records>/split_digits/<scenario>/table[_validation<F>]/`` (``split_digits.py``), and is compared whole.

The records folder is laid out as ``<records>/<benchmark>/<scenario>/<mode>/<method>_seed<k>.json`` (``benchmark``
may be nested, e.g. ``split_cifar10/resnet18``) with ``mode``
``full``, ``quick`` or ``<full|quick>_validation<F>`` (``reproduce.py`` writes them; ``benchmarks/records.py`` says
what a record holds and when it is current). Each folder gives one table (``reproduce.write_report``). The check
compares the table's text above its ``<!-- notes -->`` line (the hand-written note below it is kept as it is) and
does not redraw the curves figure.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts (benchmarks/ is not a package)
import records as run_records  # noqa: E402
import reproduce  # noqa: E402
import split_digits  # noqa: E402

MODE = re.compile(r"^(full|quick)(?:_validation([0-9.]+))?$")


def tables(records_dir: Path) -> list[tuple[str, str, bool, float]]:
    """(benchmark, scenario, quick, validation) of every records folder holding at least one record."""
    out = []
    for folder in sorted(p for p in records_dir.rglob("*") if p.is_dir()):
        m = MODE.match(folder.name)
        rel = folder.relative_to(records_dir).parts
        if m is None or len(rel) < 3 or rel[0] == "search" or not any(folder.glob("*_seed*.json")):
            continue
        out.append(("/".join(rel[:-2]), folder.parent.name, m.group(1) == "quick", float(m.group(2) or 0.0)))
    return out


def _body(text: str) -> str:
    return text.split(reproduce.NOTES_MARKER, 1)[0]


def build(records_dir: Path, results_dir: Path, benchmark: str, scenario: str, quick: bool, validation: float,
          draw: bool = True) -> Path:
    """Write the table of one records folder into ``results_dir`` (a notes part is taken from there)."""
    args = argparse.Namespace(quick=quick, validation=validation, keep=False, results_dir=str(results_dir))
    recs = reproduce.collect_records(records_dir, benchmark, scenario, quick, validation)
    return reproduce.write_report(benchmark, scenario, recs, args, command="", results_dir=results_dir, draw=draw,
                                  runs_dir=records_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records-dir", default=str(run_records.RECORDS_DIR))
    ap.add_argument("--results-dir", default=str(reproduce.ROOT / "benchmarks" / "results"))
    ap.add_argument("--check", action="store_true", help="compare with the committed tables; write nothing")
    ap.add_argument("--status", action="store_true", help="list the records that are not current; write nothing")
    args = ap.parse_args(argv)
    records_dir, results_dir = Path(args.records_dir), Path(args.results_dir)
    found = tables(records_dir)
    if not found and not any(records_dir.glob("split_digits/*/table*/*_seed*.json")):
        print(f"tables: no records under {records_dir}")
        return 0
    if args.status:  # every row of every table: current, or why not (records.currency)
        for benchmark, scenario, quick, validation in found:
            recs = reproduce.collect_records(records_dir, benchmark, scenario, quick, validation)
            folder = reproduce._runs_folder(records_dir, benchmark, scenario, quick, validation)
            rel = folder.relative_to(records_dir).as_posix()
            for method, rs in recs.items():
                states = [run_records.currency(r, rel, records_dir) for r in rs]
                stale = [r["seed"] for r, (ok, _) in zip(rs, states) if not ok]
                why = next((w for ok, w in states if not ok), "")
                state = f"stale seeds {stale}: {why}" if stale else "current"
                print(f"{rel} {method}: {len(rs)} records, {state}")
        for folder in sorted(f for f in records_dir.glob("split_digits/*/table*") if f.is_dir()):
            rel = folder.relative_to(records_dir).as_posix()
            labels = sorted({p.stem.rpartition("_seed")[0] for p in folder.glob("*_seed*.json")})
            for label in labels:
                rs = [json.loads(p.read_text()) for p in sorted(folder.glob(f"{label}_seed*.json"))
                      if p.stem.rpartition("_seed")[0] == label]
                states = [run_records.currency(r, rel, records_dir) for r in rs]
                stale = [r["seed"] for r, (ok, _) in zip(rs, states) if not ok]
                why = next((w for ok, w in states if not ok), "")
                print(f"{rel} {label}: {len(rs)} records, " + (f"stale seeds {stale}: {why}" if stale else "current"))
        return 0
    digits = sorted({float(f.name.partition("_validation")[2] or 0.0)
                     for f in records_dir.glob("split_digits/*/table*") if any(f.glob("*_seed*.json"))})
    # (table file name, the records it comes from, build(results folder, draw) -> the written table)
    jobs = [(split_digits.table_path(results_dir, v).name, "split_digits",
             lambda out, draw, v=v: split_digits.table_from_records(records_dir, out, v)) for v in digits]
    jobs += [(reproduce.report_path(results_dir, b, s, q, v).name, f"{b}/{s}",
              lambda out, draw, b=b, s=s, q=q, v=v: build(records_dir, out, b, s, q, v, draw=draw))
             for b, s, q, v in found]
    bad = []
    for name, origin, make in jobs:
        if not args.check:
            print(f"wrote {make(results_dir, True)}")
            continue
        committed = results_dir / name
        with tempfile.TemporaryDirectory() as tmp:
            if committed.is_file():  # its notes part is kept by the rebuild
                (Path(tmp) / name).write_text(committed.read_text())
            got = make(Path(tmp), False).read_text()
        if not committed.is_file() or _body(committed.read_text()) != _body(got):
            bad.append(name)
            print(f"tables: {name} differs from what its records generate (run python benchmarks/tables.py)")
        else:
            print(f"tables: {name} matches its {origin} records")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
