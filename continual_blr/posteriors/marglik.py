"""The prior precision δ that maximises the Laplace evidence, from a posterior's eigen structure.

A Laplace posterior N(`θ*`, S⁻¹) with S = H + δI (H: the curvature of the negative log-likelihood at `θ*`, e.g. the
GGN, summed over the data; δ: the precision of the prior N(m₀, δ⁻¹I)) approximates the log evidence by

    log p(D | δ) ≈ log p(D | θ*) − ½ δ ‖θ* − m₀‖² + ½ P log δ − ½ log det(H + δI)          (MacKay 1992)

(constants dropped; P the number of covered parameters). With `θ*` and H held fixed, the δ-dependent part is

    L(δ) = −½ δ s + ½ Σ_i [log δ − log(λ_i + δ)],      s = ‖θ* − m₀‖²,  λ_i the eigenvalues of H,

and L'(δ) = ½ (γ(δ)/δ − s) with γ(δ) = Σ_i λ_i / (λ_i + δ) (the effective number of parameters). γ decreases
and s·δ increases in δ, so L has one stationary point, its maximum, at γ(δ) = s·δ (MacKay's fixed point
δ = γ/s); :func:`optimal_prior_precision` finds it by bisection on log δ to machine precision. This is the
objective laplace-torch's ``optimize_prior_precision(method="marglik")`` maximises with a scalar prior precision
(``log_det_ratio`` and ``scatter`` at the fitted `θ*`).

The eigenvalues of H come from the structure (:func:`curvature_eigenvalues`), never from a P×P matrix for the
diagonal and Kronecker structures:

* diagonal: λ = diag(S) − δ;
* Kronecker, per layer S = Σ_k G_k ⊗ A_k + δI: with one term, λ = λ(G) λ(A)ᵀ (all products, exact); with two or
  more, the eigenvalues of the nearest Kronecker product of Σ_k G_k ⊗ A_k
  (:func:`~continual_blr.posteriors.kron.nearest_kronecker`), an approximation (as ``KronPosterior.merged``); other
  covered parameters: their diagonal;
* full: the eigenvalues of S − δI (dense, P ≤ 20 000).

Subtracting δ from a stored fp32 precision loses the eigenvalues far below δ·1e-7; they are clamped at 0 (they add
at most λ/δ each to γ).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .base import GaussianPosterior
from .diag import DiagPosterior
from .full import FullPosterior
from .kron import KronPosterior, nearest_kronecker

__all__ = ["curvature_eigenvalues", "log_evidence", "optimal_prior_precision", "marglik_prior_precision"]

BISECTION_RTOL = 1e-13
"""Bisection stops when the bracket [lo, hi] of δ has hi/lo − 1 below this."""


def curvature_eigenvalues(posterior: GaussianPosterior, delta: float) -> Tensor:
    """The eigenvalues of H = S − δI, float64, flat [P] (module docstring; ≥ 0, clamped).

    ``delta`` is the δ inside the posterior's precision; a Kronecker posterior stores its own (``posterior.delta``)
    and ``delta`` is not used for it.
    """
    if isinstance(posterior, DiagPosterior):
        return torch.cat([(s.double() - delta).reshape(-1) for s in posterior.precision.values()]).clamp_min(0.0)
    if isinstance(posterior, FullPosterior):
        s = posterior.precision.double()
        s = 0.5 * (s + s.T) - delta * torch.eye(s.shape[0], dtype=s.dtype, device=s.device)
        return torch.linalg.eigvalsh(s).clamp_min(0.0)
    if isinstance(posterior, KronPosterior):
        out = []
        for w, b, terms in posterior.blocks:
            d_out = posterior.mean[w].shape[0]
            d_in = posterior.mean[w][0].numel() + (b is not None)
            terms = [(a, g) for a, g in terms if bool(a.any()) and bool(g.any())]  # an unused layer's zero terms
            if not terms:
                out.append(torch.zeros(d_out * d_in, dtype=torch.float64, device=posterior.mean[w].device))
                continue
            a, g = nearest_kronecker(terms)  # the term itself when there is one
            lam_a = torch.linalg.eigvalsh(0.5 * (a + a.T).double()).clamp_min(0.0)
            lam_g = torch.linalg.eigvalsh(0.5 * (g + g.T).double()).clamp_min(0.0)
            out.append(torch.outer(lam_g, lam_a).reshape(-1))
        out += [s.double().reshape(-1).clamp_min(0.0) for s in posterior.diag.values()]
        return torch.cat(out)
    raise TypeError(f"posterior: expected a diagonal, Kronecker or full posterior, got {type(posterior).__name__}")


def log_evidence(delta: float, eigenvalues: Tensor, scatter: float) -> float:
    """L(δ) = −½ δ s + ½ Σ_i [log δ − log(λ_i + δ)], the δ-dependent part of the Laplace log evidence."""
    lam = eigenvalues.double()
    return float(-0.5 * delta * scatter - 0.5 * torch.log1p(lam / delta).sum())


def _gap(delta: float, lam: Tensor, scatter: float) -> float:
    """γ(δ) − s·δ, decreasing in δ; zero at the maximiser of L."""
    return float((lam / (lam + delta)).sum()) - scatter * delta


def optimal_prior_precision(eigenvalues: Tensor, scatter: float) -> float:
    """argmax_δ L(δ): the root of γ(δ) = s·δ by bisection on log δ (module docstring).

    Returns:
        δ̂ > 0; ``math.inf`` when s = 0 (`θ*` = m₀: L grows without bound in δ), 0.0 when H = 0 (L decreases in δ).
    """
    lam = eigenvalues.double().clamp_min(0.0)
    n_pos = int((lam > 0).sum())
    if n_pos == 0:
        return 0.0
    if not scatter > 0:
        return math.inf
    hi = n_pos / scatter  # γ ≤ n_pos, so γ(hi) − s·hi ≤ 0
    lo = hi
    while _gap(lo, lam, scatter) <= 0:  # γ → n_pos as δ → 0, so a small enough δ has a positive gap
        lo *= 1e-3
        if lo < 1e-300:
            return 0.0
    while hi / lo - 1.0 > BISECTION_RTOL:
        mid = math.sqrt(lo * hi)
        if _gap(mid, lam, scatter) > 0:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def marglik_prior_precision(posterior: GaussianPosterior, delta: float,
                            prior_mean: dict[str, Tensor] | None = None) -> float:
    """δ̂ maximising the Laplace evidence of ``posterior`` = N(`θ*`, (H + δI)⁻¹) under the prior N(m₀, δ⁻¹I).

    Args:
        posterior: diagonal, Kronecker or full; its mean is `θ*`.
        delta: the δ inside its precision (ignored for a Kronecker posterior, which stores its own).
        prior_mean: m₀ (default 0).
    """
    mean = posterior.mean
    m0 = prior_mean or {}
    scatter = sum(float(((v.double() - m0[k].double()) if k in m0 else v.double()).pow(2).sum())
                  for k, v in mean.items())
    return optimal_prior_precision(curvature_eigenvalues(posterior, delta), scatter)
