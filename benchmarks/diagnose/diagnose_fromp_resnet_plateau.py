"""What holds FROMP's penalty on its plateau on the reduced ResNet-18 (BatchNorm): a decomposition from a cached task 1.

On the GPU at the full budget, FROMP's penalty was the whole loss from task 2's first epoch (≈ 1,490) and task 1
collapsed to chance. Two explanations were open (issue 43): (a) the penalty runs in eval mode on BatchNorm running
statistics that task 2's train-mode batches overwrite, and the kernel gives those statistics no variance; (b) a
memorised task gives a tiny probability kernel, so τ acts like τ / K.

This script trains task 1 of split CIFAR-10 on a CPU scale (``--per-task`` images, ``--epochs`` epochs, the FROMP
config of ``configs/split_cifar10/resnet18/fromp.yaml`` with ``--points`` memorable points), caches it (``--cache``),
and then trains task 2 with the library's own step (``loop.train_step``) under three settings from the same cache:

* ``reference``: the config (τ 10, BatchNorm statistics shared and updated by task 2's batches);
* ``tau0.1``: τ = 0.1 (is it the kernel's scale?);
* ``frozen``: BatchNorm layers in eval mode while task 2 trains (``train.batchnorm: frozen``: the statistics stay);
* ``logits``: the penalty over centred logits (``output: logits``), whose gradient does not vanish at saturation.

A control's name combines these: ``tau<X>`` sets τ = X, ``frozen`` freezes the statistics, a ``logits`` prefix
compares logits (e.g. ``logits_tau1000``).

At every ``--every``-th step it records, all on the same probe batch and the memorable points:

* ``penalty``: the penalty as training sees it (eval mode, current running statistics);
* ``penalty_task1_stats``: the same weights with task 1's running statistics swapped back in: the **parameter part**;
  ``penalty − penalty_task1_stats`` is the **running-statistics part**;
* ``flipped`` / ``flipped_saturated``: memorable points whose predicted class differs from the one stored at task 1's
  end, and those of them predicted with p > 0.99 (on the plateau where the probability kernel's gradient ∝ p(1 − p)
  vanishes); ``flipped_task1_stats``: the same count with task 1's statistics;
* ``grad_data`` / ``grad_penalty``: ‖∇ mean CE‖ on the step's batch and ‖∇ penalty‖ (running statistics restored
  after the gradient's train-mode forward);
* the step's loss, and task 1's / task 2's test accuracy at each epoch's end.

Also the kernel's diagonal (min / median / max of diag(K + εI)) at task 2's start.

Run (≈ 10–20 CPU-minutes at the defaults; the cache makes a rerun skip task 1):

    python benchmarks/diagnose/diagnose_fromp_resnet_plateau.py --data-dir $CONTINUAL_BLR_DATA

Writes ``benchmarks/results/traces/diagnose_fromp_resnet_plateau.jsonl`` (one JSON object per measurement) and prints
a summary; ``benchmarks/results/traces/diagnose_fromp_resnet_plateau.md`` is the write-up.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
TRACE = ROOT / "benchmarks/results/traces/diagnose_fromp_resnet_plateau.jsonl"


def _bn_buffers(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()
            if k.endswith(("running_mean", "running_var", "num_batches_tracked"))}


def _load_buffers(model, buffers) -> None:
    model.load_state_dict({**model.state_dict(), **buffers})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--per-task", type=int, default=1024)
    ap.add_argument("--points", type=int, default=40)
    ap.add_argument("--epochs", type=int, default=15, help="epochs of task 1")
    ap.add_argument("--task2-epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--every", type=int, default=1, help="measure every k-th step of task 2")
    ap.add_argument("--controls", default="reference,tau0.1,frozen,logits")
    ap.add_argument("--cache", default="/tmp/continual_blr_fromp_resnet_task1.pt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(TRACE))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from continual_blr.config import RunConfig, from_dict, yaml_load
    from continual_blr.loop import _batches, evaluate_task, fit_task, norm_layers, train_step
    from continual_blr.memory import forward
    from continual_blr.methods import build_method
    from continual_blr.methods.base import TrainConfig
    from continual_blr.models import build_model
    from continual_blr.runner import build_stream
    from continual_blr.types import Batch

    cfg = from_dict(RunConfig, yaml_load((ROOT / "configs/split_cifar10/resnet18/fromp.yaml").read_text()))
    cfg.stream.data_dir = args.data_dir
    cfg.stream.options = {**cfg.stream.options, "max_per_task": args.per_task, "max_test_per_task": 500}
    stream = build_stream(cfg)
    t0, t1 = list(stream.tasks)[:2]
    params = {**cfg.methods[0].params, "n_points": args.points}
    train = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=cfg.train.lr, grad_clip=cfg.train.grad_clip)

    def fresh(output: str = "probs"):
        model = build_model(cfg.model.arch, stream.input_shape, stream.n_outputs, stream.n_heads,
                            generator=torch.Generator().manual_seed(0))
        method = build_method("fromp", {**params, "output": output}, seed=0)
        method.use_likelihood(stream.likelihood, stream.sigma)
        method.setup(model, stream, train)
        return model, method

    cache = Path(args.cache)
    key = {"per_task": args.per_task, "points": args.points, "epochs": args.epochs, "batch_size": args.batch_size}
    if cache.is_file() and torch.load(cache, weights_only=False).get("key") == key:
        state = torch.load(cache, weights_only=False)
        print(f"task 1 from the cache {cache}: train loss {state['loss']:.3g}")
    else:
        model, method = fresh()
        c0 = time.process_time()
        loss = fit_task(model, t0, method, train, seen=[t0], generator=torch.Generator().manual_seed(0),
                        progress=False)
        state = {"key": key, "loss": loss, "model": model.state_dict(), "method": method.state_dict(),
                 "cpu_s": time.process_time() - c0}
        torch.save(state, cache)
        print(f"task 1 trained: train loss {loss:.3g}, {state['cpu_s']:.0f} CPU-s, cached at {cache}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    probe = Batch(t1.x_train[: args.batch_size], t1.y_train[: args.batch_size], t1.head)
    for control in args.controls.split(","):
        output = "logits" if control.startswith("logits") else "probs"
        model, method = fresh(output)
        model.load_state_dict(state["model"])
        saved = state["method"]
        if output != "probs":  # the same memory and curvature; the outputs compared are rebuilt at the task start
            saved = copy.deepcopy(saved)
            saved["regularizer"]["config"]["output"] = output
        method.load_state_dict(saved)
        reg = method.regularizer
        tau = re.search(r"tau([0-9.]+)", control)
        if tau:
            reg.tau = float(tau.group(1))
        frozen = "frozen" in control
        method.on_task_start(model, t1)  # kernels and stored predictions at task 1's end (eval mode)
        bn1 = _bn_buffers(model)
        entries = list(reg.memory)
        diag = torch.cat([torch.diagonal(e.extras["chol"], dim1=-2, dim2=-1).flatten() ** 2 for e in entries])
        print(f"[{control}] diag(K + εI) at task 2's start: min {float(diag.min()):.3g}, median "
              f"{float(diag.median()):.3g}, max {float(diag.max()):.3g}; task 1 test acc "
              f"{evaluate_task(model, method, t0):.3f}")
        opt = method.make_optimizer(model, t1, dataclasses.replace(train, epochs=args.task2_epochs))
        gen = torch.Generator().manual_seed(1)

        def penalty_now() -> float:
            with torch.no_grad():
                return float(reg.penalty(model, probe, t1))

        def flips() -> tuple[int, int]:
            n = sat = 0
            with torch.no_grad():
                model.eval()
                for e in entries:
                    p = torch.softmax(forward(model, e.x, e.head), -1)
                    old = e.extras["p_old"]
                    if e.columns is not None:
                        p = p[:, list(e.columns)]
                    moved = p.argmax(-1) != old.argmax(-1)
                    n += int(moved.sum())
                    sat += int((moved & (p.max(-1).values > 0.99)).sum())
                model.train()
            return n, sat

        def measure(step: int, epoch: int, loss: float) -> None:
            cur = _bn_buffers(model)
            pen, (fl, fls) = penalty_now(), flips()
            _load_buffers(model, bn1)
            pen1, (fl1, _) = penalty_now(), flips()
            _load_buffers(model, cur)
            grads = {}
            for name in ("data", "penalty"):
                model.zero_grad(set_to_none=True)
                if frozen:
                    for _, m in norm_layers(model):
                        m.eval()
                if name == "data":
                    value = torch.nn.functional.cross_entropy(model(probe.x, head=probe.head), probe.y)
                else:
                    value = reg.penalty(model, probe, t1)
                value.backward()
                grads[name] = float(torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()
                                                   if p.grad is not None)))
                _load_buffers(model, cur)  # the train-mode forward must not move the statistics
            model.zero_grad(set_to_none=True)
            row = {"control": control, "tau": reg.tau, "epoch": epoch, "step": step, "loss": loss, "penalty": pen,
                   "penalty_task1_stats": pen1, "statistics_part": pen - pen1, "flipped": fl,
                   "flipped_saturated": fls, "flipped_task1_stats": fl1, "points": sum(len(e) for e in entries),
                   "grad_data": grads["data"], "grad_penalty": grads["penalty"]}
            rows.append(row)
            print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}))

        model.train()
        measure(0, 0, float("nan"))
        step = 0
        for epoch in range(1, args.task2_epochs + 1):
            for _, batch in _batches([t1], args.batch_size, gen):
                if frozen:
                    for _, m in norm_layers(model):
                        m.eval()
                loss = float(train_step(model, method, opt, batch, t1, train))
                step += 1
                if step % args.every == 0:
                    measure(step, epoch, loss)
            acc = {"control": control, "epoch": epoch, "acc_task1": evaluate_task(model, method, t0),
                   "acc_task2": evaluate_task(model, method, t1)}
            rows.append(acc)
            print(json.dumps(acc))
            model.train()
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
