"""Several seeds of one run, and the mean ± std table over them.

``continual-blr run CONFIG --seeds 0 1 2 3 4 --out DIR`` runs each seed into ``DIR/seed-<s>/`` (a normal
run folder, resumable on its own) and writes ``DIR/summary.md``; a repeated command skips finished
seeds and resumes unfinished ones. The benchmark scripts (``benchmarks/reproduce.py``,
``benchmarks/split_digits.py``) use :func:`mean_std` / :func:`format_mean_std` from here, so every table
of the project computes its spread the same way: the sample standard deviation (n − 1), 0 for one seed.

Executors: :func:`run_seeds` hands the list of :class:`SeedJob` to an executor, a callable
``executor(jobs, run_one) -> list[list[StreamResult]]`` that returns the results in job order. The
default, :func:`sequential_executor`, runs them one after the other in this process; a parallel
backend (processes, Ray) only has to call ``run_one(job)`` for each job somewhere and gather the
results (``run_one`` is a module-level function, so it pickles).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from .config import RunConfig
from .loop import StreamResult
from .run_folder import RunExistsError, RunFolder

__all__ = ["SeedJob", "Executor", "run_seeds", "run_one", "sequential_executor", "summarize", "mean_std",
           "format_mean_std", "check_seeds", "seed_dir", "same_run"]


@dataclass(frozen=True)
class SeedJob:
    """One seed of a sweep: the run's config (``seed`` and ``out`` set) and whether it resumes."""

    seed: int
    config: RunConfig
    resume: bool
    tensorboard: bool = False


Executor = Callable[[Sequence[SeedJob], Callable[[SeedJob], list[StreamResult]]], list[list[StreamResult]]]


def check_seeds(seeds: Sequence[int]) -> list[int]:
    """``seeds`` as a list if they are distinct integers >= 0.

    Raises:
        ValueError: one line naming ``--seeds`` and what is allowed.
    """
    seeds = list(seeds)
    if not seeds:
        raise ValueError("--seeds: give at least one seed")
    bad = [s for s in seeds if isinstance(s, bool) or not isinstance(s, int) or s < 0]
    if bad:
        raise ValueError(f"--seeds: got {bad[0]!r}; allowed: distinct integers >= 0")
    dup = sorted({s for s in seeds if seeds.count(s) > 1})
    if dup:
        raise ValueError(f"--seeds: seed {dup[0]} given twice; allowed: distinct integers >= 0")
    return seeds


def seed_dir(out: str | Path, seed: int) -> Path:
    """``<out>/seed-<seed>``."""
    return Path(out) / f"seed-{seed}"


def same_run(a: dict, b: dict) -> bool:
    """Whether two configs (``RunConfig.to_dict()``) describe the same run up to its seed and the settings
    that do not change results (``out``, ``progress``, ``device``, ``stream.data_dir``)."""
    def key(d: dict) -> dict:
        d = {k: v for k, v in d.items() if k not in ("seed", "out", "progress", "device")}
        if isinstance(d.get("stream"), dict):
            d["stream"] = {k: v for k, v in d["stream"].items() if k != "data_dir"}
        return d

    return key(a) == key(b)


def run_one(job: SeedJob) -> list[StreamResult]:
    """Run (or resume, or reload when finished) one seed's run folder."""
    from .runner import run_config

    return run_config(job.config, resume=job.resume, tensorboard=job.tensorboard)


def sequential_executor(jobs: Sequence[SeedJob], run: Callable[[SeedJob], list[StreamResult]]) -> list[list[StreamResult]]:
    """Run the jobs one after the other in this process."""
    return [run(job) for job in jobs]


def _job(cfg: RunConfig, seed: int, out: Path, tensorboard: bool) -> SeedJob:
    folder = seed_dir(out, seed)
    job_cfg = dataclasses.replace(cfg, seed=seed, out=str(folder))
    stored = RunFolder(folder).read_results()
    if stored is None:
        return SeedJob(seed, job_cfg, resume=False, tensorboard=tensorboard)
    if not same_run(stored.get("config", {}), job_cfg.to_dict()):
        raise RunExistsError(f"--out: {folder} holds a run of another config; choose another --out or pass "
                             "--overwrite")
    return SeedJob(seed, job_cfg, resume=True, tensorboard=tensorboard)


def run_seeds(cfg: RunConfig, seeds: Sequence[int], out: str | Path, *, executor: Executor | None = None,
              tensorboard: bool = False) -> list[list[StreamResult]]:
    """Run ``cfg`` once per seed into ``<out>/seed-<s>/`` and write ``<out>/summary.md``.

    A seed folder that holds a run of the same config (seed and out aside) is resumed (finished methods
    and seeds are reloaded, not retrained); one of another config is refused.

    Args:
        cfg: the run (its ``seed`` and ``out`` are replaced per seed).
        seeds: distinct seeds >= 0.
        out: the sweep's folder.
        executor: how the jobs run (default :func:`sequential_executor`).
        tensorboard: TensorBoard events in every seed's folder.

    Returns:
        Per seed (in the order given), the per-method results.

    Raises:
        ValueError: bad seeds; RunExistsError: a seed folder holds another config's run.
    """
    seeds = check_seeds(seeds)
    out = Path(out)
    jobs = [_job(cfg, s, out, tensorboard) for s in seeds]
    results = (executor or sequential_executor)(jobs, run_one)
    RunFolder(out).write_text("summary.md", summarize(results, title=f"{cfg.stream.name}, seeds "
                                                      f"{', '.join(map(str, seeds))}") + "\n")
    return results


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n − 1; 0 for a single value) of ``xs``."""
    xs = [float(x) for x in xs]
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def format_mean_std(xs: Sequence[float], scale: float = 100.0, digits: int = 2) -> str:
    """``mean ± std`` of ``xs`` × ``scale`` (``-`` for no values)."""
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return "-"
    m, s = mean_std([scale * x for x in xs])
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def summarize(results: Sequence[Sequence[StreamResult]], title: str | None = None) -> str:
    """A markdown table, one row per method: seeds, final average accuracy, forgetting and BWT (%, mean ±
    sample std over seeds), and mean wall time per seed.

    Args:
        results: per seed, that seed's per-method results (methods matched by name).
        title: a line above the table.
    """
    by_method: dict[str, list[StreamResult]] = {}
    for per_seed in results:
        for r in per_seed:
            by_method.setdefault(r.method, []).append(r)
    lines = [f"{title}\n" if title else ""]
    lines += ["| method | seeds | avg acc (%) | forgetting (%) | BWT (%) | time per seed (s) |",
              "|---|---|---|---|---|---|"]
    for method, rs in by_method.items():
        times = statistics.fmean(sum(r.task_times) for r in rs)
        lines.append(f"| {method} | {len(rs)} | {format_mean_std([r.avg_acc for r in rs])} | "
                     f"{format_mean_std([r.forgetting for r in rs])} | {format_mean_std([r.bwt for r in rs])} | "
                     f"{times:.1f} |")
    lines.append("")
    lines.append("mean ± sample standard deviation over seeds (0 with one seed); accuracies after the last task.")
    return "\n".join(lines).lstrip("\n")
