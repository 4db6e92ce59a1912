"""Reload a run folder written by ``continual-blr run`` and predict with it: save → load → predict.

    import continual_blr
    run = continual_blr.load_run("runs/latest", method="fromp", data=True)  # model, method, config, results, data
    proba = run.predict_proba(x_new, head=0)                        # [N, K] class probabilities
    labels = run.predict_label(x_new, head=0)                       # [N] global class labels
    outputs = run.predict(x_new, head=0)                            # [N] output indices on the head

Nothing is retrained. The stream is the description the run stored in ``results.json`` (input shape,
heads, classes, likelihood; no examples, so no dataset is needed), or with ``data=True`` rebuilt from the
saved config with its datasets (streams are deterministic in their seed), the network from the config's
architecture and its saved weights, and the method from the registry with its saved state, so the
predictions are the method's own predictive: a Monte-Carlo average over the posterior for the methods
that define one (``blr``, ``vcl``, ``ivon``, ... with ``predict_samples``), the network's softmax for
the others (``continual_blr.methods.base.Method.predict_proba``).

Run folder layout read here (other files, e.g. per-task checkpoints or logs, are ignored):

    <run>/results.json          {"config": ..., "stream": its description, "results": [...], ...}
    <run>/<method>/model.pt     the network's state_dict     (written when the method finished)
    <run>/<method>/method.pt    method.state_dict()          (idem)

A run that is still going, or was stopped, holds the methods that finished; those load. Run folders are
trusted input: they are read with ``torch.load`` (``weights_only=True`` first, the full unpickler only
for a method state holding non-tensor objects).

This module sits in the runner's layer (it reads the run configuration); inspection
(:mod:`continual_blr.inspect`) works on the loaded objects and never reads folders itself.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .config import RunConfig, from_dict
from .data.registry import DEFAULT_SCENARIOS
from .data.stream import TaskStream
from .inspect.saved_run import SavedRun, has_memory_store
from .methods import METHODS, build_method, registry_name
from .methods.base import TrainConfig
from .models import build_model
from .run_folder import RunFileError, load_torch, load_weights, read_json
from .runner import build_stream

__all__ = ["LoadedRun", "RunNotFoundError", "UnsavedStateError", "load_run", "load_boundary", "validate_run", "saved_methods", "check_config_matches", "inspect_path"]

RESULTS = "results.json"


class RunNotFoundError(FileNotFoundError):
    """The folder is not a run (no ``results.json``), or holds no saved state for the method."""


class UnsavedStateError(ValueError, LookupError):
    """A task boundary cannot be rebuilt: the method's checkpoint left trained state out (a method of one's own
    without ``state_dict``). A ``ValueError`` for callers that validate input, a ``LookupError`` for those that, like
    the report's forgetting analysis, skip what a run does not keep."""


@dataclass
class LoadedRun(SavedRun):
    """A reloaded run: the trained network and its method, ready to predict or to inspect.

    Attributes (beyond :class:`continual_blr.inspect.SavedRun`'s ``path``, ``method_name``, ``stream``,
    ``model``, ``method``, ``result``, ``methods``, ``seed``):
        config: the run's :class:`~continual_blr.config.RunConfig`.
        payload: the whole ``results.json`` (config, results of every finished method, ...).
        device: where the network and the method's state live.
        train: the training settings the method ran with (``train_used``).
        boundary: None for the finished run; ``t`` for the state kept when task ``t`` ended, ``-1`` for the
            state the first task started from (:func:`load_boundary`).
    """

    config: RunConfig | None = None
    payload: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    train: TrainConfig | None = None
    boundary: int | None = None

    def _inputs(self, x: Tensor | np.ndarray | Sequence) -> Tensor:
        """``x`` as a float tensor [N, *input_shape] on the network's device (flat rows are reshaped)."""
        t = torch.as_tensor(np.asarray(x) if not isinstance(x, Tensor) else x)
        shape = tuple(self.stream.input_shape)
        per = math.prod(shape)
        if tuple(t.shape[1:]) != shape:
            if t.dim() >= 1 and t.numel() % per == 0 and (t.dim() == 1 or math.prod(t.shape[1:]) == per):
                t = t.reshape(-1, *shape)
            else:
                raise ValueError(f"inputs: shape {tuple(t.shape)} does not fit the run's inputs; allowed: "
                                 f"[N, {', '.join(map(str, shape))}] or [N, {per}]")
        if t.shape[0] == 0:  # e.g. run.stream.tasks[i].x_test of a run loaded without its data: empty tensors
            hint = ("; the run was loaded without its data, so run.stream.tasks hold no examples: pass "
                    "load_run(..., data=True)") if self.stream.meta.get("skeleton") else ""
            raise ValueError(f"inputs: no examples (shape {tuple(t.shape)}){hint}")
        ref = next(self.model.parameters())
        return t.to(device=ref.device, dtype=ref.dtype)

    def at_boundary(self, task: int) -> "LoadedRun":
        """:func:`load_boundary` of this run (what :mod:`continual_blr.inspect.forgetting` scores each task with)."""
        return load_boundary(self, task)

    def _head(self, head: int | None) -> int:
        n = int(self.stream.n_heads)
        if head is None:
            if n > 1:
                raise ValueError(f"head: the network has {n} heads (one per task); pass head=0..{n - 1}")
            return 0
        if not 0 <= int(head) < n:
            raise ValueError(f"head: allowed 0..{n - 1}, got {head}")
        return int(head)

    @torch.no_grad()
    def predict_proba(self, x: Tensor | np.ndarray, head: int | None = None) -> Tensor:
        """Class probabilities [N, K] of the method's predictive on head ``head``.

        Args:
            x: inputs [N, *input_shape] (or flattened [N, prod(input_shape)]); a tensor or an array.
            head: the output head (the task's index in a task-incremental run; may be left out when the
                network has one head).

        Raises:
            ValueError: a regression run, inputs of the wrong shape, or a head out of range.
        """
        if self.stream.likelihood != "classification":
            raise ValueError("predict_proba: the run is a regression; use predict (the predictive mean)")
        self.model.eval()
        return self.method.predict_proba(self.model, self._inputs(x), self._head(head))

    @torch.no_grad()
    def predict(self, x: Tensor | np.ndarray, head: int | None = None) -> Tensor:
        """Predicted output indices [N] on head ``head`` (argmax of :meth:`predict_proba`); for a regression run
        the predictive mean [N, K]. Arguments as :meth:`predict_proba`.

        In a task-incremental run these are head-local (split digits' task 1 gives 0 / 1 for digits 2 / 3), as the
        stream's ``y_test`` are; :meth:`predict_label` gives the global class labels. In class- and domain-incremental
        runs the two are the same."""
        if self.stream.likelihood != "classification":
            self.model.eval()
            return self.method.predict_mean(self.model, self._inputs(x), self._head(head))
        return self.predict_proba(x, head).argmax(dim=-1)

    def head_classes(self, head: int | None = None) -> list[int]:
        """The global class label of each output of head ``head`` ([n_outputs]; -1 for an output no class uses).

        Task-incremental: output ``j`` of head ``h`` is ``classes[j]`` of the task on that head (split digits' head 1:
        ``[2, 3]``). Class- and domain-incremental runs have one head whose output ``j`` is label ``j``.
        """
        h = self._head(head)
        n = int(self.stream.n_outputs)
        if self.stream.scenario != "task":
            return list(range(n))
        task = next((t for t in self.stream.tasks if int(t.head) == h), None)
        classes = [int(c) for c in task.classes] if task is not None else []
        return [classes[j] if j < len(classes) else -1 for j in range(n)]

    @torch.no_grad()
    def predict_label(self, x: Tensor | np.ndarray, head: int | None = None) -> Tensor:
        """Predicted global class labels [N]: :meth:`predict`'s output indices mapped through
        :meth:`head_classes` (the same as :meth:`predict` outside the task-incremental scenario).

        Raises:
            ValueError: a regression run (no labels), or as :meth:`predict_proba`.
        """
        if self.stream.likelihood != "classification":
            raise ValueError("predict_label: the run is a regression; use predict (the predictive mean)")
        out = self.predict(x, head)
        return torch.tensor(self.head_classes(head), dtype=torch.int64, device=out.device)[out]


def _run_folder(path: str | Path) -> tuple[Path, str | None]:
    """``(run folder, method named by a <method>/ subfolder or None)``; follows a ``latest`` pointer file."""
    p = Path(path)
    if p.is_file() and p.name != RESULTS and p.stat().st_size < 4096:  # runs/latest as a text file
        target = p.parent / p.read_text().strip()
        if target.is_dir():
            p = target
    if p.is_file() and p.name == RESULTS:
        p = p.parent
    if p.is_dir() and not (p / RESULTS).is_file() and (p / "model.pt").is_file() and (p.parent / RESULTS).is_file():
        return p.parent, p.name
    if not (p / RESULTS).is_file():
        raise RunNotFoundError(f"run: not a run folder (no {RESULTS}): {path}; expected a folder written by "
                               "`continual-blr run`, one of its <method>/ subfolders, or the YAML config that wrote it")
    return p, None


def _read_payload(folder: Path) -> tuple[dict[str, Any], RunConfig]:
    """``results.json`` and its config, the config's ``imports`` recorded but not imported (:func:`load_run`
    imports them; a built-in method does not need them)."""
    payload = read_json(folder / RESULTS)
    if not isinstance(payload, dict) or "config" not in payload:
        raise RunFileError(f"{folder / RESULTS}: holds no run config; expected the results.json continual-blr writes")
    raw = dict(payload["config"]) if isinstance(payload["config"], dict) else payload["config"]
    imports = raw.pop("imports", None) if isinstance(raw, dict) else None
    config = from_dict(RunConfig, raw)
    config.imports = list(imports) if isinstance(imports, list) else []
    return payload, config


def _import_modules(config: RunConfig, imports: Sequence[str] | None) -> str | None:
    """Import the modules that register the run's own methods: ``imports`` when given (they replace the run's;
    relative paths and module names against the working directory), else the run's recorded ``imports``.

    Returns:
        None, or the one-line reason a *recorded* module did not import (the run or the module moved): only a
        method that is not registered without it needs it (:func:`_check_imported`).

    Raises:
        ValueError: a module of ``imports`` does not import (one line naming it).
    """
    from .methods.plugins import import_modules

    if imports is not None:
        import_modules([str(m) for m in imports], base=Path.cwd())
        config.imports = [str(m) for m in imports]
        return None
    try:
        import_modules(config.imports)
    except ValueError as err:
        return str(err).splitlines()[0]
    return None


def _check_imported(name: str, failure: str | None) -> None:
    """Raise when method ``name`` is not registered and a recorded module failed to import (``failure``)."""
    from .methods import available_methods

    if failure is not None and registry_name(name) not in available_methods():
        raise ValueError(f"{failure}; the run's method {name!r} is registered there: pass the module's current "
                         "place with --import PATH (load_run(..., imports=[PATH]))")


def saved_methods(path: str | Path) -> list[str]:
    """The methods of a run folder whose trained state is saved (``model.pt`` and ``method.pt``), in the
    config's order: the ones :func:`load_run` can load."""
    folder, _ = _run_folder(path)
    _, config = _read_payload(folder)
    return [m.name for m in config.methods if (folder / m.name / "model.pt").is_file()
            and (folder / m.name / "method.pt").is_file()]


def _default_method(folder: Path, config: RunConfig, prefer_memory: bool) -> str:
    saved = [m for m in config.methods if (folder / m.name / "model.pt").is_file()
             and (folder / m.name / "method.pt").is_file()]
    if not saved:
        raise RunNotFoundError(f"run: no method of {folder} has finished yet (no <method>/model.pt); "
                               f"the run holds {', '.join(m.name for m in config.methods)}")
    if prefer_memory:
        for mc in saved:
            if registry_name(mc.name) in METHODS and has_memory_store(
                    build_method(mc.name, mc.params, seed=config.seed)):
                return mc.name
    return saved[0].name


def load_run(path: str | Path, method: str | None = None, *, device: str = "cpu",
             prefer_memory: bool = False, data: bool = False, imports: Sequence[str] | None = None) -> LoadedRun:
    """Reload a run folder (or one of its ``<method>/`` subfolders) without retraining.

    Args:
        path: the folder holding ``results.json`` (``runs/latest`` works), or its ``<method>`` subfolder.
        method: which method to load (default: the subfolder's; else, with ``prefer_memory``, the first
            method that keeps memorable points; else the first method with saved state).
        device: where to put the network and the method's state (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        prefer_memory: the default method is the first one with a memory store (the FROMP family), as
            inspection wants.
        data: also load the stream's datasets (they must be on disk), so that ``run.stream.tasks`` hold the
            training and test examples. False (the default): ``run.stream`` is the description the run
            stored in ``results.json`` — shapes, heads, classes, no examples (``meta["skeleton"]``) — which is
            all prediction needs, on a machine without the dataset. A run written before descriptions were
            stored loads its datasets either way.
        imports: modules (names or ``.py`` paths) that register the run's own methods, replacing the ones the
            run recorded (which name the module where it was when the run started). None: the recorded ones; a
            recorded module that no longer imports is needed only when the method to load is not built in.

    Returns:
        A :class:`LoadedRun`: ``model``, ``method``, ``config``, ``result`` (this method's results),
        ``payload`` (all of ``results.json``), ``stream``; ``predict`` / ``predict_proba`` on new inputs.

    Raises:
        RunNotFoundError: no ``results.json``, or no ``model.pt`` / ``method.pt`` for the method.
        ValueError: the method is not in the run, or the device is not available.
    """
    folder, sub = _run_folder(path)
    payload, config = _read_payload(folder)
    failure = _import_modules(config, imports)
    names = [m.name for m in config.methods]
    name = method or sub or _default_method(folder, config, prefer_memory)
    if name not in names:
        raise ValueError(f"method: the run holds {', '.join(names)}; got {name!r}")
    _check_imported(name, failure)
    if registry_name(name) not in METHODS:  # a labelled entry (fromp#2) is its method's
        raise ValueError(f"method: {name!r} is not registered; allowed: {', '.join(sorted(METHODS))}")
    mdir = folder / name
    if not (mdir / "model.pt").is_file() or not (mdir / "method.pt").is_file():
        done = saved_methods(folder)
        raise RunNotFoundError(f"run: {name!r} has not finished in {folder} (no {name}/model.pt); finished: "
                               f"{', '.join(done) if done else 'none yet'}")
    dev = _check_device(device)
    results = {r["method"]: r for r in payload.get("results", []) if isinstance(r, dict) and "method" in r}
    mc = next(m for m in config.methods if m.name == name)
    stream = build_stream(config) if data or "stream" not in payload else TaskStream.skeleton(payload["stream"])
    model = build_model(config.model.arch, stream.input_shape, stream.n_outputs, stream.n_heads,
                        hidden=tuple(config.model.hidden)).to(dev)
    load_weights(model, load_torch(mdir / "model.pt", map_location=dev), str(mdir / "model.pt"))
    model.eval()
    result = results.get(name, {})
    train_dict = (result.get("config") or {}).get("train_used") or (dataclasses.asdict(config.train) | dict(mc.train))
    train = from_dict(TrainConfig, train_dict, path="train")
    meth = build_method(name, mc.params, seed=config.seed)
    meth.setup(model, stream, train)
    meth.load_state_dict(load_torch(mdir / "method.pt", map_location=dev))
    return LoadedRun(path=folder, method_name=name, stream=stream, model=model, method=meth, result=result,
                     methods=names, seed=config.seed, config=config, payload=payload, device=dev, train=train)


def load_boundary(run: LoadedRun, task: int) -> LoadedRun:
    """The run as it stood at a task boundary: the network when ``task`` (0-based) ended and the method as the
    next task started with it (its memory, prior, optimiser state and generators), read from
    ``<method>/tasks/after_task<task>.pt`` (:func:`continual_blr.runner.boundary_checkpoint`). ``task = -1``: the
    start of the stream, rebuilt as the runner builds it (the initial weights of the run's seed, a new method).

    The stream (and its data) is ``run``'s, shared, not copied; the network and method are new objects.

    Raises:
        RunNotFoundError: the run kept no checkpoint of that boundary (written before boundaries were kept).
        ValueError: ``task`` is outside ``-1 .. n_tasks - 1``.
        UnsavedStateError: the method's checkpoint left trained state out (a method of one's own without
            ``state_dict``: rebuilding it would silently use untrained state).
    """
    from .runner import boundary_checkpoint, restore_checkpoint

    assert run.config is not None and run.train is not None
    n = len(run.stream.tasks)
    if isinstance(task, bool) or not isinstance(task, int) or not -1 <= task < n:
        raise ValueError(f"task: the boundary after a task 0..{n - 1}, or -1 for the stream's start; got {task!r}")
    config, stream = run.config, run.stream
    mc = next(m for m in config.methods if m.name == run.method_name)
    model = build_model(config.model.arch, stream.input_shape, stream.n_outputs, stream.n_heads,
                        hidden=tuple(config.model.hidden), generator=torch.Generator().manual_seed(config.seed))
    model = model.to(run.device)
    meth = build_method(run.method_name, mc.params, seed=config.seed)
    meth.use_likelihood(stream.likelihood, stream.sigma)
    meth.setup(model, stream, run.train)
    if task >= 0:
        path = Path(run.path) / boundary_checkpoint(run.method_name, task)
        if not path.is_file():
            raise RunNotFoundError(f"run: {run.path} kept no checkpoint of the boundary after task {task} ({path.name} "
                                   "missing; runs written before boundaries were kept have none): run it again")
        state = load_torch(path, map_location=run.device)
        if state.get("unsaved"):  # a method of one's own whose state_dict leaves trained state out: not the run's
            raise UnsavedStateError(f"run: method {run.method_name!r} carries state its state_dict does not save "
                             f"({', '.join(state['unsaved'])}); its task boundaries cannot be rebuilt "
                             "(define state_dict / load_state_dict, docs/own_method.md)")
        restore_checkpoint(state, model, meth)
    model.eval()
    return dataclasses.replace(run, model=model, method=meth, boundary=task)


def _check_device(device: str) -> str:
    dev = str(device)
    if dev == "cpu":
        return dev
    if dev.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device: {dev!r} requested but CUDA is not available; allowed here: 'cpu'")
        return dev
    raise ValueError(f"device: got {dev!r}; allowed: 'cpu', 'cuda', 'cuda:N'")


def check_config_matches(config: RunConfig, path: str | Path, config_name: str = "the config") -> None:
    """Check that the run in ``path`` was written by ``config`` (stream, scenario, options, validation,
    methods and seed).

    Raises:
        ValueError: one line naming the first field that differs and both values.
    """
    folder, _ = _run_folder(path)
    _, saved = _read_payload(folder)
    def scenario(c: RunConfig) -> str | None:  # None is the stream's default scenario: compare what ran
        return c.stream.scenario or DEFAULT_SCENARIOS.get(c.stream.name)

    pairs = [
        ("stream", config.stream.name, saved.stream.name),
        ("stream.scenario", scenario(config), scenario(saved)),
        ("stream.options", config.stream.options, saved.stream.options),
        ("stream.validation", config.stream.validation, saved.stream.validation),
        ("methods", [m.name for m in config.methods], [m.name for m in saved.methods]),
        ("seed", config.seed, saved.seed),
    ]
    for field_name, want, got in pairs:
        if want != got:
            raise ValueError(f"inspect: {folder} was not written by {config_name}: {field_name} is {got!r} in the "
                             f"run, {want!r} in the config; run the config first or pass the run folder")


def inspect_path(path: str | Path, *, out: str | Path | None = None, method: str | None = None,
                 tasks: Sequence[int] | None = None, top: int | None = None,
                 prior_precision: float | None = None, device: str = "cpu",
                 progress: bool = False, imports: Sequence[str] | None = None, validate: int | None = None,
                 validate_epochs: int | None = None) -> tuple[Path, Any]:
    """Load a run folder, inspect it and write the report (default folder: ``<run>/inspect``).

    The default method is the first one that keeps memorable points (:func:`load_run` with
    ``prefer_memory``; ``imports`` as there). See :func:`continual_blr.inspect.inspect_run` for the other arguments.
    ``validate = N``: also check the sensitivities against N retrainings (:func:`validate_run`) on the one task of
    ``tasks`` (default: the last task), with ``validate_epochs`` epochs each; the result is ``insp.validation``
    and the report gets ``validation.json``, ``validation.png`` and its section.

    Returns:
        ``(index.html path, the Inspection)``.
    """
    import time

    from .inspect import inspect_run, write_report

    t0 = time.perf_counter()
    run = load_run(path, method, device=device, prefer_memory=True, data=True, imports=imports)
    t_load = time.perf_counter() - t0
    if validate is not None and tasks is not None and len(tasks) != 1:
        raise ValueError("validate: retrains on one task; give one task (--task) or none (the last task)")
    insp = inspect_run(run, tasks=tasks, top=top, prior_precision=prior_precision, progress=progress)
    insp.timings = {"load": t_load, **insp.timings}
    if validate is not None:  # before the report: its first screen cites the check
        insp.validation = validate_run(run, validate, task=tasks[0] if tasks else None, epochs=validate_epochs,
                                       prior_precision=prior_precision, progress=progress)
        insp.timings["validate"] = insp.validation.seconds
    target = Path(out) if out is not None else run.path / "inspect"
    index = write_report(insp, target, progress=progress)
    return index, insp


def validate_run(run: LoadedRun, n: int, *, task: int | None = None, epochs: int | None = None, seed: int = 0,
                 prior_precision: float | None = None, progress: bool = False):
    """Check the run's leave-one-out sensitivities against retraining on ``n`` examples of one task
    (:func:`continual_blr.inspect.validate.validate_sensitivity`; ``docs/inspect.md``).

    The retrainings start from the network kept when ``task`` ended and the method kept when the task before it
    ended (``tasks/after_task<t>.pt``, :func:`load_boundary`; the stream's start for the first task). ``run`` must
    hold its data (``load_run(..., data=True)``).

    Args:
        n: examples to leave out, one at a time. task: 0-based (default: the last task). epochs: of each retraining
            (default :data:`~continual_blr.inspect.validate.DEFAULT_VALIDATE_EPOCHS`). seed: the retrainings'.
        prior_precision: δ of a fallback diagonal Laplace Σ (methods without a Σ of their own).

    Returns:
        A :class:`~continual_blr.inspect.validate.Validation`.

    Raises:
        ValueError: a bad ``task``, ``n`` or ``epochs`` (one line naming it).
        RunNotFoundError: the run kept no boundary checkpoints.
    """
    import copy

    from .inspect.validate import DEFAULT_VALIDATE_EPOCHS, validate_sensitivity, validation_covariance

    tasks = [task_.to(run.device) for task_ in run.stream.tasks]  # a GPU run retrains on the GPU
    t = len(tasks) - 1 if task is None else task
    if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < len(tasks):
        raise ValueError(f"task: the stream has {len(tasks)} tasks, allowed indices 0..{len(tasks) - 1}; got {task!r}")
    end, begin = load_boundary(run, t), load_boundary(run, t - 1)
    weights = {k: v.clone() for k, v in end.model.state_dict().items()}
    sigma, source = validation_covariance(end, tasks[t], tasks[:t], prior_precision)

    def start():
        model, method = copy.deepcopy((begin.model, begin.method))  # one copy: the method's references stay its model's
        load_weights(model, weights, "the task's end")
        return model, method

    assert run.train is not None
    return validate_sensitivity(start, tasks[t], sigma, run.train, n, previous=tasks[:t],
                                epochs=DEFAULT_VALIDATE_EPOCHS if epochs is None else epochs, seed=seed,
                                sigma_source=source, progress=progress)
