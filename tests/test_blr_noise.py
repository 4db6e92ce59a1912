"""The pooled weight noise of the diagonal BLR step (``continual_blr.optim.noise``) against what its docstring
states: the pool is standardised, so given the pool the noise has mean 0 and identity covariance (checked by
enumerating every shift and by Monte Carlo over steps); marginally it is N(0, 1) (Kolmogorov–Smirnov against
``torch.distributions.Normal``); a saved stream continues where it stopped; the settings fail with one line.
The BLR's fixed point with it is checked against the mean-field optimum in ``test_blr_fixed_points.py``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from continual_blr.methods import build_method
from continual_blr.optim import BayesianLearningRule
from continual_blr.optim.noise import PooledNoise
from continual_blr.posteriors import DiagPosterior, KronPosterior, kron_layers

CPU = torch.device("cpu")
EXACT = dict(rtol=1e-12, atol=1e-12)
MC_SD = 4.0  # Monte-Carlo bounds: this many standard errors


def _draws(noise: PooledNoise, n: int, steps: int, seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([noise(n, g, dtype, CPU) for _ in range(steps)])


def test_the_pool_is_standardised_so_every_shift_averages_to_unit_variance():
    """(1/P) Σ_k z_{k+i}² = 1 and (1/P) Σ_k z_{k+i} = 0 for every coordinate i: over the uniform shift the
    conditional second moment is exactly 1 (float64 round-off), for a small pool where an unstandardised one
    is off by about √(2/P) ≈ 18 %."""
    noise = PooledNoise(refresh=10**9, min_pool=64)
    noise(40, torch.Generator().manual_seed(0), torch.float64, CPU)
    z = noise._pool[:64]
    torch.testing.assert_close(z.square().mean(), torch.tensor(1.0, dtype=torch.float64), **EXACT)
    torch.testing.assert_close(z.mean(), torch.tensor(0.0, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(noise._pool[64:], z)  # the doubled pool: a window never wraps


def test_given_the_pool_the_noise_has_mean_zero_and_identity_covariance():
    """One small pool (P = 64) kept for 40,000 steps: the Monte-Carlo mean of ε and of ε εᵀ over steps match
    0 and I within 4 standard errors (ε_i ε_j has variance 1 off the diagonal, 2 on it given the pool's
    magnitudes, bounded by max z⁴ − 1). Fails on planted bugs: no sign flips (ε_i ε_j then averages the pool's
    autocorrelation at lag j − i), a shift drawn from half the positions. (An unstandardised pool fails the
    test above; here its ~18 % falls inside the bound.)"""
    steps, n = 40_000, 24
    noise = PooledNoise(refresh=10**9, min_pool=64)
    eps = _draws(noise, n, steps)
    z4 = noise._pool[:64].pow(4).max()
    se_mean, se_off, se_diag = 1 / steps**0.5, 1 / steps**0.5, (z4 / steps).sqrt()
    assert eps.mean(0).abs().max() < MC_SD * se_mean
    cov = eps.T @ eps / steps
    off = cov - torch.diag(torch.diagonal(cov))
    assert off.abs().max() < MC_SD * se_off, off.abs().max()
    assert (torch.diagonal(cov) - 1).abs().max() < MC_SD * se_diag, torch.diagonal(cov)


def test_marginally_the_noise_is_standard_normal():
    """A fresh pool every step (R = 1): 2,000 steps × 100 coordinates against N(0, 1) by the Kolmogorov–Smirnov
    distance (critical value 1.63/√N at the 1 % level for independent draws; the coordinates of one step are
    distinct pool entries)."""
    eps = _draws(PooledNoise(refresh=1, min_pool=256), 100, 2000).reshape(-1).sort().values
    n = eps.numel()
    cdf = torch.distributions.Normal(0.0, 1.0).cdf(eps)
    ecdf_hi = torch.arange(1, n + 1, dtype=eps.dtype) / n
    ks = torch.maximum(ecdf_hi - cdf, cdf - (ecdf_hi - 1 / n)).max()
    assert ks < 1.63 / n**0.5, float(ks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_sign_flip_is_the_same_in_every_dtype(dtype):
    """float32 / float64 flip the sign bit, other dtypes multiply by ±1: the same ε as float64's, rounded."""
    a = _draws(PooledNoise(refresh=3, min_pool=128), 100, 7, dtype=dtype)
    b = _draws(PooledNoise(refresh=3, min_pool=128), 100, 7, dtype=torch.float64)
    assert torch.equal(a, b.to(dtype))
    assert (a < 0).any() and (a > 0).any()


def test_a_saved_stream_continues_where_it_stopped():
    """Draw 10 steps (R = 3: the pool is redrawn mid-way), save (noise state, generator state), draw 5 more; a new
    PooledNoise loaded from the saved state, with the generator restored, draws the same 5 (planted: a load that
    forgets the pool's age redraws at another step and fails)."""
    g = torch.Generator().manual_seed(5)
    noise = PooledNoise(refresh=3, min_pool=128)
    for _ in range(10):
        noise(50, g, torch.float32, CPU)
    state, g_state = copy.deepcopy(noise.state_dict()), g.get_state()
    after = [noise(50, g, torch.float32, CPU) for _ in range(5)]
    resumed = PooledNoise()
    resumed.load_state_dict(state)
    g.set_state(g_state)
    again = [resumed(50, g, torch.float32, CPU) for _ in range(5)]
    assert all(torch.equal(a, b) for a, b in zip(after, again))


def test_the_optimiser_saves_its_noise_stream():
    """BayesianLearningRule(noise="pooled"): state_dict carries the pool's (seed, age); an optimiser loaded from it
    (with the generator restored) takes the same next steps as the one that went on."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 5), torch.randint(0, 3, (64,))

    def make():
        model = nn.Linear(5, 3)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.linspace(-0.3, 0.3, p.numel()).view_as(p))
        prior = DiagPosterior({k: torch.zeros_like(p) for k, p in model.named_parameters()}, 1.0)
        gen = torch.Generator().manual_seed(3)
        opt = BayesianLearningRule(model, prior, n_data=64, lr=0.1, rho=0.1, mc_samples=1, curvature="price",
                                   init_hess=0.1, generator=gen, noise="pooled", noise_refresh=2)
        return model, opt, gen

    def step(model, opt):
        opt.step(lambda p: nn.functional.cross_entropy(torch.func.functional_call(model, p, (x,)), y,
                                                       reduction="none"))

    model, opt, gen = make()
    for _ in range(5):
        step(model, opt)
    saved = copy.deepcopy((opt.state_dict(), model.state_dict(), gen.get_state()))
    for _ in range(3):
        step(model, opt)
    model2, opt2, gen2 = make()
    opt2.load_state_dict(saved[0])
    model2.load_state_dict(saved[1])
    gen2.set_state(saved[2])
    for _ in range(3):
        step(model2, opt2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_bad_noise_settings_fail_with_one_line():
    model = nn.Sequential(nn.Linear(3, 2))
    zeros = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"noise: got 'uniform'; allowed: 'gaussian', 'pooled'"):
        BayesianLearningRule(model, DiagPosterior(zeros, 1.0), n_data=1, noise="uniform")
    with pytest.raises(ValueError, match=r"noise: 'pooled' is for the diagonal structure, got 'kron'"):
        BayesianLearningRule(model, KronPosterior.isotropic(zeros, 1.0, kron_layers(model)), n_data=1,
                             curvature="empirical_fisher", noise="pooled")
    with pytest.raises(ValueError, match=r"noise_refresh: must be an integer >= 1, got 0"):
        BayesianLearningRule(model, DiagPosterior(zeros, 1.0), n_data=1, noise="pooled", noise_refresh=0)
    with pytest.raises(ValueError, match=r"params.noise: 'pooled' needs structure 'diag'"):
        build_method("blr", {"structure": "kron", "noise": "pooled"})
    with pytest.raises(ValueError, match=r"params.noise_refresh: must be an integer >= 1, got 0"):
        build_method("ivon", {"noise": "pooled", "noise_refresh": 0})
