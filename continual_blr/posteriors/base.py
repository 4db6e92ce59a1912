"""The Gaussian posterior interface shared by the diagonal, Kronecker and full structures.

A posterior q(θ) = N(m, S⁻¹) covers the parameters named by ``mean.keys()`` (the whole model or a
subset such as the last layer). The *same* object serves as the prior of the next task: the
posterior after task t is the prior of task t+1 (sequential Bayes, DESIGN.md).

Log-density and KL use the standard closed forms (P = number of covered scalars):

    log q(θ)   = −½ (θ−m)ᵀ S (θ−m) − (P/2) log 2π + ½ log|S|
    KL(q ‖ p)  = ½ [ tr(S_p S_q⁻¹) + (m_p−m_q)ᵀ S_p (m_p−m_q) − P + log|S_q| − log|S_p| ]

Natural parameters are η₁ = S m and η₂ = −½ S (Khan & Rue 2023, Sec. 2).

**Precision.** Every public method of a posterior (of this base class and of every subclass, wrapped
when the subclass is defined) computes in the posterior's own dtype (fp32, or fp64), also when called
inside an active ``torch.autocast``: autocast is switched off for the call and bf16 / fp16 arguments are
cast to fp32 (:func:`continual_blr.mixed_precision.full_precision`); bf16 training never reaches the
solves, samples and log-determinants.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor

from ..mixed_precision import full_precision_methods
from ..types import ParamDict, Structure, num_params

__all__ = ["GaussianPosterior", "randn_like", "tree_sub", "tree_dot"]


def randn_like(t: Tensor, generator: torch.Generator | None, n: int | None = None) -> Tensor:
    """Standard normal noise shaped like ``t`` (with a leading ``n`` if given), drawn from ``generator``.

    If the generator lives on another device than ``t`` the noise is drawn there and moved.
    """
    shape = t.shape if n is None else (n, *t.shape)
    gen_device = generator.device if generator is not None else t.device
    eps = torch.randn(shape, generator=generator, device=gen_device, dtype=t.dtype)
    return eps.to(t.device)


def tree_sub(a: ParamDict, b: ParamDict) -> ParamDict:
    """a − b, key by key (keys of ``a``)."""
    return {k: a[k] - b[k] for k in a}


def tree_dot(a: ParamDict, b: ParamDict) -> Tensor:
    """Σ_k ⟨a_k, b_k⟩ over the keys of ``a``."""
    return sum((a[k] * b[k]).sum() for k in a)  # type: ignore[return-value]


class GaussianPosterior(ABC):
    """N(m, S⁻¹) over a ParamDict. Subclasses fix how the precision S is stored.

    Public methods compute in fp32 / fp64 even inside an active autocast (module docstring).
    """

    structure: Structure
    mean: ParamDict

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        full_precision_methods(cls)  # the subclass's own public methods: fp32 under autocast

    # ----- what each structure must provide ---------------------------------------------------
    @abstractmethod
    def precision_matvec(self, v: ParamDict) -> ParamDict:
        """S v."""

    @abstractmethod
    def covariance_matvec(self, v: ParamDict) -> ParamDict:
        """S⁻¹ v."""

    @abstractmethod
    def logdet_precision(self) -> Tensor:
        """log |S|."""

    @abstractmethod
    def sample_noise(self, generator: torch.Generator | None, n: int | None = None) -> ParamDict:
        """A draw of S^{-1/2} ε, ε ~ N(0, I) (with a leading sample axis of size ``n`` if given)."""

    @abstractmethod
    def trace_precision_times_covariance(self, other: "GaussianPosterior") -> Tensor:
        """tr(S_self · S_other⁻¹)."""

    @abstractmethod
    def covariance_diag(self) -> ParamDict:
        """diag(S⁻¹): the marginal variances."""

    @abstractmethod
    def with_mean(self, mean: ParamDict) -> "GaussianPosterior":
        """A copy with another mean and the same precision."""

    @abstractmethod
    def to_dense(self) -> tuple[Tensor, Tensor]:
        """(mean vector, dense precision) in the order of ``types.flatten(self.mean)`` — for tests."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        ...

    @classmethod
    @abstractmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "GaussianPosterior":
        ...

    @abstractmethod
    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "GaussianPosterior":
        ...

    # ----- shared, structure-independent maths ------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self.mean)

    @property
    def dim(self) -> int:
        """P, the number of scalars covered."""
        return num_params(self.mean)

    def quadratic(self, theta: ParamDict) -> Tensor:
        """(θ − m)ᵀ S (θ − m); differentiable in θ. ``theta`` may hold more keys than covered."""
        d = {k: theta[k] - self.mean[k] for k in self.mean}
        return tree_dot(d, self.precision_matvec(d))

    def sample(self, generator: torch.Generator | None = None, n: int | None = None) -> ParamDict:
        """θ = m + S^{-1/2} ε. With ``n`` the result has a leading sample axis."""
        noise = self.sample_noise(generator, n)
        return {k: self.mean[k] + noise[k] for k in self.mean}

    def log_prob(self, theta: ParamDict) -> Tensor:
        """log N(θ; m, S⁻¹)."""
        p = self.dim
        return -0.5 * self.quadratic(theta) - 0.5 * p * math.log(2 * math.pi) + 0.5 * self.logdet_precision()

    def kl(self, other: "GaussianPosterior") -> Tensor:
        """KL(self ‖ other), both over the same parameters."""
        if set(self.mean) != set(other.mean):
            raise ValueError("kl: the two Gaussians cover different parameters")
        quad = other.quadratic(self.mean)
        tr = other.trace_precision_times_covariance(self)
        return 0.5 * (tr + quad - self.dim + self.logdet_precision() - other.logdet_precision())

    def natural_params(self) -> tuple[ParamDict, "GaussianPosterior"]:
        """(η₁, S): η₁ = S m as a ParamDict; the precision is returned as the posterior itself
        (η₂ = −½ S is the precision scaled; store S, not −½ S, to keep one object per structure)."""
        return self.precision_matvec(self.mean), self

    def detach_mean(self) -> ParamDict:
        return {k: v.detach().clone() for k, v in self.mean.items()}


full_precision_methods(GaussianPosterior)  # the shared methods (quadratic, sample, log_prob, kl, ...)
