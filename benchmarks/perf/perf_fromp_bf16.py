"""FROMP's cost under bf16 on CifarNet, with the penalty's forward in fp32 (default) or in bf16, and the error bf16 adds.

Run (one torch thread; the error part reads real CIFAR-10 from ``--data-dir`` / ``$CONTINUAL_BLR_DATA``, else
random images):

    python benchmarks/perf/perf_fromp_bf16.py --threads 1            # writes benchmarks/results/perf/perf_fromp_bf16.md
    python benchmarks/perf/perf_fromp_bf16.py --steps 3 --no-write
    python benchmarks/perf/perf_fromp_bf16.py --threads 1 --out benchmarks/results/perf/perf_fromp_bf16_xeon_amx.md

**Cost** (issue 43: "a CifarNet FROMP epoch at the last task ≤ 2 × a plain epoch under bf16"): CifarNet with five
2-way heads, ``train.precision: bf16`` (+ channels_last), batch 256, four past tasks of 200 memorable points each
(FROMP's CIFAR protocol at task 5; memory from random images: speed does not depend on the data). Timed, interleaved
round by round, by CPU time: one ``loop.train_step`` of ``none``, of ``fromp`` (penalty in fp32, the default) and of
``fromp`` with ``forward_precision: train`` (the memorable points' forward and backward in bf16), the latter also with
``tasks_per_step`` 1 and 2 (the penalty's unbiased estimate over that many of the four past tasks, drawn per step)
and with ``tasks_per_step`` 1 under ``task_estimator: saga``; and ``fused_forward`` (the minibatch and the memorable
points in one pass, dropout on the minibatch's rows only) for every past task and for ``tasks_per_step`` 1.
With ``--remedy`` (issue 43's chosen CifarNet remedy, ``configs/split_cifar10/bf16/fromp_remedy.yaml``: logits,
128 context rows, ``forward_precision: train``) the steps timed are ``none``, the remedy, and the remedy with
``n_points`` 50 (with 128 or 64 context rows) or with ``tasks_per_step`` 1 (the cost candidates of the CifarNet
screen's round 2,
``benchmarks/results/search/declare_split_cifar10_cifarnet_bf16_screen.md``).
An epoch is 39 such steps, so step ratios are epoch ratios. The floor: every step also passes the 800 memorable
points, (256 + 800) / 256 = 4.1 × the plain step's rows (k past tasks per step: (256 + 200 k) / 256).

**Error** of ``forward_precision: train``: CifarNet trained on task 1 (airplane / automobile) for ``--epochs``
epochs in bf16, FROMP's task end (200 memorable points, kernels), then ``--epochs`` epochs of task 2 with FROMP; at
the weights reached, the penalty and its gradient with the forward in fp32 and in bf16 (relative error of the
penalty, of the gradient's norm, and the gradient's cosine), beside the same comparison for the data loss (the
minibatch's cross-entropy, whose forward bf16 training already runs in bf16).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from continual_blr.data.stream import Task, TaskStream
from continual_blr.loop import fit_task, train_step
from continual_blr.methods import build_method
from continual_blr.methods.base import TrainConfig, mean_nll
from continual_blr.mixed_precision import to_channels_last, training_autocast
from continual_blr.models import build_model
from continual_blr.types import Batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from records import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SHAPE, BATCH, POINTS, PAST = (3, 32, 32), 256, 200, 4
FROMP = {"tau": 10.0, "n_points": POINTS, "prior_precision": 1e-4, "jitter": 1e-6}  # configs/split_cifar10/fromp.yaml
TARGET = 2.0
# configs/split_cifar10/bf16/fromp_remedy.yaml: the CifarNet remedy chosen on validation (issue 43)
REMEDY = FROMP | {"forward_precision": "train", "output": "logits", "context_points": 128, "context_weight": 1.0}
REMEDY_STEPS = {"fromp remedy (logits, 128 context rows)": REMEDY,
                "fromp remedy, n_points 50": REMEDY | {"n_points": 50},
                "fromp remedy, tasks_per_step 1": REMEDY | {"tasks_per_step": 1},
                "fromp remedy, n_points 50, 64 context rows (w 2)": REMEDY | {"n_points": 50, "context_points": 64,
                                                                        "context_weight": 2.0}}


def _model(heads: int = 5) -> torch.nn.Module:
    model = build_model("cifarnet", SHAPE, 2, heads, generator=torch.Generator().manual_seed(0))
    to_channels_last(model)
    return model


def _random_task(i: int, n: int, g: torch.Generator) -> Task:
    x = torch.rand(n, *SHAPE, generator=g)
    y = torch.randint(0, 2, (n,), generator=g)
    return Task(i, x, y, x[:10], y[:10], (2 * i, 2 * i + 1), head=i, name=f"t{i}")


def cost(steps: int, remedy: bool = False) -> dict[str, float]:
    """Median CPU seconds of one step: none, fromp (fp32 penalty), fromp (bf16 penalty forward) and its variants;
    with ``remedy``, none and the steps of :data:`REMEDY_STEPS` instead."""
    g = torch.Generator().manual_seed(0)
    tasks = [_random_task(i, POINTS + 56, g) for i in range(PAST + 1)]
    stream = TaskStream("perf", tasks, "task", SHAPE, 2, PAST + 1)
    train = TrainConfig(batch_size=BATCH, lr=1e-3, grad_clip=1000.0, precision="bf16")
    model = _model()
    methods = {"none": build_method("none"), "fromp (penalty fp32)": build_method("fromp", dict(FROMP), seed=0),
               "fromp (forward_precision: train)": build_method("fromp", FROMP | {"forward_precision": "train"},
                                                                 seed=0),
               # the penalty's unbiased estimate over k of the 4 past tasks per step (params.tasks_per_step)
               "fromp (forward_precision: train, tasks_per_step 1)": build_method(
                   "fromp", FROMP | {"forward_precision": "train", "tasks_per_step": 1}, seed=0),
               "fromp (forward_precision: train, tasks_per_step 2)": build_method(
                   "fromp", FROMP | {"forward_precision": "train", "tasks_per_step": 2}, seed=0),
               "fromp (forward_precision: train, tasks_per_step 1, task_estimator saga)": build_method(
                   "fromp", FROMP | {"forward_precision": "train", "tasks_per_step": 1, "task_estimator": "saga"},
                   seed=0),
               # one pass over the minibatch and every memorable point (dropout split by rows: params.fused_forward)
               "fromp (forward_precision: train, fused_forward)": build_method(
                   "fromp", FROMP | {"forward_precision": "train", "fused_forward": True}, seed=0),
               "fromp (forward_precision: train, tasks_per_step 1, fused_forward)": build_method(
                   "fromp", FROMP | {"forward_precision": "train", "tasks_per_step": 1, "fused_forward": True},
                   seed=0)}
    if remedy:
        methods = {"none": methods["none"]} | {k: build_method("fromp", dict(v), seed=0)
                                               for k, v in REMEDY_STEPS.items()}
    for m in methods.values():
        m.setup(model, stream, train)
    for name, m in methods.items():
        if name != "none":
            for t in tasks[:PAST]:
                m.on_task_end(model, t)
        m.on_task_start(model, tasks[PAST])
    x = torch.rand(BATCH, *SHAPE, generator=g)
    y = torch.randint(0, 2, (BATCH,), generator=g)
    batch = Batch(x, y, PAST)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    fns = {k: (lambda m=m: train_step(model, m, opt, batch, tasks[PAST], train)) for k, m in methods.items()}
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(steps):
        for k, fn in fns.items():
            c0 = time.process_time()
            fn()
            times[k].append(time.process_time() - c0)
        print("  cost: round done", file=sys.stderr, flush=True)
    return {k: statistics.median(v) for k, v in times.items()}


def _cifar_tasks(data_dir: str | None, n: int) -> tuple[list[Task], str]:
    try:
        from continual_blr.data.registry import make_stream

        s = make_stream("split_cifar10", data_dir=data_dir, scenario="task", download=False)
        tasks = []
        for t in s.tasks[:2]:
            tasks.append(Task(t.task_id, t.x_train[:n], t.y_train[:n], t.x_test[:512], t.y_test[:512], t.classes,
                              head=t.head, name=t.name))
        return tasks, f"real CIFAR-10 (first {n} training images of tasks 1-2)"
    except Exception as e:  # noqa: BLE001 - no data here: random images, said in the report
        g = torch.Generator().manual_seed(1)
        return [_random_task(i, n, g) for i in range(2)], f"random images (no CIFAR-10: {str(e)[:80]})"


def error(data_dir: str | None, epochs: int, n: int) -> dict[str, float | str]:
    """Penalty and gradient with the forward in fp32 against bf16, at weights trained on tasks 1-2."""
    tasks, data = _cifar_tasks(data_dir, n)
    stream = TaskStream("split_cifar10", tasks, "task", SHAPE, 2, 2)
    train = TrainConfig(epochs=epochs, batch_size=BATCH, lr=1e-3, grad_clip=1000.0, precision="bf16")
    model = _model(2)
    method = build_method("fromp", dict(FROMP), seed=0)
    method.setup(model, stream, train)
    g = torch.Generator().manual_seed(0)
    for i, t in enumerate(tasks):  # task 2 without its end: the penalty stays task 1's (p_old from task 1's end)
        fit_task(model, t, method, train, seen=tasks[: i + 1], generator=g, progress=False, end_task=i == 0)
    reg = method.regularizer
    x, y = tasks[1].x_train[:BATCH], tasks[1].y_train[:BATCH]
    out: dict[str, float | str] = {"data": data}
    for what in ("penalty", "data loss"):
        grads, values = {}, {}
        for prec in ("fp32", "train"):
            reg.forward_precision = prec
            model.zero_grad(set_to_none=True)
            with training_autocast("bf16", "cpu"):
                if what == "penalty":
                    v = reg.penalty(model, Batch(x, y, 1), tasks[1])
                else:  # the minibatch's forward: bf16 under autocast against fp32 without
                    ctx = training_autocast("bf16" if prec == "train" else "fp32", "cpu")
                    with ctx:
                        v = mean_nll(model(x, head=1).float(), y)
            v.backward()
            values[prec] = float(v)
            grads[prec] = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        reg.forward_precision = "fp32"
        a, b = grads["fp32"].double(), grads["train"].double()
        out[f"{what}: value fp32"] = values["fp32"]
        out[f"{what}: value rel. error"] = abs(values["train"] - values["fp32"]) / max(abs(values["fp32"]), 1e-30)
        out[f"{what}: gradient rel. error"] = float((b - a).norm() / a.norm().clamp_min(1e-30))
        out[f"{what}: gradient cosine"] = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    return out


def report(c: dict[str, float], e: dict, steps: int, epochs: int, command: str) -> str:
    plain = c["none"]
    lines = [
        "# FROMP under bf16 on CifarNet: the penalty's forward in fp32 or in bf16",
        "",
        "Produced by:", "", "```", command, "```", "",
        f"CPU: {cpu_model()}; {torch.get_num_threads()} torch thread(s); torch {torch.__version__}, Python "
        f"{platform.python_version()}. Medians of {steps} steps, interleaved round by round, by CPU time "
        "(`time.process_time`).",
        "",
        f"## Cost at the last task (4 past tasks × {POINTS} memorable points, batch {BATCH}, bf16 + channels_last)",
        "",
        "| step | CPU ms | × none |",
        "|---|---|---|",
    ]
    for k, v in c.items():
        lines.append(f"| {k} | {1e3 * v:.0f} | {v / plain:.2f} |")
    if any(k.startswith("fromp remedy") for k in c):
        ratios = {k: v / plain for k, v in c.items() if k != "none"}
        lines += [
            "",
            f"Target (issue 43): a FROMP epoch at the last task ≤ {TARGET:.0f} × a plain bf16 epoch. "
            + "; ".join(f"{k}: {r:.2f} × " + ("(met)" if r <= TARGET else "(**not met**)") for k, r in ratios.items())
            + f". Memorable rows per step beside the {BATCH} of the minibatch: {PAST} × {POINTS} (the remedy), "
            f"{PAST} × 50 (n_points 50), 1 × {POINTS} (tasks_per_step 1); each also passes 128 context rows (64 where "
            "named) through the network and its frozen copy. Which of them keeps the remedy's accuracy is the screen's question "
            "(round 2, on validation).",
        ]
        return "\n".join(lines) + "\n"
    full = {k: v for k, v in c.items() if k != "none" and "tasks_per_step" not in k}
    best = min(full.values()) / plain
    sampled = {k: v / plain for k, v in c.items() if "tasks_per_step" in k}
    floor = (BATCH + PAST * POINTS) / BATCH
    lines += [
        "",
        f"Target (issue 43): a FROMP epoch at the last task ≤ {TARGET:.0f} × a plain bf16 epoch. With every past task "
        f"in every step (the paper): best {best:.2f} × — " + ("met" if best <= TARGET else "**not met**")
        + f" ({min(full, key=full.get)}); such a step passes the {PAST * POINTS} memorable points forward and backward beside the {BATCH} images "
        f"of the minibatch, {floor:.1f} × the rows of a plain step. With the penalty estimated over k past tasks "
        "per step: " + ", ".join(f"k = {k.split('tasks_per_step ')[1].rstrip(')')}: {r:.2f} ×"
                                 + (" (met)" if r <= TARGET else " (not met)") for k, r in sampled.items())
        + ". Whether the estimate costs accuracy on CIFAR is a validation question (docs/fromp.md).",
        "",
        f"## Error of `forward_precision: train` ({e['data']}; {epochs} epoch(s) per task in bf16, then the "
        "penalty of task 1's points at the weights task 2 ended with)",
        "",
        "| quantity | value (fp32 forward) | relative error of the bf16 forward | gradient relative error | "
        "gradient cosine |",
        "|---|---|---|---|---|",
    ]
    for what in ("penalty", "data loss"):
        lines.append(f"| {what} | {e[f'{what}: value fp32']:.4g} | {e[f'{what}: value rel. error']:.2e} | "
                     f"{e[f'{what}: gradient rel. error']:.2e} | {e[f'{what}: gradient cosine']:.6f} |")
    lines += ["", "The data-loss row is the error bf16 training already accepts in every step's minibatch forward."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=7, help="timed steps per setting (default 7)")
    ap.add_argument("--epochs", type=int, default=2, help="epochs per task before the error is measured")
    ap.add_argument("--n-train", type=int, default=2048, help="training images per task for the error part")
    ap.add_argument("--data-dir", default=os.environ.get("CONTINUAL_BLR_DATA"))
    ap.add_argument("--remedy", action="store_true",
                    help="time none and issue 43's remedy with its two cost candidates; no error part")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "perf" / "perf_fromp_bf16.md"),
                    help="the report's path (default benchmarks/results/perf/perf_fromp_bf16.md)")
    args = ap.parse_args(argv)
    if args.threads < 1 or args.steps < 1 or args.epochs < 1 or args.n_train < BATCH:
        ap.error(f"--threads, --steps, --epochs must be >= 1 and --n-train >= {BATCH}")
    torch.set_num_threads(args.threads)
    c = cost(args.steps, args.remedy)
    e = {} if args.remedy else error(args.data_dir, args.epochs, args.n_train)
    command = "python " + " ".join(shlex.quote(a) for a in ["benchmarks/perf/perf_fromp_bf16.py", *sys.argv[1:]])
    text = report(c, e, args.steps, args.epochs, command.replace(str(args.data_dir), "$CONTINUAL_BLR_DATA")
                  if args.data_dir else command)
    print(text)
    if not args.no_write:
        path = Path(args.out)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
