"""Data-parallel scaling on one machine: wall time and bytes communicated per step at 1 and W processes.

    OMP_NUM_THREADS=1 python benchmarks/perf/perf_distributed.py --data-dir /path/to/data \
        --methods fromp blr --procs 1 2 --epochs 1

For each (method, W) it starts W processes with torchrun's environment variables (gloo on CPU, nccl
on GPUs; the same code path as ``torchrun --nproc-per-node W -m continual_blr run``), trains split
MNIST with the method's config in ``configs/split_mnist/`` (epochs replaced by ``--epochs``) and reports,
from rank 0: the wall time of ``run_stream`` (all tasks, training and evaluation), the training steps,
and the bytes each process put into collectives (``continual_blr.distributed.TRAFFIC``: payload sizes,
not the wire protocol's), split into per-step traffic (gradient / BLR-step all-reduces) and per-task
traffic (curvature, memorable-point scores, evaluation). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEP_KINDS = ("gradient", "blr step", "batch size")


def _worker(method_name: str, epochs: int, data_dir: str | None, max_per_task: int | None, dtype: str) -> None:
    import torch

    from continual_blr import distributed
    from continual_blr.config import yaml_load
    from continual_blr.data.registry import make_stream
    from continual_blr.loop import run_stream
    from continual_blr.methods import TrainConfig, build_method
    from continual_blr.models import build_model

    distributed.init_from_env()
    cfg = yaml_load((ROOT / "configs" / "split_mnist" / f"{method_name}.yaml").read_text())
    kw = {"max_per_task": max_per_task} if max_per_task else {}
    # validation stream: the accuracy printed beside the times is on held-out training data, never test data
    stream = make_stream("split_mnist", data_dir=data_dir, seed=0, download=False, validation=0.1, **kw)
    dt = getattr(torch, dtype)
    for t in stream.tasks:
        t.x_train, t.x_test = t.x_train.to(dt), t.x_test.to(dt)
    model = build_model("mlp", stream.input_shape, stream.n_outputs, stream.n_heads,
                        hidden=tuple(cfg["model"]["hidden"]), generator=torch.Generator().manual_seed(0)).to(dt)
    spec = cfg["methods"][0]
    method = build_method(spec["name"], spec.get("params", {}), seed=0)
    train = TrainConfig(**{**cfg["train"], "epochs": epochs})
    steps = sum(epochs * -(-t.n_train // train.batch_size) for t in stream.tasks)
    distributed.TRAFFIC.reset()
    t0 = time.perf_counter()
    with distributed.fail_fast("perf_distributed"):
        res = run_stream(model, stream, method, train, seed=0, progress=False)
    wall = time.perf_counter() - t0
    if distributed.is_main_process():
        weights = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
        print(json.dumps({"wall_s": wall, "steps": steps, "avg_acc": res.avg_acc, "weights": weights.tolist(),
                          "bytes": distributed.TRAFFIC.bytes, "calls": distributed.TRAFFIC.calls}))
    distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(method: str, world: int, args: argparse.Namespace) -> dict:
    port = _free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, WORLD_SIZE=str(world), RANK=str(r), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        cmd = [sys.executable, __file__, "--worker", method, "--epochs", str(args.epochs), "--dtype", args.dtype]
        if args.data_dir:
            cmd += ["--data-dir", args.data_dir]
        if args.max_per_task:
            cmd += ["--max-per-task", str(args.max_per_task)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"perf_distributed: {method} at {world} processes failed: {err.strip()[-500:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=["fromp", "blr"])
    ap.add_argument("--procs", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--max-per-task", type=int, default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                    help="model and data precision (float64: 1 and W processes agree to round-off)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker, args.epochs, args.data_dir, args.max_per_task, args.dtype)
        return
    print(f"{args.dtype}; the last column: ‖θ_W − θ_1‖ / ‖θ_1‖ of the final weights against the 1-process run")
    print("| method | processes | wall time (s) | steps | bytes / step / process | all-reduces / step "
          "| bytes / task / process (curvature, scores, evaluation) | avg. acc. | weights vs 1 process |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in args.methods:
        ref = None
        for w in args.procs:
            r = _run(m, w, args)
            theta = r.pop("weights")
            if ref is None:
                ref = theta
            diff = math.sqrt(sum((a - b) ** 2 for a, b in zip(theta, ref))) / max(math.sqrt(sum(a * a for a in ref)), 1e-300)
            step_b = sum(v for k, v in r["bytes"].items() if k in STEP_KINDS)
            step_c = sum(v for k, v in r["calls"].items() if k in STEP_KINDS)
            task_b = sum(v for k, v in r["bytes"].items() if k not in STEP_KINDS)
            print(f"| {m} | {w} | {r['wall_s']:.1f} | {r['steps']} | {step_b / r['steps']:,.0f} | "
                  f"{step_c / r['steps']:.2f} | {task_b / 5:,.0f} | {100 * r['avg_acc']:.2f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
