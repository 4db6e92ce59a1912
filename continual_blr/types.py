"""Shared types: parameter dictionaries, batches and the enums that name structures and curvatures.

Every numerical object in continual_blr speaks in ``ParamDict``: a ``dict[str, Tensor]`` keyed by the
names of ``model.named_parameters()``. This is the format ``torch.func.functional_call`` takes, so the
same dictionaries feed Jacobians, posteriors and optimisers without flattening.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

import torch
from torch import Tensor, nn

ParamDict = dict[str, Tensor]

__all__ = [
    "ConfigError",
    "DivergenceError",
    "ParamDict",
    "Batch",
    "Structure",
    "Curvature",
    "params_of",
    "flatten",
    "unflatten",
    "num_params",
    "parse_enum",
    "KronBlock",
    "KronCurvature",
]


class ConfigError(ValueError):
    """A configuration value (run config or method parameter) is missing, unknown, of the wrong type or out
    of range; the message is one line naming the field and what is allowed."""


class DivergenceError(ValueError):
    """Training produced a non-finite loss: the step size is too large for the problem."""


class Batch(NamedTuple):
    """A minibatch: inputs ``x``, integer labels ``y`` and the output head ``head`` to use."""

    x: Tensor
    y: Tensor
    head: int = 0


class Structure(str, Enum):
    """Precision structure of a Gaussian over the weights.

    * ``diag`` — one precision per weight (mean-field). Memory O(P).
    * ``kron`` — per layer (Linear / Conv2d with its bias) a sum of Kronecker products A ⊗ G, A over
      the layer's (bias-augmented) inputs and G over its outputs. Memory O(Σ in² + out²).
    * ``full`` — one dense P×P precision; small models or a chosen subset (e.g. the last layer).
    """

    DIAG = "diag"
    KRON = "kron"
    FULL = "full"


class Curvature(str, Enum):
    """Which curvature estimates the Hessian of the summed loss Σ_i ℓ_i.

    * ``ggn`` — exact generalised Gauss-Newton Σ_i J_iᵀ Λ_i J_i, Λ_i = ∂²ℓ/∂f² at the model's output
      (softmax cross-entropy: diag(p) − ppᵀ; Gaussian: 1/σ²).
    * ``empirical_fisher`` — Σ_i g_i g_iᵀ from **per-example** gradients g_i = ∇ℓ_i at the observed labels.
    * ``mc_fisher`` — Σ_i ĝ_i ĝ_iᵀ with ĝ_i the gradient at a label sampled from the model's predictive.
    * ``hessian`` — the exact Hessian (small models only).

    All are *sums* over examples (not means) unless a function says otherwise.
    """

    GGN = "ggn"
    EMPIRICAL_FISHER = "empirical_fisher"
    MC_FISHER = "mc_fisher"
    HESSIAN = "hessian"


class KronBlock(NamedTuple):
    """One layer's Kronecker-factored curvature ``A ⊗ G``.

    Convention (used by the curvature engine and by :class:`~continual_blr.posteriors.KronPosterior`):
    the layer's parameters form the matrix Θ = [W.reshape(d_out, -1) | b] ∈ R^{d_out × d_in'} with
    d_in' = d_in (+1 when there is a bias; for Conv2d d_in = C_in·k_h·k_w). The curvature acts on Θ
    as Θ ↦ G Θ A, i.e. it is the matrix G ⊗ A on the row-major vectorisation of Θ (equivalently
    A ⊗ G on the column-major one).

    Attributes:
        weight: name of the weight parameter in the ParamDict.
        bias: name of the bias parameter, or None.
        A: (d_in', d_in') symmetric factor over the layer's (bias-augmented) inputs.
        G: (d_out, d_out) symmetric factor over the layer's outputs (pre-activations).
    """

    weight: str
    bias: str | None
    A: Tensor
    G: Tensor


class KronCurvature(NamedTuple):
    """A Kronecker-factored curvature of a whole model: one block per Linear/Conv2d layer, and a diagonal
    for every other parameter (e.g. BatchNorm affine weights) in ``diag``."""

    blocks: list[KronBlock]
    diag: ParamDict


def parse_enum(enum_cls: type[Enum], value: object, field: str) -> Enum:
    """Turn ``value`` into ``enum_cls`` or raise ``ValueError`` naming ``field`` and the allowed values."""
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_cls)  # type: ignore[attr-defined]
        raise ValueError(f"{field}: got {value!r}; allowed: {allowed}") from None


def params_of(model: nn.Module, names: list[str] | None = None, detach: bool = True) -> ParamDict:
    """The model's trainable parameters as a ParamDict (optionally a subset, optionally detached)."""
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad or (names is not None and name not in names):
            continue
        out[name] = p.detach() if detach else p
    if names is not None:
        missing = set(names) - set(out)
        if missing:
            raise KeyError(f"parameter names not in model: {sorted(missing)}")
    return out


def flatten(params: ParamDict) -> Tensor:
    """Concatenate a ParamDict into one vector (dictionary order)."""
    return torch.cat([t.reshape(-1) for t in params.values()])


def unflatten(vector: Tensor, like: ParamDict) -> ParamDict:
    """Split a vector into a ParamDict shaped like ``like`` (inverse of :func:`flatten`)."""
    need = sum(t.numel() for t in like.values())
    if vector.numel() != need:
        raise ValueError(f"unflatten: vector has {vector.numel()} entries, the ParamDict needs {need}")
    out, start = {}, 0
    for name, t in like.items():
        n = t.numel()
        out[name] = vector[start : start + n].view_as(t)
        start += n
    return out


def num_params(params: ParamDict) -> int:
    """Total number of scalars in a ParamDict."""
    return sum(t.numel() for t in params.values())
