"""Named methods: the registry the CLI, configs and benchmarks build methods from.

Each entry maps a name to ``(method class, params dataclass or None)``. ``build_method`` validates the
params against the dataclass (unknown keys and wrong types are one-line errors naming the field).
To add a method: write ``methods/<name>.py`` with a ``Method`` subclass and its params dataclass, and
add one line to ``METHODS``.
"""

from __future__ import annotations

from typing import Any

from .base import Method, TrainConfig, make_torch_optimizer
from .blr import BLRMethod, BLRParams
from .ewc import EWCMethod, EWCParams
from .fromp import FROMPFullParams, FROMPKronParams, FROMPL2Params, FROMPMethod, FROMPParams, FRORPParams
from .ivon import IVONMethod, IVONParams
from .joint import JointMethod
from .l2 import L2Method, L2Params
from .laplace import LaplaceMethod, LaplaceParams
from .vcl import VCLMethod, VCLParams

__all__ = ["Method", "TrainConfig", "METHODS", "build_method", "make_torch_optimizer", "register"]

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
}


def register(name: str, method_cls: type[Method], params_cls: type | None) -> None:
    """Add a method to the registry (used by the method modules and by users' own methods)."""
    METHODS[name] = (method_cls, params_cls)


def build_method(name: str, params: dict[str, Any] | None = None, seed: int = 0) -> Method:
    """Instantiate a registered method with validated parameters.

    Raises:
        ValueError: unknown method name (the message lists the allowed names) or bad params.
    """
    if name not in METHODS:
        raise ValueError(f"method: unknown method {name!r}; allowed: {', '.join(sorted(METHODS))}")
    method_cls, params_cls = METHODS[name]
    params = params or {}
    if params_cls is None:
        if params:
            raise ValueError(f"method {name!r} takes no params, got {sorted(params)}")
        method = method_cls(seed=seed)
    else:
        from ..config import from_dict

        method = method_cls(from_dict(params_cls, params, path="params"), seed=seed)  # type: ignore[call-arg]
    method.name = name
    return method
