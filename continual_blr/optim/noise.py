"""Where the diagonal BLR step's standard-normal ε comes from (θ = m + ε ∘ (S₀ + D)^{-1/2}).

Two sources, chosen with ``BayesianLearningRule(noise=...)``:

* ``"gaussian"`` — a fresh draw per step, ε ~ N(0, I) from the optimiser's ``torch.Generator``
  (``torch.randn``). On a CPU this costs about as much as the step's whole update: the generator is
  Mersenne-Twister, one 32-bit draw per coordinate.
* ``"pooled"`` — a **sign-randomised, shifted pool** (:class:`PooledNoise`): a standardised Gaussian vector z
  of P ≥ n coordinates is drawn once every ``refresh`` steps and each step takes

      ε_t = s_t ∘ (z_{(k_t + i) mod P})_{i < n},    k_t ~ U{0, …, P − 1},   s_t ∈ {±1}ⁿ i.i.d. fair signs,

  that is one draw for k_t and one 32-bit draw per 32 coordinates for the signs (32 × fewer draws).

What the pooled ε keeps, exactly. Given the pool (and so given every earlier step, which only reveals z), the
signs are fresh, so

    E[ε_t,i | past] = 0,    E[ε_t,i ε_t,j | past] = δ_ij · (1/P) Σ_p z_p² = δ_ij,

the second because k_t is uniform over all P positions and z is standardised to (1/P) Σ z_p² = 1. These two
moments are all the Price estimate ĥ = ĝ ∘ ε ∘ √(S₀ + D) and the mean step need on a quadratic loss
(`ĝ = H(θ − m*)`: `E[ĝ] = H(m − m*)`, `E[ĥ] = diag H`), so the BLR's fixed point on Bayesian linear regression is the
one of fresh Gaussian draws (``tests/test_blr_fixed_points.py`` checks it against the mean-field optimum;
``tests/test_blr_noise.py`` checks the two moments). Marginally,
over the pool, ε_t is a sign-flipped rearrangement of a standardised Gaussian vector: N(0, I) up to the
standardisation's O(1/P) (the test compares its quantiles with N(0, 1)).

What it does not keep: conditionally on the past, |ε_t,i| is one of the pool's P magnitudes rather than a fresh
|N(0, 1)| draw, so Stein's identity E[ĝ ∘ ε] = E[∇²ℓ] σ holds exactly only for a quadratic loss; beyond it the
estimate differs by terms of fourth order in the weight noise. The pool is redrawn every ``refresh`` steps.
Predictive weight samples (``sampled_params``) always use fresh Gaussian draws.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["NOISES", "PooledNoise", "gaussian_noise"]

NOISES = ("gaussian", "pooled")


def gaussian_noise(n: int, generator: torch.Generator | None, dtype: torch.dtype, device: torch.device) -> Tensor:
    """ε ~ N(0, I_n), a fresh draw from ``generator``."""
    return torch.randn(n, generator=generator, dtype=dtype, device=device)


class PooledNoise:
    """The sign-randomised shifted pool of the module docstring.

    Args:
        refresh: R ≥ 1, steps between redraws of the pool z.
        min_pool: P ≥ max(n, min_pool): a small model still shifts over many positions (the second moment
            is exact for any P; the pool's variety grows with P).

    The pool is drawn from a ``torch.Generator`` seeded with a 62-bit seed drawn from the step's generator, so a
    run stays a function of its seed, and :meth:`state_dict` holds only (seed, age): a resumed run redraws the
    same pool and continues the same stream.
    """

    def __init__(self, refresh: int = 64, min_pool: int = 1 << 16) -> None:
        if not (isinstance(refresh, int) and refresh >= 1):
            raise ValueError(f"noise_refresh: must be an integer >= 1, got {refresh!r}")
        if not (isinstance(min_pool, int) and min_pool >= 1):
            raise ValueError(f"min_pool: must be an integer >= 1, got {min_pool!r}")
        self.refresh, self.min_pool = refresh, min_pool
        self.seed: int | None = None
        self.age = 0
        self._pool: Tensor | None = None  # [z, z]: a shifted window is one slice, no wrap-around copy
        self._shifts: Tensor | None = None

    def _redraw(self, n: int, dtype: torch.dtype, device: torch.device) -> None:
        """z ~ N(0, I_P) from ``self.seed``, standardised: mean 0 and (1/P) Σ z² = 1 (in float64)."""
        assert self.seed is not None
        size = max(n, self.min_pool)
        g = torch.Generator(device=device).manual_seed(self.seed)
        z = torch.randn(size, generator=g, dtype=torch.float64, device=device)
        z -= z.mean()
        z /= z.square().mean().sqrt()
        self._pool = torch.cat([z, z]).to(dtype)
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)

    def __call__(self, n: int, generator: torch.Generator | None, dtype: torch.dtype, device: torch.device) -> Tensor:
        """This step's ε ∈ ℝⁿ (advances ``generator``: a new pool seed every ``refresh`` steps, k_t, the signs)."""
        pool = self._pool
        if (self.seed is None or self.age >= self.refresh or pool is None or pool.dtype != dtype
                or pool.device != device or pool.numel() < 2 * n):
            if self.seed is None or self.age >= self.refresh or (pool is not None and pool.numel() < 2 * n):
                self.seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=device))
                self.age = 0
            self._redraw(n, dtype, device)
            pool = self._pool
        assert pool is not None and self._shifts is not None
        size = pool.numel() // 2
        k = int(torch.randint(0, size, (1,), generator=generator, device=device))
        words = torch.randint(-(2**31), 2**31, ((n + 31) // 32, 1), generator=generator, dtype=torch.int32,
                              device=device)
        # 32 fair signs per draw, as sign bits: bit j of a word moved to bit 31
        sign = (words << (31 - self._shifts)).bitwise_and_(-(2**31)).reshape(-1)[:n]
        self.age += 1
        window = pool[k:k + n]
        if dtype == torch.float32:  # s ∘ z_{k:k+n}: flip the sign bits (one pass, no multiply)
            return (window.view(torch.int32) ^ sign).view(torch.float32)
        if dtype == torch.float64:
            return (window.view(torch.int64) ^ (sign.to(torch.int64) << 32)).view(torch.float64)
        return window * torch.where(sign < 0, -1.0, 1.0).to(dtype)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "age": self.age, "refresh": self.refresh, "min_pool": self.min_pool}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.age = state["seed"], int(state["age"])
        self.refresh, self.min_pool = int(state["refresh"]), int(state["min_pool"])
        self._pool = None  # redrawn from the seed at the next step
