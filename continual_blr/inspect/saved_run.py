"""A finished run, reloaded for inspection: stream, trained network, method state, Σ and memory.

A run folder written by :func:`continual_blr.runner.run_config` holds ``results.json`` (with the
config), and per method ``<method>/model.pt`` (the network's state_dict) and ``<method>/method.pt``
(``method.state_dict()``). Nothing is retrained: the stream is rebuilt from the config (streams are
deterministic in their seed), the network from the config's architecture and its saved weights, and
the method from the registry with its saved state.

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

Run folders are trusted input (they are read with ``torch.load``; ``weights_only=True`` first).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import MethodConfig, RunConfig, from_dict
from ..data.stream import TaskStream
from ..methods import METHODS, build_method
from ..methods.base import Method, TrainConfig
from ..models import build_model
from ..posteriors import GaussianPosterior
from ..runner import build_stream
from .scores import DEFAULT_PRIOR_PRECISION, Covariance, diag_laplace_posterior

__all__ = ["SavedRun", "RunNotFoundError", "load_run", "run_covariance", "stored_memory"]


class RunNotFoundError(FileNotFoundError):
    """The folder is not a finished run (no ``results.json``, or no saved state for the method)."""


@dataclass
class SavedRun:
    """A reloaded run: everything an inspection needs, on the CPU.

    Attributes:
        path: the run folder.
        config: the run's configuration.
        method_name: the inspected method.
        stream: the task stream, rebuilt from the config.
        model: the trained network (eval mode).
        method: the method rebuilt from the registry with its saved state loaded.
        result: the method's entry of ``results.json`` (accuracy matrix, times, ...).
        methods: every method name the run holds.
    """

    path: Path
    config: RunConfig
    method_name: str
    stream: TaskStream
    model: nn.Module
    method: Method
    result: dict[str, Any] = field(default_factory=dict)
    methods: list[str] = field(default_factory=list)


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - a state with non-tensor objects: the run folder is trusted input
        return torch.load(path, map_location="cpu", weights_only=False)


def load_run(path: str | Path, method: str | None = None) -> SavedRun:
    """Reload a finished run folder (or one of its ``<method>/`` subfolders) without retraining.

    Args:
        path: the folder holding ``results.json``, or its ``<method>`` subfolder.
        method: which method to inspect (default: the subfolder's, else the first in ``results.json``).

    Raises:
        RunNotFoundError: no ``results.json`` / no ``model.pt`` for the method.
        ValueError: the method is not in the run.
    """
    p = Path(path)
    if p.is_dir() and not (p / "results.json").is_file() and (p / "model.pt").is_file() \
            and (p.parent / "results.json").is_file():
        method = method or p.name
        p = p.parent
    if not (p / "results.json").is_file():
        raise RunNotFoundError(f"run: not a run folder (no results.json): {path}; expected a folder written by "
                               "`continual-blr run`, one of its <method>/ subfolders, or the YAML config that wrote it")
    payload = json.loads((p / "results.json").read_text())
    config = from_dict(RunConfig, payload["config"])
    results = {r["method"]: r for r in payload.get("results", [])}
    names = [m.name for m in config.methods]
    name = method or names[0]
    if name not in names:
        raise ValueError(f"--method: the run holds {', '.join(names)}; got {name!r}")
    mdir = p / name
    if not (mdir / "model.pt").is_file() or not (mdir / "method.pt").is_file():
        raise RunNotFoundError(f"run: no saved model/method state for {name!r} under {mdir}")
    if name not in METHODS:
        raise ValueError(f"method: {name!r} is not registered; allowed: {', '.join(sorted(METHODS))}")
    mc: MethodConfig = next(m for m in config.methods if m.name == name)
    stream = build_stream(config)
    model = build_model(config.model.arch, stream.input_shape, stream.n_outputs, stream.n_heads,
                        hidden=tuple(config.model.hidden))
    model.load_state_dict(_torch_load(mdir / "model.pt"))
    model.eval()
    result = results.get(name, {})
    train_dict = result.get("config", {}).get("train_used") or (dataclasses.asdict(config.train) | dict(mc.train))
    train = from_dict(TrainConfig, train_dict, path="train")
    meth = build_method(name, mc.params, seed=config.seed)
    meth.setup(model, stream, train)
    meth.load_state_dict(_torch_load(mdir / "method.pt"))
    return SavedRun(p, config, name, stream, model, meth, result, names)


def run_covariance(run: SavedRun, prior_precision: float | None = None) -> tuple[Covariance, str]:
    """The weight covariance Σ of a run and a one-line description of where it came from.

    See the module docstring for the order. ``prior_precision`` is δ of the fallback diagonal Laplace
    posterior (ignored when the method has its own Σ).
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
    data = [(t.x_train, t.head) for t in run.stream.tasks]
    post = diag_laplace_posterior(model, data, delta)
    return post, (f"diagonal Laplace–GGN posterior at the final weights (method {run.method_name!r} carries "
                  f"none): Σ = diag(1/(F + δ)), F over all tasks' training data, δ = {delta:g}")


def stored_memory(run: SavedRun) -> dict[int, dict[str, Any]]:
    """The memorable points the run's method stored, by task id: ``{"indices", "selection", "n"}``.

    Empty when the method keeps no memory (only the FROMP family does).
    """
    reg = getattr(run.method, "regularizer", None)
    mem = getattr(reg, "memory", None)
    out: dict[int, dict[str, Any]] = {}
    if mem is None:
        return out
    for e in mem:
        out[int(e.task_id)] = {"indices": e.indices.cpu().long(), "selection": e.selection, "n": len(e)}
    return out
