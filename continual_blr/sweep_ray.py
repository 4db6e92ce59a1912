"""A Ray executor for :mod:`continual_blr.sweep`: every run of a sweep as one Ray task.

    from continual_blr.sweep import run_seeds
    from continual_blr.sweep_ray import ray_executor

    run_seeds(cfg, seeds=[0, 1, 2, 3, 4], out="runs/split_mnist_fromp",
              executor=ray_executor(address=None, num_cpus=1, num_gpus=0))

Each :class:`~continual_blr.sweep.SeedJob` (one config — a benchmark and its methods — at one seed,
written into its own run folder) becomes a ``@ray.remote(num_cpus=..., num_gpus=...)`` task that calls
the sweep's ``run_one``; the driver waits for all of them and returns the results in job order, so the
sweep writes the same ``summary.md`` (mean ± std) as a sequential sweep. Finished runs are reloaded from
their folders, not retrained, by ``run_one`` itself (the run folder's resume), so a repeated invocation
reruns nothing and a killed sweep resumes. One task per (benchmark, method, seed): give each method its
own config (``configs/<benchmark>/<method>.yaml``) and call ``run_seeds`` per config.

``address``: None starts (or joins, via ``RAY_ADDRESS``) a local Ray; ``"auto"`` joins the cluster this
machine belongs to; ``"ray://HEAD:10001"`` a remote cluster. Without Ray installed
:func:`ray_executor` returns the sequential executor (the same command runs locally, one run after
another) — Ray is the optional extra ``continual_blr[ray]``.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, Sequence

from .loop import StreamResult
from .sweep import Executor, SeedJob, sequential_executor

__all__ = ["ray_available", "ray_executor"]


def ray_available() -> bool:
    """Whether Ray can be imported here."""
    return importlib.util.find_spec("ray") is not None


def ray_executor(address: str | None = None, *, num_cpus: float = 1.0, num_gpus: float = 0.0,
                 init_kwargs: dict[str, Any] | None = None, require: bool = False) -> Executor:
    """An executor that runs each job as a Ray task with ``num_cpus`` CPUs and ``num_gpus`` GPUs.

    Args:
        address: the Ray cluster (None: a local Ray; ``"auto"``; ``"ray://host:port"``).
        num_cpus: CPUs per run (Ray also sets ``OMP_NUM_THREADS`` of the task to it).
        num_gpus: GPUs per run (fractions share a GPU); the run's ``device`` must then be ``cuda``.
        init_kwargs: more keyword arguments for ``ray.init`` (e.g. ``{"num_cpus": 4}`` for a local Ray).
        require: raise instead of falling back when Ray is not installed.

    Returns:
        ``executor(jobs, run_one) -> results`` for :func:`continual_blr.sweep.run_seeds` (the sequential
        executor when Ray is missing and ``require`` is False).

    Raises:
        ValueError: ``num_cpus`` ≤ 0 or ``num_gpus`` < 0; ImportError: Ray missing with ``require``.
    """
    if not num_cpus > 0:
        raise ValueError(f"num_cpus: must be > 0, got {num_cpus}")
    if not num_gpus >= 0:
        raise ValueError(f"num_gpus: must be >= 0, got {num_gpus}")
    if not ray_available():
        if require:
            raise ImportError("ray is not installed; pip install 'continual_blr[ray]'")
        return sequential_executor

    def executor(jobs: Sequence[SeedJob], run: Callable[[SeedJob], list[StreamResult]]) -> list[list[StreamResult]]:
        import ray

        if not jobs:
            return []
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False, **(init_kwargs or {}))
        remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_retries=0)(_call)
        refs = [remote.remote(run, job) for job in jobs]
        return [list(r) for r in ray.get(refs)]

    return executor


def _call(run: Callable[[SeedJob], list[StreamResult]], job: SeedJob) -> list[StreamResult]:
    """The Ray task: one run (``sweep.run_one``), in a worker process."""
    return run(job)
