"""Trace FROMP's penalty through FROMP's CifarNet protocol on split CIFAR-10, on held-out training data only.

On a lent GPU, seed 1 of ``configs/split_cifar10/fromp.yaml`` diverged in task 3 (mean train loss of its last
epoch 7.95e6; ``benchmarks/results/tables/split_cifar10.md``). This script reruns that protocol (the first ``--tasks``
tasks, the config's 80 epochs, or ``--epochs``) and records what the table cannot show, as it is produced:

* every step: the FROMP penalty (τ/2) Σ_s Σ_c Δp_{s,c}ᵀ (K_{s,c} + εI)⁻¹ Δp_{s,c} and the gradient norm before
  the clip (``train.grad_clip``); per epoch their mean and maximum, and how many steps were clipped;
* every task start (after FROMP rebuilds its kernels at the current weights): the eigenvalues of each stored
  task's per-class kernels K_{s,c} + εI (min, max, condition number) and the jitter ε used;
* every task end: accuracy on every seen task's **validation** split (``--validation``, default 10 % of each
  task's training images, stratified and seeded by the run's seed; the test set is never read).

It is a diagnosis, not a benchmark row: nothing is chosen from it. The CPU run is not the GPU run (other
kernels, bf16 autocast by default for speed), so a divergence need not recur at the same step.

Run (about 40 CPU-minutes for 3 tasks at bf16 on a CPU with AMX-BF16):
``python benchmarks/diagnose/diagnose_fromp_divergence.py --data-dir $CONTINUAL_BLR_DATA --seed 1 --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # protocol.py beside this file


def _spectra(reg) -> list[dict]:
    """Per stored task: eigenvalues of its kernels K_{s,c} + εI (float64), summarised."""
    out = []
    for e in reg.memory:
        k = e.extras.get("kernel")
        if k is None:
            continue
        k64 = k.to(torch.float64)
        ev = torch.linalg.eigvalsh(k64)
        diag = torch.diagonal(k64, dim1=-2, dim2=-1)
        eps = float(e.extras["jitter"])
        p_old = e.extras["p_old"]
        out.append({"degenerate": int((diag <= 2.0 * eps).sum()),  # K_ii − ε ≤ ε: the point's Jacobian is ~0
                    "p_old_saturated": int(((p_old == 0.0) | (p_old == 1.0)).sum()),  # softmax exactly 0 / 1
                    "task": int(e.task_id), "points": len(e), "jitter": eps,
                    "eig_min": float(ev.min()), "eig_max": float(ev.max()), "cond": float(ev.max() / ev.min()),
                    "diag_min": float(diag.min()), "diag_max": float(diag.max())})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", required=True, help="folder holding cifar10/cifar10.npz")
    ap.add_argument("--config", default=str(ROOT / "configs/split_cifar10/fromp.yaml"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tasks", type=int, default=3, help="train the first N tasks (default 3)")
    ap.add_argument("--epochs", type=int, default=None, help="epochs per task (default: the config's)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--validation", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True, help="folder for trace.jsonl (appended as produced) and summary.md")
    args = ap.parse_args(argv)
    if not 0.0 < args.validation < 1.0:
        ap.error(f"--validation: {args.validation} is not in (0, 1); the test set is never used here")
    torch.set_num_threads(args.threads)

    from continual_blr.loop import run_stream
    from continual_blr.regularizers.functional import FunctionalRegularizer
    from protocol import first_method_run

    stream, train, method, model, params = first_method_run(args.config, args.data_dir, seed=args.seed,
                                                            validation=args.validation, tasks=args.tasks,
                                                            precision=args.precision, epochs=args.epochs)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = (out / "trace.jsonl").open("a")

    def emit(row: dict) -> None:
        trace.write(json.dumps(row) + "\n")
        trace.flush()

    emit({"kind": "start", "config": args.config, "seed": args.seed, "tasks": args.tasks, "epochs": train.epochs,
          "precision": args.precision, "validation": args.validation, "grad_clip": train.grad_clip,
          "params": params, "torch": torch.__version__})
    state = {"task": 0, "pen": [], "norm": [], "t": time.perf_counter()}

    penalty = FunctionalRegularizer.penalty
    rebuild = FunctionalRegularizer.rebuild
    clip = torch.nn.utils.clip_grad_norm_

    def traced_penalty(self, *a, **k):
        p = penalty(self, *a, **k)
        state["pen"].append(float(p.detach()))
        return p

    def traced_rebuild(self, model):
        rebuild(self, model)
        if len(self.memory):
            emit({"kind": "kernels", "task": state["task"], "entries": _spectra(self)})

    def traced_clip(parameters, max_norm, *a, **k):
        norm = clip(parameters, max_norm, *a, **k)
        state["norm"].append(float(norm))
        return norm

    def on_epoch(i: int, epoch: int, loss: float) -> None:
        pen, norm = state["pen"], state["norm"]
        clip_at = train.grad_clip if train.grad_clip is not None else math.inf
        emit({"kind": "epoch", "task": i + 1, "epoch": epoch + 1, "loss": loss,
              "pen_mean": sum(pen) / max(len(pen), 1), "pen_max": max(pen, default=0.0),
              "norm_mean": sum(norm) / max(len(norm), 1), "norm_max": max(norm, default=0.0),
              "clipped": sum(n > clip_at for n in norm), "steps": len(norm),
              "seconds": time.perf_counter() - state["t"]})
        print(f"task {i + 1} epoch {epoch + 1}: loss {loss:.4g}, penalty max {max(pen, default=0.0):.4g}, "
              f"grad norm max {max(norm, default=0.0):.4g}", flush=True)
        state["pen"], state["norm"], state["t"] = [], [], time.perf_counter()

    def on_task_end(progress, model, method) -> None:
        i = progress.next_task - 1
        state["task"] = i + 2
        emit({"kind": "task_end", "task": i + 1, "val_acc": progress.acc_matrix[i][: i + 1],
              "train_loss": progress.train_loss[i], "seconds": progress.task_times[i]})

    FunctionalRegularizer.penalty, FunctionalRegularizer.rebuild = traced_penalty, traced_rebuild
    torch.nn.utils.clip_grad_norm_ = traced_clip
    state["task"] = 1
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        run_stream(model, stream, method, train, seed=args.seed, device="cpu", progress=False,
                   on_task_end=on_task_end, on_epoch=on_epoch)
    finally:
        FunctionalRegularizer.penalty, FunctionalRegularizer.rebuild = penalty, rebuild
        torch.nn.utils.clip_grad_norm_ = clip
        emit({"kind": "end", "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0})
        trace.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
