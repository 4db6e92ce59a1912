"""The run a config file describes, built piece by piece for the diagnosis scripts of this folder.

:func:`first_method_run` gives the stream (its first ``tasks`` tasks, on the validation split of each task's training
data: the diagnoses never read the test set), the training config, the method and the freshly initialised model of
the config's first method (and its params as written), exactly as ``runner.run_config`` would build them for one seed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch


def first_method_run(config: str | Path, data_dir: str, *, seed: int, validation: float, tasks: int | None = None,
                     precision: str | None = None, epochs: int | None = None
                     ) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
    """(stream, train config, method, model, the method's params as the config gives them) of ``config``'s first
    method; ``precision`` and ``epochs`` override the config's training settings when given."""
    from continual_blr.config import RunConfig, from_dict, yaml_load
    from continual_blr.methods import build_method
    from continual_blr.models import build_model
    from continual_blr.runner import _train_for, build_stream

    cfg = from_dict(RunConfig, yaml_load(Path(config).read_text()))
    cfg.stream.data_dir = data_dir
    cfg.stream.validation = validation
    cfg.seed = seed
    stream = build_stream(cfg)
    if tasks is not None:
        stream = dataclasses.replace(stream, tasks=list(stream.tasks)[:tasks])
    mc = cfg.methods[0]
    train = _train_for(cfg, mc.train)
    overrides = {k: v for k, v in {"precision": precision, "epochs": epochs}.items() if v is not None}
    train = dataclasses.replace(train, **overrides)
    method = build_method(mc.name, mc.params, seed=seed)
    model = build_model(cfg.model.arch, stream.input_shape, stream.n_outputs, stream.n_heads,
                        hidden=tuple(cfg.model.hidden), generator=torch.Generator().manual_seed(seed))
    return stream, train, method, model, dict(mc.params)
