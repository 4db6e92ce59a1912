"""KronPosterior with several Kronecker terms per layer: S⁻¹v by conjugate gradients and exact sampling
("perturb and solve"), checked against the dense precision of ``to_dense()``."""

import warnings

import pytest
import torch

from continual_blr.posteriors import KronPosterior
from continual_blr.posteriors.kron_solve import CG_RTOL_FLOAT32, eig_solve, kron_eig, kron_matvec, pcg
from continual_blr.types import KronBlock, KronCurvature, flatten

DT = torch.float64
DELTA = 0.5

# S⁻¹v against torch.linalg.solve of the dense precision: CG stops at relative residual 1e-10 (float64); the
# example's κ(S) ≈ 46, so the relative error of S⁻¹v is ≲ 5e-9.
SOLVE64 = dict(rtol=1e-8, atol=1e-10)
# float32: CG stops at relative residual CG_RTOL_FLOAT32 = 1e-6, float32 round-off ≈ 1e-7 · κ.
SOLVE32 = dict(rtol=1e-4, atol=1e-5)
# Monte-Carlo: n draws, each entry of the sample covariance Ĉ_ij = (1/n) Σ z_i z_j (known mean 0) has standard
# deviation √((Σ_ii Σ_jj + Σ_ij²) / n); accept |Ĉ_ij − Σ_ij| ≤ MC_SIGMAS of those, elementwise. For the 27·28/2
# = 378 distinct entries the chance that one exceeds 5σ is ≈ 378 · 5.7e-7 ≈ 2e-4 (the seeds are fixed anyway).
MC_DRAWS = 200_000
MC_SIGMAS = 5.0
# secondary Monte-Carlo checks (float32, the add_precision example) use fewer draws; float32 adds an absolute
# allowance for round-off.
MC_DRAWS_SMALL = 50_000
MC_SLACK32 = 1e-4


def _spd(n, g, scale=1.0):
    a = torch.randn(n, n, generator=g, dtype=DT)
    return scale * (a @ a.T / n + 0.1 * torch.eye(n, dtype=DT))


def _posterior(seed=0, n_terms=(2, 3)):
    """A Linear(3 → 3) with bias (d_in = 4, d_out = 3) holding n_terms[0] terms, a Conv2d(1 → 3, k = 2) without
    bias (d_in = 4, d_out = 3) holding n_terms[1] terms, and a diagonal-only "norm" vector; δ = 0.5."""
    g = torch.Generator().manual_seed(seed)
    m = {
        "lin.weight": torch.randn(3, 3, generator=g, dtype=DT),
        "lin.bias": torch.randn(3, generator=g, dtype=DT),
        "conv.weight": torch.randn(3, 1, 2, 2, generator=g, dtype=DT),
        "norm.weight": torch.randn(3, generator=g, dtype=DT),
    }
    # factors of quite different shapes and scales, so that the sum is far from a Kronecker product
    blocks = [
        ("lin.weight", "lin.bias", [(_spd(4, g, 3.0**k), _spd(3, g, 0.5**k)) for k in range(n_terms[0])]),
        ("conv.weight", None, [(_spd(4, g, 2.0**-k), _spd(3, g, 4.0**k)) for k in range(n_terms[1])]),
    ]
    return KronPosterior(m, blocks, {"norm.weight": torch.rand(3, generator=g, dtype=DT) + 0.2}, DELTA)


def _rand_like(post, g, n=None):
    lead = () if n is None else (n,)
    return {k: torch.randn(*lead, *t.shape, generator=g, dtype=t.dtype) for k, t in post.mean.items()}


def _rows(d, post):
    """ParamDict with a leading axis n → [n, P] in ``flatten`` order."""
    return torch.cat([d[k].reshape(d[k].shape[0], -1) for k in post.mean], dim=1)


def _mc_z_scores(draws, sigma):
    """|Ĉ − Σ| / (standard error of Ĉ), elementwise, for zero-mean draws [n, P]."""
    n = draws.shape[0]
    cov_hat = draws.T @ draws / n
    var = sigma.diagonal()
    se = ((var[:, None] * var[None, :] + sigma**2) / n).sqrt()
    return (cov_hat - sigma).abs() / se


# ----- S⁻¹ v ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_terms", [(2, 3), (1, 2), (0, 3)])
def test_covariance_matvec_equals_dense_solve(n_terms):
    post = _posterior(n_terms=n_terms)
    _, s = post.to_dense()
    g = torch.Generator().manual_seed(1)
    v = _rand_like(post, g)
    torch.testing.assert_close(flatten(post.covariance_matvec(v)), torch.linalg.solve(s, flatten(v)), **SOLVE64)
    torch.testing.assert_close(flatten(post.precision_matvec(post.covariance_matvec(v))), flatten(v), **SOLVE64)
    # several right-hand sides at once (leading batch axis), CG vectorised over them
    vb = _rand_like(post, g, n=5)
    ref = torch.linalg.solve(s, _rows(vb, post).T).T
    torch.testing.assert_close(_rows(post.covariance_matvec(vb), post), ref, **SOLVE64)
    torch.testing.assert_close(_rows(post.precision_matvec(vb), post), _rows(vb, post) @ s, **SOLVE64)


def test_pcg_batched_zero_rhs_and_iteration_cap():
    post = _posterior()
    terms = post.blocks[1][2]
    eig = post._block_eigs()[1]
    mv = lambda x: kron_matvec(terms, DELTA, x)  # noqa: E731
    pre = lambda r: eig_solve(eig, r)  # noqa: E731
    v = torch.randn(4, 3, 4, generator=torch.Generator().manual_seed(2), dtype=DT)
    v[2] = 0.0  # a zero right-hand side stays exactly zero while the others iterate
    res = pcg(mv, pre, v, 1e-10)
    assert res.converged and res.iterations <= 12  # 12 = d_out·d_in: the exact-arithmetic bound
    assert torch.equal(res.solution[2], torch.zeros(3, 4, dtype=DT))
    for i in (0, 1, 3):  # batched == one right-hand side at a time
        torch.testing.assert_close(res.solution[i], pcg(mv, pre, v[i], 1e-10).solution, **SOLVE64)
    # the merged preconditioner alone is not the inverse: one iteration cannot reach the tolerance
    assert not pcg(mv, pre, v, 1e-10, max_iter=1).converged
    # the identity-preconditioned and the eigen path agree for a one-term block
    one = [terms[0]]
    exact = eig_solve(kron_eig(one[0], DELTA, 3, 4, v), v)
    cg = pcg(lambda x: kron_matvec(one, DELTA, x), lambda r: r, v, 1e-12).solution
    torch.testing.assert_close(cg, exact, **SOLVE64)


# ----- sampling ------------------------------------------------------------------------------------------------
def test_sample_covariance_is_exact_and_distinguishes_the_merge():
    post = _posterior()
    m, s = post.to_dense()
    sigma = torch.linalg.inv(s)
    x = _rows(post.sample_noise(torch.Generator().manual_seed(3), n=MC_DRAWS), post)
    z = _mc_z_scores(x, sigma)
    assert z.max() <= MC_SIGMAS, f"sample covariance off by {z.max():.1f} standard errors"
    # the sample mean of sample() is m within MC_SIGMAS standard errors √(Σ_ii / n)
    mean_hat = _rows(post.sample(torch.Generator().manual_seed(4), n=MC_DRAWS), post).mean(0)
    assert ((mean_hat - m).abs() / (sigma.diagonal() / MC_DRAWS).sqrt()).max() <= MC_SIGMAS
    # the same check on the nearest-Kronecker merge must fail: it is a different Gaussian …
    merged = post.merged()
    sigma_merged = torch.linalg.inv(merged.to_dense()[1])
    assert ((sigma_merged - sigma).abs() / (sigma.diagonal()[:, None] * sigma.diagonal()[None, :]).sqrt()).max() > 0.05
    # … and its samples are far outside the tolerance
    xm = _rows(merged.sample_noise(torch.Generator().manual_seed(3), n=MC_DRAWS), post)
    assert _mc_z_scores(xm, sigma).max() > 4 * MC_SIGMAS


def test_sampling_is_seeded():
    post = _posterior()
    a = post.sample(torch.Generator().manual_seed(5), n=3)
    b = post.sample(torch.Generator().manual_seed(5), n=3)
    c = post.sample(torch.Generator().manual_seed(6), n=3)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(flatten(a), flatten(c))
    # the caches are shared by with_mean and do not change the draw
    other = post.with_mean({k: torch.zeros_like(v) for k, v in post.mean.items()})
    d = other.sample_noise(torch.Generator().manual_seed(5), n=3)
    e = post.sample_noise(torch.Generator().manual_seed(5), n=3)
    assert all(torch.equal(d[k], e[k]) for k in d)


def test_one_term_sampling_path_is_unchanged():
    """One term per block: z = U_G (E / √D) U_Aᵀ with E drawn block by block from the generator, then diag."""
    post = _posterior(n_terms=(1, 1))
    got = post.sample_noise(torch.Generator().manual_seed(7), n=2)
    gen = torch.Generator().manual_seed(7)
    for w, b, [(a, g_)] in post.blocks:
        la, u_a = torch.linalg.eigh(a)
        lg, u_g = torch.linalg.eigh(g_)
        d = torch.outer(lg, la) + DELTA
        eps = torch.randn(2, *d.shape, generator=gen, dtype=DT)
        theta = u_g @ (eps * d.rsqrt()) @ u_a.mT
        ref_w = theta[..., :-1] if b is not None else theta
        torch.testing.assert_close(got[w], ref_w.reshape(got[w].shape), rtol=0, atol=0)
        if b is not None:
            torch.testing.assert_close(got[b], theta[..., -1], rtol=0, atol=0)
    s = post.diag["norm.weight"]
    ref = torch.randn(2, 3, generator=gen, dtype=DT) * (s + DELTA).rsqrt()
    torch.testing.assert_close(got["norm.weight"], ref, rtol=0, atol=0)


def test_sample_after_adding_precision_twice():
    """Online Laplace: isotropic prior + two tasks' curvatures = two terms per layer; sample() used to raise."""
    g = torch.Generator().manual_seed(8)
    m = {"w": torch.randn(3, 3, generator=g, dtype=DT), "b": torch.randn(3, generator=g, dtype=DT)}
    prior = KronPosterior.isotropic(m, DELTA, [("w", "b")])
    curv = [KronCurvature([KronBlock("w", "b", _spd(4, g), _spd(3, g))], {}) for _ in range(2)]
    post = prior.add_precision(curv[0]).add_precision(curv[1], scale=2.0)
    assert len(post.blocks[0][2]) == 2
    one = post.sample(torch.Generator().manual_seed(9))
    assert one["w"].shape == (3, 3) and one["b"].shape == (3,)
    many = post.sample(torch.Generator().manual_seed(9), n=MC_DRAWS_SMALL)
    assert many["w"].shape == (MC_DRAWS_SMALL, 3, 3) and torch.isfinite(flatten(one)).all()
    _, s = post.to_dense()
    x = _rows(many, post) - flatten(m)
    assert _mc_z_scores(x, torch.linalg.inv(s)).max() <= MC_SIGMAS


def test_float32():
    post64 = _posterior()
    post = post64.to(dtype=torch.float32)
    _, s = post64.to_dense()
    sigma = torch.linalg.inv(s)
    v = _rand_like(post64, torch.Generator().manual_seed(10), n=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CG must converge: no RuntimeWarning
        got = post.covariance_matvec({k: t.float() for k, t in v.items()})
        x = _rows(post.sample_noise(torch.Generator().manual_seed(11), n=MC_DRAWS_SMALL), post)
    ref = torch.linalg.solve(s, _rows(v, post64).T).T
    torch.testing.assert_close(_rows(got, post).double(), ref, **SOLVE32)
    assert x.dtype == torch.float32 and torch.isfinite(x).all()
    x = x.double()
    n = x.shape[0]
    var = sigma.diagonal()
    se = ((var[:, None] * var[None, :] + sigma**2) / n).sqrt()
    assert ((x.T @ x / n - sigma).abs() <= MC_SIGMAS * se + MC_SLACK32).all()
    assert CG_RTOL_FLOAT32 == 1e-6


def test_exactness_limits_still_raise_for_several_terms():
    post = _posterior()
    for op in (post.logdet_precision, post.covariance_diag):
        with pytest.raises(ValueError, match=r"merged\(\)"):
            op()
    post.merged().logdet_precision()  # the nearest-Kronecker approximation works
