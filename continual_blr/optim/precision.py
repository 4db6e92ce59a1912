"""The BLR's data part of the precision in each structure: pure functions over ParamDicts (diagonal),
dense matrices (full) and ``(blocks, diag)`` pairs of Kronecker terms (Kronecker).

The posterior precision is the prior's plus a data part, S = S₀ + D (:mod:`continual_blr.optim.blr`). These
functions update D (:func:`blr_data_update`), build Gaussians from it (:func:`assemble_posterior`), read a
start off a starting posterior (:func:`data_part`), make D = c·I (:func:`data_like`), take the mean step
(:func:`blr_mean_update`), and add, scale and check estimates in any structure. The diagonal structure's
fast path on flat buffers is :mod:`continual_blr.optim.diag_state`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..posteriors import DiagPosterior, FullPosterior, GaussianPosterior, KronPosterior, nearest_kronecker
from ..types import ParamDict

__all__ = ["blr_data_update", "assemble_posterior", "data_part", "data_like", "blr_mean_update", "add_curv",
           "scale_curv", "first_bad"]


def blr_data_update(data: object, h: object, rho: float) -> object:
    """D ← (1 − ρ) D + ρ ĥ, the data part of the precision S = S₀ + D, in its structure.

    ``data`` and ``h`` are ParamDicts (diag), dense matrices (full), or for Kronecker pairs
    ``(blocks, diag)`` with ``blocks[w] = (A, G)`` (a missing layer is a zero term) and a ParamDict for
    parameters outside the layers. The Kronecker result is one term per layer: the nearest Kronecker
    product of (1 − ρ) A_D ⊗ G_D + ρ A_ĥ ⊗ G_ĥ (PSD for PSD terms, so D ⪰ 0 stays true). The diagonal
    step with the Price estimator's positivity correction is :func:`continual_blr.optim.diag_state.diag_update`.
    """
    if isinstance(data, dict):
        assert isinstance(h, dict)
        names = list(data)
        return dict(zip(names, torch._foreach_lerp([data[k] for k in names], [h[k] for k in names], rho)))
    if isinstance(data, Tensor):
        return (1 - rho) * data + rho * h  # type: ignore[operator]
    (d_blocks, d_diag), (h_blocks, h_diag) = data, h  # type: ignore[misc]
    blocks = {}
    for w in set(d_blocks) | set(h_blocks):
        parts = []
        if w in d_blocks:
            parts.append(((1 - rho) * d_blocks[w][0], d_blocks[w][1]))
        if w in h_blocks:
            parts.append((rho * h_blocks[w][0], h_blocks[w][1]))
        # a zero term (a head no example used) adds nothing; with only zero terms the nearest-Kronecker
        # normalisation would divide 0 by 0
        parts = [(a, g) for a, g in parts if bool(a.abs().amax() > 0) and bool(g.abs().amax() > 0)]
        if parts:
            blocks[w] = nearest_kronecker(parts)
    diag = {k: (1 - rho) * v + rho * h_diag[k] if k in h_diag else (1 - rho) * v for k, v in d_diag.items()}
    return blocks, diag


def assemble_posterior(mean: ParamDict, prior: GaussianPosterior, data: object, scale: float = 1.0,
                       extra: float = 0.0) -> GaussianPosterior:
    """N(m, S₀ + scale·D + extra·I) in the prior's structure (``extra``: the step's damping N γ).

    Kronecker: the prior's terms are kept and D is appended as one more term per layer; ``extra`` is
    added to the isotropic δ (so it reaches every parameter).
    """
    if isinstance(prior, DiagPosterior):
        return DiagPosterior(mean, {k: prior.precision[k] + scale * data[k] + extra for k in prior.mean})  # type: ignore[index]
    if isinstance(prior, FullPosterior):
        eye = torch.eye(prior.precision.shape[0], dtype=prior.precision.dtype, device=prior.precision.device)
        return FullPosterior(mean, prior.precision + scale * data + extra * eye)  # type: ignore[operator]
    if isinstance(prior, KronPosterior):
        d_blocks, d_diag = data  # type: ignore[misc]
        blocks = [(w, b, terms + ([(scale * d_blocks[w][0], d_blocks[w][1])] if w in d_blocks else []))
                  for w, b, terms in prior.blocks]
        diag = {k: v + scale * d_diag[k] for k, v in prior.diag.items()}
        return KronPosterior(mean, blocks, diag, prior.delta + extra)
    raise TypeError(f"unsupported posterior type {type(prior).__name__}")


def data_part(prior: GaussianPosterior, start: GaussianPosterior) -> object:
    """D = S_start − S₀ for a starting posterior ``start`` over the prior's parameters (clamped at 0 in
    the diagonal structure; Kronecker: the starting precision's terms beyond the prior's, merged into
    one, plus its excess isotropic part as a term I ⊗ (δ_start − δ₀) I)."""
    if isinstance(prior, DiagPosterior):
        assert isinstance(start, DiagPosterior)
        return {k: (start.precision[k] - prior.precision[k]).clamp_min(0) for k in prior.mean}
    if isinstance(prior, FullPosterior):
        assert isinstance(start, FullPosterior)
        return start.precision - prior.precision
    assert isinstance(prior, KronPosterior) and isinstance(start, KronPosterior)
    n_prior = {w: len(terms) for w, _, terms in prior.blocks}
    extra_delta = max(start.delta - prior.delta, 0.0)
    blocks = {}
    for w, b, terms in start.blocks:
        parts = list(terms[n_prior.get(w, 0):])
        if extra_delta > 0:
            ref = start.mean[w]
            d_in = ref[0].numel() + (b is not None)
            parts.append((extra_delta * torch.eye(d_in, dtype=ref.dtype, device=ref.device),
                          torch.eye(ref.shape[0], dtype=ref.dtype, device=ref.device)))
        if parts:
            blocks[w] = nearest_kronecker(parts)
    diag = {k: (start.diag[k] + start.delta - prior.diag[k] - prior.delta).clamp_min(0) for k in prior.diag}
    return blocks, diag


def data_like(prior: GaussianPosterior, value: float) -> object:
    """D = value · I in the prior's structure (Kronecker: I ⊗ value·I per layer)."""
    if isinstance(prior, DiagPosterior):
        return {k: torch.full_like(v, value) for k, v in prior.mean.items()}
    if isinstance(prior, FullPosterior):
        return value * torch.eye(prior.precision.shape[0], dtype=prior.precision.dtype, device=prior.precision.device)
    assert isinstance(prior, KronPosterior)
    blocks = {}
    if value > 0:
        for w, b, _ in prior.blocks:
            ref = prior.mean[w]
            d_in = ref[0].numel() + (b is not None)
            blocks[w] = (value * torch.eye(d_in, dtype=ref.dtype, device=ref.device),
                         torch.eye(ref.shape[0], dtype=ref.dtype, device=ref.device))
    return blocks, {k: torch.full_like(prior.mean[k], value) for k in prior.diag}


def blr_mean_update(post: GaussianPosterior, direction: ParamDict, lr: float,
                    clip_radius: float | None = None) -> ParamDict:
    """m ← m − α clip_r(P⁻¹ d) with P the precision of ``post`` (no clipping when ``clip_radius`` is None;
    the optimiser passes α/(1 − β₁ᵗ) and the momentum u for d, so the clip acts before the bias correction).

    ``post`` is the preconditioner: the posterior, or the damped N(m, S + Nγ I) (:func:`assemble_posterior`).
    """
    step = post.covariance_matvec(direction)
    if clip_radius is not None:
        step = {k: v.clamp(-clip_radius, clip_radius) for k, v in step.items()}
    return {k: post.mean[k] - lr * step[k] for k in post.mean}


def add_curv(a: object, b: object) -> object:
    """a + b for two estimates in one structure (Kronecker terms with different G: their nearest Kronecker product)."""
    if isinstance(a, dict):
        return {k: a[k] + b[k] for k in a}  # type: ignore[index]
    if isinstance(a, tuple):
        (ba, da), (bb, db) = a, b  # type: ignore[misc]
        blocks = {w: (ba[w][0] + bb[w][0], ba[w][1]) if torch.equal(ba[w][1], bb[w][1]) else nearest_kronecker([ba[w], bb[w]]) for w in ba}
        return blocks, {k: da[k] + db[k] for k in da}
    return a + b  # type: ignore[operator]


def finite_flags(a: object) -> list[Tensor]:
    """One 0-d bool tensor per tensor in a ParamDict, a (blocks, diag) Kronecker estimate or a tensor."""
    if isinstance(a, dict):
        return [f for v in a.values() for f in finite_flags(v)]
    if isinstance(a, tuple):
        return [f for v in a for f in finite_flags(v)]
    if isinstance(a, Tensor):
        return [torch.isfinite(a).all()]
    return []


def first_bad(loss: Tensor, g: object, h: object) -> str | None:
    """The first of "loss", "gradient", "curvature" holding a non-finite number, or None (one device
    synchronisation for all three)."""
    groups = [finite_flags(loss), finite_flags(g), finite_flags(h)]
    flags = torch.stack([torch.stack(f).all() for f in groups]).tolist()
    for name, ok in zip(("loss", "gradient", "curvature"), flags):
        if not ok:
            return name
    return None


def scale_curv(a: object, s: float) -> object:
    """s · a for an estimate in any structure (Kronecker: the A factor scaled)."""
    if s == 1.0:
        return a
    if isinstance(a, dict):
        return {k: s * v for k, v in a.items()}
    if isinstance(a, tuple):
        blocks, diag = a
        return {w: (s * x, y) for w, (x, y) in blocks.items()}, {k: s * v for k, v in diag.items()}
    return s * a  # type: ignore[operator]
