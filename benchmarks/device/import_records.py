"""Bring the run records of a lent-GPU call (``$OUT/records.tgz`` of ``gpu_runs.sh``) into ``benchmarks/records/``.

``gpu_runs.sh`` gives each job its own records folder, ``<tag>/<benchmark>/<scenario>/<mode>/<method>_seed<s>.json``;
this copies every record to ``<records>/<benchmark>/<scenario>/<mode>/`` (the files under ``<tag>/results/`` are
tables the GPU machine wrote for its own job and are left out: ``tables.py`` rebuilds them from the records).

A record made on the GPU machine before fingerprints were canonical (Python 3.12 there, 3.11 here, see
``fingerprint.canonical_dump``) holds hashes in 3.12's ``ast.dump``; each entry is rewritten in the canonical form
only where its stored hash is checked equal to the 3.12 hash of the source at the record's own commit
(``git archive``); the record then says so in ``fingerprint_translated``. An entry that does not check keeps its
hash (the record stays stale, which ``tables.py --status`` names). A record that names no clean commit is refused,
and so is a second record for the same target in one import. A record already at the target (an earlier evaluation
of that row and seed) is moved to ``superseded/`` first (``ledger.supersede``), so it stays in the ledger.

    python benchmarks/device/import_records.py /work/.device/N/records.tgz
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fingerprint  # noqa: E402
import ledger  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def checkout(commit: str, into: Path) -> Path:
    """The package sources of ``commit`` under ``into`` (``git archive``)."""
    into.mkdir(parents=True, exist_ok=True)
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "continual_blr"], check=True,
                         capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    return into


def import_records(source: Path, records_dir: Path) -> list[str]:
    """Copy (and where needed translate) every record under ``source`` (a ``.tgz`` or a folder); returns one line
    per record."""
    lines: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if source.is_file():
            with tarfile.open(source) as tf:
                tf.extractall(tmp / "in", filter="data")
            source = tmp / "in"
        sources: dict[str, Path] = {}
        written: set[Path] = set()
        for path in sorted(source.rglob("*_seed*.json")):
            rel = path.relative_to(source)
            parts = rel.parts[1:] if len(rel.parts) > 4 else rel.parts  # drop the job tag folder
            if "results" in parts:
                continue
            record = json.loads(path.read_text())
            commit = record.get("commit")
            if not commit or record.get("dirty"):
                lines.append(f"{rel}: refused, names no clean commit ({commit!r}, dirty {record.get('dirty')})")
                continue
            note = ""
            dialect = fingerprint.record_dialect(record)
            if record.get("fingerprint") and dialect != "3.11":
                if commit not in sources:
                    sources[commit] = checkout(commit, tmp / f"src_{commit}")
                fp, unverified = fingerprint.translate_fingerprint(record["fingerprint"], sources[commit], dialect)
                record["fingerprint"] = fp
                record["fingerprint_format"] = "3.11"
                record["fingerprint_translated"] = {"from": dialect, "commit": commit, "unverified": unverified}
                note = (f", fingerprint {dialect} -> 3.11 ({len(fp) - len(unverified)} of {len(fp)} entries checked"
                        f" at {commit})")
            out = records_dir.joinpath(*parts)
            if out in written:
                lines.append(f"{rel}: refused, a record for {out.relative_to(records_dir)} came earlier in this import")
                continue
            written.add(out)
            moved = ledger.supersede(out)
            if moved is not None:
                note += f"; the record it replaces is in {moved.relative_to(records_dir)}"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(record, indent=2))
            lines.append(f"{out.relative_to(records_dir)}: avg acc {100 * record['avg_acc']:.2f}{note}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=Path, help="records.tgz from a gpu_runs.sh call, or its unpacked folder")
    ap.add_argument("--records-dir", type=Path, default=ROOT / "benchmarks" / "records")
    args = ap.parse_args(argv)
    if not args.source.exists():
        print(f"import_records: source {args.source} does not exist", file=sys.stderr)
        return 2
    for line in import_records(args.source, args.records_dir):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
