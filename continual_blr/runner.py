"""From a :class:`~continual_blr.config.RunConfig` to saved results: build stream, model and methods,
run the one loop for each method, and write ``results.json``, the heatmap and per-method state.

Output folder layout::

    <out>/results.json             every method's StreamResult + the config
    <out>/accuracy_matrix.png      heatmaps of R[i, j]
    <out>/<method>/model.pt        the trained network's state_dict (for ``continual-blr inspect``)
    <out>/<method>/method.pt       the method's state (posterior, memory, ...)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from .config import RunConfig
from .data import make_stream
from .data.stream import TaskStream
from .loop import StreamResult, run_stream
from .methods import build_method
from .methods.base import TrainConfig
from .models import build_model

__all__ = ["run_config", "load_results", "QUICK_EPOCH_DIVISOR"]

QUICK_EPOCH_DIVISOR = 5


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


def run_config(cfg: RunConfig, save: bool = True) -> list[StreamResult]:
    """Run every method of ``cfg`` on its stream; optionally write the output folder."""
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device: {cfg.device!r} requested but CUDA is not available; use 'cpu'")
    stream = build_stream(cfg)
    results = []
    out = Path(cfg.out)
    for mc in cfg.methods:
        method = build_method(mc.name, mc.params, seed=cfg.seed)
        train = _train_for(cfg, mc.train)
        model = build_model(cfg.model.arch, stream.input_shape, stream.n_outputs, stream.n_heads,
                            hidden=tuple(cfg.model.hidden), generator=torch.Generator().manual_seed(cfg.seed))
        record = cfg.to_dict() | {"method": dataclasses.asdict(mc), "train_used": dataclasses.asdict(train)}
        result = run_stream(model, stream, method, train, seed=cfg.seed, device=cfg.device,
                            progress=cfg.progress, config=record)
        results.append(result)
        if save:
            mdir = out / mc.name
            mdir.mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), mdir / "model.pt")
            torch.save(method.state_dict(), mdir / "method.pt")
    if save:
        out.mkdir(parents=True, exist_ok=True)
        payload = {"config": cfg.to_dict(), "quick": cfg.quick, "results": [r.to_dict() for r in results]}
        (out / "results.json").write_text(json.dumps(payload, indent=2))
        from .plots import plot_accuracy_matrices

        plot_accuracy_matrices(results, out / "accuracy_matrix.png")
    return results


def load_results(path: str | Path) -> list[StreamResult]:
    """Reload the StreamResults of a ``results.json`` (or of the folder holding it)."""
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    payload = json.loads(p.read_text())
    return [StreamResult.from_dict(d) for d in payload["results"]]
