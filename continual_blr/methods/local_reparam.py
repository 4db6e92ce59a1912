"""The local reparameterisation estimate of an expected loss under a mean-field Gaussian q (Kingma,
Salimans & Welling 2015, Sec. 2.3).

For a linear layer a = W x + b with independent W_ij ~ N(μ_ij, σ²_ij), b_i ~ N(μ_b,i, σ²_b,i), each
pre-activation is Gaussian given x:

    a_i | x ~ N( Σ_j μ_ij x_j + μ_b,i ,  Σ_j σ²_ij x_j² + σ²_b,i ),

so instead of drawing W (one draw shared by the whole minibatch) one draws a = m + √v ∘ ε with
ε ~ N(0, I) per example. The expected loss E_q[ℓ(θ)] is the same (the marginal of every example's output
is unchanged); what changes is the estimator: the examples of a minibatch see independent noise, so the
gradient's variance falls, and no weight matrix is drawn. For S samples, the network runs once on a
batch of S·B rows: the first sampled layer computes m and v once on the B inputs and expands to S·B rows
(its input is the same for every sample), every later one runs on its S·B rows.

It holds only where every sampled parameter is the weight or bias of an ``nn.Linear`` (the MLPs and the
linear heads); :func:`covers` says whether it does. Parameters that are not sampled keep their value.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.func import functional_call

__all__ = ["covers", "expected_outputs"]


def _linear_owners(model: nn.Module, names: list[str]) -> dict[nn.Module, tuple[str, str | None]]:
    """The ``nn.Linear`` modules whose weight is sampled: module → (weight name, sampled bias name or None)."""
    wanted = set(names)
    owners: dict[nn.Module, tuple[str, str | None]] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, nn.Linear):
            w = f"{prefix}.weight" if prefix else "weight"
            b = f"{prefix}.bias" if prefix else "bias"
            if w in wanted:
                owners[module] = (w, b if (module.bias is not None and b in wanted) else None)
    return owners


def covers(model: nn.Module, names: list[str]) -> bool:
    """Whether every name in ``names`` is the weight of an ``nn.Linear`` or the bias of one whose weight is
    also in ``names`` (the only case the local estimate is exact in distribution)."""
    owners = _linear_owners(model, names)
    covered = {n for pair in owners.values() for n in pair if n is not None}
    return set(names) <= covered


def expected_outputs(
    model: nn.Module,
    mean: Mapping[str, Tensor],
    variance: Mapping[str, Tensor],
    x: Tensor,
    samples: int,
    generator: torch.Generator,
    kwargs: Mapping[str, object] | None = None,
) -> Tensor:
    """S draws of the network's outputs under q by local reparameterisation, stacked: shape (S·B, …).

    Rows s·B … (s+1)·B − 1 are draw s for the B inputs (so ``y.repeat(S)`` matches them). Each hooked
    ``nn.Linear`` returns m + √v ∘ ε, m = F.linear(x, μ_W, μ_b), v = F.linear(x², σ²_W, σ²_b).

    Args:
        model: the network; its parameters named in ``mean`` are replaced by ``mean`` (functional call).
        mean: μ of the sampled parameters (with their autograd history).
        variance: σ² of the same parameters (with their autograd history).
        x: a batch of B inputs.
        samples: S ≥ 1.
        generator: the source of ε.
        kwargs: keyword arguments of the model's forward (``head``).

    Raises:
        ValueError: if a sampled parameter is not an ``nn.Linear``'s (see :func:`covers`).
    """
    names = list(mean)
    if not covers(model, names):
        raise ValueError("the local reparameterisation needs every sampled parameter to be an nn.Linear's weight "
                         "or bias; use the weight-sampling estimate for this model")
    owners = _linear_owners(model, names)
    expanded = [False]
    rows = samples * x.shape[0]

    def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
        w, b = owners[module]
        h = inputs[0]
        v = nn.functional.linear(h * h, variance[w], variance[b] if b is not None else None)
        sd = torch.sqrt(v.clamp_min(torch.finfo(v.dtype).tiny))
        if not expanded[0]:  # the same input for every draw: m and v once, then S rows each
            expanded[0] = True
            output = output.repeat(samples, *([1] * (output.dim() - 1)))
            sd = sd.repeat(samples, *([1] * (sd.dim() - 1)))
        elif output.shape[0] != rows:
            raise ValueError("the local reparameterisation needs the sampled layers in a chain (each one's input "
                             "computed from the one before); use the weight-sampling estimate for this model")
        eps = torch.randn(output.shape, generator=generator, dtype=output.dtype, device=output.device)
        return output + sd * eps

    handles = [module.register_forward_hook(hook) for module in owners]
    try:
        out = functional_call(model, dict(mean), (x,), dict(kwargs or {}))
    finally:
        for handle in handles:
            handle.remove()
    if not expanded[0]:  # no sampled layer ran (nothing of q reaches this output)
        out = out.repeat(samples, *([1] * (out.dim() - 1)))
    return out

