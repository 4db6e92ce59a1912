"""``kron_solve.eigh``: the eigendecomposition of Kronecker factors survives LAPACK's float32 non-convergence.

A K-FAC input factor A = E[a aᵀ] of MNIST (784 pixels + bias, 261 pixels always 0) made float32 ``syevd`` fail
with one MKL thread ("failed to converge … too many repeated eigenvalues"), which crashed ``blr`` with
``structure: kron`` on permuted MNIST at its first step; similar matrices come back with NaN eigenvalues and no
error. ``eigh`` redoes such a matrix in float64.

Oracle: float64 ``torch.linalg.eigh`` of the same matrix (eigenvalues) and the reconstruction U diag(λ) Uᵀ = M.
"""

import pytest
import torch

from continual_blr.posteriors import kron_solve
from continual_blr.posteriors.kron_solve import eig_solve, eigh, kron_eig

# float32 eigenvalues of a matrix with largest eigenvalue λ_max agree with float64's to ~ n · eps32 · λ_max;
# n = 785 gives ≈ 1e-4 relative; the reconstruction error is of the same order.
EIG_RTOL = 1e-4


def _mnist_like_factor(rows: int, scale: float, gen: torch.Generator) -> torch.Tensor:
    """A = scale · BᵀB / rows for nonnegative B [rows, 785], 261 random pixel columns zeroed, bias column 1:
    the shape of a K-FAC input factor of an MNIST MLP's first layer (PSD, ~rows nonzero eigenvalues)."""
    b = torch.randn(rows, 785, generator=gen).abs()
    b[:, torch.randperm(784, generator=gen)[:261]] = 0
    b[:, -1] = 1
    return scale * (b.T @ b) / rows


def _check(m: torch.Tensor, lam: torch.Tensor, u: torch.Tensor) -> None:
    assert lam.dtype == m.dtype and u.dtype == m.dtype
    lam64 = torch.linalg.eigvalsh(m.double())
    top = lam64.abs().max().item()
    torch.testing.assert_close(lam.double(), lam64, rtol=0, atol=EIG_RTOL * top)
    torch.testing.assert_close((u * lam) @ u.mT, m, rtol=0, atol=EIG_RTOL * top)


def test_float32_failure_is_redone_in_float64(monkeypatch):
    """A planted float32 failure: ``eigh`` still returns the float64 decomposition, in float32."""
    real = torch.linalg.eigh

    def fails_in_float32(m, *args, **kwargs):
        if m.dtype == torch.float32:
            raise torch.linalg.LinAlgError("planted: float32 eigh did not converge")
        return real(m, *args, **kwargs)

    gen = torch.Generator().manual_seed(0)
    m = _mnist_like_factor(64, 100.0, gen)
    monkeypatch.setattr(torch.linalg, "eigh", fails_in_float32)
    lam, u = eigh(m)
    _check(m, lam, u)

    # kron_eig goes through the same fallback: its inverse is the dense block's inverse.
    a = _mnist_like_factor(8, 1.0, gen)[:20, :20] + 0.1 * torch.eye(20)
    g = torch.tensor([[2.0, 0.5], [0.5, 1.0]])
    eig = kron_eig((a, g), 0.5, 2, 20, a)
    v = torch.randn(2, 20, generator=gen)
    dense = torch.kron(g.double(), a.double()) + 0.5 * torch.eye(40, dtype=torch.float64)
    want = torch.linalg.solve(dense, v.double().reshape(-1)).reshape(2, 20)
    torch.testing.assert_close(eig_solve(eig, v).double(), want, rtol=1e-4, atol=1e-5)


def test_float32_nan_is_redone_in_float64(monkeypatch):
    """A planted silent failure (NaN eigenvalues, no error) is redone in float64 as well."""
    real = torch.linalg.eigh

    def nan_in_float32(m, *args, **kwargs):
        lam, u = real(m, *args, **kwargs)
        if m.dtype == torch.float32:
            lam = lam.clone()
            lam[-1] = float("nan")
        return lam, u

    m = _mnist_like_factor(64, 100.0, torch.Generator().manual_seed(1))
    monkeypatch.setattr(torch.linalg, "eigh", nan_in_float32)
    lam, u = eigh(m)
    _check(m, lam, u)


def test_float64_failure_is_not_hidden(monkeypatch):
    """Nothing is left to fall back to in float64: the error reaches the caller."""

    def always_fails(m, *args, **kwargs):
        raise torch.linalg.LinAlgError("planted")

    monkeypatch.setattr(torch.linalg, "eigh", always_fails)
    with pytest.raises(torch.linalg.LinAlgError):
        eigh(torch.eye(3, dtype=torch.float64))


def test_mnist_like_factors_with_one_thread():
    """The failure as it occurred: MNIST-shaped factors with one torch thread (on the MKL build this was found
    with, plain float32 eigh raised on 2 of these 30 and returned NaN eigenvalues on another). Every one
    decomposes to float64's eigenvalues."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        plain_failures = 0
        for trial in range(30):
            rows = (64, 128, 256)[trial % 3]
            scale = (1.0, 100.0, 2000.0)[(trial // 3) % 3]
            m = _mnist_like_factor(rows, scale, gen)
            try:
                plain = torch.linalg.eigh(m)
                plain_failures += int(not all(torch.isfinite(t).all() for t in plain))
            except torch.linalg.LinAlgError:
                plain_failures += 1
            lam, u = kron_solve.eigh(m)
            _check(m, lam, u)
    finally:
        torch.set_num_threads(threads)
    print(f"plain float32 eigh failed on {plain_failures} of 30")


def test_a_decomposition_that_succeeds_is_unchanged():
    """The docstring's guarantee: where float32 eigh converges to finite values, ``eigh`` returns exactly its
    result (no float64 round trip), so Kronecker posteriors that worked before give the same numbers."""
    gen = torch.Generator().manual_seed(3)
    b = torch.randn(40, 12, generator=gen)
    m = b.T @ b / 40 + 0.1 * torch.eye(12)
    lam, u = eigh(m)
    lam_plain, u_plain = torch.linalg.eigh(m)
    assert torch.equal(lam, lam_plain) and torch.equal(u, u_plain)
