"""Replay one task of a finished FROMP run from its boundary checkpoint and log every optimiser step.

Run:

    python benchmarks/diagnose/fromp_step_trace.py RUN_DIR --task K --epochs E --out trace.jsonl \
        --data-dir $CONTINUAL_BLR_DATA [--threads 1] [--sharpness-at STEP ...]

``RUN_DIR`` is a run folder made with ``--work-dir`` (``results.json`` beside one method folder holding
``tasks/after_task<k>.pt``). The folder is copied to a scratch directory with task K − 1's boundary checkpoint as the
method's checkpoint, and the library's own resume (:func:`continual_blr.runner.run_config`, ``resume=True``)
trains task K (0-based) again: the same loop, the same optimiser state and generators, so with the run's thread
count the replay is the original run's arithmetic, step for step (the script compares its epoch means with the
run's ``train_log.csv`` and says whether they agree bit for bit). It stops after ``E`` epochs of task K.

Per step it writes one JSON line: the minibatch's data loss and FROMP penalty, the gradient's norm as the optimiser
sees it (after the loop's clip), the update's norm ‖Δθ‖₂ and largest entry ‖Δθ‖∞, and Adam's state: the quantiles
0.001 / 0.5 of √v̂ (v̂ = v / (1 − β₂ᵗ), the second-moment estimate that divides each coordinate's step) over all
coordinates, and ‖m̂ / (√v̂ + ε)‖₂ — the step's length in units of the learning rate. These columns tell Adam's
late-training instability (the gradient fades, v̂ decays, the normalised step grows) from an instability of the
loss itself (`benchmarks/results/traces/diagnose_fromp_adam_sharpness.md` found the latter).

``--sharpness-at STEP ...`` also measures, before those steps' updates, the **preconditioned sharpness** of the
penalty and of the minibatch's data loss (eval mode): the largest eigenvalue of P^{-1/2} H P^{-1/2}, where H is the
Hessian (Hessian-vector products by double backward, in fp32) and P = diag(√v̂ + ε) is the preconditioner Adam's
step divides by, by power iteration. Adam with learning rate η and momentum β₁ is stable on a quadratic only while
η · λ_max(P⁻¹H) < 2(1 + β₁)/(1 − β₁) = 38 for β₁ = 0.9 (Cohen et al. 2022, "Adaptive gradient methods at the edge of
stability"); the rows give η·λ against that threshold.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from continual_blr.config import RunConfig, from_dict  # noqa: E402
from continual_blr.methods import fromp as fromp_module  # noqa: E402
from continual_blr.runner import run_config  # noqa: E402


class _Stop(Exception):
    """Raised from the optimiser's step once the requested epochs are traced."""


def _scratch_copy(run: Path, task: int, scratch: Path) -> tuple[RunConfig, str]:
    results = json.loads((run / "results.json").read_text())
    cfg_dict = dict(results["config"])
    names = [m["name"] for m in cfg_dict["methods"]]
    if len(names) != 1:
        raise SystemExit(f"fromp_step_trace: {run} holds methods {names}; give a run folder of one method")
    name = names[0]
    if not name.startswith(("fromp", "frorp")):
        raise SystemExit(f"fromp_step_trace: {run} ran {name!r}; the trace reads a FROMP-type method's penalty "
                         "(fromp, frorp, fromp-l2, fromp-full, fromp-kron, fromp-replay)")
    src = run / name / "tasks" / f"after_task{task - 1}.pt"
    if task < 1 or not src.is_file():
        raise SystemExit(f"fromp_step_trace: --task {task}: {src} does not exist (a task after the first, of a run "
                         "made with --work-dir)")
    shutil.copy(run / "results.json", scratch / "results.json")
    (scratch / name).mkdir()
    shutil.copy(src, scratch / name / "checkpoint.pt")
    if (run / name / "train_log.csv").is_file():
        shutil.copy(run / name / "train_log.csv", scratch / name / "train_log.csv")
    cfg_dict["out"] = str(scratch)
    cfg_dict["progress"] = False
    return from_dict(RunConfig, cfg_dict), name


def _original_epochs(run: Path, name: str, task: int) -> dict[int, str]:
    path = run / name / "train_log.csv"
    if not path.is_file():
        return {}
    with path.open() as f:
        return {int(r["epoch"]): r["train_loss"] for r in csv.DictReader(f) if int(r["task"]) == task}


def _power_iteration(fn, params: list[torch.Tensor], scale: list[torch.Tensor], iters: int) -> float:
    """Largest eigenvalue (by modulus, signed) of S H S with S = diag(``scale``) and H the Hessian of ``fn()`` in
    ``params``, by ``iters`` rounds of power iteration from a fixed random start (Hessian-vector products by double
    backward)."""
    g = torch.Generator().manual_seed(0)
    v = [torch.randn(p.shape, generator=g) for p in params]
    norm = math.sqrt(sum(float(x.pow(2).sum()) for x in v))
    v = [x / norm for x in v]
    lam = 0.0
    for _ in range(iters):
        with torch.enable_grad():
            grads = torch.autograd.grad(fn(), params, create_graph=True, allow_unused=True)
            used = [i for i, gr in enumerate(grads) if gr is not None and gr.requires_grad]  # other heads: H = 0
            hv = torch.autograd.grad([grads[i] for i in used], [params[i] for i in used],
                                     grad_outputs=[scale[i] * v[i] for i in used], allow_unused=True)
        hvs = [torch.zeros_like(p) for p in params]
        for i, h in zip(used, hv):
            if h is not None:
                hvs[i] = h.detach()
        w = [s * h for s, h in zip(scale, hvs)]
        lam = sum(float((a * b).sum()) for a, b in zip(v, w))
        norm = math.sqrt(sum(float(x.pow(2).sum()) for x in w))
        if norm == 0:
            return 0.0
        v = [x / norm for x in w]
    return lam


def trace(run: Path, task: int, epochs: int, out: Path, data_dir: str | None, sharpness_at: tuple[int, ...] = (), power_iters: int = 20) -> str:
    scratch = Path(tempfile.mkdtemp(prefix="fromp_step_trace_"))
    try:
        cfg, name = _scratch_copy(run, task, scratch)
        if data_dir is not None:
            cfg.stream.data_dir = data_dir
        rows: list[dict] = []
        step = {"n": 0, "epoch_steps": None}
        pending: dict = {}

        add = fromp_module.PenaltyLog.add

        def logged_add(self, data, penalty, n):  # the minibatch's two parts, as the loop's log sums them
            pending["data"], pending["penalty"] = float(data.detach()), float(penalty.detach())
            return add(self, data, penalty, n)

        adam_step = torch.optim.Adam.step
        method_loss = fromp_module.FROMPMethod.loss
        live: dict = {}

        def captured_loss(self, model, batch, task_):  # the step's method, model, minibatch and task, for the Hessians
            live.update(method=self, model=model, batch=batch, task=task_)
            return method_loss(self, model, batch, task_)

        def sharpness(opt) -> dict:
            group = opt.param_groups[0]
            params = [p for p in group["params"] if p.requires_grad and opt.state.get(p)]
            beta2, eps = group["betas"][1], group["eps"]
            scale = []
            for p in params:
                st = opt.state[p]
                vhat = st["exp_avg_sq"] / (1 - beta2 ** float(st["step"]))
                scale.append((vhat.sqrt() + eps).rsqrt())
            model, method, batch, task_ = live["model"], live["method"], live["batch"], live["task"]
            was_training = model.training
            model.eval()
            try:
                pen = _power_iteration(lambda: method.regularizer.penalty(model, batch, task_), params, scale,
                                       power_iters)
                data = _power_iteration(lambda: fromp_module.mean_nll(model(batch.x.float(), head=batch.head),
                                                                      batch.y), params, scale, power_iters)
            finally:
                model.train(was_training)
            lr, beta1 = group["lr"], group["betas"][0]
            return {"sharpness_step": step["n"] + 1, "lr_x_penalty_sharpness": lr * pen,
                    "lr_x_data_sharpness": lr * data, "adam_threshold": 2 * (1 + beta1) / (1 - beta1)}

        def traced_step(self, *a, **kw):
            group = self.param_groups[0]
            if step["n"] + 1 in sharpness_at and live:
                rows.append(sharpness(self))
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            before = [p.detach().clone() for p in params]
            gnorm = math.sqrt(sum(float(p.grad.detach().float().pow(2).sum()) for p in params))
            result = adam_step(self, *a, **kw)
            beta2, eps = group["betas"][1], group["eps"]
            sq, upd = [], []
            for p, b in zip(params, before):
                st = self.state[p]
                t = float(st["step"])
                vhat = st["exp_avg_sq"] / (1 - beta2 ** t)
                mhat = st["exp_avg"] / (1 - group["betas"][0] ** t)
                sq.append(vhat.sqrt().flatten())
                upd.append((mhat / (vhat.sqrt() + eps)).flatten())
                b.sub_(p.detach()).neg_()
            root_v = torch.cat(sq)
            delta = torch.cat([b.flatten() for b in before])
            q = torch.quantile(root_v[torch.randperm(root_v.numel(), generator=torch.Generator().manual_seed(0))[:200_000]],
                               torch.tensor([0.001, 0.5]))
            step["n"] += 1
            rows.append({"step": step["n"], "data_loss": pending.get("data"), "penalty": pending.get("penalty"),
                         "grad_norm": gnorm, "update_norm": float(delta.norm()), "update_max": float(delta.abs().max()),
                         "sqrt_vhat_q001": float(q[0]), "sqrt_vhat_median": float(q[1]),
                         "normalised_step_norm": float(torch.cat(upd).norm())})
            if step["epoch_steps"] is not None and step["n"] >= epochs * step["epoch_steps"]:
                raise _Stop
            return result

        # the steps of one epoch: the task's training examples over the batch size (the loop keeps the last part)
        from continual_blr.runner import build_stream
        stream = build_stream(cfg)
        n_train = stream.tasks[task].n_train
        step["epoch_steps"] = math.ceil(n_train / cfg.train.batch_size)

        fromp_module.PenaltyLog.add = logged_add
        torch.optim.Adam.step = traced_step
        fromp_module.FROMPMethod.loss = captured_loss
        try:
            run_config(cfg, resume=True)
        except _Stop:
            pass
        finally:
            fromp_module.PenaltyLog.add = add
            torch.optim.Adam.step = adam_step
            fromp_module.FROMPMethod.loss = method_loss

        with out.open("w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        replay = _original_epochs(scratch, name, task)
        original = _original_epochs(run, name, task)
        same = [e for e in replay if e in original and replay[e] == original[e]]
        lines = [f"traced {step['n']} steps of task {task} ({step['epoch_steps']} a epoch) into {out}"]
        lines.append(f"epoch means equal to the run's train_log.csv bit for bit: {len(same)} of {len(replay)} "
                     "finished epochs")
        return "\n".join(lines)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--task", type=int, required=True, help="0-based task to replay (> 0)")
    ap.add_argument("--epochs", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sharpness-at", type=int, nargs="*", default=[], metavar="STEP")
    ap.add_argument("--power-iters", type=int, default=20)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(trace(args.run, args.task, args.epochs, args.out, args.data_dir, tuple(args.sharpness_at), args.power_iters))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
