"""The memory-perturbation sensitivities checked against retraining, on real runs: records and their table.

    # the split-MNIST recipe of docs/inspect.md (about 15 CPU-minutes per method on one thread):
    python benchmarks/inspect_validation.py configs/split_mnist/fromp.yaml --method fromp --n 400 --epochs 2 \
        --runs-dir /tmp/continual_blr_validation --data-dir $CONTINUAL_BLR_DATA
    python benchmarks/inspect_validation.py configs/split_mnist/none.yaml --method none --n 400 --epochs 2 ...
    python benchmarks/inspect_validation.py --table     # benchmarks/results/tables/inspect_validation.md, records only

Each call trains the config into ``<runs-dir>/<config folder>_<config stem>`` (once; the folder is reused when it holds the finished
method), runs ``continual-blr inspect RUN --validate N`` on the last task through the Python API
(``continual_blr.saved_run.validate_run``) and writes one record, ``benchmarks/records/inspect_validation/
<stream>_<scenario>_<method>_seed<s>.json``: the summary (correlations, floors, cost), every validated example's
estimates and true deviation, the command, the config and the provenance (commit, CPU). ``--table`` rebuilds the
table from the records alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

RECORDS = HERE / "records" / "inspect_validation"
TABLE = HERE / "results" / "tables" / "inspect_validation.md"


def _run(config: Path, method: str, runs_dir: Path, data_dir: str | None) -> Path:
    from continual_blr.cli import main

    out = runs_dir / f"{config.parent.name}_{config.stem}"
    if (out / method / "model.pt").is_file() and (out / method / "tasks").is_dir():
        return out
    args = ["run", str(config), "--out", str(out), "--no-progress", "--threads", "1", "--overwrite"]
    if data_dir:
        args += ["--data-dir", data_dir]
    if main(args) != 0:
        raise SystemExit(f"inspect_validation: training {config} failed")
    return out


def measure(args: argparse.Namespace) -> Path:
    import torch

    import records
    from continual_blr.saved_run import validate_run, load_run

    torch.set_num_threads(1)
    start = records.process_start()
    run_dir = _run(Path(args.config), args.method, Path(args.runs_dir), args.data_dir)
    t0, c0 = time.perf_counter(), time.process_time()
    run = load_run(run_dir, args.method, data=True)
    val = validate_run(run, args.n, epochs=args.epochs, seed=args.seed, progress=not args.no_progress)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    cfg = run.config
    scenario = cfg.stream.scenario or "task"
    record = {
        "kind": "inspect_validation", "stream": cfg.stream.name, "scenario": scenario, "method": args.method,
        "seed": cfg.seed, "config_file": str(Path(args.config)), "task": val.task_id, "n": args.n,
        "epochs": args.epochs, "validation_seed": args.seed, "sigma_source": val.sigma_source,
        "summary": val.summary(), "examples": {k: v for k, v in val.to_dict().items() if k != "summary"},
        "final_accuracy": run.result.get("avg_acc"), "wall_s": wall, "cpu_s": cpu,
        "command": "python benchmarks/inspect_validation.py " + " ".join(sys.argv[1:]).replace(
            os.environ.get("CONTINUAL_BLR_DATA", "\0"), "$CONTINUAL_BLR_DATA"),
        **start, **records.run_provenance(),
    }
    RECORDS.mkdir(parents=True, exist_ok=True)
    path = RECORDS / f"{cfg.stream.name}_{scenario}_{args.method}_seed{cfg.seed}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    s = record["summary"]
    print(f"{path.relative_to(ROOT)}: Spearman sensitivity {s['spearman_sensitivity']:.3f}, linearised "
          f"{s['spearman_linear']:.3f}, leverage {s['spearman_leverage']:.3f}, plain {s['spearman_plain']:.3f}; "
          f"{cpu:.0f} CPU-s")
    return path


RESOLVED = 1e-6
"""A true deviation above this is resolved well above float32 rounding of the probabilities (the table's last ρ)."""


def _resolved(record: dict) -> tuple[float, int, float, int]:
    """Spearman of the sensitivity with the true deviation over the examples with d > :data:`RESOLVED`, and over
    those whose d exceeds their own noise floor (how far the reference retraining moved them); with the counts."""
    import torch

    from continual_blr.inspect.validate import spearman

    ex = record["examples"]
    true, sens, floor = (torch.tensor(ex[k], dtype=torch.float64) for k in ("true", "sensitivity", "noise_floor"))
    a, b = true > RESOLVED, true > floor
    return spearman(sens[a], true[a]), int(a.sum()), spearman(sens[b], true[b]), int(b.sum())


def table() -> str:
    """The table of every record (one row each), rebuilt from the records alone."""
    rows = [json.loads(p.read_text()) for p in sorted(RECORDS.glob("*.json"))]
    lines = [
        "# Leave-one-out sensitivities against retraining (`inspect --validate`)",
        "",
        "Generated by `python benchmarks/inspect_validation.py --table` from `benchmarks/records/inspect_validation/`;",
        "do not edit. True deviation d = ‖softmax(f∖i) − softmax(f ref)‖₁ of the left-out example after a warm-started",
        "retraining without it (the run's method as the task started, its optimiser, every other minibatch equal to the",
        "reference retraining's); estimates: the report's sensitivity ‖V e‖₁, the linearised ‖Λ V e‖₁, the plain",
        "‖softmax(f + V e) − softmax(f)‖₁ and the leverage-corrected one (V (I − ΛV)⁻¹ e). Spearman's ρ over all N",
        "examples (drawn one per rank stratum of the sensitivity), and over those above the seed floor (the disagreement",
        "of two reference retrainings with other minibatch orders). Noise floor: how far the reference retraining moves",
        "the trained network's prediction. Resolved: ρ of the sensitivity over the examples whose d exceeds 10⁻⁶",
        "(above float32 rounding of the probabilities), and over those whose d exceeds their own noise floor.",
        "Goal of issue 40: Spearman ≥ 0.8.",
        "",
        "| stream | method | task | N × epochs | ρ sensitivity | ρ linearised | ρ plain | ρ leverage | ρ above seed floor (n) "
        "| ρ d > 1e-6 (n) | ρ d > noise floor (n) | Pearson linearised | ρ loss change | median true d | median noise floor | median seed floor | CPU | command |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r["summary"]
        rho6, n6, rhof, nf = _resolved(r)
        lines.append(
            f"| {r['stream']} ({r['scenario']}) | {r['method']} | {r['task'] + 1} | {r['n']} × {r['epochs']} "
            f"| {s['spearman_sensitivity']:.3f} | {s['spearman_linear']:.3f} | {s['spearman_plain']:.3f} "
            f"| {s['spearman_leverage']:.3f} | {s['spearman_sensitivity_above_floor']:.3f} "
            f"({int(s['n_above_seed_floor'])}) | {rho6:.3f} ({n6}) | {rhof:.3f} ({nf}) | {s['pearson_linear']:.3f} | {s['spearman_loss_change']:.3f} "
            f"| {s['median_true']:.2e} | {s['median_noise_floor']:.2e} | {s['median_seed_floor']:.2e} "
            f"| {r['cpu_s'] / 60:.1f} min | `{r['command']}` |")
    lines += ["", "Σ per row: " + "; ".join(f"{r['method']}: {r['sigma_source']}" for r in rows), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="the run's YAML config")
    p.add_argument("--method", help="the method of the config to validate")
    p.add_argument("--n", type=int, default=400, help="examples left out, one at a time (default 400)")
    p.add_argument("--epochs", type=int, default=2, help="epochs of each retraining (default 2)")
    p.add_argument("--seed", type=int, default=0, help="the retrainings' seed (default 0)")
    p.add_argument("--runs-dir", default="/tmp/continual_blr_validation", help="where the runs are trained (outside the tree)")
    p.add_argument("--data-dir", default=os.environ.get("CONTINUAL_BLR_DATA"))
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--table", action="store_true", help="only rebuild the table from the records")
    p.add_argument("--check", action="store_true", help="exit 1 if the committed table differs from the records'")
    args = p.parse_args(argv)
    if args.check:
        return 0 if TABLE.is_file() and TABLE.read_text() == table() else 1
    if not args.table:
        if not args.config or not args.method:
            p.error("config and --method are needed (or --table)")
        measure(args)
    TABLE.parent.mkdir(parents=True, exist_ok=True)
    TABLE.write_text(table())
    print(f"wrote {TABLE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
