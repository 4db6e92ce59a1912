"""Diagnose FROMP on the reduced ResNet-18 (BatchNorm) of split CIFAR-10, at a CPU scale.

On the GPU at the full budget (``split_cifar10_resnet18.md``) FROMP's first task fell to exactly 50 % once the
second was trained. This script checks two candidate causes on a small copy of the protocol (the first two tasks,
``--per-task`` training images each, ``--points`` memorable points):

1. BatchNorm drift: the penalty runs in eval mode, on running statistics that the next task's training batches
   move. Train-mode forwards over task 2 (no weight change) show how far that alone moves the penalty.
2. Degenerate kernels: a memorised task has Λ ≈ 0 at its points, so K = J_p Σ J_pᵀ + εI could be ≈ εI; the
   diagonal of K (from its Cholesky factor) is printed.

Then task 2 is trained for ``--task2-epochs`` epochs with the penalty at ``--tau`` (0: no regularisation, as
``none``), printing the penalty, the eval-mode feature statistics and both tasks' accuracies after each epoch.

Run: ``python benchmarks/diagnose/diagnose_fromp_batchnorm.py --data-dir $CONTINUAL_BLR_DATA`` (about 2 CPU-minutes per
epoch of task 1 at 512 images).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--per-task", type=int, default=512)
    ap.add_argument("--points", type=int, default=40)
    ap.add_argument("--epochs", type=int, default=12, help="epochs of task 1")
    ap.add_argument("--task2-epochs", type=int, default=2)
    ap.add_argument("--tau", type=float, default=None, help="τ while training task 2 (default: the config's)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from continual_blr.config import RunConfig, from_dict, yaml_load
    from continual_blr.loop import evaluate_task, fit_task
    from continual_blr.methods import build_method
    from continual_blr.methods.base import TrainConfig
    from continual_blr.models import build_model
    from continual_blr.runner import build_stream
    from continual_blr.types import Batch

    cfg = from_dict(RunConfig, yaml_load((ROOT / "configs/split_cifar10/resnet18/fromp.yaml").read_text()))
    cfg.stream.data_dir = args.data_dir
    cfg.stream.options = {**cfg.stream.options, "max_per_task": args.per_task, "max_test_per_task": 400}
    stream = build_stream(cfg)
    t0, t1 = list(stream.tasks)[:2]
    torch.manual_seed(0)
    model = build_model(cfg.model.arch, stream.input_shape, stream.n_outputs, stream.n_heads)
    method = build_method("fromp", {**cfg.methods[0].params, "n_points": args.points}, seed=0)
    train = TrainConfig(epochs=args.epochs, batch_size=128, lr=cfg.train.lr, grad_clip=cfg.train.grad_clip)
    g = torch.Generator().manual_seed(0)
    start = time.process_time()
    loss = fit_task(model, t0, method, train, seen=[], generator=g, progress=False)
    print(f"task 1: train loss {loss:.5f}, test acc {evaluate_task(model, method, t0):.3f} "
          f"({time.process_time() - start:.0f} CPU-s)")
    reg = method.regularizer
    method.on_task_start(model, t1)
    probe = Batch(t1.x_train[:128], t1.y_train[:128], t1.head)

    def penalty() -> float:
        with torch.no_grad():
            return float(reg.penalty(model, probe, t1))

    def features(tag: str) -> None:
        model.eval()
        with torch.no_grad():
            h = model.body(t0.x_test[:256])
            out = model(t0.x_test[:256], t0.head)
        print(f"{tag}: eval-mode features of task 1's test images: {float((h == 0).float().mean()):.3f} zero, "
              f"mean norm {float(h.norm(dim=1).mean()):.2f}; logit std over images {float(out.std(0).mean()):.3f}")

    print(f"penalty at the start of task 2 (weights unchanged): {penalty():.4g}")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    with torch.no_grad():
        for k in range(3):
            for i in range(0, t1.x_train.shape[0], 128):
                model(t1.x_train[i:i + 128], t1.head)
            print(f"after {k + 1} train-mode pass(es) over task 2, no weight change: penalty {penalty():.4g}, "
                  f"task 1 acc {evaluate_task(model, method, t0):.3f}")
    model.load_state_dict(state)  # back to task 1's running statistics
    for _, _, parts in reg._groups:
        for part in parts:
            chol = part[-1]
            if chol is not None:
                dk = torch.diagonal(chol, dim1=-2, dim2=-1) ** 2
                print(f"diagonal of K + εI: min {float(dk.min()):.3g}, median {float(dk.median()):.3g}, "
                      f"max {float(dk.max()):.3g} (ε = {reg.jitter:g})")
    if args.tau is not None:
        reg.tau = args.tau
    # train task 2 one epoch at a time; the kernels above stay (fit_task would rebuild the same ones), and the
    # task's end (curvature, memorable selection) is not run between epochs
    method.on_task_start = lambda *a, **k: None  # type: ignore[method-assign]
    method.on_task_end = lambda *a, **k: None  # type: ignore[method-assign]
    features("before task 2")
    one = dataclasses.replace(train, epochs=1)
    for ep in range(args.task2_epochs):
        loss = fit_task(model, t1, method, one, seen=[t0], generator=g, progress=False)
        features(f"task 2 epoch {ep + 1}")
        print(f"task 2 epoch {ep + 1} (τ {reg.tau:g}): train loss {loss:.4f}, penalty {penalty():.4g}, test acc "
              f"task 1 {evaluate_task(model, method, t0):.3f}, task 2 {evaluate_task(model, method, t1):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
