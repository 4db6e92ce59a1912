"""What a memory selection costs at a task's end: FROMP's pass with λ against the same pass with the sensitivity.

Run (one thread, real MNIST; the split-MNIST class-incremental network, MLP 784-256-256-10, one head):

    python benchmarks/perf/perf_memory_selection.py --data-dir $CONTINUAL_BLR_DATA

For the first task of class-incremental split MNIST (digits 0/1, 12,665 training images) it times, median of
``--repeats``, at the same weights (trained for one epoch so that the scores are not those of an untrained net):

* ``lambda``: FROMP's task-end work before this change — the diagonal GGN of the task's data (the curvature
  engine, Λ^{1/2} cotangents) plus tr Λ scores and the per-class top-k;
* ``sensitivity``: the one pass that gives the diagonal GGN and every example's ‖J Σ Jᵀ e‖₁ (identity cotangents,
  the rows kept until Σ is complete) plus the per-class top-k — what FROMP, fromp-replay, er and derpp run with
  ``selection: sensitivity`` / ``stratified``;
* ``tr Λ only``: the forward-only score (what er / derpp with ``selection: lambda`` pay);

and the memory the kept rows take (per Linear layer N·(K·d_out + d_in) numbers). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from continual_blr.curvature import curvature
    from continual_blr.data import make_stream
    from continual_blr.memory import hessian_trace_scores, select_per_class, selection_scores
    from continual_blr.models import build_model

    stream = make_stream("split_mnist", scenario="class", data_dir=args.data_dir, seed=0)
    task = stream.tasks[0]
    model = build_model("mlp", stream.input_shape, stream.n_outputs, stream.n_heads, hidden=(256, 256),
                        generator=torch.Generator().manual_seed(0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for s in range(0, task.n_train, 128):  # one epoch, so that the scores are a trained network's
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(task.x_train[s:s + 128], head=0), task.y_train[s:s + 128]).backward()
        opt.step()
    x, y = task.x_train, task.y_train

    def t_lambda():
        curvature(model, x, kind="ggn", structure="diag", head=0)
        select_per_class(hessian_trace_scores(model, x), y, 100, selection="lambda")

    def t_sens():
        s, _ = selection_scores(model, x, y, selection="sensitivity", head=0, prior_precision=1e-3)
        select_per_class(s, y, 100, selection="sensitivity")

    def t_trace():
        select_per_class(hessian_trace_scores(model, x), y, 100, selection="lambda")

    rows = []
    for name, fn in (("lambda: GGN pass + tr Λ", t_lambda), ("sensitivity: one pass (GGN + ‖J Σ Jᵀ e‖₁)", t_sens),
                     ("tr Λ only (forward)", t_trace)):
        fn()  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.process_time()
            fn()
            times.append(time.process_time() - t0)
        rows.append((name, statistics.median(times)))
    k = stream.n_outputs
    kept = task.n_train * sum(k * d_out + d_in for d_in, d_out in ((784, 256), (256, 256), (256, k)))
    print(f"task 1 of split MNIST (class): N = {task.n_train}, MLP 784-256-256-{k}, {args.threads} thread(s)\n")
    print("| task-end work | CPU s (median) | × lambda |\n|---|---|---|")
    for name, t in rows:
        print(f"| {name} | {t:.2f} | {t / rows[0][1]:.2f} |")
    print(f"\nrows kept until Σ is complete: {kept:,} numbers = {kept * 4 / 2**20:.0f} MiB in float32")


if __name__ == "__main__":
    main()
