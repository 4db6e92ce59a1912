"""Process-group facts and collectives for data-parallel runs under ``torch.distributed`` (torchrun).

Without an initialised process group (or with one process) every function answers as for a single
process — sharding returns everything, reductions return their input — so the library runs unchanged
in one process and nothing here costs anything there.

Data parallelism in this library (``docs/distributed.md``):

* every rank draws the **same global minibatch** from the same seeded ``torch.Generator`` and keeps
  its contiguous part (:func:`shard_bounds`: ``torch.tensor_split`` order, so uneven shards differ by
  at most one example);
* gradient-like quantities are sums over examples: each rank computes the sum over its shard (or its
  shard's mean times b_r / B) and :func:`all_reduce_sum_` adds them up, so the result equals one
  process's on the global batch up to the order of floating-point additions (per step: over a float32 run
  the differences grow as another seed's would; ``docs/distributed.md``);
* selections over a data set (FROMP's memorable points) use :func:`all_gather_cat` so that every rank
  holds the scores of all examples and chooses the same top k.

Launch: ``torchrun --nproc-per-node N -m continual_blr run CONFIG`` (``continual_blr.__main__`` calls
:func:`init_from_env`). A failure on one rank ends that rank with one line on stderr and a non-zero
exit status (:func:`fail_fast`); torchrun then stops the others, and any collective still waiting on a
lost peer gives up after the process group's timeout.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "is_distributed", "rank", "world_size", "is_main_process", "init_from_env", "shutdown", "shard_bounds",
    "shard", "all_reduce_sum_", "all_reduce_dict", "all_reduce_float", "all_gather_cat", "broadcast_module", "broadcast_object",
    "rank_seed", "fail_fast", "Traffic", "TRAFFIC", "DEFAULT_TIMEOUT_S",
]

DEFAULT_TIMEOUT_S = 300.0
"""Seconds a collective waits for a lost peer before it raises (the process group's timeout)."""

T = TypeVar("T")


def is_distributed() -> bool:
    """True when a ``torch.distributed`` process group is initialised with more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """True on rank 0: the only process that writes outputs (results, checkpoints, logs, plots)."""
    return rank() == 0


# ------------------------------------------------------------------------------------------ set-up


def init_from_env(env: Mapping[str, str] | None = None, backend: str | None = None,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Join the process group that torchrun (or any launcher setting its variables) describes.

    Reads ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` from ``env``
    (default: ``os.environ``; only the command-line entry points call this). Does nothing and returns
    False when ``WORLD_SIZE`` is unset or 1, or when a group is already initialised. The backend is
    ``nccl`` when CUDA is available (each rank then uses ``cuda:LOCAL_RANK``), else ``gloo``.

    Args:
        env: the environment variables.
        backend: ``"gloo"`` | ``"nccl"`` (default: by device, as above).
        timeout_s: how long a collective waits for a lost peer before raising.

    Returns:
        True when this call initialised a process group with more than one process.

    Raises:
        ValueError: malformed launcher variables (one line).
    """
    env = os.environ if env is None else env
    if not dist.is_available() or dist.is_initialized():
        return False
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        r = int(env.get("RANK", "0"))
        local = int(env.get("LOCAL_RANK", str(r)))
    except ValueError:
        raise ValueError("distributed: WORLD_SIZE, RANK and LOCAL_RANK must be integers") from None
    if world <= 1:
        return False
    if not 0 <= r < world:
        raise ValueError(f"distributed: RANK={r} is outside 0..WORLD_SIZE-1={world - 1}")
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        raise ValueError("distributed: WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT (launch with torchrun)")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local)
    dist.init_process_group(backend=backend, init_method=f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
                            rank=r, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    return True


def shutdown() -> None:
    """Leave the process group (no-op without one): a barrier first, so that no rank tears the group down while a
    peer is still in a collective (gloo then aborted that peer at exit: ``terminate called without an active
    exception``, exit −6, seen in about one 2-process CLI run in twenty)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def rank_seed(seed: int) -> int:
    """A per-rank seed derived from the run's seed: ``seed · world_size + rank`` (IVON's rule; ``seed``
    itself in one process)."""
    return int(seed) * world_size() + rank()


@contextmanager
def fail_fast(prefix: str = "continual-blr") -> Iterator[None]:
    """In a multi-process run, turn an exception on this rank into one line on stderr and exit status 1.

    The line reads ``{prefix}: error (rank r of W): {type}: {message}``. The process leaves with
    ``os._exit(1)`` (no interpreter teardown that could wait on the other ranks): torchrun sees the
    failed worker and stops the others; a launcher that does not gets them out of their next
    collective through the process group's timeout. Without a process group the exception propagates
    unchanged (the CLI reports it as usual).
    """
    try:
        yield
    except BaseException as err:  # noqa: BLE001 — also KeyboardInterrupt: no rank may linger
        if not is_distributed():
            raise
        msg = str(err).strip().splitlines()[0] if str(err).strip() else ""
        print(f"{prefix}: error (rank {rank()} of {world_size()}): {type(err).__name__}: {msg}",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


# -------------------------------------------------------------------------------------- sharding


def shard_bounds(n: int, r: int | None = None, w: int | None = None) -> tuple[int, int]:
    """[start, stop) of rank ``r``'s contiguous part of ``n`` items split over ``w`` ranks.

    The first ``n mod w`` ranks get ⌈n/w⌉ items, the others ⌊n/w⌋ (``torch.tensor_split``'s rule);
    a rank may get none when n < w.
    """
    r = rank() if r is None else r
    w = world_size() if w is None else w
    base, extra = divmod(int(n), w)
    start = r * base + min(r, extra)
    return start, start + base + (1 if r < extra else 0)


def shard(t: Tensor) -> Tensor:
    """This rank's contiguous part of ``t`` along dim 0 (all of ``t`` in one process); a view."""
    if not is_distributed():
        return t
    s, e = shard_bounds(t.shape[0])
    return t[s:e]


# ------------------------------------------------------------------------------------ collectives


class Traffic:
    """Bytes this process sent into collectives (payload sizes, not the wire protocol's), by kind.

    The benchmark (``benchmarks/perf/perf_distributed.py``) resets and reads :data:`TRAFFIC`.
    """

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def add(self, kind: str, n_bytes: int) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + int(n_bytes)
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def total(self) -> int:
        return sum(self.bytes.values())


TRAFFIC = Traffic()
"""The process's collective-traffic counter (instrumentation only; nothing reads it to decide anything)."""


def all_reduce_sum_(tensors: Sequence[Tensor], kind: str = "other") -> None:
    """In place: every tensor becomes the sum of its values over the ranks — ONE collective for all
    (flattened into one buffer per dtype). No-op in one process."""
    if not is_distributed() or not tensors:
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        TRAFFIC.add(kind, flat.numel() * flat.element_size())
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        off = 0
        for t in group:
            n = t.numel()
            t.copy_(flat[off:off + n].view_as(t))
            off += n


def all_reduce_dict(d: Mapping[str, Tensor], kind: str = "other") -> dict[str, Tensor]:
    """{name: Σ_ranks d[name]} (new tensors; one collective). The input itself in one process."""
    if not is_distributed():
        return dict(d)
    out = {k: v.detach().clone() for k, v in d.items()}
    all_reduce_sum_(list(out.values()), kind)
    return out


def all_reduce_float(x: float, kind: str = "other") -> float:
    """Σ_ranks x as a Python float (float64 on the wire; ``x`` itself in one process)."""
    if not is_distributed():
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64, device=_device())
    all_reduce_sum_([t], kind)
    return float(t.item())


def all_gather_cat(t: Tensor, kind: str = "gather") -> Tensor:
    """The ranks' tensors concatenated along dim 0 in rank order (shards of different lengths allowed);
    ``t`` in one process. With :func:`shard` this rebuilds the unsharded tensor on every rank."""
    if not is_distributed():
        return t
    w = world_size()
    n = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(w)]
    dist.all_gather(sizes, n)
    lengths = [int(s.item()) for s in sizes]
    top = max(lengths)
    pad = t.new_zeros((top, *t.shape[1:]))
    pad[: t.shape[0]] = t
    parts = [torch.empty_like(pad) for _ in range(w)]
    TRAFFIC.add(kind, pad.numel() * pad.element_size())
    dist.all_gather(parts, pad.contiguous())
    return torch.cat([p[:k] for p, k in zip(parts, lengths)])


def broadcast_module(module: torch.nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers into every rank's ``module`` (one collective per
    tensor; at the start of a run, so that every rank starts from the same weights)."""
    if not is_distributed():
        return
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            TRAFFIC.add("broadcast", t.numel() * t.element_size())
            dist.broadcast(t.data, src=src)


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank ``src``'s ``obj`` (any picklable value) on every rank; ``obj`` itself in one process. Used for
    decisions that only one rank may take, e.g. the name of a new run folder."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

