"""Per-example Jacobians and per-example gradients on ``torch.func`` (chunked).

Both are thin layers over the backpropagation engine (:mod:`._engine`): a pass with cotangents
v = identity gives the Jacobian rows, a pass with `v = ∇_f ℓ` gives the per-example gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import closing

import torch
from torch import Tensor, nn
from torch.func import jacrev, vmap

from ..mixed_precision import full_precision
from ..types import ParamDict, params_of
from ._engine import (
    Pass,
    auto_chunk,
    backprop,
    eval_mode,
    find_layers,
    iter_batches,
    model_device_dtype,
    model_kwargs,
    resolve_chunk,
)

__all__ = ["per_example_jacobians", "per_example_grads", "output_jacobian_cotangents", "select", "passes",
           "pass_rows", "gram_factor"]


def select(model: nn.Module, param_names: list[str] | None) -> ParamDict:
    """Detached selected parameters (all trainable ones when ``param_names`` is None), model order."""
    if param_names is not None and not isinstance(param_names, (list, tuple, set)):
        raise TypeError(f"param_names: expected a list of parameter names, got {type(param_names).__name__}")
    sel = params_of(model, list(param_names) if param_names is not None else None)
    if not sel:
        raise ValueError("param_names: no trainable parameter selected")
    return sel


def output_jacobian_cotangents(output_fn: Callable[[Tensor], Tensor] | None) -> Callable[[Tensor], Tensor]:
    """Cotangents whose VJPs are the Jacobian rows of ``output_fn ∘ f``: v[b, c] = ∂o_{b,c}/∂f_b
    (the identity when ``output_fn`` is None). ``output_fn`` must act row-wise on [B, K] logits."""
    if output_fn is None:
        def ident(f: Tensor) -> Tensor:
            eye = torch.eye(f.shape[1], dtype=f.dtype, device=f.device)
            return eye.expand(f.shape[0], -1, -1)
        return ident

    def rows(f: Tensor) -> Tensor:
        return vmap(jacrev(lambda z: output_fn(z.unsqueeze(0))[0]))(f)

    return rows


def _eigh_rescued(m: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """``eigh`` of Grams on which LAPACK's float32 eigh did not converge: a saturated softmax gives Grams of ~1e-11
    with subnormal entries (~1e-43). Each M_b is divided by its largest entry (λ_b scales by the same factor, Q_b
    is unchanged), entries still subnormal after that (below ``finfo.tiny`` of the largest: far below float32's
    resolution of it) are set to zero, and float64 is tried if float32 still fails. ``(None, None)`` if both fail.
    Only called after the plain eigh failed, so Grams it handles well give bit-for-bit what they gave before."""
    tiny = torch.finfo(m.dtype).tiny
    scale = m.abs().amax(dim=(1, 2), keepdim=True).clamp_min(tiny)
    ms = m / scale
    ms = ms.masked_fill(ms.abs() < tiny, 0.0)
    for dtype in (m.dtype, torch.float64):
        try:
            lam, q = torch.linalg.eigh(ms.to(dtype))
        except torch.linalg.LinAlgError:
            continue
        return lam.to(m.dtype) * scale.squeeze(2), q.to(m.dtype)
    return None, None


def gram_factor(v: Tensor, rtol: float | None = None) -> Tensor:
    """Fewest cotangents with the same Gram matrix: W [B, C', K] with Σ_c w_c w_cᵀ = Σ_c v_c v_cᵀ per example.

        M_b = V_bᵀ V_b = Q_b diag(λ_b) Q_bᵀ,    W_b = diag(√λ_b) Q_bᵀ  restricted to the C' largest eigenvalues,

    C' = the largest numerical rank in the chunk (eigenvalues above ``rtol · max λ_b``, default
    ``K · eps`` of the dtype: dropped directions carry only rounding error, so every Gram-based estimate
    Σ_c J_bᵀ w_c w_cᵀ J_b — GGN diag, K-FAC's G, full — is unchanged to rounding). For the softmax
    cotangents Λ^{1/2} (rank K − 1: Λ𝟙 = 0) this is K − 1 passes instead of K: one instead of two for a
    2-way head. Per-example Jacobian rows and gradients need the cotangents themselves, not this.

    Args:
        v: cotangents [B, C, K].
        rtol: relative eigenvalue threshold.

    Returns:
        [B, C', K] with C' ≤ min(C, K) (at least 1); ``v`` itself when the eigendecomposition fails to
        converge in float32 and in float64.
    """
    b, c, k = v.shape
    if k > c:  # rank ≤ C already
        return v
    m = v.transpose(1, 2) @ v  # [B, K, K] = Σ_c v_c v_cᵀ
    try:
        lam, q = torch.linalg.eigh(m)  # ascending
    except torch.linalg.LinAlgError:
        lam, q = _eigh_rescued(m)
        if lam is None:
            return v  # the same Gram exactly; only the saving of passes is lost
    if not (bool(torch.isfinite(lam).all()) and bool(torch.isfinite(q).all())):
        return v
    tol = (k * torch.finfo(v.dtype).eps if rtol is None else rtol) * lam[:, -1:].clamp_min(0)
    keep = max(1, int((lam > tol).sum(1).max()))
    lam, q = lam[:, -keep:].clamp_min(0), q[:, :, -keep:]
    return (q * lam.sqrt().unsqueeze(1)).transpose(1, 2).contiguous()  # [B, C', K]


def passes(
    model: nn.Module,
    x: Tensor | Iterable,
    y: Tensor | None,
    selected: ParamDict,
    cotangents: Callable[[Tensor, Tensor | None, slice, int], Tensor],
    *,
    head: int | None,
    chunk_size: int | None,
    per_batch: Callable[[int, Tensor | None], object] | None = None,
    dense: int = 0,
    gram_only: bool = False,
) -> Iterator[tuple[Pass, Tensor | None]]:
    """Run :func:`backprop` chunk by chunk over the data, on the model's device and dtype.

    ``cotangents(logits, y_chunk, sl, batch_state)`` builds v for one chunk; ``per_batch(n, y)`` may
    draw per-batch state (e.g. MC noise) so that results do not depend on the chunking. The model is
    in eval mode for the whole iteration (restored when the generator finishes or is closed —
    consume it inside ``contextlib.closing`` so that an error in the consumer restores it at once).

    ``gram_only=True`` tells the engine that the consumer uses only Σ_c u_{b,c} u_{b,c}ᵀ (GGN / Fisher in
    diag, kron or full structure): the cotangents are then compressed by :func:`gram_factor` (K − 1 passes
    for the softmax GGN instead of K). The passes' per-cotangent vectors are then not the caller's.
    """
    device, dtype = model_device_dtype(model)
    kw = model_kwargs(model, head)
    layers = find_layers(model, selected)
    with eval_mode(model):
        for xb, yb in iter_batches(x, y):
            xb = xb.to(device=device, dtype=dtype if xb.is_floating_point() else None, non_blocking=True)
            if yb is not None:
                yb = yb.to(device=device, non_blocking=True)
            n = xb.shape[0]
            if chunk_size is None:
                chunk_size = auto_chunk(model, layers, xb, kw, dense)
            state = per_batch(n, yb) if per_batch is not None else None
            for start in range(0, n, chunk_size):
                sl = slice(start, min(start + chunk_size, n))
                yc = yb[sl] if yb is not None else None
                if gram_only:
                    def cot(f: Tensor, yc=yc, sl=sl) -> Tensor:
                        return gram_factor(cotangents(f, yc, sl, state))
                else:
                    def cot(f: Tensor, yc=yc, sl=sl) -> Tensor:
                        return cotangents(f, yc, sl, state)
                p = backprop(model, selected, layers, xb[sl], cot, kw)
                yield p, yc
                del p  # the consumer is done with this chunk: free it before the next pass


def pass_rows(p: Pass, selected: ParamDict) -> ParamDict:
    """Materialise the per-example VJPs of a pass: ParamDict of [B, C, *shape] in ``selected`` order."""
    b = p.n
    c = None
    out: dict[str, Tensor] = {}
    for layer in p.layers:
        if layer.index in p.g:
            jw, jb = p.layer_jacobian(layer.index)
            c = jw.shape[1]
            if layer.weight is not None:
                out[layer.weight] = jw.reshape(b, c, *selected[layer.weight].shape)
            if layer.bias is not None:
                out[layer.bias] = jb
    out.update(p.other)
    if c is None:
        c = next(iter(p.other.values())).shape[1] if p.other else 1
    res = {}
    for name, t in selected.items():
        res[name] = out[name] if name in out else t.new_zeros((b, c) + tuple(t.shape))
    return res


def _stack(chunks: list[ParamDict]) -> ParamDict:
    return {k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}


@full_precision
def per_example_jacobians(
    model: nn.Module,
    x: Tensor,
    *,
    head: int | None = 0,
    param_names: list[str] | None = None,
    chunk_size: int | None = None,
    output_fn: Callable[[Tensor], Tensor] | None = None,
) -> ParamDict:
    """Per-example Jacobians of the outputs with respect to the parameters.

    Precision: computed in the model's dtype (fp32 / fp64) also inside an active ``torch.autocast``
    (bf16 training): autocast is off for the call and bf16 / fp16 arguments are cast to fp32
    (:func:`~continual_blr.mixed_precision.full_precision`).

        J[θ]_{b,k} = ∂o_k(x_b) / ∂θ,    o = output_fn(f_θ(x, head))    (o = f without output_fn)

    Computed with ``torch.func`` (``functional_call`` + ``vmap`` over examples of ``vjp``, ``vmap`` over
    the K output rows), ``chunk_size`` examples at a time; Linear/Conv2d weight rows are assembled as
    Σ_r g_r a_rᵀ from the backpropagated output gradient g and the layer input a (exact).
    The model runs in eval mode (BatchNorm on running statistics, dropout off; flags restored).

    Args:
        model: any module with outputs [B, K]; called as ``model(x, head=head)`` when it takes ``head``.
        x: inputs [B, ...].
        head: output head of a multi-head model.
        param_names: subset of ``model.named_parameters()`` names (default: all trainable).
        chunk_size: examples per vectorised pass (default: chosen from a probe forward so that a pass
            holds about 2²⁶ numbers); memory O(chunk·K·P) at most.
        output_fn: row-wise map of the logits, e.g. ``lambda f: f.softmax(-1)`` (FROMP's
            probability-space Jacobians).

    Returns:
        ParamDict with entries [B, K, *param_shape] (K = outputs of ``output_fn`` when given).
    """
    chunk = resolve_chunk(chunk_size)
    sel = select(model, param_names)
    rows = output_jacobian_cotangents(output_fn)
    p_all = sum(t.numel() for t in sel.values())
    with closing(passes(model, x, None, sel, lambda f, y, sl, s: rows(f), head=head, chunk_size=chunk,
                        dense=p_all)) as run:
        chunks = [pass_rows(p, sel) for p, _ in run]
    return _stack(chunks)


@full_precision
def per_example_grads(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    *,
    head: int | None = 0,
    param_names: list[str] | None = None,
    chunk_size: int | None = None,
) -> tuple[Tensor, ParamDict]:
    """Per-example losses and gradients g_b = ∇_θ ℓ(f_θ(x_b), y_b) (not a minibatch mean).

    Precision: computed in the model's dtype (fp32 / fp64) also inside an active ``torch.autocast``
    (bf16 training): autocast is off for the call and bf16 / fp16 arguments are cast to fp32
    (:func:`~continual_blr.mixed_precision.full_precision`).

    ``loss_fn(logits, y)`` must return per-example losses [B] (``reduction='none'``) and treat examples
    independently. Computed as `J_bᵀ ∇_f ℓ_b`: one forward, `∇_f ℓ` by ``torch.func.grad`` of `Σ_b ℓ_b`
    with respect to the logits, and one vector-Jacobian product per example (see
    :func:`per_example_jacobians` for the engine, eval mode and chunking).

    Returns:
        ``(losses [B], ParamDict of [B, *param_shape])``.
    """
    chunk = resolve_chunk(chunk_size)
    sel = select(model, param_names)
    losses: list[Tensor] = []

    def cot(f: Tensor, yc: Tensor | None, sl: slice, state: object) -> Tensor:
        fd = f.detach()
        loss = loss_fn(fd, yc)
        if loss.shape != (f.shape[0],):
            raise ValueError(f"loss_fn: must return per-example losses of shape [{f.shape[0]}], "
                             f"got {tuple(loss.shape)} (use reduction='none')")
        losses.append(loss)
        grad = torch.func.grad(lambda z: loss_fn(z, yc).sum())(fd)
        return grad.unsqueeze(1)

    with closing(passes(model, x, y, sel, cot, head=head, chunk_size=chunk,
                        dense=sum(t.numel() for t in sel.values()))) as run:
        chunks = [{k: v[:, 0] for k, v in pass_rows(p, sel).items()} for p, _ in run]
    return torch.cat(losses), _stack(chunks)
