"""Linear algebra for one Kronecker block of :class:`~continual_blr.posteriors.KronPosterior` (pure functions).

A block's precision acts on the layer matrix Θ ∈ R^{d_out × d_in} as

    S Θ = Σ_k G_k Θ A_k + δ Θ

(G ⊗ A on the row-major vec(Θ)). Every function here accepts any number of leading batch axes on Θ
(several right-hand sides / samples at once, e.g. shape [n, d_out, d_in]) and works in the dtype and
on the device of its inputs.

* :func:`kron_eig` — the eigendecomposition of a block with at most one term,
  S = (U_G ⊗ U_A) diag(vec D) (U_G ⊗ U_A)ᵀ with D[o, j] = λ_G[o] λ_A[j] + δ;
  :func:`eig_solve` applies its inverse exactly.
* :func:`pcg` — preconditioned conjugate gradients for S X = V when the block holds several terms
  (no eigendecomposition of Σ_k G_k ⊗ A_k exists in Kronecker form).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "CG_RTOL_FLOAT32",
    "CG_RTOL_FLOAT64",
    "CG_MAX_ITER",
    "CGResult",
    "cg_tolerance",
    "kron_matvec",
    "kron_eig",
    "eig_solve",
    "eigh",
    "psd_sqrt",
    "pcg",
]

#: CG stops once ‖r‖ / ‖v‖ ≤ this for float64 right-hand sides …
CG_RTOL_FLOAT64 = 1e-10
#: … and for every other dtype (float32; half precision will usually run to :data:`CG_MAX_ITER` instead).
CG_RTOL_FLOAT32 = 1e-6
#: CG gives up after this many iterations (in exact arithmetic it terminates in ≤ d_out·d_in).
CG_MAX_ITER = 200

#: (U_G, U_A, D) of a one-term block, D[o, j] = λ_G[o] λ_A[j] + δ.
Eig = tuple[Tensor, Tensor, Tensor]


class CGResult(NamedTuple):
    """Output of :func:`pcg`.

    Attributes:
        solution: X ≈ S⁻¹ V, shaped like V.
        iterations: CG iterations run (the slowest right-hand side's count).
        converged: whether every right-hand side reached the tolerance.
    """

    solution: Tensor
    iterations: int
    converged: bool


def cg_tolerance(dtype: torch.dtype) -> float:
    """The relative-residual tolerance for ``dtype``: :data:`CG_RTOL_FLOAT64` or :data:`CG_RTOL_FLOAT32`."""
    return CG_RTOL_FLOAT64 if dtype == torch.float64 else CG_RTOL_FLOAT32


def kron_matvec(terms: list[tuple[Tensor, Tensor]], delta: float, theta: Tensor) -> Tensor:
    """S Θ = Σ_k G_k Θ A_k + δ Θ for ``terms`` = [(A_1, G_1), …], exact; Θ: [..., d_out, d_in]."""
    res = delta * theta
    for a, g in terms:
        res = res + g @ theta @ a
    return res


def eigh(m: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.eigh`` of a symmetric matrix, redone in float64 where the first attempt fails.

    LAPACK's divide-and-conquer ``syevd`` can fail to converge in float32 on a PSD matrix with many (near-)zero
    eigenvalues: a K-FAC input factor A = E[a aᵀ] of permuted MNIST's first steps (261 of its 785 rows zero, for
    pixels no image had lit; ~650 eigenvalues within round-off of 0) fails that way with one MKL thread; on
    similar matrices it returns NaN eigenvalues without raising. In float64 the same matrices decompose. The fallback runs only
    where the first attempt raised or returned a non-finite value, so a decomposition that succeeds is
    unchanged; the result is cast back to ``m``'s dtype.

    Returns:
        (eigenvalues ascending, eigenvectors as columns), in ``m``'s dtype.
    """
    try:
        lam, u = torch.linalg.eigh(m)
        if m.dtype == torch.float64 or (torch.isfinite(lam).all() and torch.isfinite(u).all()):
            return lam, u
    except torch.linalg.LinAlgError:
        if m.dtype == torch.float64:
            raise
    lam, u = torch.linalg.eigh(m.to(torch.float64))
    return lam.to(m.dtype), u.to(m.dtype)


def kron_eig(term: tuple[Tensor, Tensor] | None, delta: float, d_out: int, d_in: int, like: Tensor) -> Eig:
    """Eigendecomposition of the one-term block G ⊗ A + δI (or δI when ``term`` is None).

    With A = U_A Λ_A U_Aᵀ and G = U_G Λ_G U_Gᵀ (:func:`eigh`, eigenvalues clamped at 0):

        S = (U_G ⊗ U_A) diag(vec D) (U_G ⊗ U_A)ᵀ,   D[o, j] = λ_G[o] λ_A[j] + δ

    (Martens & Grosse 2015, Sec. 6.3).

    Args:
        term: (A, G) with A: (d_in, d_in), G: (d_out, d_out) symmetric PSD; None for no term.
        delta: δ ≥ 0.
        d_out, d_in: the block's shape (used when ``term`` is None).
        like: dtype / device reference (used when ``term`` is None).

    Returns:
        (U_G, U_A, D). D may hold zeros (singular block); the caller decides.
    """
    if term is None:
        u_g = torch.eye(d_out, dtype=like.dtype, device=like.device)
        u_a = torch.eye(d_in, dtype=like.dtype, device=like.device)
        return u_g, u_a, torch.full((d_out, d_in), delta, dtype=like.dtype, device=like.device)
    a, g = term
    la, u_a = eigh(a)
    lg, u_g = eigh(g)
    return u_g, u_a, torch.outer(lg.clamp_min(0), la.clamp_min(0)) + delta


def eig_solve(eig: Eig, v: Tensor) -> Tensor:
    """S⁻¹ V = U_G ((U_Gᵀ V U_A) / D) U_Aᵀ for a one-term block (exact); V: [..., d_out, d_in]."""
    u_g, u_a, d = eig
    return u_g @ ((u_g.mT @ v @ u_a) / d) @ u_a.mT


def psd_sqrt(m: Tensor) -> Tensor:
    """The symmetric PSD square root M^{1/2} = U diag(√max(λ, 0)) Uᵀ of a symmetric matrix (via :func:`eigh`)."""
    lam, u = eigh(m)
    return (u * lam.clamp_min(0).sqrt()) @ u.mT


def _dot(x: Tensor, y: Tensor) -> Tensor:
    """⟨X, Y⟩_F over the last two axes (one value per leading index)."""
    return (x * y).sum(dim=(-2, -1))


def pcg(
    matvec: Callable[[Tensor], Tensor],
    precond: Callable[[Tensor], Tensor],
    rhs: Tensor,
    tol: float,
    max_iter: int = CG_MAX_ITER,
) -> CGResult:
    """Preconditioned conjugate gradients for S X = V, vectorised over V's leading axes.

    Every right-hand side V_i (the last two axes) runs its own CG recursion (its own step sizes α, β);
    they share the calls to ``matvec`` / ``precond``. A right-hand side is frozen once its recursively
    updated residual r = V − S X satisfies

        ‖r‖_F ≤ tol · ‖V‖_F

    (V = 0 gives X = 0 at once). The loop ends when all are frozen or after ``max_iter`` iterations,
    whichever comes first; ``converged`` tells which.

    Args:
        matvec: X ↦ S X for symmetric positive-definite S (batched over leading axes).
        precond: R ↦ P⁻¹ R for a symmetric positive-definite P ≈ S (batched over leading axes).
        rhs: V, shape [..., d_out, d_in].
        tol: relative residual at which to stop (see :func:`cg_tolerance`).
        max_iter: iteration cap.

    Returns:
        :class:`CGResult` (solution, iterations, converged).
    """
    x = torch.zeros_like(rhs)
    r = rhs.clone()
    bound = tol * rhs.norm(dim=(-2, -1))
    active = r.norm(dim=(-2, -1)) > bound
    z = precond(r)
    p = z
    rz = _dot(r, z)
    it = 0
    while it < max_iter and bool(active.any()):
        it += 1
        sp = matvec(p)
        psp = _dot(p, sp)
        alpha = torch.where(active, rz / torch.where(active, psp, torch.ones_like(psp)), torch.zeros_like(psp))
        x = x + alpha[..., None, None] * p
        r = r - alpha[..., None, None] * sp
        active = active & (r.norm(dim=(-2, -1)) > bound)
        z = precond(r)
        rz_new = _dot(r, z)
        beta = torch.where(active, rz_new / torch.where(active, rz, torch.ones_like(rz)), torch.zeros_like(rz))
        p = z + beta[..., None, None] * p
        rz = rz_new
    return CGResult(x, it, not bool(active.any()))
