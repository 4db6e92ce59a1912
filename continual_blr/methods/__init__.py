"""Named methods: the registry the CLI, configs and benchmarks build methods from.

Each entry maps a name to ``(method class, params dataclass or None)``. ``build_method`` takes the
params as an instance of that dataclass or as a plain mapping (parsed YAML), which :func:`parse_params`
checks against the dataclass: unknown keys and wrong types are one-line errors naming the method and the
field. The check lives here, in the methods layer, so that the registry does not import the run
configuration (``continual_blr.config`` sits above the methods and imports them, never the reverse).
To add a method inside the package: write ``methods/<name>.py`` with a ``Method`` subclass and its params
dataclass, and add one line to ``METHODS``. Outside it: call :func:`register` in a module of your own and
name the module in a config's ``imports:`` (or ``--import``), or declare it as an entry point of the group
``continual_blr.methods`` (:mod:`continual_blr.methods.plugins`, ``docs/own_method.md``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from ..types import ConfigError
from .base import Method, TrainConfig, make_torch_optimizer
from .blr import BLRMethod, BLRParams
from .ewc import EWCMethod, EWCParams
from .fromp import FROMPFullParams, FROMPKronParams, FROMPL2Params, FROMPMethod, FROMPParams, FRORPParams
from .fromp_replay import FROMPReplayMethod, FROMPReplayParams
from .ivon import IVONMethod, IVONParams
from .joint import JointMethod
from .l2 import L2Method, L2Params
from .laplace import LaplaceMethod, LaplaceParams
from .replay import DERPPMethod, DERPPParams, ERMethod, ERParams
from .vcl import VCLMethod, VCLParams

__all__ = ["Method", "TrainConfig", "METHODS", "MethodParamsError", "build_method", "make_torch_optimizer",
           "parse_params", "register", "available_methods", "registry_name"]


def registry_name(name: str) -> str:
    """The registry key of a run's method name: ``"fromp#2"`` or ``"fromp#tau100"`` → ``"fromp"``.

    A run may list one method several times with different parameters; each entry then has its own name
    ``<method>#<label>`` (:func:`continual_blr.config.label_methods`), which names its results and its folder."""
    return name.split("#", 1)[0]

METHODS: dict[str, tuple[type[Method], type | None]] = {
    "none": (Method, None),
    "joint": (JointMethod, None),
    "blr": (BLRMethod, BLRParams),
    "ewc": (EWCMethod, EWCParams),
    "laplace": (LaplaceMethod, LaplaceParams),
    "l2": (L2Method, L2Params),
    "vcl": (VCLMethod, VCLParams),
    "ivon": (IVONMethod, IVONParams),
    "fromp": (FROMPMethod, FROMPParams),
    "frorp": (FROMPMethod, FRORPParams),
    "fromp-l2": (FROMPMethod, FROMPL2Params),
    "fromp-full": (FROMPMethod, FROMPFullParams),
    "fromp-kron": (FROMPMethod, FROMPKronParams),
    "fromp-replay": (FROMPReplayMethod, FROMPReplayParams),
    "er": (ERMethod, ERParams),
    "derpp": (DERPPMethod, DERPPParams),
}

DESCRIPTIONS: dict[str, str] = {
    "fromp": "FROMP: functional regularisation of memorable points (top tr Λ per class), one kernel per class",
    "frorp": "FROMP with memorable points drawn at random per class instead of by tr Λ (selection: random)",
    "fromp-l2": "FROMP without the kernel: (τ/2) Σ ‖Δp‖² at the memorable points (kernel: identity)",
    "fromp-full": "FROMP with the full multi-output kernel, cross-class terms kept (kernel: full)",
    "fromp-kron": "FROMP with a Kronecker-factored (K-FAC) weight covariance Σ in its kernels (kernel: kron)",
}
"""One-line descriptions for ``continual-blr methods`` where one class serves several names (the FROMP
variants differ only in their parameters' defaults); every other method is described by its class docstring."""


def register(name: str, method_cls: type[Method], params_cls: type | None) -> None:
    """Add a method to the registry (used by the method modules and by users' own methods).

    Raises:
        ValueError: ``name`` is not a non-empty string, ``method_cls`` is not a ``Method`` subclass, or
            ``params_cls`` is neither None nor a dataclass.
    """
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise ValueError(f"register: name must be a non-empty string without spaces, got {name!r}")
    if not (isinstance(method_cls, type) and issubclass(method_cls, Method)):
        raise ValueError(f"register: {name!r}: method_cls must be a subclass of continual_blr.methods.Method")
    if params_cls is not None and not dataclasses.is_dataclass(params_cls):
        raise ValueError(f"register: {name!r}: params_cls must be a dataclass or None")
    METHODS[name] = (method_cls, params_cls)


def available_methods() -> dict[str, tuple[type[Method], type | None]]:
    """The registry, with the methods of installed packages' ``continual_blr.methods`` entry points loaded."""
    from .plugins import load_entry_points

    load_entry_points()
    return METHODS


class MethodParamsError(ConfigError):
    """A method's parameters are unknown, of the wrong type or out of range (one line naming the field).

    A :class:`~continual_blr.types.ConfigError`, so one ``except ConfigError`` at the CLI catches it with
    the run config's errors."""


def _type_ok(value: Any, annotation: Any) -> bool:
    """Whether ``value`` (from parsed YAML) fits the field annotation ``annotation``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is Any:
        return True
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if origin is not None:
        return isinstance(value, origin)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True


def parse_params(params_cls: type, data: Any, path: str = "params") -> Any:
    """Build the params dataclass ``params_cls`` from a mapping, checking keys and types.

    Ints are accepted for float fields (and converted); the dataclass's own ``__post_init__`` checks
    ranges. An instance of ``params_cls`` is returned as it is.

    Args:
        params_cls: a method's params dataclass (the second entry of its ``METHODS`` row).
        data: a mapping of field names to values (e.g. a YAML ``params:`` block), or a ``params_cls``.
        path: the dotted name of ``data`` in error messages.

    Returns:
        An instance of ``params_cls``.

    Raises:
        MethodParamsError: ``data`` is not a mapping, names an unknown field, holds a value of the wrong
            type, or the dataclass rejects a value (one line naming the field and what is allowed).
    """
    if isinstance(data, params_cls):
        return data
    if not isinstance(data, dict):
        raise MethodParamsError(f"{path} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(params_cls)
    fields = {f.name for f in dataclasses.fields(params_cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise MethodParamsError(f"{path}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(fields))})")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        ann = hints[key]
        if not _type_ok(value, ann):
            want = getattr(ann, "__name__", str(ann)).replace("typing.", "")
            raise MethodParamsError(f"{path}.{key} must be {want}, got {value!r}")
        kwargs[key] = float(value) if ann is float and isinstance(value, int) else value
    try:
        return params_cls(**kwargs)
    except MethodParamsError:
        raise
    except (ValueError, TypeError) as err:
        raise MethodParamsError(str(err).splitlines()[0] if str(err) else type(err).__name__) from None


def build_method(name: str, params: Any = None, seed: int = 0) -> Method:
    """Instantiate a registered method.

    Args:
        name: a key of :data:`METHODS`, optionally with a ``#<label>`` suffix (``"fromp#2"``): the method is
            the key's, and the instance's ``name`` (its results' name) is the whole string.
        params: the method's params dataclass, or a mapping checked by :func:`parse_params`
            (``None`` / empty: the defaults).
        seed: the method's random stream.

    Raises:
        ValueError: unknown method name (the message lists the allowed names).
        MethodParamsError: bad params; the message starts with ``method '<name>':``.
    """
    key = registry_name(name)
    if key not in METHODS and key not in available_methods():
        raise ValueError(f"method: unknown method {key!r}; allowed: {', '.join(sorted(METHODS))}")
    method_cls, params_cls = METHODS[key]
    if params_cls is None:
        if params:
            keys = sorted(params) if isinstance(params, dict) else type(params).__name__
            raise MethodParamsError(f"method {name!r} takes no params, got {keys}")
        method = method_cls(seed=seed)
    else:
        try:
            parsed = parse_params(params_cls, params if params is not None else {}, path="params")
        except MethodParamsError as err:
            raise MethodParamsError(f"method {name!r}: {err}") from None
        method = method_cls(parsed, seed=seed)  # type: ignore[call-arg]
    method.name = name
    return method
