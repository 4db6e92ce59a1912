"""Continual learning with the Bayesian learning rule: the posterior of task t is the prior of task t+1.

The public entry points:

* :func:`load_run` — reload a run folder written by ``continual-blr run`` (model, method, config,
  results) and predict on new inputs with :meth:`~continual_blr.saved_run.LoadedRun.predict` /
  :meth:`~continual_blr.saved_run.LoadedRun.predict_proba`;
* :data:`__version__` — the installed distribution's version.

The building blocks live in their subpackages (``continual_blr.methods``, ``continual_blr.loop``,
``continual_blr.posteriors``, …; see the API reference). Nothing heavy is imported with the package
itself: :func:`load_run` is imported on first use, so ``import continual_blr.types`` stays cheap and
no import cycle runs through this file.
"""

from __future__ import annotations

from importlib import metadata as _metadata
from typing import Any

__all__ = ["__version__", "load_run", "LoadedRun"]

try:
    __version__: str = _metadata.version("continual_blr")
except _metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0.0.0+unknown"

_LAZY = {"load_run": "continual_blr.saved_run", "LoadedRun": "continual_blr.saved_run"}


def __getattr__(name: str) -> Any:
    """Import the public names of :mod:`continual_blr.saved_run` on first use (PEP 562)."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'continual_blr' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
