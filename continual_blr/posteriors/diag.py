"""Diagonal (mean-field) Gaussian posterior: S = diag(s), one precision per weight."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..types import ParamDict, Structure, flatten
from .base import GaussianPosterior, randn_like

__all__ = ["DiagPosterior"]


class DiagPosterior(GaussianPosterior):
    """q(θ) = N(m, diag(s)⁻¹).

    Args:
        mean: the mean m as a ParamDict.
        precision: s, a ParamDict with the shapes of ``mean`` (all entries > 0), or a float for an
            isotropic precision.
    """

    structure = Structure.DIAG

    def __init__(self, mean: ParamDict, precision: ParamDict | float) -> None:
        self.mean = {k: v.detach() for k, v in mean.items()}
        if isinstance(precision, (int, float)):
            if precision <= 0:
                raise ValueError(f"precision: must be > 0, got {precision}")
            precision = {k: torch.full_like(v, float(precision)) for k, v in self.mean.items()}
        if set(precision) != set(self.mean):
            raise ValueError("precision: keys must equal the mean's keys")
        self.precision = {k: precision[k].detach().to(self.mean[k]) for k in self.mean}

    @classmethod
    def isotropic(cls, mean: ParamDict, precision: float) -> "DiagPosterior":
        """N(m, δ⁻¹ I) — the usual initial prior."""
        return cls(mean, precision)

    def precision_matvec(self, v: ParamDict) -> ParamDict:
        return {k: self.precision[k] * v[k] for k in self.mean}

    def covariance_matvec(self, v: ParamDict) -> ParamDict:
        return {k: v[k] / self.precision[k] for k in self.mean}

    def logdet_precision(self) -> Tensor:
        return sum(torch.log(s).sum() for s in self.precision.values())  # type: ignore[return-value]

    def sample_noise(self, generator: torch.Generator | None, n: int | None = None) -> ParamDict:
        return {k: randn_like(m, generator, n) * self.precision[k].rsqrt() for k, m in self.mean.items()}

    def trace_precision_times_covariance(self, other: GaussianPosterior) -> Tensor:
        var = other.covariance_diag()
        return sum((self.precision[k] * var[k]).sum() for k in self.mean)  # type: ignore[return-value]

    def covariance_diag(self) -> ParamDict:
        return {k: 1.0 / s for k, s in self.precision.items()}

    def add_precision(self, curvature: ParamDict, scale: float = 1.0) -> "DiagPosterior":
        """A copy with precision s + scale · c (e.g. a Laplace update with a diagonal GGN c)."""
        return DiagPosterior(self.mean, {k: self.precision[k] + scale * curvature[k] for k in self.mean})

    def with_mean(self, mean: ParamDict) -> "DiagPosterior":
        return DiagPosterior({k: mean[k] for k in self.mean}, self.precision)

    def to_dense(self) -> tuple[Tensor, Tensor]:
        return flatten(self.mean), torch.diag(flatten(self.precision))

    def state_dict(self) -> dict[str, Any]:
        return {"structure": self.structure.value, "mean": dict(self.mean), "precision": dict(self.precision)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "DiagPosterior":
        return cls(state["mean"], state["precision"])

    def to(self, device=None, dtype=None) -> "DiagPosterior":
        return DiagPosterior(
            {k: v.to(device=device, dtype=dtype) for k, v in self.mean.items()},
            {k: v.to(device=device, dtype=dtype) for k, v in self.precision.items()},
        )
