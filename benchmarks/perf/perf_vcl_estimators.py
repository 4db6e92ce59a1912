"""What a Bayes-by-backprop VCL step costs with each estimator of E_q[ℓ], against an Adam (``none``) step.

Run (one torch thread; ratios are measured in the same run, the settings interleaved round by round):

    python benchmarks/perf/perf_vcl_estimators.py            # prints the table, writes benchmarks/results/perf/perf_vcl_estimators.md
    python benchmarks/perf/perf_vcl_estimators.py --rounds 3 --calls 30 --no-write

Setting: permuted MNIST's network (MLP 784-100-100, one 10-way head), minibatches of 128 (the FROMP protocol) and
256 (the VCL paper's), uniform pixels; ``configs/permuted_mnist/vcl.yaml``'s VCL (``optimizer: bbb``, 10 samples
per step) with ``estimator: weights`` (θ_s = μ + σ ∘ ε_s, one draw shared by the minibatch: the paper's) and
``estimator: local`` (per-example pre-activation draws, :mod:`continual_blr.methods.local_reparam`). Each row is
``loop.train_step`` on a task whose prior is q_0, after a warm-up.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

from continual_blr.models import build_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite (records, reproduce)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_timing import interleaved_medians, publish, step_runner  # noqa: E402

VCL = {"optimizer": "bbb", "prior_precision": 1.0, "init_log_variance": -6.0, "mc_samples": 10,
       "predict_samples": 20, "lr": 0.001, "log_var_lr": 0.003, "coreset_size": 0}  # configs/permuted_mnist/vcl.yaml


def _step(name: str, params: dict, batch: int):
    model = build_model("mlp", (784,), 10, 1, hidden=(100, 100), generator=torch.Generator().manual_seed(0))
    return step_runner(model, name, params, 784, 10, batch, 1e-3)


def measure(rounds: int, calls: int, batches: list[int]) -> dict[tuple[str, int], float]:
    """Median CPU ms per step of each (setting, batch), interleaved round by round."""
    fns = {}
    for b in batches:
        fns[("none", b)] = _step("none", {}, b)
        fns[("vcl, estimator: weights", b)] = _step("vcl", VCL | {"estimator": "weights"}, b)
        fns[("vcl, estimator: local", b)] = _step("vcl", VCL | {"estimator": "local"}, b)
    return interleaved_medians(fns, rounds, calls, warmup=5)


def report(ms: dict, rounds: int, calls: int, command: str) -> str:
    lines = ["# VCL (Bayes-by-backprop): the cost of a step by estimator", "", "Produced by:", "", "```", command, "```", "",
             f"MLP 784-100-100, one 10-way head; 10 samples per VCL step; median CPU ms per step over {rounds} rounds "
             f"of {calls} calls, every row interleaved in each round; 1 torch thread; {platform.machine()}, torch "
             f"{torch.__version__}. The machine is shared: read the ratios, which are measured in the same run.", "",
             "| step | batch | CPU ms / step | × none (same batch) | × weights (same batch) |", "|---|---|---|---|---|"]
    for (name, b), v in ms.items():
        lines.append(f"| {name} | {b} | {v:.2f} | {v / ms[('none', b)]:.2f} | "
                     f"{v / ms[('vcl, estimator: weights', b)]:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--batches", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.calls < 1 or args.threads < 1 or min(args.batches) < 1:
        ap.error("--rounds, --calls, --threads and --batches must be >= 1")
    torch.set_num_threads(args.threads)
    ms = measure(args.rounds, args.calls, args.batches)
    return publish("perf_vcl_estimators", lambda command: report(ms, args.rounds, args.calls, command), args.no_write)


if __name__ == "__main__":
    sys.exit(main())
