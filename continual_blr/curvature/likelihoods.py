"""Likelihoods in output space: the loss ℓ(f, y), its gradient, the square root of its Hessian Λ, and
labels sampled from the model's predictive (for the MC Fisher).

Everything here acts on a batch of model outputs ``f`` of shape [B, K] and returns cotangent vectors
of shape [B, C, K]: the curvature estimates are all of the form Σ_b Σ_c u_{b,c} u_{b,c}ᵀ with
u_{b,c} = J_bᵀ v_{b,c}, and only the cotangents v differ:

| estimate                          | `v_{b,c}`                                     | C |
|-----------------------------------|-----------------------------------------------|---|
| GGN `Σ_b J_bᵀ Λ_b J_b`            | columns of `L_b`, `Λ_b = L_b L_bᵀ`            | K |
| empirical Fisher `Σ_b g_b g_bᵀ`   | `∇_f ℓ(f_b, y_b)`                             | 1 |
| MC Fisher                         | `∇_f ℓ(f_b, ŷ_{b,s}) / √S`, `ŷ ~ p(y | f_b)`  | S |

Classification (softmax cross-entropy, ℓ = −log softmax(f)_y):

    ∇_f ℓ = p − e_y,   Λ = diag(p) − ppᵀ,   L = diag(√p) − p √pᵀ   (column c: √p_c (e_c − p)).
    Check: L Lᵀ = diag(p) − 2ppᵀ + p (√pᵀ√p) pᵀ = diag(p) − ppᵀ since Σ p = 1.
Regression (Gaussian, ℓ = ‖f − y‖² / (2σ²) + const):

    ∇_f ℓ = (f − y)/σ²,   Λ = I/σ²,   L = I/σ,   ŷ = f + σ ε  ⇒  ∇_f ℓ(f, ŷ) = −ε/σ.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "LIKELIHOODS",
    "check_likelihood",
    "nll",
    "loss_gradient",
    "hessian_sqrt",
    "output_hessian",
    "mc_cotangents",
]

LIKELIHOODS = ("classification", "regression")


def check_likelihood(likelihood: str, sigma: float) -> None:
    if likelihood not in LIKELIHOODS:
        raise ValueError(f"likelihood: got {likelihood!r}; allowed: 'classification', 'regression'")
    if likelihood == "regression" and not (isinstance(sigma, (int, float)) and sigma > 0):
        raise ValueError(f"sigma: got {sigma!r}; the Gaussian noise standard deviation must be > 0")


def _targets(f: Tensor, y: Tensor | None, likelihood: str) -> Tensor:
    if y is None:
        raise ValueError("y: labels/targets are required for this estimate")
    y = y.to(f.device)
    if likelihood == "classification":
        if y.dim() != 1 or y.shape[0] != f.shape[0]:
            raise ValueError(f"y: expected integer labels of shape [{f.shape[0]}], got {tuple(y.shape)}")
        return y.long()
    y = y.to(f.dtype)
    if y.dim() == 1 and f.shape[1] == 1:
        y = y[:, None]
    if y.shape != f.shape:
        raise ValueError(f"y: expected regression targets of shape {tuple(f.shape)}, got {tuple(y.shape)}")
    return y


def nll(f: Tensor, y: Tensor, likelihood: str, sigma: float = 1.0) -> Tensor:
    """Per-example loss ℓ(f_b, y_b), shape [B] (cross-entropy, or ‖f − y‖²/(2σ²) without the constant).

    Precision: bf16 / fp16 outputs (a forward under ``torch.autocast``) are cast to fp32 first, so the loss
    is an fp32 (or fp64) number whatever the forward ran in.
    """
    if f.dtype in (torch.bfloat16, torch.float16):
        f = f.float()
    y = _targets(f, y, likelihood)
    if likelihood == "classification":
        return torch.nn.functional.cross_entropy(f, y, reduction="none")
    return 0.5 * ((f - y) ** 2).sum(-1) / sigma**2


def loss_gradient(f: Tensor, y: Tensor, likelihood: str, sigma: float = 1.0) -> Tensor:
    """∇_f ℓ(f_b, y_b) as cotangents [B, 1, K] (the empirical Fisher's v)."""
    y = _targets(f, y, likelihood)
    if likelihood == "classification":
        g = torch.softmax(f, -1)
        g = g - torch.nn.functional.one_hot(y, f.shape[1]).to(f.dtype)
    else:
        g = (f - y) / sigma**2
    return g.unsqueeze(1)


def hessian_sqrt(f: Tensor, likelihood: str, sigma: float = 1.0) -> Tensor:
    """L_b with Λ_b = L_b L_bᵀ, returned as cotangents [B, C=K, K] (v[b, c] = column c of L_b)."""
    b, k = f.shape
    if likelihood == "classification":
        p = torch.softmax(f, -1)
        eye = torch.eye(k, dtype=f.dtype, device=f.device)
        # v[b, c, :] = √p_c (e_c − p)
        return p.sqrt().unsqueeze(-1) * (eye.unsqueeze(0) - p.unsqueeze(1))
    return (torch.eye(k, dtype=f.dtype, device=f.device) / sigma).expand(b, k, k)


def output_hessian(f: Tensor, likelihood: str, sigma: float = 1.0) -> Tensor:
    """Λ_b = ∂²ℓ/∂f² [B, K, K]: diag(p) − ppᵀ (classification) or I/σ² (regression)."""
    b, k = f.shape
    if likelihood == "classification":
        p = torch.softmax(f, -1)
        return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    return (torch.eye(k, dtype=f.dtype, device=f.device) / sigma**2).expand(b, k, k)


def mc_cotangents(f: Tensor, noise: Tensor, likelihood: str, sigma: float = 1.0) -> Tensor:
    """Cotangents [B, S, K] of the MC Fisher from pre-drawn noise.

    ``noise`` is [B, S] uniforms in [0, 1) (classification: ŷ = inverse-CDF sample of softmax(f)) or
    [B, S, K] standard normals (regression: ŷ = f + σ ε). Each cotangent is ∇_f ℓ(f, ŷ)/√S so that
    Σ_s u_s u_sᵀ is the mean over the S samples.
    """
    s = noise.shape[1]
    if likelihood == "classification":
        p = torch.softmax(f, -1)
        cdf = p.cumsum(-1)
        labels = torch.searchsorted(cdf.contiguous(), noise.to(f.dtype).contiguous(), right=True)
        labels = labels.clamp_(max=f.shape[1] - 1)
        onehot = torch.nn.functional.one_hot(labels, f.shape[1]).to(f.dtype)  # [B, S, K]
        v = p.unsqueeze(1) - onehot
    else:
        v = -noise.to(f.dtype) / sigma
    return v / math.sqrt(s)


def draw_noise(
    n: int, k: int, mc_samples: int, likelihood: str, generator: torch.Generator, device: torch.device,
    dtype: torch.dtype,
) -> Tensor:
    """Noise for :func:`mc_cotangents`, drawn on the generator's device (so the same generator gives the
    same samples whatever the model's device/dtype) and moved to ``device`` once per batch."""
    gdev = generator.device
    if likelihood == "classification":
        u = torch.rand(n, mc_samples, generator=generator, device=gdev, dtype=torch.float64)
    else:
        u = torch.randn(n, mc_samples, k, generator=generator, device=gdev, dtype=torch.float64)
    return u.to(device=device, dtype=dtype, non_blocking=True)
