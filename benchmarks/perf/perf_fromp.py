"""FROMP speed against plain Adam and against the reference code, in one run.

Run (2 CPU threads, as the reference figures were measured on 2 cores):

    python benchmarks/perf/perf_fromp.py                      # prints the table and writes the results file
    python benchmarks/perf/perf_fromp.py --steps 30 --no-write

Setting: FROMP's permuted-MNIST protocol — MLP 784-100-100-10 (one head), 200 memorable points per
past task, minibatch 128, τ = 0.5, δ = 1e-5, ε = 1e-5, gradient-norm clip 0.01, Adam. Inputs are
uniform random pixels (speed does not depend on the data). For 1, 4 and 9 past tasks it measures

* the training step (zero_grad, loss = mean CE + FROMP penalty, backward, clip, Adam step — the same
  sequence as ``loop.fit_task``), median over ``--steps`` steps after warm-up;
* one forward/backward of the cross-entropy over (batch + all memorable points) — the issue's yardstick:
  a FROMP step should cost at most 2× that;
* the rebuild at a task start (old predictions, class-wise kernels and their Cholesky factors for
  every past task), median of ``--rebuilds`` after one warm-up;
* (for information) the task-end pass: diagonal GGN over the task's training data + λ selection.

and prints the ratios to plain Adam and the speed-up over the reference code (docs/anchors.md:
plain step ≈ 1.1 ms; FROMP step 0.40 / 1.9 / 3.5 s; rebuild 0.9 / 3.4 / 7.6 s).

End to end (``--end-to-end``, one thread): the split-MNIST configs ``configs/split_mnist/none.yaml`` and
``fromp.yaml`` run one after the other in the same invocation (real MNIST under ``--data-dir``; ``--quick``
divides the epochs by 5), each timed by the process CPU time it used; the FROMP run is repeated under
cProfile and its time split into the training steps' model passes, the penalty, the task-end work
(diagonal GGN + memorable selection), the task-start rebuild and evaluation. Target (issue 43): FROMP ≤ 1.5× none;
``--tasks-per-step K ...`` adds a fromp run per K with the penalty estimated over K past tasks per step;
``--fused`` adds each fromp run again with ``fused_forward`` (the minibatch and the memorable points in one forward
pass). Each row also shows the rows per step through the network over ``none``'s (``rows_ratio``).

    python benchmarks/perf/perf_fromp.py --end-to-end --data-dir $CONTINUAL_BLR_DATA --threads 1
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from continual_blr.data.stream import Task, TaskStream
from continual_blr.methods import TrainConfig, build_method
from continual_blr.models import MLP
from continual_blr.types import Batch

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = {  # past tasks → (step s, rebuild s), reference code on 2 cores (docs/anchors.md)
    1: (0.40, 0.9),
    4: (1.9, 3.4),
    9: (3.5, 7.6),
}
REFERENCE_PLAIN_STEP = 1.1e-3
PAST_TASKS = (1, 4, 9)
N_POINTS, BATCH, CLIP = 200, 128, 0.01
PARAMS = {"tau": 0.5, "n_points": N_POINTS, "prior_precision": 1e-5, "jitter": 1e-5}


def _task(i: int, n: int, g: torch.Generator) -> Task:
    x = torch.rand(n, 784, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return Task(i, x, y, x[:10], y[:10], tuple(range(10)), head=0, name=f"perm{i}")


def _step(model: nn.Module, method, opt: torch.optim.Optimizer, batch: Batch, task: Task) -> None:
    """One training step exactly as ``continual_blr.loop.fit_task`` does it (non-BLR branch)."""
    opt.zero_grad(set_to_none=True)
    loss = method.loss(model, batch, task)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()


def _median_time(fn, n: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _interleaved(fns: dict, steps: int, per_round: int = 5, warmup: int = 5) -> dict[str, float]:
    """Median time of each function, measured in alternating rounds of ``per_round`` calls so that a
    change in the machine's load hits all of them alike (the ratios are what matters)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(max(1, steps // per_round)):
        for name, fn in fns.items():
            for _ in range(per_round):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def run(steps: int, rebuilds: int, n_train: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = MLP(784, (100, 100), 10)
    train = TrainConfig(batch_size=BATCH, lr=1e-3, grad_clip=CLIP)
    tasks = [_task(i, n_train, g) for i in range(max(PAST_TASKS) + 1)]
    stream = TaskStream("perf", tasks, "domain", (784,), 10, 1)
    xb = torch.rand(BATCH, 784, generator=g)
    yb = torch.randint(0, 10, (BATCH,), generator=g)
    batch = Batch(xb, yb, 0)

    out: dict = {"rows": []}
    plain = build_method("none")
    plain_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    method = build_method("fromp", dict(PARAMS), seed=seed)
    method.setup(model, stream, train)
    end_times = []
    done = 0
    for n_past in PAST_TASKS:
        while done < n_past:  # finish tasks until n_past are stored
            t0 = time.perf_counter()
            method.on_task_end(model, tasks[done])
            end_times.append(time.perf_counter() - t0)
            done += 1
        current = tasks[n_past]
        rebuild = _median_time(lambda: method.on_task_start(model, current), rebuilds, warmup=1)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        mem_x = torch.cat([e.x for e in method.regularizer.memory])
        x_all, y_all = torch.cat([xb, mem_x]), torch.cat([yb, torch.zeros(mem_x.shape[0], dtype=torch.long)])

        def fwd_bwd() -> None:
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x_all, head=0), y_all).backward()

        t = _interleaved({
            "plain": lambda: _step(model, plain, plain_opt, batch, current),
            "step": lambda: _step(model, method, opt, batch, current),
            "fwd_bwd": fwd_bwd,
        }, steps)
        out["rows"].append({"past": n_past, "rebuild": rebuild, "memorable": int(mem_x.shape[0]), **t})
    out["plain"] = statistics.median(r["plain"] for r in out["rows"])
    out["task_end_per_10k"] = statistics.median(end_times) / n_train * 10_000
    return out


def report(res: dict, steps: int, n_train: int) -> str:
    plain = res["plain"]
    lines = [
        "# FROMP speed (permuted-MNIST net 784-100-100-10, 200 points per past task, batch 128)",
        "",
        f"Measured by `python benchmarks/perf/perf_fromp.py` with {torch.get_num_threads()} CPU threads, torch "
        f"{torch.__version__}, Python {platform.python_version()}, {platform.machine()}; medians over {steps} "
        f"steps. The machine is shared (1-minute load average {res['load'][0]:.1f} at the start, "
        f"{res['load'][1]:.1f} at the end, on 2 cores); under other jobs' load absolute times inflate and move",
        "between runs, while the ratios within a row are measured under the same load.",
        "Reference: team-approx-bayes/fromp on 2 cores (docs/anchors.md).",
        "",
        f"Plain Adam step (median of the rows): **{plain * 1e3:.2f} ms** (reference ≈ "
        f"{REFERENCE_PLAIN_STEP * 1e3:.1f} ms). Plain, FROMP and fwd/bwd steps are timed in alternating rounds, so",
        "each row's ratios compare steps run under the same load.",
        "",
        "| past tasks | memorable pts | plain Adam step | FROMP step | × plain Adam | × fwd/bwd(batch+mem) | "
        "reference step | speed-up | rebuild at task start | reference rebuild | speed-up |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        ref_step, ref_rebuild = REFERENCE[r["past"]]
        lines.append(
            f"| {r['past']} | {r['memorable']} | {r['plain'] * 1e3:.2f} ms | {r['step'] * 1e3:.2f} ms | "
            f"{r['step'] / r['plain']:.1f} | "
            f"{r['step'] / r['fwd_bwd']:.2f} | {ref_step:.2f} s | {ref_step / r['step']:.0f}× | "
            f"{r['rebuild']:.3f} s | {ref_rebuild:.1f} s | {ref_rebuild / r['rebuild']:.1f}× |"
        )
    lines += [
        "",
        "* FROMP step: zero_grad, mean CE + (τ/2) Σ Δpᵀ K⁻¹ Δp, backward, clip, Adam — one extra forward/backward",
        "  over the memorable points; no Jacobian is formed in the step; Δpᵀ K⁻¹ Δp = ‖L⁻¹Δp‖² by one batched",
        "  triangular solve with the Cholesky factors built at the task start.",
        "* × fwd/bwd(batch+mem): the step relative to one cross-entropy forward/backward over the minibatch and",
        "  all memorable points together (target ≤ 2). The yardstick has no clipping or optimiser step, whose fixed",
        "  cost (all 89,610 weights) weighs most with 1 past task.",
        "* Rebuild: old predictions, 10 class-wise kernels per past task J_p Σ J_pᵀ (curvature engine,",
        "  diagonal Σ) and their float64 Cholesky factors; once per task boundary.",
        f"* Task end (diagonal GGN over the task's data + λ scoring and selection): "
        f"{res['task_end_per_10k']:.2f} s per 10,000 examples (measured on tasks of {n_train}); the",
        "  reference code's per-example GGN loop takes 60–72 s per split-MNIST task (~12,000 examples).",
    ]
    return "\n".join(lines) + "\n"


PERF_VALIDATION = 0.1  # the accuracies printed beside the times are on held-out training data


def _split_mnist_config(method: str, data_dir: str | None, quick: bool, benchmark: str = "split_mnist"):
    from continual_blr.config import RunConfig, from_dict, yaml_load

    cfg = from_dict(RunConfig, yaml_load((ROOT / "configs" / benchmark / f"{method}.yaml").read_text()))
    if data_dir:
        cfg.stream.data_dir = data_dir
    cfg.quick, cfg.progress = quick, False
    cfg.stream.validation = PERF_VALIDATION  # a perf script never scores on test data (docs/benchmarks.md)
    return cfg


def with_params(cfg, extra: dict):
    """``cfg`` with ``extra`` laid over its first method's params (the end-to-end scripts' variants of a config)."""
    import dataclasses

    if extra:
        spec = cfg.methods[0]
        cfg.methods[0] = dataclasses.replace(spec, params={**spec.params, **extra})
    return cfg


# cProfile rows (function name fragments) that split the FROMP run's time; cumulative times overlap by nesting
_PROFILE_ROWS = [
    ("training steps (train_step, all of it)", "loop.py", "train_step"),
    ("  FROMP penalty (forward over memorable points + solves)", "functional.py", "penalty"),
    ("  autograd backward (minibatch + penalty)", "", "run_backward"),
    ("  gradient clipping", "clip_grad.py", "clip_grad_norm"),
    ("  Adam update", "adam.py", "_single_tensor_adam"),
    ("task end (diag GGN over the task + memorable selection)", "functional.py", "on_task_end"),
    ("task start (old predictions, kernels, Cholesky)", "functional.py", "rebuild"),
    ("evaluation", "loop.py", "evaluate_task"),
]


def timed_runs(cfgs: list[tuple[str, Any]]) -> dict[str, tuple[float, float, float]]:
    """Whole runs of ``(label, RunConfig)`` pairs in this process, after one warm-up run (imports, first
    calls): label -> (CPU s, wall s, final average accuracy %). The end-to-end modes of the perf scripts."""
    from continual_blr.runner import run_config

    run_config(_split_mnist_config("none", None, True, "split_digits"), save=False)
    out = {}
    for label, cfg in cfgs:
        c0, w0 = time.process_time(), time.perf_counter()
        (res,) = run_config(cfg, save=False)
        out[label] = (time.process_time() - c0, time.perf_counter() - w0, 100 * res.avg_acc)
    return out


def add_end_to_end_args(ap: argparse.ArgumentParser, what: str, benchmark_help: str) -> None:
    """The ``--end-to-end`` options shared by the perf scripts."""
    ap.add_argument("--end-to-end", action="store_true", help=what)
    ap.add_argument("--data-dir", help="data root for --end-to-end (else $CONTINUAL_BLR_DATA)")
    ap.add_argument("--quick", action="store_true", help="--end-to-end with epochs / 5")
    ap.add_argument("--benchmark", default="split_mnist", help=benchmark_help)


def write_end_to_end(script: str, args: argparse.Namespace, text: str) -> None:
    """Print an end-to-end report and (unless ``--no-write``) save it as ``--out`` where given, else as
    ``benchmarks/results/perf/perf_<script>_end_to_end_<benchmark>[_quick].md``."""
    print(text)
    if not args.no_write:
        default = f"perf_{script}_end_to_end_{args.benchmark}{'_quick' if args.quick else ''}.md"
        out = Path(args.out) if getattr(args, "out", None) else ROOT / "benchmarks" / "results" / "perf" / default
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}")


def rows_ratio(cfg, tasks_per_step: int) -> float:
    """The FROMP run's rows through the network per step over ``none``'s, averaged over the tasks with equal steps
    per task: (1/T) Σ_t (B + m_t) / B, m_t = M · min(t − 1, k or t − 1) memorable rows at task t (M per task, batch
    B, T tasks): the ratio of the two runs' matrix-product work (not of their fixed per-step costs)."""
    params = cfg.methods[0].params
    m, b = int(params.get("n_points", 40)), int(cfg.train.batch_size)
    n_tasks = {"split_mnist": 5, "permuted_mnist": 10, "split_digits": 5}.get(cfg.stream.name, 5)
    k = int(tasks_per_step)
    per_task = [(b + m * (min(t, k) if k else t)) / b for t in range(n_tasks)]
    return sum(per_task) / n_tasks


def end_to_end(data_dir: str | None, quick: bool, benchmark: str = "split_mnist",
               tasks_per_step: list[int] | None = None, fused: bool = False, repeats: int = 1) -> str:
    """CPU seconds of the split-MNIST ``none`` and ``fromp`` runs in this invocation (and of ``fromp`` with each
    ``tasks_per_step`` k given: the penalty's unbiased estimate over k past tasks per step; with ``fused`` each FROMP
    run also with ``fused_forward``: one forward pass for the minibatch and the memorable points), and the FROMP
    profile. With ``repeats`` R > 1 every row runs R times in rounds (each round all rows in order, so a change of
    the machine's load hits a round's rows alike): each row's median CPU and the median, smallest and largest over
    the rounds of its ratio to that round's ``none``."""
    if repeats < 1:
        raise ValueError(f"--repeats: must be >= 1, got {repeats}")
    import cProfile
    import pstats

    from continual_blr.runner import run_config

    variants = [("fromp", {})] + [(f"fromp, tasks_per_step {k}", {"tasks_per_step": k}) for k in (tasks_per_step or [])]
    if fused:
        variants += [(f"{label}, fused_forward", {**extra, "fused_forward": True}) for label, extra in variants]
    cfgs = [("none", _split_mnist_config("none", data_dir, quick, benchmark))]
    cfgs += [(label, with_params(_split_mnist_config("fromp", data_dir, quick, benchmark), extra))
             for label, extra in variants]
    rows = {label: rows_ratio(cfg, cfg.methods[0].params.get("tasks_per_step", 0)) for label, cfg in cfgs[1:]}
    rounds = [timed_runs(cfgs) for _ in range(repeats)]
    cpu = {m: statistics.median(r[m][0] for r in rounds) for m in rounds[0]}
    ratios = {m: sorted(r[m][0] / r["none"][0] for r in rounds) for m in rounds[0]}
    accs = {m: r[2] for m, r in rounds[0].items()}
    prof = cProfile.Profile()
    prof.enable()
    run_config(_split_mnist_config("fromp", data_dir, quick, benchmark), save=False)
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    total = sum(v[2] for v in stats.values())
    tps = " --tasks-per-step " + " ".join(map(str, tasks_per_step)) if tasks_per_step else ""
    tps += (" --fused" if fused else "") + (f" --repeats {repeats}" if repeats > 1 else "")
    lines = [f"# FROMP end to end on {benchmark} ({'QUICK: epochs / 5' if quick else 'full budget'})", "",
             f"Command: `python benchmarks/perf/perf_fromp.py --end-to-end --benchmark {benchmark}{' --quick' if quick else ''}{tps} "
             "--data-dir $CONTINUAL_BLR_DATA --threads 1`; torch threads "
             f"{torch.get_num_threads()}, {platform.machine()}. Accuracies on the held-out "
             f"{PERF_VALIDATION:g} of each task's training data (validation, not test)"
             f"{f'; {repeats} rounds, medians' if repeats > 1 else ''}.", "",
             "| run | CPU (s) | × none | × none, min-max | rows per step × none | final avg acc (%) |",
             "|---|---|---|---|---|---|"]
    for m in cpu:
        row = f"{rows[m]:.2f}" if m in rows else "1.00"
        lines.append(f"| {m} | {cpu[m]:.1f} | {statistics.median(ratios[m]):.2f} | {ratios[m][0]:.2f}-"
                     f"{ratios[m][-1]:.2f} | {row} | {accs[m]:.2f} |")
    lines += ["", "Rows per step × none: the minibatch and the memorable points the step passes through the network, over "
              "the minibatch alone, averaged over the tasks (`rows_ratio`): the ratio of the runs' matrix-product work. "
              "It is no floor for the whole run: the step's fixed costs (Adam, Python, launches) are the same in both "
              "runs and pull the measured ratio under it, while FROMP's clipping and penalty operations push it over."]
    lines += ["", f"Target (issue 43): FROMP ≤ 1.5× none. Profile of a second FROMP run (cProfile, {total:.1f} s of "
              "profiled time; rows nest):", "", "| part | cumulative (s) | share |", "|---|---|---|"]
    for label, file_part, name in _PROFILE_ROWS:
        cum = sum(v[3] for k, v in stats.items() if name in k[2] and file_part in k[0])  # cProfile's cumtime
        lines.append(f"| {label} | {cum:.1f} | {100 * cum / max(total, 1e-9):.0f} % |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="timed steps per setting (median)")
    ap.add_argument("--rebuilds", type=int, default=2, help="timed rebuilds per setting (median)")
    ap.add_argument("--n-train", type=int, default=2000, help="examples per synthetic past task")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (the reference used 2 cores)")
    ap.add_argument("--out", default=None, help="the report file (default: benchmarks/results/perf/perf_fromp.md; "
                    "with --end-to-end perf_<script>_end_to_end_<benchmark>[_quick].md)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    add_end_to_end_args(ap, "time the split-MNIST none and fromp runs (configs/split_mnist) in this invocation",
                        "--end-to-end: the configs/ folder (split_digits: a smoke run)")
    ap.add_argument("--tasks-per-step", type=int, nargs="*", default=None, metavar="K",
                    help="--end-to-end: also time fromp with params.tasks_per_step K (one run per K)")
    ap.add_argument("--repeats", type=int, default=1, help="--end-to-end: rounds of all rows (medians reported)")
    ap.add_argument("--fused", action="store_true",
                    help="--end-to-end: also time each fromp run with params.fused_forward (one forward pass)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.end_to_end:
        write_end_to_end("fromp", args, end_to_end(args.data_dir, args.quick, args.benchmark, args.tasks_per_step,
                                                   args.fused, args.repeats))
        return 0
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    res = run(args.steps, args.rebuilds, args.n_train)
    res["load"] = (load0, os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan"))
    text = report(res, args.steps, args.n_train)
    print(text)
    if not args.no_write:
        out = Path(args.out or ROOT / "benchmarks" / "results" / "perf" / "perf_fromp.md")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    worst = max(r["step"] / r["fwd_bwd"] for r in res["rows"])
    speedup9 = REFERENCE[9][0] / res["rows"][-1]["step"]
    print(f"max step / fwd-bwd(batch+mem) = {worst:.2f} (target <= 2); speed-up at 9 past tasks = {speedup9:.0f}x "
          "(target >= 50x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
