"""Where a training step's time goes on a GPU: ``torch.profiler`` over steps of ``perf_train.py``'s step.

Issue 43 asks for a reduced-ResNet-18 step ≤ 4 ms on the lent GPU; ``perf_train.py --device cuda`` measures 9-11 ms,
and neither bf16 nor ``torch.compile`` (``default``, ``reduce-overhead``) shortens it. This script profiles
``--steps`` steps after ``--warmup`` and prints, per network and setting, the wall time per step, the summed
CUDA kernel time per step (what the GPU computed) and the operators with the most self CUDA time and the most
self CPU time, so that launch overhead, synchronisation and kernels can be told apart.

Run (on a GPU machine, a minute): ``python benchmarks/perf/profile_train_cuda.py --out DIR``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf_train import _step_fn  # noqa: E402

CASES = [("reduced_resnet18", "fp32", True), ("reduced_resnet18", "fp32", False), ("cifarnet", "fp32", True)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--out", default=None, help="folder for profile.md")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_train_cuda: needs a CUDA device")
        return 2
    lines = [f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; {args.steps} steps after "
             f"{args.warmup}; batch of perf_train.py", ""]
    for arch, precision, cl in CASES:
        step = _step_fn(arch, precision, cl, 0, device="cuda")
        for _ in range(args.warmup):
            step()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        wall = (time.perf_counter() - t0) / args.steps * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
        events = prof.key_averages()
        dev_key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
        cuda_total = sum(getattr(e, dev_key) for e in events) / args.steps / 1e3
        kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / args.steps
        lines += [f"## {arch} {precision}{' + channels_last' if cl else ''}",
                  f"wall {wall:.2f} ms / step (unprofiled); CUDA kernel time {cuda_total:.2f} ms / step; "
                  f"{kernels:.0f} kernels / step", "", "```",
                  events.table(sort_by=dev_key, row_limit=args.rows, max_name_column_width=60),
                  events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60),
                  "```", ""]
        print("\n".join(lines[-8:-6]), flush=True)
    text = "\n".join(lines)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
