"""The rank-cut coupling of a Kronecker-factored precision, on parameter dicts and on one flat vector.

A block's parameters form Θ = [W | b] (:mod:`~continual_blr.posteriors.kron`) and its precision Σ_k G_k ⊗ A_k + δI.
Cutting each input factor to its r largest eigenpairs, A_k⁽ʳ⁾ = U_r Λ_r U_rᵀ, and keeping the rest on the diagonal,

    S_r = Σ_k [G_k ⊗ A_k⁽ʳ⁾ + Diag(diag(G_k) ⊗ diag(A_k − A_k⁽ʳ⁾))] + δI,

gives a PSD precision with diag(S_r) = diag(S). Its off-diagonal part R_r = S_r − diag(S_r) acts as

    R_r Θ = Σ_k G_k (Θ U_r)(Λ_r U_rᵀ) − O ⊙ Θ,      O = Σ_k diag(G_k) diag(A_k⁽ʳ⁾)ᵀ,

(a term with r ≥ its A_k's size is kept whole: G_k Θ A_k, and O takes diag(A_k)). :class:`KronCoupling` evaluates it
with Θ U_r split as W U_w + b u_bᵀ (U_r's rows for the weights and for the bias) and the output split likewise,
so Θ = [W | b] is never assembled; :meth:`KronCoupling.flat` does the same on one flat parameter vector, reading
W and b as views of it and writing R_r v into views of an output vector: a handful of matrix products per block
and no per-call dictionaries, concatenations or copies (the BLR's correction between two exact couplings calls it
on every step, ``BayesianLearningRule.set_prior``). Cost per cut term: 4 d_out d_in r + 2 d_out² r flops.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..types import ParamDict
from .kron_solve import eigh

Block = tuple[str, "str | None", list[tuple[Tensor, Tensor]]]


class _Cut:
    """One term G ⊗ A⁽ʳ⁾ as G, U_r split into weight rows U_w and bias row u_b, and Λ_r U_rᵀ split into V_w, v_b."""

    def __init__(self, g: Tensor, u: Tensor, lam: Tensor, has_bias: bool) -> None:
        vt = lam.unsqueeze(1) * u.mT  # Λ_r U_rᵀ, [r, d_in]
        self.g = g
        self.u_w = (u[:-1] if has_bias else u).contiguous()
        self.u_b = u[-1].contiguous() if has_bias else None
        self.v_w = (vt[:, :-1] if has_bias else vt).contiguous()
        self.v_b = vt[:, -1].contiguous() if has_bias else None

    def add(self, w: Tensor, b: Tensor | None, out_w: Tensor, out_b: Tensor | None, first: bool) -> None:
        """out (+)= G (Θ U_r) Λ_r U_rᵀ, Θ = [W | b] (W [*lead, d_out, d_w], b [*lead, d_out])."""
        if w.dim() == 2:  # one vector (the flat form's case): 2-D kernels, in place where they can be
            p = torch.mm(w, self.u_w)
            if b is not None:
                p.addr_(b, self.u_b)
            q = torch.mm(self.g, p)
            if first:
                torch.mm(q, self.v_w, out=out_w)
            else:
                out_w.addmm_(q, self.v_w)
            if out_b is not None:
                if first:
                    torch.mv(q, self.v_b, out=out_b)
                else:
                    out_b.addmv_(q, self.v_b)
            return
        p = torch.matmul(w, self.u_w)
        if b is not None:
            p = p + b.unsqueeze(-1) * self.u_b
        q = torch.matmul(self.g, p)
        if first:
            torch.matmul(q, self.v_w, out=out_w)
        else:
            out_w.add_(torch.matmul(q, self.v_w))
        if out_b is not None:
            if first:
                torch.matmul(q, self.v_b, out=out_b)
            else:
                out_b.add_(torch.matmul(q, self.v_b))


class _Whole:
    """One term G ⊗ A kept whole (r ≥ A's size): G Θ A, with Θ assembled (small layers only)."""

    def __init__(self, g: Tensor, a: Tensor) -> None:
        self.g, self.a = g, a

    def add(self, w: Tensor, b: Tensor | None, out_w: Tensor, out_b: Tensor | None, first: bool) -> None:
        theta = torch.cat([w, b.unsqueeze(-1)], dim=-1) if b is not None else w
        r = torch.matmul(torch.matmul(self.g, theta), self.a)
        r_w = r[..., :-1] if b is not None else r
        if first:
            out_w.copy_(r_w)
        else:
            out_w.add_(r_w)
        if out_b is not None:
            if first:
                out_b.copy_(r[..., -1])
            else:
                out_b.add_(r[..., -1])


class KronCoupling:
    """v ↦ R_r v, the off-diagonal part of the rank-cut precision S_r of a Kronecker posterior's blocks (module
    docstring); the eigendecompositions are made once, here (:func:`~continual_blr.posteriors.kron_solve.eigh`).

    Call it on a parameter dict (entries may carry leading batch axes; parameters outside the blocks map to zero),
    or get :meth:`flat`'s operator for one flat vector.

    Args:
        mean: the posterior's mean (shapes only).
        blocks: ``(weight name, bias name or None, [(A_k, G_k), ...])`` per block, as ``KronPosterior.blocks``.
        rank: r ≥ 1, the eigenpairs kept of each A_k.
    """

    def __init__(self, mean: ParamDict, blocks: list[Block], rank: int) -> None:
        self.shapes = {k: v.shape for k, v in mean.items()}
        self.blocks: list[tuple[str, str | None, int, int, list[_Cut | _Whole], Tensor, Tensor | None]] = []
        for w, b, terms in blocks:
            d_out = mean[w].shape[0]
            d_w = mean[w][0].numel()
            kept: list[_Cut | _Whole] = []
            off = torch.zeros(d_out, d_w + (b is not None), dtype=mean[w].dtype, device=mean[w].device)
            for a, g in terms:
                if rank >= a.shape[0]:
                    kept.append(_Whole(g, a))
                    a_r = a
                else:
                    lam_all, u_all = eigh(a)
                    u, lam = u_all[:, -rank:], lam_all[-rank:]
                    kept.append(_Cut(g, u, lam, b is not None))
                    a_r = (u * lam) @ u.mT
                off = off + torch.outer(torch.diagonal(g), torch.diagonal(a_r))
            off_w = (off[:, :-1] if b is not None else off).contiguous()
            off_b = off[:, -1].contiguous() if b is not None else None
            self.blocks.append((w, b, d_out, d_w, kept, off_w, off_b))

    @staticmethod
    def _block(w: Tensor, b: Tensor | None, out_w: Tensor, out_b: Tensor | None, kept: list[_Cut | _Whole],
               off_w: Tensor, off_b: Tensor | None) -> None:
        """R_r Θ of one block into (out_w, out_b); every term writes or adds, then − O ⊙ Θ."""
        if not kept:
            out_w.zero_()
            if out_b is not None:
                out_b.zero_()
            return
        for i, term in enumerate(kept):
            term.add(w, b, out_w, out_b, i == 0)
        out_w.addcmul_(off_w, w, value=-1)
        if out_b is not None:
            out_b.addcmul_(off_b, b, value=-1)

    def __call__(self, v: ParamDict) -> ParamDict:
        out: ParamDict = {}
        for w, b, d_out, d_w, kept, off_w, off_b in self.blocks:
            lead = v[w].shape[: v[w].dim() - len(self.shapes[w])]
            wt = v[w].reshape(*lead, d_out, d_w)
            out_w = torch.empty_like(wt)
            out_b = torch.empty_like(v[b]) if b is not None else None
            self._block(wt, v[b] if b is not None else None, out_w, out_b, kept, off_w, off_b)
            out[w] = out_w.reshape(v[w].shape)
            if b is not None:
                out[b] = out_b
        for k in self.shapes:
            if k not in out:
                out[k] = torch.zeros_like(v[k])
        return out

    def flat(self, names: list[str], numels: list[int]) -> Callable[[Tensor, Tensor], Tensor]:
        """The operator (v, out) ↦ out with out set to R_r v, for flat vectors in the layout ``names`` / ``numels``
        (each parameter's entries contiguous, row-major): the blocks' entries are written, the entries of parameters
        outside the blocks are set to zero, so ``out`` may hold anything before the call (a caller that adds to the
        result in place and passes the same buffer again gets R_r v, not a sum). Every block's weight and bias must
        be in ``names``.

        Raises:
            ValueError: if a block's parameter is not in ``names``, or its size there differs from the mean's.
        """
        start: dict[str, tuple[int, int]] = {}
        at = 0
        for k, n in zip(names, numels):
            start[k] = (at, n)
            at += n
        plan = []
        for w, b, d_out, d_w, kept, off_w, off_b in self.blocks:
            for k in (w, b):
                if k is not None and (k not in start or start[k][1] != self.shapes[k].numel()):
                    raise ValueError(f"KronCoupling.flat: parameter {k!r} is not in the layout with its "
                                     f"{self.shapes[k].numel()} entries")
            plan.append((start[w][0], start[b][0] if b is not None else None, d_out, d_w, kept, off_w, off_b))
        in_blocks = {k for w, b, *_ in self.blocks for k in (w, b) if k is not None}
        outside = [(start[k][0], start[k][0] + start[k][1]) for k in names if k not in in_blocks]

        def apply(v: Tensor, out: Tensor) -> Tensor:
            for lo, hi in outside:
                out[lo:hi].zero_()
            for ow, ob, d_out, d_w, kept, off_w, off_b in plan:
                n = d_out * d_w
                self._block(v[ow:ow + n].view(d_out, d_w), v[ob:ob + d_out] if ob is not None else None,
                            out[ow:ow + n].view(d_out, d_w), out[ob:ob + d_out] if ob is not None else None,
                            kept, off_w, off_b)
            return out

        return apply


__all__ = ["KronCoupling"]
