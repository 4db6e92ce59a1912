"""Per-example logit covariances under a diagonal weight covariance, and the memory-perturbation sensitivity.

For example i with logits f_i = f_θ(x_i) ∈ R^K, per-example logit Jacobian J_i = ∂f_i/∂θ ∈ R^{K×P}, a diagonal
weight covariance Σ = diag(s) and the softmax error e_i = softmax(f_i) − onehot(y_i):

    V_i = J_i Σ J_iᵀ ∈ R^{K×K}                                   (the predictive logit covariance)
    s_i = ‖V_i e_i‖₁ = Σ_k |(V_i e_i)_k|                          (memory-perturbation sensitivity)

V_i e_i ≈ the change of example i's own logits if it were left out of training (Nickl, Xu, Tailor, Möllenhoff &
Khan, "The memory-perturbation equation", NeurIPS 2023): at a minimum with Σ = (∇²L)⁻¹, removing ℓ_i moves the
minimiser by about Σ ∇ℓ_i = Σ J_iᵀ e_i, so f_i moves by J_i Σ J_iᵀ e_i. Large s_i: the examples the fit depends
on most (large error × large variance) — those worth keeping in a memory.

Linear layers without materialised per-example Jacobians. For a Linear layer J_{i,c} = g_{ic} a_iᵀ (output
gradient g_{ic} ∈ R^{d_out} of logit c, layer input a_i ∈ R^{d_in}), so with a diagonal covariance s_W (shaped
like W) and s_b,

    (J_i Σ J_iᵀ)_{cc'} = Σ_o g_{ic,o} g_{ic',o} w_{i,o},      w_{i,o} = Σ_d s_W[o, d] a_{id}² + s_b[o],

one [B, d_in] × [d_in, d_out] product per layer. Other layers (Conv2d, BatchNorm, Linear on sequences) and
parameters outside layers use their materialised per-example VJPs.

One pass for Σ and the scores (:func:`ggn_diag_and_sensitivity`). FROMP's Σ = diag(1 / (F + δ)) needs the
diagonal GGN F = Σ_i diag(J_iᵀ Λ_i J_i) (Λ_i = diag(p_i) − p_i p_iᵀ) of the task that just ended, and s_i needs Σ.
Both come from the same backward pass with identity cotangents (the K logit-Jacobian rows g_{ic}):

    F_W[o, d] = Σ_i h_{i,o} a_{id}²,    F_b[o] = Σ_i h_{i,o},    h_{i,o} = Σ_{c,c'} Λ_{i,cc'} g_{ic,o} g_{ic',o},

and the rows g_{ic} and a_i² are kept (per Linear layer: N·(K·d_out + d_in) numbers) until F, hence Σ, is
complete; then V_i and s_i are contractions of what was kept. No second Jacobian pass; the extra cost over the
GGN pass alone is the memory of the kept rows and the O(N·K²·d_out) contractions.
"""

from __future__ import annotations

from contextlib import closing

import torch
from torch import Tensor, nn

from ..mixed_precision import full_precision
from ..types import ParamDict
from .jacobians import output_jacobian_cotangents, passes, select

__all__ = ["diag_prediction_covariance", "sensitivity", "ggn_diag_and_sensitivity"]


def _layer_terms(p, var: ParamDict | None = None):
    """Per tapped layer reached by the pass: ("linear", weight, bias, g [B, K, d_out], a² [B, d_in]) for a Linear
    layer on [B, d_in], else ("rows", name, rows [B, K, n]) for each of its parameters (materialised VJPs)."""
    b, k = p.logits.shape
    out = []
    for layer in p.layers:
        if layer.index not in p.g:  # not reached by this head: zero Jacobian
            continue
        g, a = p.g[layer.index], p.a[layer.index]
        if layer.kind == "linear" and g.shape[-1] == 1:
            out.append(("linear", layer.weight, layer.bias, g[..., 0], a[..., 0] ** 2))
            continue
        jw, jb = p.layer_jacobian(layer.index)
        if layer.weight is not None:
            out.append(("rows", layer.weight, jw.reshape(b, k, -1)))
        if jb is not None and layer.bias is not None:
            out.append(("rows", layer.bias, jb))
    for name, t in p.other.items():
        out.append(("rows", name, t.reshape(b, k, -1)))
    return out


def _covariance_from_terms(terms, var: ParamDict, b: int, k: int, like: Tensor) -> Tensor:
    """V_i = Σ over ``terms`` of J_i diag(s) J_iᵀ, [B, K, K] (module docstring)."""
    v = like.new_zeros(b, k, k)
    for t in terms:
        if t[0] == "linear":
            _, weight, bias, g1, a2 = t
            w = g1.new_zeros(b, g1.shape[-1])
            if weight is not None:
                w = w + a2 @ var[weight].reshape(g1.shape[-1], -1).T
            if bias is not None:
                w = w + var[bias]
            v += torch.einsum("bco,bo,bdo->bcd", g1, w, g1)
        else:
            _, name, rows = t
            v += torch.einsum("bcp,p,bdp->bcd", rows, var[name].reshape(-1), rows)
    return v


@full_precision
def diag_prediction_covariance(model: nn.Module, x: Tensor, var: ParamDict, head: int | None = 0,
                               chunk_size: int | None = None) -> Tensor:
    """V_i = J_i diag(s) J_iᵀ per example, [N, K, K], for a diagonal covariance s (module docstring).

    Args:
        model: network with logits [N, K]; run in eval mode.
        x: inputs [N, ...].
        var: the variances s, one tensor per parameter Σ covers (shaped like it); other parameters are fixed.
        head: output head.
        chunk_size: examples per pass (None: the engine's default).

    Returns:
        [N, K, K] in the model's dtype. Equal to the dense route J_i Σ J_iᵀ to rounding (``tests/test_inspect.py``,
        ``tests/test_memory_selection.py``).
    """
    rows = output_jacobian_cotangents(None)
    sel = select(model, list(var))
    out = []
    with closing(passes(model, x, None, sel, lambda f, y, sl, st: rows(f), head=head, chunk_size=chunk_size)) as run:
        for p, _ in run:
            b, k = p.logits.shape
            out.append(_covariance_from_terms(_layer_terms(p), var, b, k, p.logits))
    return torch.cat(out) if out else x.new_zeros(0, 0, 0)


def sensitivity(covariance: Tensor, error: Tensor) -> Tensor:
    """s_i = ‖V_i e_i‖₁ from V [N, K, K] and e = softmax − onehot [N, K]; returns [N]."""
    return torch.einsum("nkl,nl->nk", covariance, error).abs().sum(-1)


@full_precision
def ggn_diag_and_sensitivity(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    prior_precision: float,
    head: int | None = 0,
    prior_ggn: ParamDict | None = None,
    chunk_size: int | None = None,
) -> tuple[ParamDict, Tensor]:
    """The task's diagonal GGN F and every example's sensitivity under Σ = diag(1 / (F₀ + F + δ)), in one pass.

        F = Σ_i diag(J_iᵀ Λ_i J_i),   Λ_i = diag(p_i) − p_i p_iᵀ,   p_i = softmax(f_θ(x_i, head)),
        Σ = diag(1 / (F₀ + F + δ)),   s_i = ‖J_i Σ J_iᵀ (p_i − onehot(y_i))‖₁

    (module docstring). F₀ = ``prior_ggn`` is the curvature accumulated before (FROMP: the past tasks' GGN; None:
    zero — the Laplace posterior of this task alone with the prior N(0, δ⁻¹I)).

    Args:
        model: classifier with logits [N, K] (softmax cross-entropy); run in eval mode.
        x: the task's inputs [N, ...].
        y: their labels [N] (indices into the head's outputs).
        prior_precision: δ > 0.
        head: output head.
        prior_ggn: F₀ per parameter (a missing parameter counts as zero; one shaped differently is matched by the
            caller).
        chunk_size: examples per pass (None: the engine's default).

    Returns:
        ``(F, s)``: F per trainable parameter (a sum over the N examples, shaped like it) and s [N].
    """
    if not prior_precision > 0:
        raise ValueError(f"prior_precision: must be > 0, got {prior_precision}")
    sel = select(model, None)
    ident = output_jacobian_cotangents(None)
    ggn = {n: torch.zeros_like(t) for n, t in sel.items()}
    kept: list[tuple[list, Tensor]] = []  # per chunk: (layer terms, error [B, K])
    y = y.reshape(-1)
    with closing(passes(model, x, y, sel, lambda f, yc, sl, st: ident(f), head=head, chunk_size=chunk_size)) as run:
        for p, yc in run:
            prob = torch.softmax(p.logits, dim=-1)
            lam = torch.diag_embed(prob) - prob.unsqueeze(2) * prob.unsqueeze(1)  # Λ_i [B, K, K]
            err = prob - torch.nn.functional.one_hot(yc.long(), prob.shape[1]).to(prob)
            terms = _layer_terms(p)
            for t in terms:
                if t[0] == "linear":
                    _, weight, bias, g1, a2 = t
                    h = torch.einsum("bco,bcd,bdo->bo", g1, lam, g1)  # Σ_cc' Λ_cc' g_c g_c'
                    if weight is not None:
                        ggn[weight] += (h.T @ a2).reshape(ggn[weight].shape)
                    if bias is not None:
                        ggn[bias] += h.sum(0)
                else:
                    _, name, rows = t
                    ggn[name] += torch.einsum("bcp,bcd,bdp->p", rows, lam, rows).reshape(ggn[name].shape)
            kept.append((terms, err))
            del p
    var = {n: 1.0 / (ggn[n] + (prior_ggn[n] if prior_ggn is not None and n in prior_ggn else 0.0) + prior_precision)
           for n in sel}
    scores = []
    for terms, err in kept:
        b, k = err.shape
        scores.append(sensitivity(_covariance_from_terms(terms, var, b, k, err), err))
    return ggn, (torch.cat(scores) if scores else x.new_zeros(0))
