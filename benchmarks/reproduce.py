"""Reproduce the published continual-learning tables: methods × seeds on one benchmark.

Run (real MNIST under ``--data-dir``; CPU):

    python benchmarks/reproduce.py split_mnist --methods fromp ewc none --seeds 0 1 2 3 4 --data-dir DATA
    python benchmarks/reproduce.py permuted_mnist --methods fromp ewc vcl none --seeds 0 1 2 --data-dir DATA
    python benchmarks/reproduce.py split_mnist --scenario class --methods fromp none --seeds 0
    python benchmarks/reproduce.py split_digits --methods blr none --seeds 0 1 --quick   # smoke run

Each (benchmark, scenario, method, seed) run reads ``configs/<benchmark>/<method>.yaml``, runs the one
training loop, and stores its StreamResult under ``--runs-dir`` (default ``benchmarks/runs/``, not
committed). Finished runs are skipped when the command is repeated (resumable). The summary goes to
``benchmarks/results/<benchmark>[_<scenario>][_quick].md``: final average accuracy mean ± std over
seeds, the number of seeds, scenario, memory size, wall time per run and the published reference
number beside ours; plus ``..._curves.png``, the average accuracy after each task per method.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parent.parent

# Published numbers (final average test accuracy, %), from shared/ANCHORS.md: (value, source).
REFERENCES: dict[tuple[str, str, str], tuple[float, str]] = {
    ("split_mnist", "task", "fromp"): (99.3, "FROMP paper / reference code README"),
    ("split_mnist", "task", "frorp"): (99.07, "reference code run here (FRORP)"),
    ("split_mnist", "task", "vcl"): (98.4, "VCL + k-center coreset (VCL w/o coreset ≈ 95.5)"),
    ("permuted_mnist", "domain", "fromp"): (94.8, "FROMP paper / reference code README"),
    ("permuted_mnist", "domain", "vcl"): (92.7, "VCL with coreset, 10 tasks (others' run)"),
    ("split_cifar", "task", "fromp"): (76.2, "FROMP paper / reference code README"),
}
HIGHER_ANCHORS: dict[tuple[str, str], tuple[float, str]] = {
    ("split_mnist", "task"): (99.54, "S-FSVI"),
    ("permuted_mnist", "domain"): (95.76, "S-FSVI"),
    ("split_cifar", "task"): (77.57, "S-FSVI"),
    ("split_mnist", "class"): (92.87, "S-FSVI with coreset"),
}


def _load_config(benchmark: str, method: str, args: argparse.Namespace):
    import yaml

    from continual_blr.config import RunConfig, from_dict

    path = ROOT / "configs" / benchmark / f"{method}.yaml"
    if not path.is_file():
        available = sorted(p.stem for p in (ROOT / "configs" / benchmark).glob("*.yaml"))
        raise SystemExit(f"reproduce: no config {path.relative_to(ROOT)}; available for {benchmark}: {', '.join(available)}")
    cfg = from_dict(RunConfig, yaml.safe_load(path.read_text()) or {})
    if args.scenario:
        cfg.stream.scenario = args.scenario
    if args.data_dir:
        cfg.stream.data_dir = args.data_dir
    cfg.device = args.device
    cfg.quick = args.quick
    cfg.progress = False
    return cfg


def _memory_size(cfg) -> str:
    params = cfg.methods[0].params
    for key in ("n_points", "memory_size", "coreset_size"):
        if key in params:
            return str(params[key])
    return "-"


def run_one(benchmark: str, method: str, seed: int, args: argparse.Namespace, runs_dir: Path) -> dict:
    """Run (or reload) one (method, seed); returns the stored record."""
    cfg = _load_config(benchmark, method, args)
    cfg.seed = seed
    scenario = cfg.stream.scenario or "default"
    path = runs_dir / benchmark / scenario / ("quick" if args.quick else "full") / f"{method}_seed{seed}.json"
    if path.is_file() and not args.force:
        return json.loads(path.read_text())
    from continual_blr.runner import run_config

    cfg.out = str(path.parent / f"{method}_seed{seed}")
    t0 = time.perf_counter()
    result = run_config(cfg, save=False)[0]
    record = result.to_dict() | {"wall_s": time.perf_counter() - t0, "memory": _memory_size(cfg), "quick": args.quick}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    return record


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def write_report(benchmark: str, scenario: str, records: dict[str, list[dict]], args: argparse.Namespace, command: str) -> Path:
    from continual_blr.plots import plot_average_accuracy

    suffix = ("" if scenario in ("task", "domain", "default") else f"_{scenario}") + ("_quick" if args.quick else "")
    out = ROOT / "benchmarks" / "results" / f"{benchmark}{suffix}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"# {benchmark} ({scenario}-incremental){' — QUICK MODE (epochs / 5), not comparable to published numbers' if args.quick else ''}", ""]
    lines += ["Produced by:", "", "```", command, "```", ""]
    lines += ["| method | final avg acc (%) | seeds | scenario | memory | wall / run (s) | forgetting (%) | published | ours − published |",
              "|---|---|---|---|---|---|---|---|---|"]
    for method, recs in records.items():
        accs = [100 * r["avg_acc"] for r in recs]
        m, s = _mean_std(accs)
        fg, _ = _mean_std([100 * r["forgetting"] for r in recs])
        wall, _ = _mean_std([r["wall_s"] for r in recs])
        ref = REFERENCES.get((benchmark, scenario, method))
        ref_s = f"{ref[0]:.2f} ({ref[1]})" if ref else "-"
        diff = f"{m - ref[0]:+.2f}" if ref else "-"
        lines.append(f"| {method} | {m:.2f} ± {s:.2f} | {len(recs)} | {scenario} | {recs[0].get('memory', '-')} | "
                     f"{wall:.0f} | {fg:.2f} | {ref_s} | {diff} |")
    hi = HIGHER_ANCHORS.get((benchmark, scenario))
    if hi:
        lines += ["", f"Higher anchor on the same protocol: {hi[1]} {hi[0]:.2f}."]
    lines += ["", "Accuracy matrices (seed of the first run, rows: after task i, columns: task j, %):", ""]
    for method, recs in records.items():
        lines.append(f"**{method}** (seed {recs[0]['seed']})")
        lines.append("")
        lines.append("```")
        for row in recs[0]["acc_matrix"]:
            lines.append(" ".join("   -  " if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:6.2f}" for v in row))
        lines.append("```")
        lines.append("")
    out.write_text("\n".join(lines))
    curves = {m: [r["avg_acc_per_step"] for r in recs] for m, recs in records.items()}
    plot_average_accuracy(curves, out.with_name(out.stem + "_curves.png"), title=f"{benchmark} ({scenario})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("benchmark", help="a folder of configs/ (split_mnist, permuted_mnist, split_cifar, split_digits, ...)")
    parser.add_argument("--methods", nargs="+", required=True)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--scenario", help="override the configs' scenario (task / class / domain)")
    parser.add_argument("--data-dir", help="data root (else $CONTINUAL_BLR_DATA)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="epochs / 5; labelled QUICK in the outputs")
    parser.add_argument("--force", action="store_true", help="rerun finished runs")
    parser.add_argument("--runs-dir", default=str(ROOT / "benchmarks" / "runs"))
    args = parser.parse_args(argv)
    command = "python benchmarks/reproduce.py " + " ".join(sys.argv[1:] if argv is None else argv)
    runs_dir = Path(args.runs_dir)
    records: dict[str, list[dict]] = {}
    scenario = None
    jobs = [(m, s) for m in args.methods for s in args.seeds]
    for method, seed in tqdm(jobs, desc=args.benchmark):
        rec = run_one(args.benchmark, method, seed, args, runs_dir)
        scenario = rec["scenario"]
        records.setdefault(method, []).append(rec)
        tqdm.write(f"{method} seed {seed}: avg acc {100 * rec['avg_acc']:.2f}%  ({rec['wall_s']:.0f} s)")
    out = write_report(args.benchmark, scenario or "task", records, args, command)
    print(out.read_text())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
