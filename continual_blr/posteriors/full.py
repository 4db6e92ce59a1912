"""Full-precision Gaussian posterior: one dense P×P precision (small models or a parameter subset)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..types import ParamDict, Structure, flatten, unflatten
from .base import GaussianPosterior, randn_like

__all__ = ["FullPosterior"]


class FullPosterior(GaussianPosterior):
    """q(θ) = N(m, S⁻¹) with dense S in the order of ``types.flatten(mean)``.

    Args:
        mean: the mean m (the covered parameters only, e.g. the last layer).
        precision: a (P, P) symmetric positive-definite matrix, or a float for δ I.
    """

    structure = Structure.FULL

    def __init__(self, mean: ParamDict, precision: Tensor | float) -> None:
        self.mean = {k: v.detach() for k, v in mean.items()}
        m = flatten(self.mean)
        p = m.numel()
        if isinstance(precision, (int, float)):
            if precision <= 0:
                raise ValueError(f"precision: must be > 0, got {precision}")
            precision = float(precision) * torch.eye(p, dtype=m.dtype, device=m.device)
        if precision.shape != (p, p):
            raise ValueError(f"precision: expected shape ({p}, {p}), got {tuple(precision.shape)}")
        self.precision = precision.detach().to(m)
        self._chol: Tensor | None = None

    @property
    def chol(self) -> Tensor:
        """Lower Cholesky factor L of S = L Lᵀ (cached)."""
        if self._chol is None:
            self._chol = torch.linalg.cholesky(self.precision)
        return self._chol

    def _vec(self, v: ParamDict) -> Tensor:
        return torch.cat([v[k].reshape(-1) for k in self.mean])

    def precision_matvec(self, v: ParamDict) -> ParamDict:
        return unflatten(self.precision @ self._vec(v), self.mean)

    def covariance_matvec(self, v: ParamDict) -> ParamDict:
        x = torch.cholesky_solve(self._vec(v).unsqueeze(-1), self.chol).squeeze(-1)
        return unflatten(x, self.mean)

    def covariance(self) -> Tensor:
        """S⁻¹ as a dense matrix."""
        return torch.cholesky_inverse(self.chol)

    def logdet_precision(self) -> Tensor:
        return 2.0 * torch.log(torch.diagonal(self.chol)).sum()

    def sample_noise(self, generator: torch.Generator | None, n: int | None = None) -> ParamDict:
        m = flatten(self.mean)
        eps = randn_like(m, generator, n)  # (n, P) or (P,)
        # x = L⁻ᵀ ε has covariance (L Lᵀ)⁻¹ = S⁻¹.
        x = torch.linalg.solve_triangular(self.chol.mT, eps.reshape(-1, m.numel()).mT, upper=True).mT
        if n is None:
            return unflatten(x[0], self.mean)
        return {k: t.reshape(n, *self.mean[k].shape) for k, t in _split(x, self.mean).items()}

    def trace_precision_times_covariance(self, other: GaussianPosterior) -> Tensor:
        if isinstance(other, FullPosterior):
            return torch.trace(torch.cholesky_solve(self.precision, other.chol))
        _, s_other = other.to_dense()
        return torch.trace(torch.linalg.solve(s_other, self.precision))

    def covariance_diag(self) -> ParamDict:
        return unflatten(torch.diagonal(self.covariance()).clone(), self.mean)

    def add_precision(self, curvature: Tensor, scale: float = 1.0) -> "FullPosterior":
        """A copy with precision S + scale · C for a dense curvature C."""
        return FullPosterior(self.mean, self.precision + scale * curvature)

    def with_mean(self, mean: ParamDict) -> "FullPosterior":
        out = FullPosterior({k: mean[k] for k in self.mean}, self.precision)
        out._chol = self._chol
        return out

    def to_dense(self) -> tuple[Tensor, Tensor]:
        return flatten(self.mean), self.precision

    def state_dict(self) -> dict[str, Any]:
        return {"structure": self.structure.value, "mean": dict(self.mean), "precision": self.precision}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "FullPosterior":
        return cls(state["mean"], state["precision"])

    def to(self, device=None, dtype=None) -> "FullPosterior":
        return FullPosterior(
            {k: v.to(device=device, dtype=dtype) for k, v in self.mean.items()},
            self.precision.to(device=device, dtype=dtype),
        )


def _split(x: Tensor, like: ParamDict) -> ParamDict:
    """Split the last axis of ``x`` into the entries of ``like`` (flattened)."""
    out, start = {}, 0
    for k, t in like.items():
        out[k] = x[..., start : start + t.numel()]
        start += t.numel()
    return out
