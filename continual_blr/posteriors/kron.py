"""Kronecker-factored Gaussian posterior (per layer), usable as the next task's prior.

For each Linear / Conv2d layer the parameters form Θ = [W.reshape(d_out, −1) | b] (see
:class:`~continual_blr.types.KronBlock`) and the precision acts as

    S Θ = Σ_k G_k Θ A_k + δ Θ                                    (sum of Kronecker products + δI)

Every other covered parameter has a diagonal precision ``diag + δ``. This is the form an online
Kronecker-factored Laplace posterior takes (Ritter et al. 2018): the precision after task t is the
precision before it plus that task's curvature, i.e. one more Kronecker term.

What is exact for which number of terms K per block:

* any K — S v (``precision_matvec``, hence the penalty ½(θ−m)ᵀS(θ−m) a regulariser needs);
  S⁻¹ v (``covariance_matvec``) and sampling (``sample`` / ``sample_noise``), for K ≥ 2 up to the
  conjugate-gradient tolerance of :mod:`~continual_blr.posteriors.kron_solve` (relative residual
  1e-10 in float64, 1e-6 in float32, at most 200 iterations).
* K ≤ 1 only — ``covariance_diag``, ``logdet_precision`` (so ``log_prob`` and ``kl``) and
  ``trace_precision_times_covariance`` against this posterior; they raise ``ValueError`` for K ≥ 2.
  :meth:`KronPosterior.merged` gives the nearest-Kronecker approximation on which they work.

With K ≤ 1, by the eigendecompositions A = U_A Λ_A U_Aᵀ, G = U_G Λ_G U_Gᵀ:

    S = (U_G ⊗ U_A) diag(λ_G λ_Aᵀ + δ) (U_G ⊗ U_A)ᵀ                (Martens & Grosse 2015, Sec. 6.3)

so S⁻¹, S^{-1/2}, log|S| and diag(S⁻¹) are closed-form. With K ≥ 2:

* S⁻¹ V: preconditioned conjugate gradients on S X = V, preconditioned by the exact inverse of the
  merged block P = G ⊗ A + δI, (A, G) = nearest_kronecker(terms) (below), through the same
  eigendecomposition (⊗ here and below on the row-major vec(Θ), as in :class:`~continual_blr.types.KronBlock`).
* sampling, "perturb and solve": r = √δ E₀ + Σ_k G_k^{1/2} E_k A_k^{1/2} with independent standard
  normal E₀, E_k has Cov(vec r) = δI + Σ_k G_k ⊗ A_k = S, so z = S⁻¹ r has Cov(z) = S⁻¹ S S⁻¹ = S⁻¹.

:meth:`KronPosterior.merged` replaces Σ_k A_k ⊗ G_k by its nearest Kronecker product in Frobenius
norm (Van Loan & Pitsianis 1993), computed exactly from the K×K Gram matrices of the factors. It is a
*different* Gaussian (its precision can differ from S by a factor of several along some directions).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import torch
from torch import Tensor

from ..types import KronCurvature, ParamDict, Structure, flatten
from .base import GaussianPosterior, randn_like
from .kron_coupling import KronCoupling
from .kron_solve import CG_MAX_ITER, Eig, cg_tolerance, eig_solve, kron_eig, kron_matvec, pcg, psd_sqrt

__all__ = ["KronPosterior", "nearest_kronecker", "kron_layers"]


def _frobenius(stack: Tensor, tiny: float) -> Tensor:
    """‖X_k‖_F of each matrix of a stack, scaled by its largest entry first so that squares cannot overflow."""
    peak = stack.abs().amax(dim=(1, 2)).clamp_min(tiny)
    return peak * (stack / peak[:, None, None]).flatten(1).norm(dim=1)


def nearest_kronecker(terms: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """argmin_{A,G} ‖Σ_k A_k ⊗ G_k − A ⊗ G‖_F for symmetric PSD factors.

    The rearranged matrix R = Σ_k vec(A_k) vec(G_k)ᵀ has rank ≤ K, so its leading singular pair is
    found in the span of the factors: with Gram matrices `(M_A)_{ij} = ⟨A_i, A_j⟩` and
    `(M_G)_{ij} = ⟨G_i, G_j⟩`, the coefficients c of A = Σ c_i A_i are the leading eigenvector of
    M_G M_A, and G = Σ_i ⟨A_i, A⟩ G_i / ‖A‖². For PSD factors all Gram entries are ≥ 0, so c ≥ 0
    (Perron–Frobenius) and A, G stay PSD.

    Terms with a zero factor (e.g. an unused head's G = 0 in a task-incremental stream) add nothing to the sum
    and are left out; if every term has one, the nearest product is the zero term (0 · A₁, 0 · G₁).

    Returns:
        (A, G). For a single term, that term.
    """
    if len(terms) == 1:
        return terms[0]
    live = [(a, g) for a, g in terms if bool(a.any()) and bool(g.any())]
    if len(live) < len(terms):
        return nearest_kronecker(live) if live else (torch.zeros_like(terms[0][0]), torch.zeros_like(terms[0][1]))
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

    Immutable once built: the eigendecompositions and square roots the solves and samples need are
    computed on first use and cached.

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
        self._eig: list[Eig] | None = None  # per block: exact (≤ 1 term) or the merged preconditioner (≥ 2)
        self._sqrt: list[list[tuple[Tensor, Tensor]]] | None = None  # per block: (G_k^{1/2}, A_k^{1/2})

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
        """One Kronecker term per block: Σ_k A_k ⊗ G_k → nearest Kronecker product (δ kept exact).

        An approximation of q (a different Gaussian), on which ``covariance_diag``, ``logdet_precision``
        and the KL work; sampling and S⁻¹ v do not need it.
        """
        blocks = [(w, b, [nearest_kronecker(terms)] if terms else []) for w, b, terms in self.blocks]
        return KronPosterior(self.mean, blocks, self.diag, self.delta)

    def coupling(self, rank: int | None = None) -> Callable[[ParamDict], ParamDict]:
        """v ↦ R v, the off-diagonal part of the precision, R = S_r − diag(S), for a coupled diagonal step.

        Per term (A_k, G_k) of a block, A_k = U Λ Uᵀ is cut to its ``rank`` largest eigenpairs A_k⁽ʳ⁾ = U_r Λ_r U_rᵀ
        and the rest A_k − A_k⁽ʳ⁾ (PSD) is kept on the diagonal only:

            S_r = Σ_k [G_k ⊗ A_k⁽ʳ⁾ + Diag(diag(G_k) ⊗ diag(A_k − A_k⁽ʳ⁾))] + δI   (+ the diagonal parameters)

        a PSD precision whose diagonal is diag(S) exactly (:meth:`precision_diag`) and which is S itself when
        ``rank`` is None or at least every A_k's size. Then R Θ = Σ_k [G_k (Θ U_r) Λ_r U_rᵀ − (diag(G_k)
        diag(A_k⁽ʳ⁾)ᵀ) ⊙ Θ], 4 d_out d_in r + 2 d_out² r flops per term instead of the exact product's
        2 d_out d_in² + 2 d_out² d_in (for permuted MNIST's first layer, 785 inputs, rank 64: 21 against 139 MFLOP).
        The eigendecompositions are made once, here (:func:`~continual_blr.posteriors.kron_solve.eigh`).
        Parameters outside the blocks have no coupling (zero). ``v`` may carry leading batch axes.

        Returns:
            ``rank`` None: a function of parameter dicts. Otherwise a
            :class:`~continual_blr.posteriors.kron_coupling.KronCoupling`, which also acts on one flat vector
            (:meth:`~continual_blr.posteriors.kron_coupling.KronCoupling.flat`).
        """
        if rank is not None and not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1):
            raise ValueError(f"rank: must be an integer >= 1 or None, got {rank!r}")
        if rank is None:  # exact: S v − diag(S) v
            diag = self.precision_diag()

            def exact(v: ParamDict) -> ParamDict:
                full = self.precision_matvec({k: v[k] for k in self.mean})
                return {k: full[k] - diag[k] * v[k] for k in full}

            return exact
        return KronCoupling(self.mean, self.blocks, rank)

    # ----- layout helpers ----------------------------------------------------------------------
    def _lead(self, v: ParamDict, name: str) -> tuple[int, ...]:
        """Leading (batch / sample) axes of ``v[name]`` beyond the parameter's own shape."""
        return tuple(v[name].shape[: v[name].dim() - self.mean[name].dim()])

    def _theta(self, v: ParamDict, w: str, b: str | None) -> Tensor:
        """Θ = [W.reshape(d_out, −1) | b], shape [*lead, d_out, d_in] (``v`` may carry leading axes)."""
        lead = self._lead(v, w)
        wt = v[w].reshape(*lead, self.mean[w].shape[0], -1)
        return torch.cat([wt, v[b].unsqueeze(-1)], dim=-1) if b is not None else wt

    def _split_theta(self, theta: Tensor, w: str, b: str | None, out: ParamDict, lead: tuple[int, ...] = ()) -> None:
        shape_w = self.mean[w].shape
        if b is not None:
            out[w] = theta[..., :-1].reshape(*lead, *shape_w)
            out[b] = theta[..., -1]
        else:
            out[w] = theta.reshape(*lead, *shape_w)

    def _block_eigs(self) -> list[Eig]:
        """Per block (U_G, U_A, D), D[o, j] = λ_G[o] λ_A[j] + δ, of its one-term form (cached).

        Exact for a block with 0 or 1 term; for K ≥ 2 terms it is the merged block
        nearest_kronecker(terms) + δI, used as the conjugate-gradient preconditioner.

        Raises:
            ValueError: if some D ≤ 0 (singular precision, or singular preconditioner); use δ > 0.
        """
        if self._eig is None:
            eig = []
            for w, b, terms in self.blocks:
                d_out = self.mean[w].shape[0]
                d_in = self.mean[w][0].numel() + (b is not None)
                term = nearest_kronecker(terms) if terms else None
                u_g, u_a, d = kron_eig(term, self.delta, d_out, d_in, self.mean[w])
                if (d <= 0).any():
                    what = "precision" if len(terms) <= 1 else "nearest-Kronecker preconditioner"
                    raise ValueError(f"KronPosterior: {what} of layer {w!r} is singular; use delta > 0")
                eig.append((u_g, u_a, d))
            self._eig = eig
        return self._eig

    def _eigs(self) -> list[Eig]:
        """:meth:`_block_eigs`, for operations that are exact only with at most one term per block.

        Raises:
            ValueError: if a block holds K ≥ 2 terms.
        """
        for w, _, terms in self.blocks:
            if len(terms) > 1:
                raise ValueError(
                    f"KronPosterior: layer {w!r} holds {len(terms)} Kronecker terms; covariance_diag, log-det, "
                    "log_prob and the KL need one term per layer — .merged() gives the nearest-Kronecker "
                    "approximation (covariance_matvec and sampling are exact for any number of terms)"
                )
        return self._block_eigs()

    def _sqrts(self) -> list[list[tuple[Tensor, Tensor]]]:
        """Per block with K ≥ 2 terms the PSD square roots [(G_k^{1/2}, A_k^{1/2})] (cached; [] otherwise)."""
        if self._sqrt is None:
            self._sqrt = [
                [(psd_sqrt(g), psd_sqrt(a)) for a, g in terms] if len(terms) > 1 else [] for _, _, terms in self.blocks
            ]
        return self._sqrt

    def _solve(self, i: int, v: Tensor) -> Tensor:
        """S_i⁻¹ V for block i, V: [..., d_out, d_in]. Exact for ≤ 1 term, else PCG (see ``covariance_matvec``)."""
        terms = self.blocks[i][2]
        eig = self._block_eigs()[i]
        if len(terms) <= 1:
            return eig_solve(eig, v)
        res = pcg(lambda x: kron_matvec(terms, self.delta, x), lambda r: eig_solve(eig, r), v,
                  cg_tolerance(v.dtype), CG_MAX_ITER)
        if not res.converged:
            warnings.warn(
                f"KronPosterior: conjugate gradients for layer {self.blocks[i][0]!r} did not reach relative "
                f"residual {cg_tolerance(v.dtype):g} in {CG_MAX_ITER} iterations; S⁻¹v is approximate",
                RuntimeWarning,
                stacklevel=3,
            )
        return res.solution

    # ----- the interface -----------------------------------------------------------------------
    def precision_matvec(self, v: ParamDict) -> ParamDict:
        """S v, exact for any number of terms: Σ_k G_k Θ A_k + δΘ per block, (diag + δ) v elsewhere.

        ``v`` may carry leading batch axes (e.g. [n, *param_shape] for n vectors at once).
        """
        out: ParamDict = {}
        for w, b, terms in self.blocks:
            self._split_theta(kron_matvec(terms, self.delta, self._theta(v, w, b)), w, b, out, self._lead(v, w))
        for k, s in self.diag.items():
            out[k] = (s + self.delta) * v[k]
        return out

    def covariance_matvec(self, v: ParamDict) -> ParamDict:
        """S⁻¹ v, block by block. ``v`` may carry leading batch axes ([n, *param_shape]).

        * Block with 0 or 1 term: exact, U_G ((U_Gᵀ V U_A) / D) U_Aᵀ.
        * Block with K ≥ 2 terms: preconditioned conjugate gradients (vectorised over the batch) on

              Σ_k G_k X A_k + δ X = V,

          with the exact matvec on the left and as preconditioner the exact inverse of the merged block
          P = G ⊗ A + δI, (A, G) = nearest_kronecker(terms). It stops when ‖V − S X‖_F ≤ tol ‖V‖_F
          (recursive residual, per right-hand side) with tol = ``CG_RTOL_FLOAT64`` = 1e-10 for float64
          and ``CG_RTOL_FLOAT32`` = 1e-6 otherwise, or after ``CG_MAX_ITER`` = 200 iterations (then a
          ``RuntimeWarning`` is issued and the last iterate returned).
        * Other parameters: v / (diag + δ).
        """
        out: ParamDict = {}
        for i, (w, b, _) in enumerate(self.blocks):
            self._split_theta(self._solve(i, self._theta(v, w, b)), w, b, out, self._lead(v, w))
        for k, s in self.diag.items():
            out[k] = v[k] / (s + self.delta)
        return out

    def logdet_precision(self) -> Tensor:
        """log|S| = Σ_blocks Σ log D + Σ log(diag + δ). Needs at most one term per block.

        Raises:
            ValueError: if a block holds ≥ 2 terms (use ``.merged()`` for the nearest-Kronecker approximation).
        """
        total = sum(torch.log(d).sum() for _, _, d in self._eigs())
        total = total + sum(torch.log(s + self.delta).sum() for s in self.diag.values())
        return torch.as_tensor(total, dtype=next(iter(self.mean.values())).dtype)

    def sample_noise(self, generator: torch.Generator | None, n: int | None = None) -> ParamDict:
        """z ~ N(0, S⁻¹), exact for any number of terms (with a leading sample axis of size ``n`` if given).

        All noise comes from ``generator`` (deterministic for a given seed), block by block in order, then
        the diagonal parameters.

        * Block with 0 or 1 term: z = U_G (E / √D) U_Aᵀ, E standard normal.
        * Block with K ≥ 2 terms, perturb and solve: with independent standard normal E₀, E_1, …, E_K,

              r = √δ E₀ + Σ_k G_k^{1/2} E_k A_k^{1/2},   Cov(vec r) = δI + Σ_k G_k ⊗ A_k = S,
              z = S⁻¹ r  (conjugate gradients, see :meth:`covariance_matvec`),   Cov(z) = S⁻¹ S S⁻¹ = S⁻¹,

          exact up to the CG tolerance (E₀ is not drawn when δ = 0).
        * Other parameters: E / √(diag + δ).
        """
        out: ParamDict = {}
        lead = () if n is None else (n,)
        for i, ((w, b, terms), (u_g, u_a, d)) in enumerate(zip(self.blocks, self._block_eigs())):
            if len(terms) <= 1:
                eps = randn_like(d, generator, n)
                self._split_theta(u_g @ (eps * d.rsqrt()) @ u_a.mT, w, b, out, lead)
                continue
            r = torch.zeros(lead + tuple(d.shape), dtype=d.dtype, device=d.device)
            if self.delta > 0:
                r = r + math.sqrt(self.delta) * randn_like(d, generator, n)
            for g_half, a_half in self._sqrts()[i]:
                r = r + g_half @ randn_like(d, generator, n) @ a_half
            self._split_theta(self._solve(i, r), w, b, out, lead)
        for k, s in self.diag.items():
            out[k] = randn_like(s, generator, n) * (s + self.delta).rsqrt()
        return out

    def precision_diag(self) -> ParamDict:
        """diag(S), exact for any number of terms: Σ_k diag(G_k)[o] · diag(A_k)[j] + δ at Θ[o, j] per block,
        ``diag + δ`` elsewhere (the diagonal of G ⊗ A on the row-major vec(Θ) is diag(G) ⊗ diag(A)).

        It is the precision of the mean-field Gaussian nearest to this one in KL(q ‖ p) over diagonal q: the
        diagonal BLR step's prior part when this posterior is the prior (``BLRParams.carry = "kfac"``).
        """
        out: ParamDict = {}
        for w, b, terms in self.blocks:
            ref = self.mean[w]
            d_out = ref.shape[0]
            d_in = ref[0].numel() + (b is not None)
            diag = torch.full((d_out, d_in), self.delta, dtype=ref.dtype, device=ref.device)
            for a, g in terms:
                diag = diag + torch.outer(torch.diagonal(g), torch.diagonal(a))
            self._split_theta(diag, w, b, out)
        for k, s in self.diag.items():
            out[k] = s + self.delta
        return out

    def covariance_diag(self) -> ParamDict:
        """diag(S⁻¹): Σ_{o', j'} U_G[o, o']² U_A[j, j']² / D[o', j'] per block. Needs at most one term per block.

        Raises:
            ValueError: if a block holds ≥ 2 terms (use ``.merged()`` for the nearest-Kronecker approximation).
        """
        out: ParamDict = {}
        for (w, b, _), (u_g, u_a, d) in zip(self.blocks, self._eigs()):
            # diag(S⁻¹)[o, j] = Σ_{o', j'} U_G[o, o']² U_A[j, j']² / D[o', j']
            self._split_theta((u_g**2) @ (1.0 / d) @ (u_a**2).mT, w, b, out)
        for k, s in self.diag.items():
            out[k] = 1.0 / (s + self.delta)
        return out

    def trace_precision_times_covariance(self, other: GaussianPosterior) -> Tensor:
        """tr(S_self S_other⁻¹): closed form when ``other`` is a KronPosterior with the same layers (which
        then needs at most one term per block, else ``ValueError``), dense otherwise."""
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
        out._eig, out._sqrt = self._eig, self._sqrt
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

