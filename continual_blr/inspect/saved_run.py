"""A finished run, already loaded, as inspection sees it: stream, trained network, method, Σ and memory.

Inspection does not read run folders: :func:`continual_blr.saved_run.load_run` (the runner's layer, which
knows the run configuration) rebuilds the stream, the network and the method from a run folder and
hands them over as a :class:`SavedRun` (its :class:`~continual_blr.saved_run.LoadedRun` is one). Any
code that holds a trained network, its method and its stream can build a :class:`SavedRun` directly
and inspect it without a run folder.

Where Σ comes from (:func:`run_covariance`), in this order:

1. FROMP and its variants with a kernel (``fromp``, ``frorp``, ``fromp-full``, ``fromp-kron``): the Σ
   their kernels use, diag(1/(F + δ)) with F the diagonal GGN accumulated over all tasks at each
   task's end (Kronecker factors for ``fromp-kron``) and δ the method's ``prior_precision``;
2. methods that carry a Gaussian posterior (``blr``, ``laplace``, ``vcl``, ``ivon``): that posterior's
   covariance (its mean is ignored: the network is linearised at its own weights);
3. every other method (``none``, ``joint``, ``ewc``, ``l2``, ``fromp-l2``): a diagonal Laplace–GGN
   posterior at the final weights, Σ = diag(1/(F + δ)) with F the GGN summed over the training data of
   every task on its own head — the same recipe as FROMP's, evaluated at the final weights — and
   δ = ``prior_precision`` (default :data:`~.scores.DEFAULT_PRIOR_PRECISION` = 1e-3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data.stream import TaskStream
from ..methods.base import Method
from ..posteriors import GaussianPosterior
from ..replay_buffer import ReplayBuffer
from .scores import DEFAULT_PRIOR_PRECISION, Covariance, diag_laplace_posterior

__all__ = ["SavedRun", "run_covariance", "stored_memory", "has_memory_store", "memory_kind"]


@dataclass
class SavedRun:
    """A trained network with its method and stream: everything an inspection needs.

    Attributes:
        path: the run folder (where the report goes by default).
        method_name: the inspected method.
        stream: the task stream the network was trained on.
        model: the trained network (eval mode).
        method: the method, with its state after the last task.
        result: the method's entry of ``results.json`` (accuracy matrix, times, ...); may be empty.
        methods: every method name the run holds.
        seed: the run's seed.
    """

    path: Path
    method_name: str
    stream: TaskStream
    model: nn.Module
    method: Method
    result: dict[str, Any] = field(default_factory=dict)
    methods: list[str] = field(default_factory=list)
    seed: int = 0

    def at_boundary(self, task: int) -> "SavedRun":
        """The run as it stood when ``task`` (0-based) ended: the network at that task's end, the method as the next
        task starts with it. A run loaded from a folder (:class:`continual_blr.saved_run.LoadedRun`) reads it from the
        folder's ``<method>/tasks/after_task<task>.pt``; a :class:`SavedRun` built in a script keeps no boundaries.

        Raises:
            LookupError: this run keeps no task boundaries.
        """
        raise LookupError(f"run: {self.path} keeps no task boundaries (a SavedRun built in a script; a run folder "
                          "written since boundaries were kept has them)")


def has_memory_store(method: Method) -> bool:
    """Whether ``method`` keeps past examples: memorable points (a regulariser with a ``memory`` store: the FROMP
    family) or a replay buffer (``er``, ``derpp``: a :class:`~continual_blr.replay_buffer.ReplayBuffer`)."""
    return (getattr(getattr(method, "regularizer", None), "memory", None) is not None
            or isinstance(getattr(method, "buffer", None), ReplayBuffer))


def memory_kind(method: Method) -> str:
    """``"fromp"`` (memorable points), ``"replay"`` (a replay buffer) or ``""`` (the method keeps no examples)."""
    if getattr(getattr(method, "regularizer", None), "memory", None) is not None:
        return "fromp"
    return "replay" if isinstance(getattr(method, "buffer", None), ReplayBuffer) else ""


def run_covariance(run: SavedRun, prior_precision: float | None = None,
                   tasks: Sequence[int] | None = None) -> tuple[Covariance, str]:
    """The weight covariance Σ of a run and a one-line description of where it came from.

    See the module docstring for the order. ``prior_precision`` is δ of the fallback diagonal Laplace
    posterior (ignored when the method has its own Σ). ``tasks``: the tasks (indices into the stream) whose
    training data the fallback's F sums over (default all); a run at the boundary after task t
    (:meth:`SavedRun.at_boundary`) takes ``range(t + 1)``, the tasks its network had seen. A method's own Σ holds
    exactly the tasks it has seen and ignores ``tasks``.
    """
    meth, model = run.method, run.model
    reg = getattr(meth, "regularizer", None)
    if reg is not None and callable(getattr(reg, "sigma", None)) and getattr(reg, "fisher", None) is not None:
        sigma = reg.sigma(model)
        form = "Kronecker factors" if not isinstance(sigma, dict) else "diag(1/(F + δ))"
        return sigma, (f"{run.method_name}'s own Σ = {form}: F the GGN accumulated over all tasks, "
                       f"δ = {reg.prior_precision:g}")
    post_fn = getattr(meth, "posterior", None)
    if callable(post_fn):
        post = post_fn(model)  # every method's posterior takes the model (BLR / Laplace ignore it)
        if isinstance(post, GaussianPosterior):
            return post, f"{run.method_name}'s posterior ({post.structure.value} precision, {post.dim} weights)"
    delta = DEFAULT_PRIOR_PRECISION if prior_precision is None else float(prior_precision)
    chosen = list(range(len(run.stream.tasks))) if tasks is None else [int(t) for t in tasks]
    data = [(run.stream.tasks[t].x_train, run.stream.tasks[t].head) for t in chosen]
    post = diag_laplace_posterior(model, data, delta)
    if len(chosen) == len(run.stream.tasks):
        which = "every task"
    elif len(chosen) == 1:
        which = f"task {chosen[0] + 1}"
    elif chosen == list(range(chosen[0], chosen[-1] + 1)):
        which = f"tasks {chosen[0] + 1}–{chosen[-1] + 1}"
    else:
        which = f"tasks {', '.join(str(t + 1) for t in chosen)}"
    return post, (f"diagonal Laplace–GGN posterior at the network's weights (method {run.method_name!r} carries "
                  f"none): Σ = diag(1/(F + δ)), F over the training data of {which}, δ = {delta:g}")


def stored_memory(run: SavedRun) -> dict[int, dict[str, Any]]:
    """The past examples the run's method stored, by task id: ``{"indices", "selection", "n"}``.

    The FROMP family: its memorable points (``indices`` into the task's training set, as stored). A replay
    buffer (``er``, ``derpp``): the buffer's examples of each task, located in the task's training set by
    their inputs (``selection`` names the buffer's rule, e.g. ``"replay buffer (reservoir)"``; ``n`` counts the
    buffer's examples of the task, ``indices`` those found among the training inputs). Empty when the method
    keeps no examples.
    """
    reg = getattr(run.method, "regularizer", None)
    mem = getattr(reg, "memory", None)
    out: dict[int, dict[str, Any]] = {}
    if mem is None:
        buffer = getattr(run.method, "buffer", None)
        return _buffer_memory(buffer, run.stream) if isinstance(buffer, ReplayBuffer) else out
    for e in mem:
        out[int(e.task_id)] = {"indices": e.indices.cpu().long(), "selection": e.selection, "n": len(e)}
    return out


def _buffer_memory(buffer: ReplayBuffer, stream: TaskStream) -> dict[int, dict[str, Any]]:
    """A replay buffer's examples per task, as indices into the task's training set (matched by exact input)."""
    out: dict[int, dict[str, Any]] = {}
    if buffer.size == 0 or getattr(buffer, "x", None) is None:
        return out
    xs = buffer.x[: buffer.size].detach().cpu().contiguous()
    task_ids = buffer.task_id[: buffer.size].cpu().tolist()
    tasks = {int(t.task_id): t for t in stream.tasks}
    for tid in sorted(set(task_ids)):
        rows = [i for i, t in enumerate(task_ids) if t == tid]
        task = tasks.get(int(tid))
        where: dict[bytes, list[int]] = {}
        if task is not None and task.x_train.numel():
            train = task.x_train.detach().cpu().to(xs.dtype).reshape(len(task.x_train), -1).contiguous()
            for j in range(len(train)):
                where.setdefault(train[j].numpy().tobytes(), []).append(j)
        found = []
        for r in rows:
            hits = where.get(xs[r].reshape(-1).numpy().tobytes())
            if hits:
                found.append(hits.pop(0))
        out[int(tid)] = {"indices": torch.tensor(sorted(found), dtype=torch.long),
                         "selection": f"replay buffer ({buffer.selection})", "n": len(rows)}
    return out
