"""Process-group facts for data-parallel runs under ``torch.distributed`` (torchrun).

Without an initialised process group every function answers as for a single process, so the library
runs unchanged in one process.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["is_distributed", "rank", "world_size", "is_main_process"]


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
