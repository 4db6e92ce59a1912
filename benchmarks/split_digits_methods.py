"""Weight-space methods on split digits: EWC, Laplace, VCL, BLR, IVON, L2 against "none" and "joint".

Run (CPU, 1 torch thread; finished runs are stored under benchmarks/runs/ and reused):

    python benchmarks/split_digits_methods.py                          # 5 seeds, task + class, writes the table
    python benchmarks/split_digits_methods.py --seeds 0 --methods none ewc --no-write   # quick look

Every row is one YAML of ``configs/split_digits/`` (its ``methods[0]``: registry name and params) run
through the one training loop (``runner.run_config``) with the *same* model and budget for every
method — the ``model`` and ``train`` of ``configs/split_digits/none.yaml`` (MLP 64-100-100, 10 epochs
per task, batch 32, Adam lr 1e-3 for the non-BLR optimisers). Only the scenario and the seed change:
``task`` (multi-head, one 2-way head per task) and ``class`` (single 10-way head). The table in
``benchmarks/results/split_digits_methods.md`` gives the final average accuracy (mean ± sample std
over seeds), forgetting, the paired difference to "none" on the same seeds, and the wall/CPU time.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

from continual_blr.config import MethodConfig, RunConfig, from_dict
from continual_blr.runner import run_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs" / "split_digits"
SCENARIOS = ("task", "class")
# row label -> config file (methods[0] of it); the order of the table
ROWS = [
    ("none", "none"),
    ("l2", "l2"),
    ("ewc", "ewc"),
    ("ewc (online)", "ewc_online"),
    ("laplace (kron)", "laplace"),
    ("laplace (diag)", "laplace_diag"),
    ("vcl (vogn)", "vcl"),
    ("vcl (bbb)", "vcl_bbb"),
    ("vcl (vogn) + k-center coreset", "vcl_coreset"),
    ("blr (diag, VOGN)", "blr"),
    ("ivon", "ivon"),
    ("joint", "joint"),
]


def _load(name: str) -> RunConfig:
    return from_dict(RunConfig, yaml.safe_load((CONFIGS / f"{name}.yaml").read_text()))


def _method(config: str) -> MethodConfig:
    mc = _load(config).methods[0]
    return MethodConfig(mc.name, dict(mc.params))


def run_one(label: str, config: str, scenario: str, seed: int, runs_dir: Path, force: bool) -> dict:
    """Run (or reload) one (row, scenario, seed)."""
    mc = _method(config)
    path = runs_dir / scenario / f"{config}_seed{seed}.json"
    key = {"name": mc.name, "params": mc.params}
    if path.is_file() and not force:
        rec = json.loads(path.read_text())
        if rec.get("method_config") == key:
            return rec
    cfg = copy.deepcopy(_load("none"))  # the shared model and budget
    cfg.stream.scenario = scenario
    cfg.seed = seed
    cfg.progress = False
    cfg.methods = [mc]
    t0, c0 = time.perf_counter(), time.process_time()
    res = run_config(cfg, save=False)[0]
    rec = res.to_dict() | {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                           "label": label, "method_config": key}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, indent=2))
    tmp.replace(path)
    return rec


def _ms(xs: list[float], scale: float = 100.0) -> str:
    m = statistics.fmean(xs)
    s = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{scale * m:.1f} ± {scale * s:.1f}"


def report(records: dict[tuple[str, str], list[dict]], seeds: list[int], wall: float, command: str) -> str:
    base = _load("none")
    t = base.train
    lines = [
        "# Split digits: weight-space methods (final average accuracy, %)",
        "",
        "Produced by:",
        "",
        "```",
        command,
        "```",
        "",
        f"Seeds {', '.join(map(str, seeds))}; mean ± sample std over seeds. Same model and budget for every "
        f"method: MLP 64-{'-'.join(map(str, base.model.hidden))}, {t.epochs} epochs per task, batch {t.batch_size}, "
        f"Adam lr {t.lr} (BLR/VCL-vogn/IVON use their own optimiser over the same minibatches). "
        "Task: one 2-way head per task (multi-head); class: one 10-way head (single-head). "
        "Δ none: mean ± std over seeds of (method − none) on the same seed.",
        "",
        "| method | config | task-incremental | Δ none | forgetting | class-incremental | Δ none | forgetting | CPU / run (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, config in ROWS:
        if not any((label, s) in records for s in SCENARIOS):
            continue
        cells, cpu = [], []
        for scen in SCENARIOS:
            recs = records.get((label, scen))
            if not recs:
                cells += ["-", "-", "-"]
                continue
            none = {r["seed"]: r["avg_acc"] for r in records.get(("none", scen), [])}
            diffs = [r["avg_acc"] - none[r["seed"]] for r in recs if r["seed"] in none]
            cells += [_ms([r["avg_acc"] for r in recs]),
                      _ms(diffs) if diffs and label != "none" else "-",
                      _ms([r["forgetting"] for r in recs])]
            cpu += [r.get("cpu_s", r["wall_s"]) for r in recs]
        lines.append(f"| {label} | `{config}.yaml` | {' | '.join(cells)} | {statistics.fmean(cpu):.1f} |")
    lines += ["", f"Total wall time of this invocation: {wall:.0f} s (reused runs cost 0).", "",
              "Method parameters (from the YAML files):", ""]
    for label, config in ROWS:
        if any((label, s) in records for s in SCENARIOS):
            mc = _method(config)
            lines.append(f"- **{label}**: `{mc.name}` {json.dumps(mc.params) if mc.params else '(defaults)'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--methods", nargs="+", default=None, help="configs to run (default: all rows)")
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument("--runs-dir", default=str(ROOT / "benchmarks" / "runs" / "split_digits_methods"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "split_digits_methods.md"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--force", action="store_true", help="rerun stored runs")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    command = "python benchmarks/split_digits_methods.py " + " ".join(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    records: dict[tuple[str, str], list[dict]] = {}
    for label, config in ROWS:
        if args.methods and config not in args.methods:
            continue
        if config == "ivon":
            import importlib.util

            if importlib.util.find_spec("ivon") is None:
                print("ivon: skipped (pip install ivon-opt==0.1.3)")
                continue
        for scen in args.scenarios:
            for seed in args.seeds:
                rec = run_one(label, config, scen, seed, Path(args.runs_dir), args.force)
                records.setdefault((label, scen), []).append(rec)
                print(f"{label:32s} {scen:5s} seed {seed}: {100 * rec['avg_acc']:5.1f}%  "
                      f"({rec['wall_s']:.1f} s wall, {rec.get('cpu_s', 0):.1f} s CPU)", flush=True)
    text = report(records, args.seeds, time.perf_counter() - t0, command.strip())
    print(text)
    if not args.no_write:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
