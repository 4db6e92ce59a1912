"""What the per-step timing scripts share (``perf_price_floor.py``, ``perf_vcl_estimators.py``): one training step of
a method through ``loop.train_step`` on fixed minibatches of uniform pixels, and CPU medians with every setting
interleaved round by round (so that the machine's load falls on all of them alike)."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from continual_blr.data.stream import Task
from continual_blr.loop import train_step
from continual_blr.methods import TrainConfig, build_method
from continual_blr.types import Batch


def step_runner(model: nn.Module, name: str, params: dict, n_inputs: int, n_classes: int, batch: int, lr: float,
                n_batches: int = 20) -> Callable[[], None]:
    """A zero-argument callable: one ``train_step`` of method ``name`` (set up for one task of ``n_classes``
    labels, head 0) on the next of ``n_batches`` fixed minibatches of ``batch`` inputs."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(batch * n_batches, n_inputs, generator=g)
    y = torch.randint(0, n_classes, (batch * n_batches,), generator=g)
    task = Task(0, x, y, x[:8], y[:8], tuple(range(n_classes)), name="t0")
    train = TrainConfig(batch_size=batch, lr=lr)
    model.train()
    method = build_method(name, params, seed=0)
    method.setup(model, None, train)  # type: ignore[arg-type]
    method.on_task_start(model, task)
    opt = method.make_optimizer(model, task, train)
    batches = [Batch(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch], 0) for i in range(n_batches)]
    state = {"i": 0}

    def run() -> None:
        state["i"] += 1
        train_step(model, method, opt, batches[state["i"] % n_batches], task, train)
    return run


def interleaved_medians(fns: dict, rounds: int, calls: int, warmup: int) -> dict:
    """Median CPU ms per call of each callable: ``warmup`` calls each, then ``rounds`` rounds of ``calls`` calls
    of every callable in turn."""
    for f in fns.values():
        for _ in range(warmup):
            f()
    cpu: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            c0 = time.process_time()
            for _ in range(calls):
                f()
            cpu[k].append((time.process_time() - c0) / calls * 1e3)
        print("  round done", file=sys.stderr, flush=True)
    return {k: statistics.median(v) for k, v in cpu.items()}


def publish(script: str, report: Callable[[str], str], no_write: bool) -> int:
    """Print ``report(command)`` (``command``: this invocation as a line to rerun) and, unless ``no_write``, write
    it to ``benchmarks/results/perf/<script>.md``; returns the exit status."""
    command = "python " + " ".join([f"benchmarks/{script}.py", *sys.argv[1:]])
    text = report(command)
    print(text)
    if not no_write:
        (Path(__file__).resolve().parents[1] / "results" / "perf" / f"{script}.md").write_text(text)
    return 0
