"""Gaussian posteriors over a model's parameters in diagonal, Kronecker-factored and full structure.

Each posterior is also the prior of the next task. ``load_posterior`` rebuilds any of them from its
``state_dict``.
"""

from typing import Any

from ..types import Structure
from .base import GaussianPosterior
from .diag import DiagPosterior
from .full import FullPosterior
from .kron import KronPosterior, kron_layers, nearest_kronecker

__all__ = [
    "GaussianPosterior",
    "DiagPosterior",
    "KronPosterior",
    "FullPosterior",
    "kron_layers",
    "nearest_kronecker",
    "load_posterior",
    "POSTERIORS",
]

POSTERIORS: dict[Structure, type[GaussianPosterior]] = {
    Structure.DIAG: DiagPosterior,
    Structure.KRON: KronPosterior,
    Structure.FULL: FullPosterior,
}


def load_posterior(state: dict[str, Any]) -> GaussianPosterior:
    """Rebuild a posterior from ``posterior.state_dict()`` (any structure)."""
    return POSTERIORS[Structure(state["structure"])].from_state_dict(state)
