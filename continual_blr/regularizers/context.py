"""Context points for FROMP: the functional prior read at the current task's inputs too.

Why. FROMP keeps the network's outputs close to the previous function at M memorable points per past task. On a
network that can fit 200 points without moving the rest of a task's function (the reduced ResNet-18 of split
CIFAR-10), the penalty is met at the memorable points while held-out images of the same task drift to chance
(``docs/fromp.md``, ``benchmarks/diagnose/fromp_memorable_fit.py``). S-FSVI (Rudner et al., ICML 2022, Sec. 4) reads
its function-space prior at *context points* drawn from the current task's inputs for this reason; FRCL and
K-priors likewise evaluate the old function away from the stored examples.

What. With the previous network θ_{t−1} kept frozen at the task's start (the same weights the memorable points'
old outputs come from), each step adds, for the first n rows X_b of its minibatch,

    R_ctx(θ) = (τ w / 2) Σ_{s<t} Σ_c (1 / d̄_{s,c}) Σ_{x ∈ X_b} (o_{s,c}(x; θ) − o_{s,c}(x; θ_{t−1}))²

where ``o_{s,c}`` is output c of past task s's head as FROMP compares it (probabilities, or centred logits under
``output="logits"``; a class-incremental head restricted to task s's classes), ``d̄_{s,c} = (1/M) tr K_{s,c}`` the mean
diagonal of that task's kernel at its rebuild (1 under ``tau_scale="kernel"``, where every kernel has unit mean
diagonal; FROMP-L2's identity kernel has d̄ = 1 and its logit scale 1/C²), and w the relative weight
(``context_weight``). It is FROMP's GP prior N(o(·; θ_{t−1}), K) at n further inputs with every covariance between
them (and with the memorable points) dropped and each variance set to the task's average one: no Jacobian is formed
per step, and the cost is one eval-mode forward of the frozen network (no gradient) and one of the network on n rows
per distinct head. At the task's start θ = θ_{t−1}, so the term and its gradient are exactly 0.

Both forwards run in eval mode (no dropout noise in Δ, BatchNorm on running statistics: those of each past task
where the loop keeps them per task), as FROMP's memorable points do.
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager
from typing import Callable

import torch
from torch import Tensor, nn

from ..curvature import eval_mode
from ..memory import MemoryEntry, forward
from ..mixed_precision import resumed_autocast, to_fp32
from ..types import ParamDict


def frozen_copy(model: nn.Module) -> nn.Module:
    """An independent copy of ``model`` in eval mode whose parameters need no gradient: θ_{t−1} at a task's start."""
    snapshot = copy.deepcopy(model)
    snapshot.eval()
    for p in snapshot.parameters():
        p.requires_grad_(False)
    return snapshot


def kernel_mean_diagonal(k: Tensor, n_outputs: int) -> Tensor:
    """d̄ per compared output: the mean diagonal of each classwise kernel ``k`` [C, M, M], or of the one full kernel
    [M·C', M·C'] repeated for the ``n_outputs`` outputs. Returned in float64, shape [C]."""
    d = torch.diagonal(k.detach().to(torch.float64), dim1=-2, dim2=-1).mean(-1)
    return d.expand(n_outputs).clone() if d.dim() == 0 else d


def context_sum(model: nn.Module, snapshot: nn.Module, x: Tensor, entries: list[MemoryEntry],
                outputs: Callable[[tuple[int, ...] | None], Callable[[Tensor], Tensor]],
                norm: Callable[[nn.Module, int | None], AbstractContextManager], params: ParamDict | None = None,
                outer: tuple[str, torch.dtype] | None = None, per_task_norm: bool = False) -> Tensor:
    """``Σ_s Σ_c (1/d̄_{s,c}) Σ_x (o_{s,c}(x; θ) − o_{s,c}(x; θ_{t−1}))²`` over the stored tasks ``entries`` (module
    docstring; without the factor τ w / 2).

    Args:
        model: the network at θ (or evaluated at ``params``).
        snapshot: the frozen network at θ_{t−1} (:func:`frozen_copy`).
        x: the context inputs (rows of the current minibatch).
        entries: the stored tasks; each needs ``extras["context_scale"]`` ([C] float64: d̄, times any scale of
            the compared outputs, e.g. C² for FROMP-L2's logits).
        outputs: maps a task's compared columns to the function from raw outputs to compared outputs.
        norm: ``norm(module, task_id)`` — the block in which a module runs on that task's BatchNorm statistics.
        params: evaluate ``model`` at these parameters (``torch.func`` closures of the BLR optimisers).
        outer: the training step's autocast to resume for the two forwards (None: they run as called); their
            outputs are cast to fp32 before Δ.
        per_task_norm: whether ``norm`` swaps in per-task statistics (then each task is a forward of its own);
            otherwise a multi-head network's body runs once per network for all stored tasks' heads.

    Returns:
        The sum, a scalar.
    """
    for e in entries:
        if e.extras.get("context_scale") is None:
            raise RuntimeError("FROMP context points: the stored tasks have no context_scale; call on_task_start "
                               "(or rebuild) after on_task_end / load_state_dict")
    total = None
    if shared_body(model, params, per_task_norm):  # one body pass per network, then each stored task's head
        with eval_mode(model), resumed_autocast(outer):
            h = model.body(x)
            new = [model.heads[_head(model, e)](h) for e in entries]
        with torch.no_grad(), resumed_autocast(outer):
            h = snapshot.body(x)
            old = [snapshot.heads[_head(model, e)](h) for e in entries]
        pairs = zip(entries, new, old)
    else:
        pairs = (_forwards(model, snapshot, x, e, norm, params, outer) for e in entries)
    for e, new, old in pairs:
        fn = outputs(e.columns)
        d = fn(to_fp32(new)) - fn(to_fp32(old))
        scale = e.extras["context_scale"]
        term = ((d * d).sum(0) / scale.to(device=d.device, dtype=d.dtype)).sum()
        total = term if total is None else total + term
    return torch.zeros((), device=x.device) if total is None else total


def shared_body(model: nn.Module, params: ParamDict | None, per_task_norm: bool) -> bool:
    """Whether every stored task's outputs can come from one pass of the network's body (a
    :class:`~continual_blr.models.MultiHeadNet` at its own parameters, with one set of BatchNorm statistics)."""
    return (params is None and not per_task_norm and isinstance(getattr(model, "body", None), nn.Module)
            and isinstance(getattr(model, "heads", None), nn.ModuleList))


def _head(model: nn.Module, e: MemoryEntry) -> int:
    return 0 if len(model.heads) == 1 else int(e.head)


def _forwards(model: nn.Module, snapshot: nn.Module, x: Tensor, e: MemoryEntry,
              norm: Callable[[nn.Module, int | None], AbstractContextManager], params: ParamDict | None,
              outer: tuple[str, torch.dtype] | None) -> tuple[MemoryEntry, Tensor, Tensor]:
    """(``e``, task e's head at θ, at θ_{t−1}) on ``x``, each network on task e's BatchNorm statistics."""
    with eval_mode(model), norm(model, e.task_id), resumed_autocast(outer):
        new = forward(model, x, e.head, params)
    with torch.no_grad(), norm(snapshot, e.task_id), resumed_autocast(outer):
        old = forward(snapshot, x, e.head)
    return e, new, old
