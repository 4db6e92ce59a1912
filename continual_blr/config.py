"""Typed run configuration and its validation from plain dictionaries (parsed YAML).

Every error names the offending field by its dotted path and what is allowed, in one line, e.g.
``config: unknown key 'train.epoch' (allowed: epochs, batch_size, ...)`` or
``config: train.epochs must be int, got 'ten'``. Reading files is the CLI's job; this module only
turns dictionaries into dataclasses.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .methods import _type_ok
from .methods.base import TrainConfig
from .types import ConfigError

__all__ = ["check_device", "check_seed", "label_methods", "ConfigError", "StreamConfig", "ModelConfig", "MethodConfig", "RunConfig", "from_dict", "DEFAULT_CONFIG"]


SPLIT_DIGITS_BLR: dict[str, Any] = {}
"""BLR parameters of the embedded split-digits run (configs/split_digits/blr.yaml): the library defaults of
``BLRParams`` (GGN ĥ, debiased precision rate, α 0.03, step clip 0.3, ess 20, δ 100, T 0.01), chosen on a
validation split of the training data (benchmarks/results/search/search_blr.md)."""
SPLIT_DIGITS_FROMP: dict[str, Any] = {"tau": 10.0, "n_points": 40, "prior_precision": 1e-3, "jitter": 1e-6,
                                      "classes": "task"}
"""FROMP parameters of the embedded run: the reference code's split-MNIST values (not tuned)."""


@dataclass
class StreamConfig:
    """Which task stream: ``name`` from ``continual_blr.data.STREAMS`` plus its options.

    ``validation`` in [0, 1): 0 evaluates on the test set; otherwise that fraction of every task's
    training data is held out (seeded by the run's seed) and evaluated on instead, the test set is
    not used (``make_stream(..., validation=...)``). Hyper-parameters are chosen with it > 0.
    """

    name: str = "split_digits"
    scenario: str | None = None
    data_dir: str | None = None
    options: dict = field(default_factory=dict)
    validation: float = 0.0

    def __post_init__(self) -> None:
        from .data.builders import check_validation
        from .data.registry import STREAMS, stream_options

        try:
            self.validation = check_validation(self.validation)
        except ValueError as err:
            raise ValueError(f"stream.{err}") from None
        if self.name in STREAMS and isinstance(self.options, dict):
            allowed = stream_options(self.name)
            for key in self.options:
                if key not in allowed:
                    raise ValueError(f"stream.options: unknown option {key!r} for {self.name} "
                                     f"(allowed: {', '.join(allowed)})")


@dataclass
class ModelConfig:
    """The network: ``arch`` is ``"mlp"`` (with ``hidden`` widths) or ``"cifarnet"``."""

    arch: str = "mlp"
    hidden: list = field(default_factory=lambda: [100, 100])


@dataclass
class MethodConfig:
    """A method by registry name, its own parameters, and overrides of the train settings."""

    name: str = "none"
    params: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)


@dataclass
class RunConfig:
    """A whole run: one stream, one model architecture, one or more methods compared on it."""

    stream: StreamConfig = field(default_factory=StreamConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # The embedded default: the BLR with the split-digits parameters of configs/split_digits/blr.yaml
    # (chosen on tuning seeds 100-109, checked on 110-129), FROMP with the reference code's split-MNIST parameters
    # (configs/split_digits/fromp.yaml), and the no-prior baseline.
    methods: list = field(default_factory=lambda: [MethodConfig("blr", dict(SPLIT_DIGITS_BLR)),
                                                   MethodConfig("fromp", dict(SPLIT_DIGITS_FROMP)),
                                                   MethodConfig("none")])
    seed: int = 0
    device: str = "cpu"
    # None: a new folder runs/<stream>-<methods>-<YYYYmmdd-HHMMSS> per run (runner.resolve_out, docs/runs.md)
    out: str | None = None
    progress: bool = True
    quick: bool = False
    # modules that register methods of your own (names, or paths to .py files), imported before the methods
    # are looked up; stored with the run so that --resume, predict and inspect import them again
    imports: list = field(default_factory=list)

    def __post_init__(self) -> None:
        check_device(self.device)
        check_seed(self.seed)
        self.methods = label_methods(self.methods)
        if self.imports:
            from .methods.plugins import import_modules

            self.imports = [str(Path(m).resolve()) if isinstance(m, str) and m.endswith(".py") else m
                            for m in self.imports]
            import_modules(self.imports)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")


def check_device(device: str) -> str:
    """``device`` if it is ``cpu``, ``cuda`` or ``cuda:N``.

    Raises:
        ValueError: one line naming the field and what is allowed.
    """
    if not isinstance(device, str) or not DEVICE_PATTERN.fullmatch(device):
        raise ValueError(f"device: got {device!r}; allowed: cpu, cuda, cuda:N")
    return device


def check_seed(seed: int) -> int:
    """``seed`` if it is an integer in [0, 2**63).

    Raises:
        ValueError: one line naming the field and what is allowed.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed: got {seed!r}; allowed: an integer >= 0")
    return seed


_LABEL = re.compile(r"[A-Za-z0-9_.=+-]+")


def label_methods(methods: list[MethodConfig], path: str = "methods") -> list[MethodConfig]:
    """One distinct name per entry of a run's ``methods`` (a name is a result's row and its folder).

    A method listed again with other ``params`` or ``train`` is a run of its own: the second is renamed
    ``<name>#2``, the third ``<name>#3`` (a name may also be given as ``<method>#<label>``, e.g. ``fromp#tau100``:
    the method is the part before ``#``). An entry equal to an earlier one in name, params and train would repeat
    its result, so it is refused.

    Raises:
        ValueError: one line naming the repeated entry (``methods[2] repeats methods[0] ...``) or a bad label.
    """
    out: list[MethodConfig] = []
    for i, mc in enumerate(methods):
        if not isinstance(mc, MethodConfig):
            out.append(mc)
            continue
        base, sep, label = mc.name.partition("#")
        if sep and not _LABEL.fullmatch(label):
            raise ValueError(f"{path}[{i}].name: got {mc.name!r}; a label after '#' is letters, digits, "
                             "'_', '.', '=', '+' or '-'")
        for j, prev in enumerate(methods[:i]):
            if (prev.name, prev.params, prev.train) == (mc.name, mc.params, mc.train):
                raise ValueError(f"{path}[{i}] repeats {path}[{j}] ({mc.name!r} with the same params and train); "
                                 "remove it or give it other params")
        name, k = mc.name, 1
        while name in {m.name for m in out}:
            k += 1
            name = f"{base}#{k}"
        out.append(mc if name == mc.name else dataclasses.replace(mc, name=name))
    return out


def from_dict(cls: type, data: Any, path: str = "config") -> Any:
    """Build dataclass ``cls`` from ``data``, checking keys and types recursively.

    Raises:
        ConfigError: with the dotted path of the bad field and what is allowed.
    """
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r} (allowed: {', '.join(fields)})")
    kwargs = {}
    for key, value in data.items():
        ann = hints[key]
        sub = f"{path}.{key}" if path != "config" else key
        if dataclasses.is_dataclass(ann):
            kwargs[key] = from_dict(ann, value, sub)
        elif key == "methods" and cls is RunConfig:
            kwargs[key] = _methods(value, sub)
        else:
            if not _type_ok(value, ann):
                want = getattr(ann, "__name__", str(ann)).replace("typing.", "")
                raise ConfigError(f"config: {sub} must be {want}, got {value!r}")
            if ann is float and isinstance(value, int):
                value = float(value)
            kwargs[key] = value
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        raise ConfigError(f"config: {err}") from None


_FLOAT_YAML_1_2 = re.compile(r"""^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?$
    |^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$""", re.X)


def yaml_load(text: str) -> Any:
    """``yaml.safe_load`` that reads YAML 1.2 floats: ``1e-3`` is the number 0.001, not the string PyYAML's
    YAML 1.1 rules make of it (they want a dot, ``1.0e-3``). Integers stay integers."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    resolvers = {k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:float"]
                 for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.yaml_implicit_resolvers = resolvers
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_YAML_1_2, list("-+0123456789."))
    return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass


def _methods(value: Any, path: str) -> list[MethodConfig]:
    """``methods`` may be a name, a list of names, or a list of mappings."""
    items = [value] if isinstance(value, (str, dict)) else value
    if not isinstance(items, list) or not items:
        raise ConfigError(f"config: {path} must be a method name or a non-empty list of methods")
    out = []
    for i, item in enumerate(items):
        out.append(MethodConfig(item) if isinstance(item, str) else from_dict(MethodConfig, item, f"{path}[{i}]"))
    return out


DEFAULT_CONFIG = RunConfig()
