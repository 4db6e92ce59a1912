"""Posteriors against torch.distributions.MultivariateNormal on their dense equivalents (float64)."""

import pytest
import torch
from torch.distributions import MultivariateNormal, kl_divergence

from continual_blr.posteriors import DiagPosterior, FullPosterior, KronPosterior, load_posterior, nearest_kronecker
from continual_blr.types import KronBlock, KronCurvature, flatten, unflatten

from conftest import EXACT

DT = torch.float64


def _spd(n, g, scale=1.0):
    a = torch.randn(n, n, generator=g, dtype=DT)
    return scale * (a @ a.T / n + 0.5 * torch.eye(n, dtype=DT))


def _mean(g):
    # a Linear(3 -> 2) with bias, a Conv2d(1 -> 2, k=2) without bias, and a "norm" vector (no block)
    return {
        "lin.weight": torch.randn(2, 3, generator=g, dtype=DT),
        "lin.bias": torch.randn(2, generator=g, dtype=DT),
        "conv.weight": torch.randn(2, 1, 2, 2, generator=g, dtype=DT),
        "norm.weight": torch.randn(3, generator=g, dtype=DT),
    }


def _diag(g, seed_mean=None):
    m = _mean(g)
    return DiagPosterior(m, {k: torch.rand(v.shape, generator=g, dtype=DT) + 0.3 for k, v in m.items()})


def _kron(g, delta=0.7, n_terms=1):
    m = _mean(g)
    blocks = [
        ("lin.weight", "lin.bias", [(_spd(4, g), _spd(2, g)) for _ in range(n_terms)]),
        ("conv.weight", None, [(_spd(4, g), _spd(2, g)) for _ in range(n_terms)]),
    ]
    return KronPosterior(m, blocks, {"norm.weight": torch.rand(3, generator=g, dtype=DT)}, delta)


def _full(g):
    m = _mean(g)
    p = flatten(m).numel()
    return FullPosterior(m, _spd(p, g))


MAKERS = {"diag": _diag, "kron": _kron, "full": _full}


def _mvn(post):
    m, s = post.to_dense()
    return MultivariateNormal(m, precision_matrix=s)


@pytest.mark.parametrize("structure", list(MAKERS))
def test_log_prob_matches_multivariate_normal(structure, gen):
    post = MAKERS[structure](gen)
    theta = {k: v + torch.randn(v.shape, generator=gen, dtype=DT) for k, v in post.mean.items()}
    torch.testing.assert_close(post.log_prob(theta), _mvn(post).log_prob(flatten(theta)), **EXACT)


@pytest.mark.parametrize("p_struct", list(MAKERS))
@pytest.mark.parametrize("q_struct", list(MAKERS))
def test_kl_matches_multivariate_normal(p_struct, q_struct, gen):
    q = MAKERS[q_struct](gen)
    p = MAKERS[p_struct](gen).with_mean({k: torch.randn(v.shape, generator=gen, dtype=DT) for k, v in q.mean.items()})
    torch.testing.assert_close(q.kl(p), kl_divergence(_mvn(q), _mvn(p)), **EXACT)


@pytest.mark.parametrize("structure", list(MAKERS))
def test_matvecs_match_dense(structure, gen):
    post = MAKERS[structure](gen)
    v = {k: torch.randn(t.shape, generator=gen, dtype=DT) for k, t in post.mean.items()}
    _, s = post.to_dense()
    torch.testing.assert_close(flatten(post.precision_matvec(v)), s @ flatten(v), **EXACT)
    torch.testing.assert_close(flatten(post.covariance_matvec(v)), torch.linalg.solve(s, flatten(v)), **EXACT)
    torch.testing.assert_close(flatten(post.covariance_diag()), torch.diagonal(torch.linalg.inv(s)), **EXACT)


def test_kron_dense_is_kronecker_product(gen):
    """One Linear block without δ: the dense precision is G ⊗ A on row-major vec([W | b])."""
    a, g_ = _spd(4, gen), _spd(2, gen)
    m = {"w": torch.randn(2, 3, generator=gen, dtype=DT), "b": torch.randn(2, generator=gen, dtype=DT)}
    post = KronPosterior(m, [("w", "b", [(a, g_)])], None, 0.0)
    _, dense = post.to_dense()
    # Build the reference independently: Θ = [W | b] row-major; permute to flatten order (W then b).
    ref = torch.kron(g_, a)
    perm = [o * 4 + j for o in range(2) for j in range(3)] + [o * 4 + 3 for o in range(2)]
    torch.testing.assert_close(dense, ref[perm][:, perm], **EXACT)
    # and the matvec equals G Θ A
    theta = torch.cat([m["w"], m["b"][:, None]], 1)
    out = post.precision_matvec(m)
    torch.testing.assert_close(torch.cat([out["w"], out["b"][:, None]], 1), g_ @ theta @ a, **EXACT)


def test_kron_multi_term_matvec_exact_and_merge_is_nearest(gen):
    post = _kron(gen, n_terms=3)
    v = {k: torch.randn(t.shape, generator=gen, dtype=DT) for k, t in post.mean.items()}
    _, s = post.to_dense()
    torch.testing.assert_close(flatten(post.precision_matvec(v)), s @ flatten(v), **EXACT)
    with pytest.raises(ValueError, match="merged"):
        post.logdet_precision()
    # nearest Kronecker product: no perturbation of the returned factors reduces the Frobenius error
    terms = post.blocks[0][2]
    target = sum(torch.kron(a, g_) for a, g_ in terms)
    a, g_ = nearest_kronecker(terms)
    best = torch.linalg.norm(target - torch.kron(a, g_))
    for _ in range(20):
        da = 1e-3 * _spd(4, gen)
        dg = 1e-3 * _spd(2, gen)
        for sa in (-1, 1):
            assert torch.linalg.norm(target - torch.kron(a + sa * da, g_ + sa * dg)) >= best - 1e-12
    post.merged().logdet_precision()  # exact ops work after merging


@pytest.mark.parametrize("structure", list(MAKERS))
def test_sample_moments(structure):
    g = torch.Generator().manual_seed(0)
    post = MAKERS[structure](g)
    m, s = post.to_dense()
    draws = post.sample(torch.Generator().manual_seed(1), n=40000)
    x = torch.cat([draws[k].reshape(40000, -1) for k in post.mean], 1)
    # Whiten with the true precision S = L Lᵀ: z = Lᵀ (x − m) must be N(0, I). With n = 40000 draws each
    # entry of the sample mean / covariance of z has standard deviation ≈ 1/√n = 0.005 (off-diagonal)
    # and ≈ 0.007 (diagonal); 0.03 is > 4 standard deviations for every one of the ~400 entries.
    n = x.shape[0]
    z = (x - m) @ torch.linalg.cholesky(s)
    mc_tol = dict(rtol=0.0, atol=6.0 / n**0.5)
    torch.testing.assert_close(z.mean(0), torch.zeros_like(m), **mc_tol)
    torch.testing.assert_close(torch.cov(z.T), torch.eye(m.numel(), dtype=DT), **mc_tol)
    # seeded: the same generator seed gives the same draw
    a = flatten(post.sample(torch.Generator().manual_seed(5)))
    b = flatten(post.sample(torch.Generator().manual_seed(5)))
    assert torch.equal(a, b)


@pytest.mark.parametrize("structure", list(MAKERS))
def test_state_dict_roundtrip_and_to(structure, gen, tmp_path):
    post = MAKERS[structure](gen)
    torch.save(post.state_dict(), tmp_path / "p.pt")
    back = load_posterior(torch.load(tmp_path / "p.pt", weights_only=False))
    assert type(back) is type(post)
    for a, b in zip(post.to_dense(), back.to_dense()):
        assert torch.equal(a, b)
    f32 = post.to(dtype=torch.float32)
    assert all(v.dtype == torch.float32 for v in f32.mean.values())
    torch.testing.assert_close(f32.to_dense()[1].double(), post.to_dense()[1], rtol=1e-6, atol=1e-6)


def test_posterior_is_next_prior_kron_laplace(gen):
    """Adding a task's Kronecker curvature to a Kronecker prior gives a Kronecker posterior whose dense
    precision is the prior's plus the curvature's (sequential Laplace, exact in matvec form)."""
    m = {"w": torch.randn(2, 3, generator=gen, dtype=DT), "b": torch.randn(2, generator=gen, dtype=DT)}
    prior = KronPosterior.isotropic(m, 0.5, [("w", "b")])
    c1 = KronCurvature([KronBlock("w", "b", _spd(4, gen), _spd(2, gen))], {})
    c2 = KronCurvature([KronBlock("w", "b", _spd(4, gen), _spd(2, gen))], {})
    post1 = prior.add_precision(c1)
    post2 = post1.add_precision(c2, scale=2.0)
    _, d0 = prior.to_dense()
    dense_c = [KronPosterior(m, [("w", "b", [(c.blocks[0].A, c.blocks[0].G)])]).to_dense()[1] for c in (c1, c2)]
    torch.testing.assert_close(post2.to_dense()[1], d0 + dense_c[0] + 2.0 * dense_c[1], **EXACT)


def test_validation_errors(gen):
    m = _mean(gen)
    with pytest.raises(ValueError, match="precision"):
        DiagPosterior(m, -1.0)
    with pytest.raises(ValueError, match="precision"):
        FullPosterior(m, torch.eye(3, dtype=DT))
    with pytest.raises(ValueError, match="delta"):
        KronPosterior(m, [], None, -1.0)
    with pytest.raises(ValueError, match="unflatten|vector"):
        unflatten(torch.zeros(3, dtype=DT), m)


def test_nearest_kronecker_is_invariant_to_how_each_term_splits_its_scale(gen):
    """A_k ⊗ G_k = (s A_k) ⊗ (G_k / s): the product returned must not depend on s, and factors of 1e20
    (whose squared entries overflow float32) must not turn it into inf / NaN."""
    terms = [(_spd(3, gen).float(), _spd(2, gen).float()) for _ in range(3)]
    a, g_ = nearest_kronecker(terms)
    ref = torch.kron(a, g_)
    split = [(1e20 * terms[0][0], terms[0][1] / 1e20), (terms[1][0] / 1e15, 1e15 * terms[1][1]), terms[2]]
    a2, g2 = nearest_kronecker(split)
    torch.testing.assert_close(torch.kron(a2, g2), ref, rtol=1e-4, atol=0)


def test_nearest_kronecker_leaves_out_terms_with_a_zero_factor(gen):
    """A term with G = 0 (an unused head's K-FAC term) adds nothing: the product of [T₁, T₂, (A, 0)] is that of
    [T₁, T₂] to the exact tier, [T₁, (0, G)] returns T₁ itself, and terms that are all zero give the zero product,
    not NaN. Planted once: without the filter the all-zero case raises (eig of a NaN matrix)."""
    t1, t2 = (_spd(3, gen), _spd(2, gen)), (_spd(3, gen), _spd(2, gen))
    dead_g, dead_a = (_spd(3, gen), torch.zeros(2, 2, dtype=DT)), (torch.zeros(3, 3, dtype=DT), _spd(2, gen))
    torch.testing.assert_close(torch.kron(*nearest_kronecker([t1, t2, dead_g])),
                               torch.kron(*nearest_kronecker([t1, t2])), **EXACT)
    torch.testing.assert_close(torch.kron(*nearest_kronecker([t1, dead_a])), torch.kron(*t1), **EXACT)
    a, g_ = nearest_kronecker([dead_g, dead_a])
    assert torch.equal(torch.kron(a, g_), torch.zeros(6, 6, dtype=DT))
