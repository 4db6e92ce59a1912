"""Kronecker-factored Gaussian posterior (per layer), usable as the next task's prior.

For each Linear / Conv2d layer the parameters form Θ = [W.reshape(d_out, −1) | b] (see
:class:`~continual_blr.types.KronBlock`) and the precision acts as

    S Θ = Σ_k G_k Θ A_k + δ Θ                                    (sum of Kronecker products + δI)

Every other covered parameter has a diagonal precision ``diag + δ``. This is the form an online
Kronecker-factored Laplace posterior takes (Ritter et al. 2018): the precision after task t is the
precision before it plus that task's curvature, i.e. one more Kronecker term. Matrix-vector products
(and therefore the Gaussian penalty ½(θ−m)ᵀS(θ−m) a regulariser needs) are exact for any number
of terms.

Operations that need S⁻¹ or log|S| (sampling, the KL, log-density) are exact when every block has
at most one term, by the eigendecompositions A = U_A Λ_A U_Aᵀ, G = U_G Λ_G U_Gᵀ:

    S = (U_G ⊗ U_A) diag(λ_G λ_Aᵀ + δ) (U_G ⊗ U_A)ᵀ                (Martens & Grosse 2015, Sec. 6.3)

A block with several terms is brought to one term by :meth:`KronPosterior.merged`, which replaces
Σ_k A_k ⊗ G_k by its nearest Kronecker product in Frobenius norm (Van Loan & Pitsianis 1993),
computed exactly from the K×K Gram matrices of the factors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..types import KronCurvature, ParamDict, Structure, flatten
from .base import GaussianPosterior, randn_like

__all__ = ["KronPosterior", "nearest_kronecker", "kron_layers"]


def _frobenius(stack: Tensor, tiny: float) -> Tensor:
    """‖X_k‖_F of each matrix of a stack, scaled by its largest entry first so that squares cannot overflow."""
    peak = stack.abs().amax(dim=(1, 2)).clamp_min(tiny)
    return peak * (stack / peak[:, None, None]).flatten(1).norm(dim=1)


def nearest_kronecker(terms: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """argmin_{A,G} ‖Σ_k A_k ⊗ G_k − A ⊗ G‖_F for symmetric PSD factors.

    The rearranged matrix R = Σ_k vec(A_k) vec(G_k)ᵀ has rank ≤ K, so its leading singular pair is
    found in the span of the factors: with Gram matrices (M_A)_{ij} = ⟨A_i, A_j⟩ and
    (M_G)_{ij} = ⟨G_i, G_j⟩, the coefficients c of A = Σ c_i A_i are the leading eigenvector of
    M_G M_A, and G = Σ_i ⟨A_i, A⟩ G_i / ‖A‖². For PSD factors all Gram entries are ≥ 0, so c ≥ 0
    (Perron–Frobenius) and A, G stay PSD.

    Returns:
        (A, G). For a single term, that term.
    """
    if len(terms) == 1:
        return terms[0]
    # Work with unit-norm factors and weights w_k = ‖A_k‖‖G_k‖ / max_k(…): R = Σ_k w_k vec(Â_k) vec(Ĝ_k)ᵀ, so c is
    # the leading eigenvector of W M_Ĝ W M_Â. Same result; the Gram products cannot overflow float32 when the
    # precision itself is large (≈1e19 per factor would overflow ⟨A_i, A_j⟩⟨G_j, G_k⟩ directly).
    a_stack = torch.stack([a for a, _ in terms])
    g_stack = torch.stack([g for _, g in terms])
    tiny = torch.finfo(a_stack.dtype).tiny
    a_norm, g_norm = _frobenius(a_stack, tiny), _frobenius(g_stack, tiny)
    a_hat = a_stack / a_norm[:, None, None]
    g_hat = g_stack / g_norm[:, None, None]
    scale = (a_norm * g_norm).amax()
    w = a_norm / scale * g_norm  # ≤ 1, computed without forming ‖A‖‖G‖ when that would overflow
    m_a = torch.einsum("iab,jab->ij", a_hat, a_hat)
    m_g = torch.einsum("iab,jab->ij", g_hat, g_hat)
    # W M_Ĝ W M_Â is similar to a symmetric matrix; use the non-symmetric eig of this small K×K matrix and take
    # the real leading eigenvector.
    evals, evecs = torch.linalg.eig((w[:, None] * m_g * w[None, :]) @ m_a)
    c = evecs[:, torch.argmax(evals.real)].real
    c = c * torch.sign(c.sum())
    a = torch.einsum("i,iab->ab", c, a_hat)
    coef = torch.einsum("iab,ab->i", a_hat, a) * w / (a * a).sum()
    g = torch.einsum("i,iab->ab", coef, g_hat) * scale
    return a, g


class KronPosterior(GaussianPosterior):
    """q(θ) = N(m, S⁻¹) with per-layer Kronecker-factored precision (see module docstring).

    Args:
        mean: the mean m (covered parameters).
        blocks: for each layer, ``(weight_name, bias_name | None, [(A_1, G_1), ...])``.
        diag: diagonal precision for covered parameters that belong to no block (may be empty).
        delta: isotropic precision δ ≥ 0 added to everything (the initial prior's precision).
    """

    structure = Structure.KRON

    def __init__(
        self,
        mean: ParamDict,
        blocks: list[tuple[str, str | None, list[tuple[Tensor, Tensor]]]],
        diag: ParamDict | None = None,
        delta: float = 0.0,
    ) -> None:
        self.mean = {k: v.detach() for k, v in mean.items()}
        self.blocks = [(w, b, [(a.detach(), g.detach()) for a, g in terms]) for w, b, terms in blocks]
        self.delta = float(delta)
        if self.delta < 0:
            raise ValueError(f"delta: must be >= 0, got {delta}")
        in_blocks = {w for w, _, _ in self.blocks} | {b for _, b, _ in self.blocks if b is not None}
        missing = in_blocks - set(self.mean)
        if missing:
            raise ValueError(f"blocks: parameters not in the mean: {sorted(missing)}")
        diag = dict(diag or {})
        for k in self.mean:
            if k not in in_blocks and k not in diag:
                diag[k] = torch.zeros_like(self.mean[k])
        self.diag = {k: diag[k].detach().to(self.mean[k]) for k in self.mean if k not in in_blocks}
        self._eig: list[tuple[Tensor, Tensor, Tensor]] | None = None

    # ----- construction ------------------------------------------------------------------------
    @classmethod
    def isotropic(cls, mean: ParamDict, delta: float, layers: list[tuple[str, str | None]]) -> "KronPosterior":
        """N(m, δ⁻¹ I) in Kronecker form: blocks without terms, precision δ everywhere."""
        if delta <= 0:
            raise ValueError(f"delta: must be > 0, got {delta}")
        return cls(mean, [(w, b, []) for w, b in layers], None, delta)

    @classmethod
    def from_curvature(cls, mean: ParamDict, curvature: KronCurvature, delta: float, scale: float = 1.0) -> "KronPosterior":
        """N(m, (scale·C + δI)⁻¹) for a Kronecker curvature C (a Laplace posterior)."""
        blocks = [(blk.weight, blk.bias, [(scale * blk.A, blk.G)]) for blk in curvature.blocks]
        diag = {k: scale * v for k, v in curvature.diag.items() if k in mean}
        return cls(mean, blocks, diag, delta)

    def add_precision(self, curvature: KronCurvature, scale: float = 1.0) -> "KronPosterior":
        """A copy with precision S + scale·C: each block gains one Kronecker term (online Laplace)."""
        extra = {blk.weight: blk for blk in curvature.blocks}
        blocks = []
        for w, b, terms in self.blocks:
            blk = extra.get(w)
            blocks.append((w, b, terms + ([(scale * blk.A, blk.G)] if blk is not None else [])))
        diag = {k: v + scale * curvature.diag[k] if k in curvature.diag else v for k, v in self.diag.items()}
        return KronPosterior(self.mean, blocks, diag, self.delta)

    def merged(self) -> "KronPosterior":
        """One Kronecker term per block: Σ_k A_k ⊗ G_k → nearest Kronecker product (δ kept exact)."""
        blocks = [(w, b, [nearest_kronecker(terms)] if terms else []) for w, b, terms in self.blocks]
        return KronPosterior(self.mean, blocks, self.diag, self.delta)

    # ----- layout helpers ----------------------------------------------------------------------
    def _theta(self, v: ParamDict, w: str, b: str | None) -> Tensor:
        wt = v[w].reshape(v[w].shape[0], -1)
        return torch.cat([wt, v[b].unsqueeze(-1)], dim=-1) if b is not None else wt

    def _split_theta(self, theta: Tensor, w: str, b: str | None, out: ParamDict, lead: tuple[int, ...] = ()) -> None:
        shape_w = self.mean[w].shape
        if b is not None:
            out[w] = theta[..., :-1].reshape(*lead, *shape_w)
            out[b] = theta[..., -1]
        else:
            out[w] = theta.reshape(*lead, *shape_w)

    def _eigs(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        """Per block (U_G, U_A, D) with D[o, j] = λ_G[o] λ_A[j] + δ."""
        if self._eig is None:
            eig = []
            for w, b, terms in self.blocks:
                d_out = self.mean[w].shape[0]
                d_in = self.mean[w][0].numel() + (b is not None)
                ref = self.mean[w]
                if len(terms) > 1:
                    raise ValueError(
                        f"KronPosterior: layer {w!r} holds {len(terms)} Kronecker terms; inverse, log-det and "
                        "sampling need one — call .merged() first (nearest Kronecker product)"
                    )
                if not terms:
                    u_g = torch.eye(d_out, dtype=ref.dtype, device=ref.device)
                    u_a = torch.eye(d_in, dtype=ref.dtype, device=ref.device)
                    d = torch.full((d_out, d_in), self.delta, dtype=ref.dtype, device=ref.device)
                else:
                    a, g = terms[0]
                    la, u_a = torch.linalg.eigh(a)
                    lg, u_g = torch.linalg.eigh(g)
                    d = torch.outer(lg.clamp_min(0), la.clamp_min(0)) + self.delta
                if (d <= 0).any():
                    raise ValueError(f"KronPosterior: precision of layer {w!r} is singular; use delta > 0")
                eig.append((u_g, u_a, d))
            self._eig = eig
        return self._eig

    # ----- the interface -----------------------------------------------------------------------
    def precision_matvec(self, v: ParamDict) -> ParamDict:
        out: ParamDict = {}
        for w, b, terms in self.blocks:
            th = self._theta(v, w, b)
            res = self.delta * th
            for a, g in terms:
                res = res + g @ th @ a
            self._split_theta(res, w, b, out)
        for k, s in self.diag.items():
            out[k] = (s + self.delta) * v[k]
        return out

    def covariance_matvec(self, v: ParamDict) -> ParamDict:
        out: ParamDict = {}
        for (w, b, _), (u_g, u_a, d) in zip(self.blocks, self._eigs()):
            th = self._theta(v, w, b)
            self._split_theta(u_g @ ((u_g.mT @ th @ u_a) / d) @ u_a.mT, w, b, out)
        for k, s in self.diag.items():
            out[k] = v[k] / (s + self.delta)
        return out

    def logdet_precision(self) -> Tensor:
        total = sum(torch.log(d).sum() for _, _, d in self._eigs())
        total = total + sum(torch.log(s + self.delta).sum() for s in self.diag.values())
        return torch.as_tensor(total, dtype=next(iter(self.mean.values())).dtype)

    def sample_noise(self, generator: torch.Generator | None, n: int | None = None) -> ParamDict:
        out: ParamDict = {}
        lead = () if n is None else (n,)
        for (w, b, _), (u_g, u_a, d) in zip(self.blocks, self._eigs()):
            eps = randn_like(d, generator, n)
            self._split_theta(u_g @ (eps * d.rsqrt()) @ u_a.mT, w, b, out, lead)
        for k, s in self.diag.items():
            out[k] = randn_like(s, generator, n) * (s + self.delta).rsqrt()
        return out

    def covariance_diag(self) -> ParamDict:
        out: ParamDict = {}
        for (w, b, _), (u_g, u_a, d) in zip(self.blocks, self._eigs()):
            # diag(S⁻¹)[o, j] = Σ_{o', j'} U_G[o, o']² U_A[j, j']² / D[o', j']
            self._split_theta((u_g**2) @ (1.0 / d) @ (u_a**2).mT, w, b, out)
        for k, s in self.diag.items():
            out[k] = 1.0 / (s + self.delta)
        return out

    def trace_precision_times_covariance(self, other: GaussianPosterior) -> Tensor:
        if isinstance(other, KronPosterior) and [x[:2] for x in other.blocks] == [x[:2] for x in self.blocks]:
            total = torch.zeros((), dtype=next(iter(self.mean.values())).dtype)
            for (w, b, terms), (u_g, u_a, d) in zip(self.blocks, other._eigs()):
                inv_d = 1.0 / d
                total = total + self.delta * inv_d.sum()
                for a, g in terms:
                    dg = torch.diagonal(u_g.mT @ g @ u_g)
                    da = torch.diagonal(u_a.mT @ a @ u_a)
                    total = total + (torch.outer(dg, da) * inv_d).sum()
            var = other.covariance_diag()
            for k, s in self.diag.items():
                total = total + ((s + self.delta) * var[k]).sum()
            return total
        _, s_self = self.to_dense()
        _, s_other = other.to_dense()
        return torch.trace(torch.linalg.solve(s_other, s_self))

    def with_mean(self, mean: ParamDict) -> "KronPosterior":
        out = KronPosterior({k: mean[k] for k in self.mean}, self.blocks, self.diag, self.delta)
        out._eig = self._eig
        return out

    def to_dense(self) -> tuple[Tensor, Tensor]:
        """Dense (mean, precision) in ``flatten(mean)`` order — O(P²) memory, for tests and tiny models."""
        offsets, start = {}, 0
        for k, t in self.mean.items():
            offsets[k] = start
            start += t.numel()
        m = flatten(self.mean)
        dense = torch.zeros(start, start, dtype=m.dtype, device=m.device)
        for w, b, terms in self.blocks:
            d_out = self.mean[w].shape[0]
            d_w = self.mean[w][0].numel()
            d_in = d_w + (b is not None)
            # index of Θ[o, j] in the flat vector
            o = torch.arange(d_out).unsqueeze(1)
            j = torch.arange(d_in).unsqueeze(0)
            idx = offsets[w] + o * d_w + j
            if b is not None:
                idx[:, -1] = offsets[b] + torch.arange(d_out)
            idx = idx.reshape(-1)
            block = self.delta * torch.eye(d_out * d_in, dtype=m.dtype, device=m.device)
            for a, g in terms:
                block = block + torch.kron(g, a)  # row-major vec(Θ): vec(G Θ A) = (G ⊗ A) vec(Θ)
            dense[idx.unsqueeze(1), idx.unsqueeze(0)] = block
        for k, s in self.diag.items():
            i = torch.arange(offsets[k], offsets[k] + s.numel())
            dense[i, i] = s.reshape(-1) + self.delta
        return m, dense

    def state_dict(self) -> dict[str, Any]:
        return {
            "structure": self.structure.value,
            "mean": dict(self.mean),
            "blocks": [(w, b, list(terms)) for w, b, terms in self.blocks],
            "diag": dict(self.diag),
            "delta": self.delta,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "KronPosterior":
        return cls(state["mean"], state["blocks"], state["diag"], state["delta"])

    def to(self, device=None, dtype=None) -> "KronPosterior":
        mv = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
        return KronPosterior(
            {k: mv(v) for k, v in self.mean.items()},
            [(w, b, [(mv(a), mv(g)) for a, g in terms]) for w, b, terms in self.blocks],
            {k: mv(v) for k, v in self.diag.items()},
            self.delta,
        )


def kron_layers(model: torch.nn.Module, names: list[str] | None = None) -> list[tuple[str, str | None]]:
    """(weight, bias) names of the model's Linear and Conv2d layers (optionally restricted to ``names``)."""
    layers = []
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.Linear, torch.nn.Conv2d)):
            prefix = f"{mod_name}." if mod_name else ""
            w = prefix + "weight"
            b = prefix + "bias" if mod.bias is not None else None
            if names is None or w in names:
                layers.append((w, b if (b is None or names is None or b in names) else None))
    return layers

