"""From a :class:`~continual_blr.config.RunConfig` to a run folder: build stream, model and methods, run
the one loop (:func:`continual_blr.loop.run_stream`) for each method, and keep the folder current.

After every task of every method the runner writes, atomically (:mod:`continual_blr.run_folder`):
``results.json`` (finished methods complete, the running one with its finished tasks), the table
``results.md``, the method's ``checkpoint.pt`` and its logs; the heatmap ``accuracy_matrix.png`` once, when
the run (or its resume) ends. A
finished method also gets ``<method>/model.pt`` and ``<method>/method.pt`` (what ``continual-blr
inspect`` reads). :func:`run_config` with ``resume=True`` skips finished methods and continues the
unfinished one from its last finished task; the result equals an uninterrupted run's (same seed, CPU).

Checkpoint (``<method>/checkpoint.pt``, a dict; ``torch.load(..., weights_only=True)`` reads it):
``progress`` (next task, accuracy rows, times, losses, the loop's minibatch-order generator state),
``model`` (state_dict), ``method`` (the method's state_dict), ``generators`` (every ``torch.Generator``
the method holds, by attribute path: method state_dicts leave them out) and ``optimizer`` (the state of
an optimiser that lives across tasks, ``method.optimizer``, e.g. the BLR's).

Mid-task checkpoint (``<method>/epoch_checkpoint.pt``, the same dict with ``progress`` a
:class:`~continual_blr.loop.TaskProgress`): written after an epoch once ``checkpoint_every`` seconds have passed
since the method's last checkpoint of either kind (by default 300; 0: after every epoch), removed when the task
ends. A resume continues the unfinished task after that epoch, so a run stopped by a kill (no chance to save)
loses at most ``checkpoint_every`` seconds and an epoch, not the task.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import RunConfig
from .data import make_stream
from .data.stream import TaskStream
from .loop import EpochHook, LoopProgress, StreamResult, TaskProgress, run_stream, stream_metrics
from .methods import build_method
from .methods.base import Method, TrainConfig
from .models import build_model
from .run_folder import (
    CHECKPOINT, RunFileError, RunFolder, RunNotFoundError, check_out_dir, clear_run, deferred_interrupts,
    generator_states, load_generator_states, unsaved_state, load_torch, load_weights, new_run_dir, read_json,
)
from .run_logs import TrainingLog

__all__ = ["run_config", "boundary_checkpoint", "restore_checkpoint", "resolve_out", "load_results", "load_run_config", "build_stream", "check_runnable", "check_methods",
           "format_table", "format_heading", "set_threads", "RunInterrupted", "QUICK_EPOCH_DIVISOR", "RUNS_ROOT"]

QUICK_EPOCH_DIVISOR = 5
RUNS_ROOT = "runs"
EPOCH_CHECKPOINT = "epoch_checkpoint.pt"
"""``<method>/epoch_checkpoint.pt``: the state inside the task under way after its last saved epoch (the boundary
checkpoint's dict, with ``progress`` a :class:`~continual_blr.loop.TaskProgress`); removed when the task ends."""
CHECKPOINT_EVERY_S = 300.0
"""Default of ``run_config(checkpoint_every=...)``: the least seconds between two mid-task checkpoints of a method."""
"""Where runs without an ``out`` go: ``runs/<stream>-<methods>-<YYYYmmdd-HHMMSS>`` and ``runs/latest``."""


class RunInterrupted(Exception):
    """SIGINT / SIGTERM stopped a run; what finished is kept in ``out``.

    Attributes:
        out: the run folder.
        done: per method, ``(name, finished tasks, total tasks)`` for every method started.
    """

    def __init__(self, out: Path, done: list[tuple[str, int, int]]) -> None:
        self.out, self.done = out, done
        super().__init__(self.summary())

    def summary(self) -> str:
        """e.g. ``finished blr (5/5 tasks); fromp stopped after 2/5 tasks``."""
        full = [f"{m} ({k}/{n} tasks)" for m, k, n in self.done if k == n]
        part = [f"{m} after {k}/{n} tasks" for m, k, n in self.done if k < n]
        bits = [f"finished {', '.join(full)}" if full else "no method finished"]
        if part:
            bits.append(f"stopped {', '.join(part)}")
        return "; ".join(bits)


def set_threads(n: int) -> int:
    """Use ``n`` torch threads: ``torch.set_num_threads(n)`` (intra-op: the threads one matmul or
    convolution is split over) and, where torch still allows it (before the first inter-op parallel
    work), ``torch.set_num_interop_threads(n)``. Returns the previous intra-op count.

    Results do not depend on it on CPU up to floating-point summation order; one thread is often faster
    when other processes share the cores (see ``docs/runs.md``).

    Raises:
        ValueError: ``n`` < 1 (one line).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"threads: got {n!r}; allowed: an integer >= 1")
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:
        pass  # already fixed by earlier parallel work in this process; the intra-op count is what matters
    return old


def _train_for(cfg: RunConfig, overrides: dict[str, Any]) -> TrainConfig:
    from .config import from_dict

    base = dataclasses.asdict(cfg.train) | dict(overrides)
    train = from_dict(TrainConfig, base, path="train")
    if cfg.quick:
        train = dataclasses.replace(train, epochs=max(1, train.epochs // QUICK_EPOCH_DIVISOR))
    return train


def build_stream(cfg: RunConfig) -> TaskStream:
    """The stream a config names (options passed through to the stream builder); with
    ``stream.validation > 0`` the validation stream (evaluated on held-out training data, not test)."""
    kwargs = dict(cfg.stream.options)
    if cfg.stream.scenario is not None:
        kwargs["scenario"] = cfg.stream.scenario
    if cfg.stream.validation:
        kwargs["validation"] = cfg.stream.validation
    return make_stream(cfg.stream.name, data_dir=cfg.stream.data_dir, seed=cfg.seed, **kwargs)


def check_runnable(cfg: RunConfig) -> None:
    """Everything about ``cfg`` that can fail before training, checked before a folder is made: the device
    is available and every method builds (:func:`check_methods`).

    Raises:
        ValueError: one line naming the field.
    """
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device: {cfg.device!r} requested but CUDA is not available; use 'cpu'")
    check_methods(cfg)


def check_methods(cfg: RunConfig) -> None:
    """Build every method of ``cfg`` once, so that a bad parameter fails before anything trains.

    Raises:
        ValueError: one line naming the method, e.g. ``methods[0] (blr): params: unknown key 'lrr' (allowed: ...)``.
    """
    for i, mc in enumerate(cfg.methods):
        try:
            build_method(mc.name, mc.params, seed=cfg.seed)
            _train_for(cfg, mc.train)
        except (ValueError, TypeError) as err:
            msg = str(err).splitlines()[0] if str(err) else type(err).__name__
            msg = msg.removeprefix("config: ").removeprefix(f"method {mc.name!r}: ")
            raise ValueError(f"methods[{i}] ({mc.name}): {msg}") from None


def resolve_out(cfg: RunConfig, *, overwrite: bool = False, root: str | Path = RUNS_ROOT) -> RunConfig:
    """A copy of ``cfg`` whose ``out`` is where the run will write (the overwrite policy, ``docs/runs.md``).

    No ``out``: a new folder ``<root>/<stream>-<methods>-<YYYYmmdd-HHMMSS>`` with ``<root>/latest`` pointing
    at it. An ``out`` that holds a run (``results.json``): refused unless ``overwrite``, which deletes that
    run's files first.

    Raises:
        RunExistsError: ``out`` holds a run and ``overwrite`` is False.
    """
    cfg = dataclasses.replace(cfg)
    if cfg.out is None:
        cfg.out = str(new_run_dir(root, cfg.stream.name, [m.name for m in cfg.methods]))
        return cfg
    check_out_dir(cfg.out, overwrite=overwrite)
    if overwrite:
        clear_run(cfg.out)
    return cfg


def load_run_config(path: str | Path) -> RunConfig:
    """The config of the run in folder ``path`` (its ``results.json``), with ``out`` set to ``path``.

    Raises:
        RunNotFoundError: no ``results.json`` in ``path``.
    """
    from .config import from_dict

    folder = RunFolder(path)
    payload = folder.read_results() if folder.path.is_dir() else None
    if payload is None or "config" not in payload:
        raise RunNotFoundError(f"resume: {path} holds no run (no results.json); give a folder written by "
                               "`continual-blr run`")
    cfg = from_dict(RunConfig, payload["config"])
    cfg.out = str(folder.path)
    return cfg


def _partial_result(method: str, stream: TaskStream, seed: int, progress: LoopProgress,
                    config: dict[str, Any], memory: dict[str, Any] | None = None) -> StreamResult:
    """A StreamResult of the tasks finished so far (metrics over the finished k×k block of R)."""
    k = progress.next_task
    metrics = stream_metrics([row[:k] for row in progress.acc_matrix[:k]])
    return StreamResult(method=method, stream=stream.name, scenario=stream.scenario, seed=seed,
                        acc_matrix=progress.acc_matrix, task_times=progress.task_times, train_loss=progress.train_loss,
                        config=config, memory=dict(memory or {}), **metrics)


def format_table(results: list[StreamResult]) -> str:
    """Final accuracy (%) per task after the last finished task, average, forgetting, time and the number of past
    examples the method stores (``StreamResult.memory``), per method."""
    t = len(results[0].acc_matrix)
    width = max(10, *(len(r.method) + 1 for r in results))
    head = (f"{'method':<{width}}" + "".join(f"{'T' + str(j + 1):>8}" for j in range(t))
            + f"{'avg':>8}{'forget':>8}{'time s':>8}{'stored':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        done = [row for row in r.acc_matrix if not math.isnan(row[0])]
        last = done[-1] if done else [math.nan] * t
        cells = "".join(f"{100 * v:>8.2f}" if not math.isnan(v) else f"{'-':>8}" for v in last)
        note = "" if len(done) == t else f"  ({len(done)}/{t} tasks)"
        stored = int((r.memory or {}).get("stored_examples", 0))
        lines.append(f"{r.method:<{width}}{cells}{100 * r.avg_acc:>8.2f}{100 * r.forgetting:>8.2f}"
                     f"{sum(r.task_times):>8.1f}{stored if stored else '-':>8}{note}")
    return "\n".join(lines)


def format_heading(results: list[StreamResult], cfg: RunConfig) -> str:
    """The two lines above a run's table (printed, and in ``results.md``): stream, scenario, seed, a QUICK label
    for a quick run, and what the accuracies were measured on."""
    label = f" [QUICK MODE: epochs / {QUICK_EPOCH_DIVISOR}]" if cfg.quick else ""
    evaluated_on = (f"validation (held-out {cfg.stream.validation:g} of each task's training data, not test)"
                    if cfg.stream.validation else "test")
    return (f"{results[0].stream} ({results[0].scenario}-incremental), seed {cfg.seed}{label}\n"
            f"final {evaluated_on} accuracy (%) per task after the last task:")


class _Writer:
    """Keeps a run folder current: results and table after every task, the heatmap at the end; checkpoints."""

    def __init__(self, folder: RunFolder, cfg: RunConfig, tensorboard: bool) -> None:
        self.folder, self.cfg, self.tensorboard = folder, cfg, tensorboard
        self.results: dict[str, StreamResult] = {}
        self.progress: dict[str, tuple[int, int]] = {}
        self.stream: TaskStream | None = None  # described in results.json: prediction needs no dataset

    def write_results(self, figure: bool = False) -> None:
        """``results.json`` and ``results.md``; with ``figure`` also the heatmap (drawn once, at the run's end:
        drawing it after every task cost more than the training of a default run)."""
        results = [self.results[m.name] for m in self.cfg.methods if m.name in self.results]
        payload = {"config": self.cfg.to_dict(), "quick": self.cfg.quick, "threads": torch.get_num_threads(),
                   "results": [r.to_dict() for r in results],
                   "progress": {m: {"finished_tasks": k, "n_tasks": n, "complete": k == n}
                                for m, (k, n) in self.progress.items()}}
        if self.stream is not None:
            payload["stream"] = self.stream.describe()
        self.folder.write_json("results.json", payload)
        if results:
            self.folder.write_text("results.md", f"{format_heading(results, self.cfg)}\n\n"
                                                 f"```\n{format_table(results)}\n```\n")
        if results and figure:
            from .plots import plot_accuracy_matrices

            self.folder.save_figure("accuracy_matrix.png", lambda p: plot_accuracy_matrices(results, p))

    def checkpoint(self, name: str, progress: LoopProgress, model: nn.Module, method: Method,
                   unsaved: list[str] | None = None) -> None:
        self.folder.save_torch(f"{name}/{CHECKPOINT}", _checkpoint_state(progress, model, method, unsaved))
        self.folder.keep_copy(f"{name}/{CHECKPOINT}", boundary_checkpoint(name, progress.next_task - 1))
        self.folder.remove(f"{name}/{EPOCH_CHECKPOINT}")  # after the boundary: the task it continued has ended

    def epoch_checkpoint(self, name: str, progress: TaskProgress, model: nn.Module, method: Method,
                         unsaved: list[str] | None = None) -> None:
        """``<name>/epoch_checkpoint.pt``: the boundary checkpoint's dict inside a task (:data:`EPOCH_CHECKPOINT`)."""
        self.folder.save_torch(f"{name}/{EPOCH_CHECKPOINT}", _checkpoint_state(progress, model, method, unsaved))


def _checkpoint_state(progress: LoopProgress | TaskProgress, model: nn.Module, method: Method,
                      unsaved: list[str] | None) -> dict[str, Any]:
    """The dict a checkpoint holds (module docstring)."""
    opt = getattr(method, "optimizer", None)
    return {
        "format": 1,
        "unsaved": list(unsaved or []),  # the method's attributes its state_dict leaves out (_own_unsaved)
        "progress": dataclasses.asdict(progress),
        "model": model.state_dict(),
        "method": method.state_dict(),
        "generators": generator_states(method),
        "optimizer": opt.state_dict() if isinstance(opt, torch.optim.Optimizer) else None,
    }


def boundary_checkpoint(method: str, task: int) -> str:
    """Where a run folder keeps the checkpoint written when ``task`` (0-based) ended, relative to the run:
    ``<method>/tasks/after_task<task>.pt``, the same dict as ``checkpoint.pt`` at that boundary (the network at
    the task's end; the method as the next task starts with it). Written as a hard link to ``checkpoint.pt``:
    no extra time, the disk of one checkpoint per task. What ``inspect --validate`` retrains from and what the
    forgetting analysis scores each task's examples with."""
    return f"{method}/tasks/after_task{task}.pt"


def _load_checkpoint(path: Path) -> dict[str, Any]:
    state = load_torch(path)
    if not isinstance(state, dict) or "model" not in state or "progress" not in state:
        raise RunFileError(f"{path}: not a checkpoint written by continual-blr (no model state); remove it to "
                           "restart that method's unfinished task from the start")
    return state


def _own_unsaved(mc: Any, cfg: RunConfig, stream: TaskStream, train: TrainConfig, method: Method,
                 initial: nn.Module) -> list[str]:
    """The attributes of a method of your own (a class outside this package that keeps ``Method.state_dict``) that
    training changed and a checkpoint would not save (:func:`~continual_blr.run_folder.unsaved_state`): compared with
    the same method built and set up anew on the initial weights, as a resume does. Built-in methods: [] (their
    resume is checked bit for bit by ``tests/test_resume.py``)."""
    if type(method).__module__.startswith("continual_blr."):
        return []
    fresh = build_method(mc.name, mc.params, seed=cfg.seed)
    fresh.use_likelihood(stream.likelihood, stream.sigma)
    fresh.setup(copy.deepcopy(initial), stream, train)
    unsaved = unsaved_state(method, fresh)
    if unsaved:
        warnings.warn(f"method {mc.name!r} carries state its state_dict does not save ({', '.join(unsaved)}): this run "
                      "cannot be resumed; define state_dict / load_state_dict (docs/own_method.md)", RuntimeWarning,
                      stacklevel=2)
    return unsaved


def _restore(state: dict[str, Any]):
    """``restore(model, method)`` for :func:`run_stream`: load model, method, optimiser and generator states."""
    return lambda model, method: restore_checkpoint(state, model, method)


def restore_checkpoint(state: dict[str, Any], model: nn.Module, method: Method) -> None:
    """Load a checkpoint dict (``checkpoint.pt``, ``tasks/after_task<t>.pt``) into a model and a method already
    set up (``method.setup``): weights, the method's state, the optimiser that lives across tasks, the
    method's generators.

    Raises:
        ValueError: the checkpoint holds generators the method does not have.
    """
    load_weights(model, state["model"], "the checkpoint")
    method.load_state_dict(state["method"])
    opt = getattr(method, "optimizer", None)
    if state.get("optimizer") is not None and isinstance(opt, torch.optim.Optimizer):
        opt.load_state_dict(state["optimizer"])
    missing = load_generator_states(method, state.get("generators", {}))
    if missing:
        raise ValueError(f"resume: the checkpoint's generators {missing} are not in the method; "
                         "was it written by another version?")


def _generalisation_rows(log: TrainingLog | None, model: nn.Module, method: Method, stream: TaskStream, name: str,
                         task_index: int) -> tuple[list, float] | None:
    """``--log-loo``: the leave-one-out estimates of the seen tasks at this task end and the seconds they took, for
    ``TrainingLog.generalisation`` (None where nothing is logged: no log, or not the main process)."""
    import time

    from .distributed import is_main_process
    from .inspect.generalisation import generalisation_at_task_end

    if log is None or not is_main_process():
        return None
    t0 = time.perf_counter()
    rows = generalisation_at_task_end(model, method, stream, name, task_index)
    return rows, time.perf_counter() - t0


def _warm_up() -> None:
    """Pay the process's one-time start-up costs before any method's training is timed, so that the ``time s``
    column measures each method alone: the first ``torch.optim`` optimiser imports ``torch._dynamo`` (about 2 s),
    the first backward starts autograd's engine. Touches no generator and no state a run reads."""
    weight = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([weight], lr=0.0)
    (weight * weight).sum().backward()
    opt.step()


def _epoch_hooks(*hooks: EpochHook | None) -> EpochHook | None:
    """One epoch hook calling each of ``hooks`` that is not None, in order (None if there is none)."""
    given = [h for h in hooks if h is not None]
    if not given:
        return None
    return lambda i, e, loss: [h(i, e, loss) for h in given] and None


def run_config(cfg: RunConfig, save: bool = True, *, overwrite: bool = False, resume: bool = False,
               tensorboard: bool = False, on_epoch: EpochHook | None = None,
               log_loo: bool = False, checkpoint_every: float | None = CHECKPOINT_EVERY_S) -> list[StreamResult]:
    """Run every method of ``cfg`` on its stream, keeping the run folder current.

    The folder is ``cfg.out`` under the overwrite policy of :func:`resolve_out` (a new time-stamped
    folder when ``cfg.out`` is None), chosen once the stream has loaded, so bad input leaves no folder
    behind; each result's ``config["out"]`` names it.

    Args:
        cfg: the run.
        save: write the run folder (False: only return the results).
        overwrite: replace a run already in ``cfg.out`` (else it is refused).
        resume: continue the run in ``cfg.out``: finished methods are reloaded from ``results.json``, the
            unfinished one continues from its checkpoint.
        tensorboard: also write TensorBoard events (``torch.utils.tensorboard`` must import).
        on_epoch: ``on_epoch(task_index, epoch, mean_loss)`` after every epoch of every method (beside the run
            log's own), e.g. for the benchmarks' executed-code fingerprint.
        log_loo: at every task end also write ``<method>/generalisation.csv``: the leave-one-out estimate of every
            seen task's test NLL and accuracy from its training data, beside the measured ones
            (:func:`continual_blr.inspect.generalisation.generalisation_at_task_end`; one Σ and one scoring pass of
            the seen tasks' training data per task end). Off by default: it costs time and changes no result.
        checkpoint_every: with ``save``, write a mid-task checkpoint (:data:`EPOCH_CHECKPOINT`) after an epoch once
            this many seconds have passed since the method's last checkpoint (0: after every epoch; None: only at
            task boundaries). It changes no result: a resume from it equals the uninterrupted run.

    Raises:
        RunExistsError: ``cfg.out`` holds a run and neither ``overwrite`` nor ``resume``.
        RunInterrupted: SIGINT (KeyboardInterrupt) or SIGTERM (if the caller maps it to KeyboardInterrupt)
            stopped the run; everything finished is on disk.
    """
    check_runnable(cfg)
    if checkpoint_every is not None and not (isinstance(checkpoint_every, (int, float)) and checkpoint_every >= 0):
        raise ValueError(f"checkpoint_every: got {checkpoint_every!r}; allowed: seconds >= 0, or None")
    if save and not resume and cfg.out is not None:
        check_out_dir(cfg.out, overwrite=overwrite)  # before the data load: fail fast
    stream = build_stream(cfg)
    if save and not resume:
        cfg = resolve_out(cfg, overwrite=overwrite)
    folder = RunFolder(cfg.out if cfg.out is not None else ".")
    writer = _Writer(folder, cfg, tensorboard)
    writer.stream = stream
    previous = folder.read_results() if (save and resume) else None
    if previous is not None:
        done = previous.get("progress", {})
        for d in previous.get("results", []):  # finished methods, and the interrupted one's finished tasks
            writer.results[d["method"]] = StreamResult.from_dict(d)
            info = done.get(d["method"], {})
            writer.progress[d["method"]] = (int(info.get("finished_tasks", 0)), len(stream.tasks))
    n_tasks = len(stream.tasks)
    # every checkpoint a resume will use is read before anything is written: a damaged one is one line, exit 2
    def finished(name: str) -> bool:
        return writer.progress.get(name, (0, n_tasks))[0] == n_tasks and (folder.path / name / "model.pt").is_file()

    states = {mc.name: _load_checkpoint(folder.path / mc.name / CHECKPOINT) for mc in cfg.methods
              if save and resume and not finished(mc.name) and (folder.path / mc.name / CHECKPOINT).is_file()}
    # a mid-task checkpoint continues the task after the boundary checkpoint's (or the first task, without one)
    within = {}
    for mc in cfg.methods:
        path = folder.path / mc.name / EPOCH_CHECKPOINT
        if save and resume and not finished(mc.name) and path.is_file():
            state = _load_checkpoint(path)
            boundary = states[mc.name]["progress"]["next_task"] if mc.name in states else 0
            if state["progress"].get("task") == boundary:
                within[mc.name] = state
    for name, state in [*states.items(), *within.items()]:  # a resume without the carried state would diverge
        if state.get("unsaved"):
            raise ValueError(f"resume: method {name!r} carries state its state_dict does not save "
                             f"({', '.join(state['unsaved'])}); define state_dict / load_state_dict "
                             "(docs/own_method.md) or run it again from the start")
    if save:
        writer.write_results()
    _warm_up()
    try:
        for mc in cfg.methods:
            if finished(mc.name):
                continue  # finished before: reloaded from results.json
            method = build_method(mc.name, mc.params, seed=cfg.seed)
            train = _train_for(cfg, mc.train)
            model = build_model(cfg.model.arch, stream.input_shape, stream.n_outputs, stream.n_heads,
                                hidden=tuple(cfg.model.hidden), generator=torch.Generator().manual_seed(cfg.seed))
            record = cfg.to_dict() | {"method": dataclasses.asdict(mc), "train_used": dataclasses.asdict(train)}
            start, restore, resume_task = None, None, None
            state = states.pop(mc.name, None)
            if state is not None:
                start, restore = LoopProgress(**state["progress"]), _restore(state)
            mid = within.pop(mc.name, None)
            if mid is not None:
                resume_task = (TaskProgress(**mid["progress"]), _restore(mid))
            log = TrainingLog(folder, mc.name, tensorboard) if save else None
            if log is not None:
                log.trim(start.next_task if start is not None else 0,
                         resume_task[0].epochs_done if resume_task is not None else 0)
            writer.progress[mc.name] = (start.next_task if start is not None else 0, n_tasks)
            own = not type(method).__module__.startswith("continual_blr.")
            initial = copy.deepcopy(model) if save and own else None  # what a resume sets the method up on

            def on_task_end(progress: LoopProgress, model: nn.Module, method: Method, mc=mc, record=record,
                            log=log, initial=initial, train=train) -> None:
                writer.progress[mc.name] = (progress.next_task, n_tasks)
                if not save:
                    return
                unsaved = _own_unsaved(mc, cfg, stream, train, method, initial) if initial is not None else []
                # --log-loo: computed before the boundary is written, written with it (an interrupt while it computes
                # leaves the task unfinished, to be retrained on resume: the log never misses a boundary's rows)
                loo = _generalisation_rows(log, model, method, stream, mc.name, progress.next_task - 1) if log_loo else None
                with deferred_interrupts():
                    writer.checkpoint(mc.name, progress, model, method, unsaved)
                    writer.results[mc.name] = _partial_result(mc.name, stream, cfg.seed, progress, record,
                                                                   method.memory_stats())
                    if progress.next_task == n_tasks:
                        folder.save_torch(f"{mc.name}/model.pt", model.state_dict())
                        folder.save_torch(f"{mc.name}/method.pt", method.state_dict())
                    assert log is not None
                    log.task_end(progress)
                    if loo is not None:
                        log.generalisation(progress.next_task - 1, *loo)
                    writer.write_results()

            saved_at = [time.perf_counter()]  # when this method's last checkpoint (of either kind) was written

            def on_epoch_state(make, model: nn.Module, method: Method, mc=mc, initial=initial, train=train) -> None:
                if time.perf_counter() - saved_at[0] < checkpoint_every:
                    return
                unsaved = _own_unsaved(mc, cfg, stream, train, method, initial) if initial is not None else []
                with deferred_interrupts():
                    writer.epoch_checkpoint(mc.name, make(), model, method, unsaved)
                saved_at[0] = time.perf_counter()

            def at_task_end(progress: LoopProgress, model: nn.Module, method: Method) -> None:
                on_task_end(progress, model, method)
                saved_at[0] = time.perf_counter()

            try:
                result = run_stream(model, stream, method, train, seed=cfg.seed, device=cfg.device,
                                    progress=cfg.progress, config=record, resume=start, restore=restore,
                                    on_task_end=at_task_end,
                                    on_epoch=_epoch_hooks(on_epoch, None if log is None else
                                    (lambda i, e, loss, m=method, lg=log: lg.epoch(i, e, loss, m.epoch_stats()))),
                                    resume_task=resume_task,
                                    on_epoch_state=on_epoch_state if save and checkpoint_every is not None else None)
            finally:
                if log is not None:
                    log.close()
            writer.results[mc.name] = result
            if save and not (folder.path / mc.name / "model.pt").is_file():  # resumed at the very end
                folder.save_torch(f"{mc.name}/model.pt", model.state_dict())
                folder.save_torch(f"{mc.name}/method.pt", method.state_dict())
        if save:
            writer.write_results(figure=True)
    except KeyboardInterrupt:
        done = [(m.name, *writer.progress[m.name]) for m in cfg.methods if m.name in writer.progress]
        raise RunInterrupted(Path(cfg.out or "."), done) from None
    return [writer.results[m.name] for m in cfg.methods]


def load_results(path: str | Path) -> list[StreamResult]:
    """Reload the StreamResults of a ``results.json`` (or of the folder holding it)."""
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    payload = read_json(p)
    return [StreamResult.from_dict(d) for d in payload["results"]]
