"""DNN2GP / FROMP kernels  K = J Σ Jᵀ  and kernel-vector products, without materialising a P×P matrix
(unless Σ itself is given dense) and without holding all M·K Jacobian rows of a Linear layer.

Notation: M points x_m, outputs o = output_fn(f_θ(x)) ∈ R^K (o = f without ``output_fn``; FROMP uses
softmax probabilities), J_{m,c} = ∂o_c(x_m)/∂θ ∈ R^P, Σ a covariance over the selected parameters.

* full multi-output kernel: K[(m,c),(n,d)] = J_{m,c} Σ J_{n,d}ᵀ, returned as [M·K, M·K] with row index
  m·K + c (points outer, outputs inner);
* class-wise blocks (FROMP, Pan et al. 2020): K_c[m, n] = J_{m,c} Σ J_{n,c}ᵀ, returned as [K, M, M].

Σ can be given as

* a ParamDict of variances (diagonal Σ);
* a dense [P, P] tensor in ``types.flatten`` order of the selected parameters (full Σ);
* a :class:`~continual_blr.types.KronCurvature` of **covariance** factors: per block Σ acts on
  Θ = [W.reshape(d_out, -1) | b] as Θ ↦ G Θ A (i.e. pass A = A_prec⁻¹ and G = G_prec⁻¹ of a Kronecker
  precision A_prec ⊗ G_prec), plus variances in ``diag`` for the other parameters.

How (``method="structured"``, the default): one engine pass (:mod:`._engine`) gives, per Linear layer,
its inputs a_m and the backpropagated output gradients g_{m,c}, so that J_{m,c}[W] = g_{m,c} a_mᵀ. Then

* diagonal Σ (variances S_{o,i} of W, s_o of b):
  K[(m,c),(n,d)] += Σ_o g_{m,c,o} g_{n,d,o} T_o[m,n],  T_o[m,n] = Σ_i a_{m,i} S_{o,i} a_{n,i} + s_o,
  so the M×M×d_in work is shared by all outputs (K× fewer flops than forming J_c Σ J_cᵀ per class);
* Kronecker Σ: K[(m,c),(n,d)] += (g_{m,c}ᵀ G g_{n,d}) · (ã_mᵀ A ã_n)  with ã = [a; 1];
* Conv2d layers, other parameters (BatchNorm …) and full Σ: the Jacobian rows of that parameter
  group are formed (M·K_group × P_group) and contracted with Σ by matrix products.

``method="jvp"`` builds the kernel column by column as K e = J Σ (Jᵀ e): ``torch.func.vjp`` then Σ ⊙,
then ``torch.func.jvp`` (vectorised with ``vmap`` over the unit vectors, ``chunk_size`` at a time);
:func:`kernel_vector_product` uses the same two passes for a single vector. Both are exact; the
structured path is the faster one for the FROMP sizes (see ``benchmarks/results/perf/perf_curvature.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp, vjp, vmap

from ..mixed_precision import full_precision
from ..types import KronCurvature, ParamDict, flatten, params_of, unflatten
from ._engine import eval_mode, find_layers, model_device_dtype, model_kwargs
from .jacobians import output_jacobian_cotangents, passes

__all__ = ["kernel", "kernel_vector_product", "BUDGET"]

BUDGET = 2**26
"""Numbers (elements) an intermediate of the structured kernel may hold; larger work is chunked."""


# ---------------------------------------------------------------------------------------------- Σ spec


@dataclass
class _Sigma:
    kind: str  # "diag" | "full" | "kron"
    sel: ParamDict  # detached selected parameters, model order
    diag: ParamDict = field(default_factory=dict)  # variances (diag Σ, or kron's non-block part)
    dense: Tensor | None = None
    blocks: dict[str, tuple[str | None, Tensor, Tensor]] = field(default_factory=dict)  # weight → (bias, A, G)

    def apply(self, u: ParamDict) -> ParamDict:
        """Σ u for a ParamDict u (the middle step of J Σ Jᵀ v)."""
        if self.kind == "full":
            return unflatten(self.dense @ flatten(u), self.sel)
        out = {n: u[n] * s for n, s in self.diag.items()}
        for w, (b, a, g) in self.blocks.items():
            theta = u[w].reshape(u[w].shape[0], -1)
            if b is not None:
                theta = torch.cat([theta, u[b].unsqueeze(1)], dim=1)
            theta = g @ theta @ a
            if b is not None:
                out[b] = theta[:, -1]
                theta = theta[:, :-1]
            out[w] = theta.reshape(u[w].shape)
        return {n: out[n] for n in self.sel}


def _sigma_spec(model: nn.Module, sigma: object, param_names: list[str] | None) -> _Sigma:
    device, dtype = model_device_dtype(model)
    if isinstance(sigma, dict):
        names = list(sigma)
        if param_names is not None and set(param_names) != set(names):
            raise ValueError("param_names: must name exactly the parameters of the diagonal sigma")
        sel = params_of(model, names)
        diag = {}
        for n, t in sel.items():
            if sigma[n].shape != t.shape:
                raise ValueError(f"sigma[{n!r}]: shape {tuple(sigma[n].shape)}, parameter has {tuple(t.shape)}")
            diag[n] = sigma[n].to(device=device, dtype=dtype)
        return _Sigma("diag", sel, diag=diag)
    if isinstance(sigma, Tensor):
        sel = params_of(model, list(param_names) if param_names is not None else None)
        p = sum(t.numel() for t in sel.values())
        if sigma.shape != (p, p):
            raise ValueError(f"sigma: dense covariance must be [{p}, {p}] for the selected parameters, "
                             f"got {tuple(sigma.shape)}")
        return _Sigma("full", sel, dense=sigma.to(device=device, dtype=dtype))
    if hasattr(sigma, "blocks") and hasattr(sigma, "diag"):
        names, blocks = [], {}
        for blk in sigma.blocks:
            names += [blk.weight] + ([blk.bias] if blk.bias is not None else [])
            blocks[blk.weight] = (blk.bias, blk.A.to(device=device, dtype=dtype), blk.G.to(device=device, dtype=dtype))
        names += list(sigma.diag)
        if param_names is not None and set(param_names) != set(names):
            raise ValueError("param_names: must name exactly the parameters covered by the Kronecker sigma")
        sel = params_of(model, names)
        for w, (b, a, g) in blocks.items():
            d_in = sel[w][0].numel() + (1 if b is not None else 0)
            if a.shape != (d_in, d_in) or g.shape != (sel[w].shape[0],) * 2:
                raise ValueError(f"sigma block {w!r}: A must be [{d_in}, {d_in}] and G [{sel[w].shape[0]}]*2, "
                                 f"got {tuple(a.shape)} and {tuple(g.shape)}")
        diag = {n: sigma.diag[n].to(device=device, dtype=dtype) for n in sigma.diag}
        return _Sigma("kron", sel, diag=diag, blocks=blocks)
    raise TypeError("sigma: expected a ParamDict of variances, a dense [P, P] tensor or a KronCurvature "
                    f"of covariance factors, got {type(sigma).__name__}")


# --------------------------------------------------------------------------------------- rows of J


@dataclass
class _Rows:
    """Jacobian rows of one class group over all M points, factored where possible.

    linear: weight name → (a [M, d_in], g [M, Cg, d_out], bias name | None) for Linear layers on 2-D inputs;
    dense: parameter name → rows [M, Cg, *shape] for everything else.
    """

    m: int
    c: int
    linear: dict[str, tuple[Tensor, Tensor, str | None]] = field(default_factory=dict)
    dense: ParamDict = field(default_factory=dict)


def _pass_pieces(p, spec: _Sigma, factor_linear: bool) -> dict:
    """One chunk's rows: factored (a, g) for Linear layers on 2-D inputs, dense rows for the rest."""
    lin, dense = {}, dict(p.other)
    for layer in p.layers:
        i = layer.index
        if i not in p.g:
            continue  # unused layer (another head): zero rows, nothing to add
        g, a = p.g[i], p.a[i]
        if factor_linear and layer.kind == "linear" and layer.weight is not None and g.shape[-1] == 1:
            lin[layer.weight] = (a[..., 0], g[..., 0], layer.bias)
            continue
        jw, jb = p.layer_jacobian(i)
        if layer.weight is not None:
            dense[layer.weight] = jw.reshape(jw.shape[:2] + spec.sel[layer.weight].shape)
        if layer.bias is not None:
            dense[layer.bias] = jb
    return {"lin": lin, "dense": dense, "m": p.n}


def _collect(model: nn.Module, x: Tensor, spec: _Sigma, rows_fn: Callable, group: list[int], head, chunk: int | None,
             factor_linear: bool) -> _Rows:
    pieces: list[dict] = []
    lo, hi = group[0], group[-1] + 1  # groups are contiguous ranges of classes

    def cot(f: Tensor, yc, sl, st) -> Tensor:
        return rows_fn(f)[:, lo:hi, :]

    with closing(passes(model, x, None, spec.sel, cot, head=head, chunk_size=chunk)) as run:
        for p, _ in run:
            pieces.append(_pass_pieces(p, spec, factor_linear))
    out = _Rows(m=sum(pc["m"] for pc in pieces), c=len(group))
    for w in pieces[0]["lin"]:
        out.linear[w] = (torch.cat([pc["lin"][w][0] for pc in pieces]),
                         torch.cat([pc["lin"][w][1] for pc in pieces]), pieces[0]["lin"][w][2])
    for n in pieces[0]["dense"]:
        out.dense[n] = torch.cat([pc["dense"][n] for pc in pieces])
    return out


# ------------------------------------------------------------------------------------ contractions


def _t_chunks(a: Tensor, s_w: Tensor, s_b: Tensor | None, per_o: int):
    """Yield (o-slice, T) with T[m, o, n] = Σ_i a_{m,i} S_{o,i} a_{n,i} + s_o for a slice of outputs o,
    the slice sized so that no intermediate exceeds :data:`BUDGET` numbers (``per_o`` = extra numbers per
    (m, o, n) the caller will form)."""
    m, d_in = a.shape
    d_out = s_w.shape[0]
    step = max(1, min(d_out, BUDGET // max(1, m * max(d_in, m * per_o))))
    at = a.T
    for o0 in range(0, d_out, step):
        sl = slice(o0, min(o0 + step, d_out))
        t = torch.matmul(a.unsqueeze(1) * s_w[sl].unsqueeze(0), at)  # [M, o, I] @ [I, N] → [M, o, N]
        if s_b is not None:
            t = t + s_b[sl].view(1, -1, 1)
        yield sl, t


def _block_diag_lin(out: Tensor, rows: _Rows, spec: _Sigma, w: str) -> None:
    """Class-wise blocks for a factored Linear layer: out [Cg, M, M] += ...

    diag Σ: K_c[m, n] += Σ_o g[m,c,o] T[m,o,n] g[n,c,o] — one broadcast product and one batched
    matrix product (batch m) per class; Kron Σ: (g_c G g_cᵀ) ⊙ (ã A ãᵀ)."""
    a, g, b = rows.linear[w]
    if w not in spec.blocks:
        s_b = spec.diag[b] if b is not None else None
        for sl, t in _t_chunks(a, spec.diag[w], s_b, 1):
            gs = g[:, :, sl]  # [M, Cg, o]
            for c in range(rows.c):
                gc = gs[:, c, :].contiguous()  # [M, o]
                y = t * gc.T.contiguous().unsqueeze(0)  # [M, o, N] scaled by g[n, c, o]
                out[c] += torch.bmm(gc.unsqueeze(1), y).squeeze(1)
    else:  # kron
        bias, A, G = spec.blocks[w]
        at = torch.cat([a, a.new_ones(a.shape[0], 1)], 1) if bias is not None else a
        ka = at @ A @ at.T  # [M, M]
        gt = g.transpose(0, 1)  # [Cg, M, O]
        out += torch.matmul(gt @ G, gt.transpose(1, 2)) * ka


def _full_lin(out: Tensor, r1: _Rows, r2: _Rows, spec: _Sigma, w: str) -> None:
    """Full multi-output block for a factored Linear layer: out [M, C1, M, C2] += ..."""
    a, g1, b = r1.linear[w]
    g2 = r2.linear[w][1]
    m = a.shape[0]
    if w not in spec.blocks:
        s_b = spec.diag[b] if b is not None else None
        for sl, t in _t_chunks(a, spec.diag[w], s_b, r2.c):
            # Z[m, o, (n, d)] = T[m, o, n] g2[n, d, o];  out[m, c, (n, d)] += Σ_o g1[m, c, o] Z[m, o, (n, d)]
            g2s = g2[:, :, sl].permute(2, 0, 1)  # [o, N, C2]
            z = (t.unsqueeze(-1) * g2s.unsqueeze(0)).reshape(m, t.shape[1], -1)  # [M, o, N·C2]
            out += torch.bmm(g1[:, :, sl], z).reshape(out.shape)
    else:
        bias, A, G = spec.blocks[w]
        at = torch.cat([a, a.new_ones(m, 1)], 1) if bias is not None else a
        ka = at @ A @ at.T
        kg = (g1.reshape(-1, g1.shape[-1]) @ G @ g2.reshape(-1, g2.shape[-1]).T).reshape(out.shape)
        out += kg * ka[:, None, :, None]


def _dense_groups(rows: _Rows, spec: _Sigma):
    """Yield (flat rows [M, Cg, P_grp], function applying Σ_grp to flat rows) per dense parameter group."""
    if spec.kind == "full":
        j = torch.cat([rows.dense[n].reshape(rows.m, rows.c, -1) if n in rows.dense
                       else spec.sel[n].new_zeros(rows.m, rows.c, spec.sel[n].numel()) for n in spec.sel], -1)
        yield j, lambda r: r @ spec.dense  # Σ symmetric
        return
    done = set()
    for w, (b, A, G) in spec.blocks.items():
        if w not in rows.dense:
            continue
        done.update([w, b])
        uw = rows.dense[w].reshape(rows.m, rows.c, spec.sel[w].shape[0], -1)
        u = torch.cat([uw, rows.dense[b].unsqueeze(-1)], -1) if b is not None else uw
        yield u.reshape(rows.m, rows.c, -1), (lambda r, A=A, G=G, shp=u.shape: (G @ r.reshape(-1, *shp[2:]) @ A)
                                               .reshape(r.shape))
    for n, t in rows.dense.items():
        if n in done:
            continue
        s = spec.diag[n].reshape(-1)
        yield t.reshape(rows.m, rows.c, -1), (lambda r, s=s: r * s)


def _contract_linear(out: Tensor, spec: _Sigma, rows: _Rows, blockwise: bool) -> None:
    """Add the factored Linear layers' part (all classes at once, so T is formed once)."""
    for w in rows.linear:
        if blockwise:
            _block_diag_lin(out, rows, spec, w)
        else:
            _full_lin(out, rows, rows, spec, w)


def _contract_dense(spec: _Sigma, r1: _Rows, r2: _Rows | None, blockwise: bool) -> Tensor:
    """The dense rows' part: [Cg, M, M] class blocks, or the [M, C1, M, C2] block between two groups."""
    m = r1.m
    ref = next(iter(spec.sel.values()))
    if blockwise:
        out = ref.new_zeros(r1.c, m, m)
        for j, apply in _dense_groups(r1, spec):
            jt = j.transpose(0, 1)  # [Cg, M, P]
            out += torch.matmul(apply(jt), jt.transpose(1, 2))
        return out
    r2 = r1 if r2 is None else r2
    out = ref.new_zeros(m, r1.c, m, r2.c)
    for (j1, apply), (j2, _) in zip(_dense_groups(r1, spec), _dense_groups(r2, spec)):
        out += (apply(j1).reshape(m * r1.c, -1) @ j2.reshape(m * r2.c, -1).T).reshape(out.shape)
    return out


def _merge_linear(parts: list[_Rows], m: int) -> _Rows:
    """Concatenate the factored Linear rows of all class groups (a is shared, g joins along classes)."""
    out = _Rows(m=m, c=sum(p.c for p in parts))
    for w, (a, _, b) in parts[0].linear.items():
        out.linear[w] = (a, torch.cat([p.linear[w][1] for p in parts], dim=1), b)
    return out


# ---------------------------------------------------------------------------------------------- API


def _n_outputs(model: nn.Module, x: Tensor, kw: dict, output_fn) -> int:
    device, dtype = model_device_dtype(model)
    with torch.no_grad(), eval_mode(model):
        f = model(x[:1].to(device=device, dtype=dtype if x.is_floating_point() else None), **kw)
        if output_fn is not None:
            f = output_fn(f)
    return f.shape[1]


@full_precision
def kernel(
    model: nn.Module,
    x: Tensor,
    sigma: ParamDict | Tensor | KronCurvature,
    *,
    head: int | None = 0,
    output_fn: Callable[[Tensor], Tensor] | None = None,
    blockwise: bool = True,
    param_names: list[str] | None = None,
    chunk_size: int | None = None,
    method: str = "structured",
) -> Tensor:
    """The DNN2GP kernel K = J Σ Jᵀ of ``output_fn ∘ f`` at M points (see the module docstring).

    Precision: computed in the model's dtype (fp32 / fp64) also inside an active ``torch.autocast``
    (bf16 training): autocast is off for the call and bf16 / fp16 arguments are cast to fp32
    (:func:`~continual_blr.mixed_precision.full_precision`).

    Args:
        model: network with outputs [B, K]; runs in eval mode (flags restored afterwards).
        x: the M points [M, ...].
        sigma: covariance over the selected parameters — ParamDict of variances (diagonal), dense
            [P, P] (``types.flatten`` order) or KronCurvature of covariance factors (Θ ↦ G Θ A).
        head: output head of a multi-head model.
        output_fn: row-wise map of the logits (FROMP: ``lambda f: f.softmax(-1)``).
        blockwise: True → class-wise blocks [K, M, M] (K_c = J_c Σ J_cᵀ, FROMP); False → full
            multi-output kernel [M·K, M·K] with index m·K + c.
        param_names: the parameters Σ is over (dense Σ; for ParamDict / Kron Σ they are Σ's keys).
        chunk_size: points per engine pass (structured) or unit vectors per vmap call (jvp).
        method: ``"structured"`` (default) or ``"jvp"`` (columns via jvp(Σ ⊙ vjp(e))).

    Returns:
        [K, M, M] (blockwise) or [M·K, M·K], on the model's device and dtype.
    """
    spec = _sigma_spec(model, sigma, param_names)
    kw = model_kwargs(model, head)
    device, dtype = model_device_dtype(model)
    x = x.to(device=device, dtype=dtype if x.is_floating_point() else None)
    m = x.shape[0]
    if method == "jvp":
        return _kernel_jvp(model, x, spec, kw, output_fn, blockwise, chunk_size)
    if method != "structured":
        raise ValueError(f"method: got {method!r}; allowed: 'structured', 'jvp'")
    k = _n_outputs(model, x, kw, output_fn)
    chunk = int(chunk_size) if chunk_size is not None else None  # None: automatic (probe forward)
    rows_fn = output_jacobian_cotangents(output_fn)
    factor_linear = spec.kind != "full"
    # class groups so that the dense rows of one group stay within BUDGET numbers
    layers = find_layers(model, spec.sel)
    lin_w = {l.weight for l in layers if l.weight is not None and isinstance(l.module, nn.Linear)}
    dense_p = sum(t.numel() for n, t in spec.sel.items() if not (factor_linear and n in lin_w))
    per_class = max(1, m * dense_p)
    gsize = max(1, min(k, BUDGET // per_class))
    groups = [list(range(s, min(s + gsize, k))) for s in range(0, k, gsize)]

    def collect(g: list[int]) -> _Rows:
        return _collect(model, x, spec, rows_fn, g, head, chunk, factor_linear)

    # dense rows (Conv2d, BatchNorm, other parameters, full Σ) group by group; factored Linear rows
    # of every group are kept (small: a [M, d_in], g [M, Cg, d_out]) and contracted once at the end.
    parts: list[_Rows] = []
    if blockwise:
        out = torch.empty(k, m, m, device=device, dtype=dtype)
        for g in groups:
            r = collect(g)
            out[g[0]:g[-1] + 1] = _contract_dense(spec, r, None, True)
            r.dense.clear()
            parts.append(r)
        _contract_linear(out, spec, _merge_linear(parts, m), True)
        return out
    out = torch.empty(m, k, m, k, device=device, dtype=dtype)
    for i, gi in enumerate(groups):
        ri = collect(gi)
        for gj in groups[i:]:
            rj = ri if gj is gi else collect(gj)
            blk = _contract_dense(spec, ri, rj, False)  # [M, Ci, M, Cj]
            out[:, gi[0]:gi[-1] + 1, :, gj[0]:gj[-1] + 1] = blk
            if gj is not gi:
                out[:, gj[0]:gj[-1] + 1, :, gi[0]:gi[-1] + 1] = blk.permute(2, 3, 0, 1)
        ri.dense.clear()
        parts.append(ri)
    _contract_linear(out, spec, _merge_linear(parts, m), False)
    return out.reshape(m * k, m * k)


def _kvp_operator(model: nn.Module, x: Tensor, spec: _Sigma, kw: dict, output_fn):
    """v ↦ J Σ Jᵀ v for v [M, K] (one vjp, Σ, one jvp)."""
    frozen = {n: t for n, t in params_of(model).items() if n not in spec.sel}

    def f(p: ParamDict) -> Tensor:
        out = functional_call(model, {**frozen, **p}, (x,), kw)
        return output_fn(out) if output_fn is not None else out

    _, pullback = vjp(f, spec.sel)

    def op(v: Tensor) -> Tensor:
        (u,) = pullback(v)
        return jvp(f, (spec.sel,), (spec.apply(u),))[1]

    return op


def _kernel_jvp(model, x, spec, kw, output_fn, blockwise, chunk_size) -> Tensor:
    m = x.shape[0]
    with eval_mode(model):
        op = _kvp_operator(model, x, spec, kw, output_fn)
        k = _n_outputs(model, x, kw, output_fn)
        eye = torch.eye(m * k, device=x.device, dtype=x.dtype).reshape(m * k, m, k)
        cols = vmap(op, chunk_size=chunk_size)(eye)  # [(m,c), M, K] = K[(n,d), (m,c)] (symmetric)
    full = cols.reshape(m, k, m, k)
    if blockwise:
        idx = torch.arange(k, device=x.device)
        return full[:, idx, :, idx]  # [K, M, M]
    return full.reshape(m * k, m * k)


@full_precision
def kernel_vector_product(
    model: nn.Module,
    x: Tensor,
    sigma: ParamDict | Tensor | KronCurvature,
    v: Tensor,
    *,
    head: int | None = 0,
    output_fn: Callable[[Tensor], Tensor] | None = None,
    blockwise: bool = True,
    param_names: list[str] | None = None,
) -> Tensor:
    """K v for the kernel of :func:`kernel` and v of shape [M, K], as jvp(Σ ⊙ vjp(v)).

    Precision: computed in the model's dtype (fp32 / fp64) also inside an active ``torch.autocast``
    (bf16 training): autocast is off for the call and bf16 / fp16 arguments are cast to fp32
    (:func:`~continual_blr.mixed_precision.full_precision`).

    full (``blockwise=False``): (K v)[m, c] = Σ_{n,d} J_{m,c} Σ J_{n,d}ᵀ v[n, d]  — one vjp, one jvp;
    blockwise: (K v)[m, c] = Σ_n K_c[m, n] v[n, c] — the same, vmapped over the K classes with v
    masked to column c. Nothing of size P×P or M·K×P is formed (except Σ when given dense).

    Returns:
        [M, K] on the model's device.
    """
    spec = _sigma_spec(model, sigma, param_names)
    kw = model_kwargs(model, head)
    device, dtype = model_device_dtype(model)
    x = x.to(device=device, dtype=dtype if x.is_floating_point() else None)
    v = v.to(device=device, dtype=dtype)
    with eval_mode(model):
        op = _kvp_operator(model, x, spec, kw, output_fn)
        if v.dim() != 2 or v.shape[0] != x.shape[0]:
            raise ValueError(f"v: expected [M, K] with M = {x.shape[0]}, got {tuple(v.shape)}")
        if not blockwise:
            return op(v)
        k = v.shape[1]
        eye = torch.eye(k, device=device, dtype=dtype)
        masked = v.unsqueeze(0) * eye.unsqueeze(1)  # [K, M, K]: class c keeps column c only
        res = vmap(op)(masked)  # [K, M, K]
        idx = torch.arange(k, device=device)
        return res[idx, :, idx].T  # [M, K]
