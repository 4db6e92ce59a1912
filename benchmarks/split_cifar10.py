"""Summarise the split CIFAR-10 runs into ``benchmarks/results/archive/split_cifar10_cpu_budget.md``.

The runs themselves are made by the shared drivers (stored under ``benchmarks/runs/``, not committed):

    python benchmarks/reproduce.py split_cifar10/cpu_budget --methods none fromp --seeds 0 1 2 \\
        --data-dir $CONTINUAL_BLR_DATA --threads 1
    python benchmarks/search.py split_cifar10/cpu_budget ewc --grid lam=100,10000 --seeds 0 \\
        --validation 0.1 --then-test 0 1 2 --data-dir $CONTINUAL_BLR_DATA --threads 1 \\
        --out benchmarks/results/search/search_split_cifar10_ewc.md

then

    python benchmarks/split_cifar10.py --protocol cpu_budget

reads every finished test-set run of that protocol folder (``reproduce.py``'s runs and ``search.py``'s
``--then-test`` runs) and writes one table per protocol: final average accuracy mean ± sample std over the
seeds, forgetting, wall and CPU seconds per run, the device, and the published anchors beside them. Text
below the ``<!-- notes -->`` line of an existing report is kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTES = "<!-- notes -->"

ANCHORS = [
    ("fine-tuning (none)", "69.53 ± 1.34", "van de Ven 2025, reduced ResNet-18, 2,000 iterations per task, 30 seeds (± s.e.)"),
    ("EWC, exact Fisher", "84.91 ± 0.65", "van de Ven 2025, same protocol, λ from a sweep, 30 seeds (± s.e.)"),
    ("FROMP", "76.2", "FROMP paper, 6-task split CIFAR (CIFAR-10 + 5 CIFAR-100 tasks), CifarNet, 80 epochs: a different stream"),
    ("S-FSVI", "77.57 ± 0.84", "S-FSVI, the same 6-task split CIFAR"),
]
ORDER = ["fromp", "frorp", "ewc", "laplace", "blr", "none", "joint"]


def _records(protocol: str) -> dict[str, list[dict]]:
    """Test-set runs of ``configs/split_cifar10/<protocol>``: method -> records (one per seed)."""
    folders = [ROOT / "benchmarks" / "runs" / "split_cifar10" / protocol,
               ROOT / "benchmarks" / "runs" / "search" / "split_cifar10" / protocol]
    out: dict[str, dict[int, dict]] = {}
    for folder in folders:
        for path in sorted(folder.rglob("*.json")) if folder.is_dir() else []:
            if "validation" in str(path.relative_to(folder)):
                continue
            rec = json.loads(path.read_text())
            if "avg_acc" not in rec or rec.get("validation"):
                continue
            rec["_path"] = str(path.relative_to(ROOT))
            out.setdefault(rec["method"], {})[int(rec["seed"])] = rec
    return {m: [r for _, r in sorted(d.items())] for m, d in out.items()}


def _fmt(xs: list[float]) -> str:
    if not xs:
        return "-"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.2f} ± {sd:.2f}"


def report(protocol: str, device: str) -> str:
    recs = _records(protocol)
    methods = sorted(recs, key=lambda m: (ORDER.index(m) if m in ORDER else len(ORDER), m))
    lines = [f"# Split CIFAR-10 (5 tasks × 2 classes, task-incremental): `{protocol}`", "",
             f"Configs: `configs/split_cifar10/{protocol}/<method>.yaml`. Device: {device}. "
             "Mean ± sample std over seeds of the final average test accuracy (%).", "",
             "| method | final avg acc (%) | seeds | forgetting (%) | params | wall / run (s) | CPU / run (s) |",
             "|---|---|---|---|---|---|---|"]
    for m in methods:
        rs = recs[m]
        acc = [100 * r["avg_acc"] for r in rs]
        fgt = [100 * r["forgetting"] for r in rs]
        params = rs[0].get("params") or rs[0].get("config", {}).get("methods", [{}])[0].get("params", {})
        lines.append(f"| {m} | {_fmt(acc)} | {len(rs)} ({', '.join(str(r['seed']) for r in rs)}) | {_fmt(fgt)} | "
                     f"{json.dumps(params, sort_keys=True) if params else '-'} | "
                     f"{statistics.mean(r['wall_s'] for r in rs):.0f} | {statistics.mean(r['cpu_s'] for r in rs):.0f} |")
    lines += ["", "Published anchors (full budgets; none of them is this run's budget):", "",
              "| method | published (%) | source |", "|---|---|---|"]
    lines += [f"| {a} | {v} | {s} |" for a, v, s in ANCHORS]
    lines += ["", "Per-seed accuracies (%):", ""]
    for m in methods:
        lines.append(f"- {m}: " + ", ".join(f"seed {r['seed']} {100 * r['avg_acc']:.2f}" for r in recs[m]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--protocol", default="cpu_budget", help="folder under configs/split_cifar10 (cpu_budget, ...)")
    ap.add_argument("--device", default="CPU, 1 torch thread (shared 2-core machine)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "archive" / "split_cifar10_cpu_budget.md"))
    args = ap.parse_args(argv)
    text = report(args.protocol, args.device)
    out = Path(args.out)
    if out.is_file() and NOTES in out.read_text():
        text += "\n" + NOTES + out.read_text().split(NOTES, 1)[1]
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
