"""Shared set-up of the FROMP tests: stored past tasks whose kernels and old outputs are all different and nonzero."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from continual_blr.data.stream import Task


def store_past_tasks(end_task: Callable[[nn.Module, Task], None], start_task: Callable[[nn.Module, Task], None],
                     model: nn.Module, tasks: list[Task], generator: torch.Generator) -> None:
    """``end_task`` every task but the last, moving the weights a little after each (so each stored task has its own
    kernel), ``start_task`` the last one, then move the weights again so that every Δ of the penalty is nonzero."""

    def move(scale: float) -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(scale * torch.randn(p.shape, generator=generator, dtype=p.dtype))

    for t in tasks[:-1]:
        end_task(model, t)
        move(0.05)
    start_task(model, tasks[-1])
    move(0.1)
