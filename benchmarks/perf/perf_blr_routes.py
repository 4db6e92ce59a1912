"""Cheaper BLR routes on split MNIST: CPU time against ``none`` and accuracy on the *validation* split, in one run.

Run (one torch thread; every row in this process, after one warm-up run; ratios are to the first row):

    python benchmarks/perf/perf_blr_routes.py --data-dir $CONTINUAL_BLR_DATA            # the default rows below
    python benchmarks/perf/perf_blr_routes.py --route 'k5=blr:{"mc_samples": 0, "curvature_every": 5}' --no-write

Issue 23 asks for the split-MNIST BLR configuration at ≤ 1.5 × the CPU of ``none`` end to end; the table's is
``blr_price.yaml`` (the one-sample Price estimate, ``perf_blr.py --end-to-end``). A route is a config of
``configs/split_mnist/`` with params laid over its method's: the default rows are the issue's other suggestion, the
exact GGN every k steps (``curvature_every``) with the delta method (``mc_samples`` 0: no weight samples, so no
Gaussian draw, which alone costs about a third of an Adam step, ``perf_price_floor.py``). Every run trains on 0.9 of
each task's training data and is scored on the held-out 0.1 (``stream.validation``), so the accuracies can choose a
route without touching the test set. Writes ``benchmarks/results/perf/perf_blr_routes_split_mnist.md`` unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite (records, reproduce)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts (benchmarks/ is not a package)
from perf_fromp import _split_mnist_config, timed_runs, with_params  # noqa: E402
from reproduce import shown_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FUSED_DELTA = {"mc_samples": 0, "fused_step": True}
DEFAULT_ROUTES = [
    ("none", "none", {}),
    ("blr_price (the table's)", "blr_price", {}),
    ("GGN every 10, delta", "blr", {**FUSED_DELTA, "curvature_every": 10}),
    ("GGN every 10, delta, T 1e-4", "blr", {**FUSED_DELTA, "curvature_every": 10, "temperature": 1e-4}),
    ("GGN every 2, delta", "blr", {**FUSED_DELTA, "curvature_every": 2}),
]


def parse_route(text: str) -> tuple[str, str, dict]:
    """``LABEL=CONFIG:{json params}`` (the params optional) -> (label, config, params)."""
    label, _, rest = text.partition("=")
    config, _, params = rest.partition(":")
    if not label or not config:
        raise SystemExit(f"--route: expected LABEL=CONFIG[:{{json}}], got {text!r}")
    try:
        extra = json.loads(params) if params else {}
    except json.JSONDecodeError as e:
        raise SystemExit(f"--route {label}: the params are not JSON ({e.msg})") from None
    return label, config, extra


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--route", action="append", metavar="LABEL=CONFIG:{json}",
                    help="a row (repeatable; the first is the baseline); default: none, blr_price and three GGN routes")
    ap.add_argument("--data-dir", help="data root (else $CONTINUAL_BLR_DATA)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    routes = [parse_route(r) for r in args.route] if args.route else DEFAULT_ROUTES
    cfgs = []
    for label, config, extra in routes:
        cfg = with_params(_split_mnist_config(config, args.data_dir, False, "split_mnist"), extra)
        cfg.stream.validation, cfg.seed = 0.1, args.seed
        cfgs.append((label, cfg))
    runs = timed_runs(cfgs)
    base = runs[routes[0][0]][0]
    command = "python benchmarks/perf/perf_blr_routes.py " + shown_command(sys.argv[1:] if argv is None else argv,
                                                                     args.data_dir)
    lines = ["# Cheaper BLR routes on split MNIST (full budget, validation split 0.1)", "",
             f"Command: `{command.strip()}`; seed {args.seed}, torch threads {torch.get_num_threads()}, "
             f"{platform.machine()}, torch {torch.__version__}. Accuracies are on the held-out 0.1 of each task's "
             "training data, never the test set.", "",
             f"| route | config + params | CPU (s) | × {routes[0][0]} | validation acc (%) |", "|---|---|---|---|---|"]
    for (label, config, extra), (cpu, _wall, acc) in zip(routes, runs.values()):
        lines.append(f"| {label} | `{config}.yaml` + `{json.dumps(extra)}` | {cpu:.1f} | {cpu / base:.2f} | {acc:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        out = ROOT / "benchmarks" / "results" / "perf" / "perf_blr_routes_split_mnist.md"
        out.write_text(text)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
