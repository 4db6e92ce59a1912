"""Curvature estimates (GGN, empirical Fisher, MC Fisher, Hessian) in diagonal, Kronecker and full
structure. All are **sums over examples** (never means).

Every estimate except the Hessian has the form  C = Σ_b Σ_c u_{b,c} u_{b,c}ᵀ,  u_{b,c} = J_bᵀ v_{b,c},
with the cotangents v of :mod:`.likelihoods`:

* ``ggn``:               C = Σ_b J_bᵀ Λ_b J_b                  (v = columns of Λ_b^{1/2}, C = K)
* ``empirical_fisher``:  C = Σ_b ∇ℓ_b ∇ℓ_bᵀ at the observed y_b (`v = ∇_f ℓ`, per example, C = 1)
* ``mc_fisher``:         C = Σ_b (1/S) Σ_s ĝ_{b,s} ĝ_{b,s}ᵀ, ĝ at ŷ_{b,s} ~ p(y | f_b)   (C = S)
* ``hessian``:           C = ∇²_θ Σ_b ℓ_b (dense; small models / subsets only)

Structures:

* ``diag``: diag(C) as a ParamDict shaped like the parameters. For a Linear layer used on [B, d_in]
  inputs it is computed without forming per-example gradients:
  diag_W = Σ_{b,c} (g_{b,c} ⊙ g_{b,c}) (a_b ⊙ a_b)ᵀ (one matrix product); Conv2d layers form the
  per-example, per-cotangent weight gradients of one chunk (chunk·C·d_out·d_in numbers) and square them.
* ``full``: C as a dense P×P tensor in the order of ``types.flatten(params)``.
* ``kron``: K-FAC, a :class:`~continual_blr.types.KronCurvature`. For each Linear/Conv2d layer with
  input patches a_{b,r} (r over the R output positions, R = 1 for a Linear on [B, d_in]), bias-augmented
  ã = [a; 1] when the bias is selected, and backpropagated output gradients g_{b,c,r} = ∂(v_{b,c}ᵀ f_b)/∂y_{b,r}:

      A = (1/(N·R)) Σ_b Σ_r ã_{b,r} ã_{b,r}ᵀ          (mean over examples and positions)
      G = Σ_b Σ_r Σ_c g_{b,c,r} g_{b,c,r}ᵀ              (sum over examples, positions and cotangents)

  so that (for the GGN) the block ≈ Σ_b (ã_b ã_bᵀ) ⊗ (Σ_c g_{b,c} g_{b,c}ᵀ) keeps the *sum* scaling, and it
  is exact for one example through one Linear layer. For Conv2d this is **K-FAC-expand** (Eschenhagen et
  al., 2023), i.e. KFC of Grosse & Martens (2016) with the 1/R moved from G to A (the product A⊗G
  is the same). Parameters outside Linear/Conv2d layers (and a bias whose weight is not selected)
  get their exact diagonal in ``KronCurvature.diag``.

**Data parallel** (``continual_blr.distributed``, more than one process; ``shard``): every estimate is a
sum over examples, so each rank computes it on its contiguous part of the N examples and one
all-reduce adds the parts — the result is one process's, up to the order of floating-point additions.
K-FAC's A is a *mean*: rank r contributes (N_r/N)·A_r, so the sum is the mean over all N. The Monte-Carlo
Fisher draws the noise of all N examples on every rank (the same generator state everywhere) and
uses its rows, so the sampled labels are one process's too and the generators stay in step.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import closing

import torch
from torch import Tensor, nn
from torch.func import functional_call

from .. import distributed
from ..mixed_precision import full_precision
from ..types import Curvature, KronBlock, KronCurvature, ParamDict, Structure, flatten, parse_enum, unflatten
from . import likelihoods as lk
from ._engine import (
    Pass,
    eval_mode,
    iter_batches,
    model_device_dtype,
    model_kwargs,
    resolve_chunk,
)
from .jacobians import pass_rows, passes, select

__all__ = ["curvature", "diag_curvature", "kron_curvature", "full_curvature", "curvature_tensors"]


@full_precision
def curvature(
    model: nn.Module,
    x: Tensor | Iterable,
    y: Tensor | None = None,
    *,
    kind: Curvature | str = Curvature.GGN,
    structure: Structure | str = Structure.DIAG,
    likelihood: str = "classification",
    sigma: float = 1.0,
    head: int | None = 0,
    param_names: list[str] | None = None,
    chunk_size: int | None = None,
    batch_size: int | None = None,
    generator: torch.Generator | None = None,
    mc_samples: int = 1,
    shard: bool | None = None,
    reduce: bool = True,
) -> ParamDict | Tensor | KronCurvature:
    """A curvature of the summed loss Σ_b ℓ(f_θ(x_b), y_b) over a data set (see the module docstring).

    Precision: computed in the model's dtype (fp32 / fp64) also inside an active ``torch.autocast``
    (bf16 training): autocast is off for the call and bf16 / fp16 arguments are cast to fp32
    (:func:`~continual_blr.mixed_precision.full_precision`).

    Args:
        model: network with outputs [B, K] (logits for classification, means for regression).
        x: inputs [N, ...] (then ``y`` [N] / [N, K]), or an iterable of ``(x, y, ...)`` batches
            (e.g. a DataLoader; ``y`` must then be None). Batches are moved to the model's device.
        y: labels (classification) or targets (regression); needed by ``empirical_fisher`` and
            ``hessian``, ignored by ``ggn`` and ``mc_fisher``.
        kind: ``ggn`` | ``empirical_fisher`` | ``mc_fisher`` | ``hessian``.
        structure: ``diag`` | ``kron`` | ``full``.
        likelihood: ``"classification"`` (softmax cross-entropy) or ``"regression"`` (Gaussian).
        sigma: Gaussian noise standard deviation (regression): Λ = I/σ².
        head: output head of a multi-head model (one per call).
        param_names: subset of parameter names (default: all trainable), e.g. the last layer.
        chunk_size: examples per vectorised pass. A pass holds at most about chunk·C·P numbers (C
            cotangents per example, C = K for the GGN) — far less for Linear layers, whose diagonal
            and K-FAC factors need no per-example gradients. Default: chosen from a probe forward so
            that a pass holds about 2²⁶ numbers. ``batch_size`` is an alias.
        generator: ``torch.Generator`` for ``mc_fisher`` (required there). Noise is drawn on the
            generator's device per batch, so results do not depend on the chunking or model device.
        mc_samples: S, labels sampled per example for ``mc_fisher`` (the estimate averages over them).
        shard: in a multi-process run, compute on this rank's part of ``x`` (tensors only) — the default
            (None) when a process group of more than one process is initialised and ``x`` is a tensor.
            Every rank must then call this function (it communicates). False: the data are this rank's
            own (e.g. a BLR minibatch part) and nothing is communicated. An iterable ``x`` is never
            sharded (each rank computes on all of it).
        reduce: with ``shard``, all-reduce the ranks' parts (one collective); False returns this rank's
            part (K-FAC's A weighted by N_r/N) for the caller to reduce with its own quantities.

    Returns:
        diag → ParamDict shaped like the parameters; full → dense [P, P] in ``types.flatten`` order;
        kron → :class:`~continual_blr.types.KronCurvature`. All sums over the N examples, on the
        model's device and in its dtype.

    The model runs in eval mode throughout (BatchNorm on running statistics, dropout off); every
    module's ``training`` flag is restored in a ``finally``.
    """
    kind = parse_enum(Curvature, kind, "kind")
    structure = parse_enum(Structure, structure, "structure")
    lk.check_likelihood(likelihood, sigma)
    chunk = resolve_chunk(chunk_size, batch_size)
    sel = select(model, param_names)
    if shard is None:
        shard = isinstance(x, Tensor)
    shard = bool(shard) and distributed.is_distributed()
    rows, weight = None, 1.0
    if shard:
        if not isinstance(x, Tensor):
            raise ValueError("shard: only tensor data can be sharded over the ranks; pass x as a tensor")
        n = x.shape[0]
        start, stop = distributed.shard_bounds(n)
        weight = (stop - start) / max(n, 1)
        if stop == start:  # no examples here: the same computation on one example, times 0
            start, stop = 0, min(1, n)
        rows = (n, start)
        x, y = x[start:stop], (y[start:stop] if y is not None else None)
    if kind is Curvature.HESSIAN:
        c = _hessian(model, x, y, sel, structure, likelihood, sigma, head, chunk)
    else:
        cot, per_batch = _cotangent_fn(kind, likelihood, sigma, generator, mc_samples, model, rows)
        dense = sum(t.numel() for t in sel.values()) if structure is Structure.FULL else 0
        reducer = {Structure.DIAG: diag_curvature, Structure.FULL: full_curvature, Structure.KRON: kron_curvature}
        # closing(): the generator's eval-mode context ends here even when the reducer raises
        # Every reducer uses only Σ_c u_c u_cᵀ per example: the GGN's K softmax cotangents (rank K − 1)
        # are compressed to K − 1 (jacobians.gram_factor; exact to rounding).
        with closing(passes(model, x, y, sel, cot, head=head, chunk_size=chunk, per_batch=per_batch,
                            dense=dense, gram_only=kind is Curvature.GGN)) as run:
            c = reducer[structure](run, sel)
    if not shard:
        return c
    c = _shard_part(c, weight)
    if reduce:
        distributed.all_reduce_sum_(curvature_tensors(c), "curvature")
    return c


def curvature_tensors(c: ParamDict | Tensor | KronCurvature) -> list[Tensor]:
    """The tensors of a curvature estimate (for an in-place all-reduce: every one of them is a sum
    over examples; K-FAC's A after :func:`_shard_part`'s weighting)."""
    if isinstance(c, KronCurvature):
        return [t for blk in c.blocks for t in (blk.A, blk.G)] + list(c.diag.values())
    if isinstance(c, dict):
        return list(c.values())
    return [c]


def _shard_part(c: ParamDict | Tensor | KronCurvature, weight: float) -> ParamDict | Tensor | KronCurvature:
    """A rank's part in a form whose sum over ranks is the estimate: sums unchanged (zeroed for a rank
    without examples, weight 0), K-FAC's per-rank mean A times N_r/N."""
    if isinstance(c, KronCurvature):
        z = 0.0 if weight == 0 else 1.0
        return KronCurvature([blk._replace(A=weight * blk.A, G=z * blk.G) for blk in c.blocks],
                             {k: z * v for k, v in c.diag.items()})
    if weight == 0:
        return {k: torch.zeros_like(v) for k, v in c.items()} if isinstance(c, dict) else torch.zeros_like(c)
    return c


def _cotangent_fn(kind: Curvature, likelihood: str, sigma: float, generator: torch.Generator | None,
                  mc_samples: int, model: nn.Module, rows: tuple[int, int] | None = None):
    """(cotangent function, per-batch state) of the estimate. ``rows = (N, start)``: the batch is rows
    start.. of an N-example data set whose MC noise is drawn whole (data parallel, see the module docstring)."""
    if kind is Curvature.GGN:
        return (lambda f, yc, sl, st: lk.hessian_sqrt(f, likelihood, sigma)), None
    if kind is Curvature.EMPIRICAL_FISHER:
        return (lambda f, yc, sl, st: lk.loss_gradient(f, yc, likelihood, sigma)), None
    # MC Fisher
    if generator is None:
        raise ValueError("generator: mc_fisher needs a torch.Generator (sampled labels must be reproducible)")
    if int(mc_samples) < 1:
        raise ValueError(f"mc_samples: got {mc_samples}; must be ≥ 1")
    device, dtype = model_device_dtype(model)

    def per_batch(n: int, yb: Tensor | None) -> dict:
        return {"n": n, "noise": None}

    def cot(f: Tensor, yc: Tensor | None, sl: slice, st: dict) -> Tensor:
        if st["noise"] is None:  # drawn once per batch, for all its chunks
            if rows is None:
                st["noise"] = lk.draw_noise(st["n"], f.shape[1], int(mc_samples), likelihood, generator, device, dtype)
            else:  # all N rows drawn, as one process does; this rank's rows kept
                full = lk.draw_noise(rows[0], f.shape[1], int(mc_samples), likelihood, generator, device, dtype)
                st["noise"] = full[rows[1]:rows[1] + st["n"]]
        return lk.mc_cotangents(f, st["noise"][sl], likelihood, sigma)

    return cot, per_batch


# -------------------------------------------------------------------------------------------- reducers


def diag_curvature(run: Iterable[tuple[Pass, Tensor | None]], sel: ParamDict) -> ParamDict:
    """diag(Σ_{b,c} u_{b,c} u_{b,c}ᵀ) accumulated over the passes."""
    acc = {n: torch.zeros_like(t) for n, t in sel.items()}
    for p, _ in run:
        for layer in p.layers:
            i = layer.index
            if i not in p.g:
                continue
            g, a = p.g[i], p.a[i]
            if layer.weight is not None:
                if layer.kind == "linear" and g.shape[-1] == 1:  # Linear on [B, d_in]: Σ_{b,c} g² a²ᵀ without per-example gradients
                    g2 = g[..., 0].square().sum(1)  # [B, d_out]
                    dw = g2.T @ a[..., 0].square()  # [d_out, d_in]
                else:
                    jw, _ = p.layer_jacobian(i)  # chunk·C·(d_out·d_in) numbers, squared in place
                    dw = jw.square_().sum((0, 1))
                    del jw
                acc[layer.weight] += dw.reshape(acc[layer.weight].shape)
            if layer.bias is not None:
                acc[layer.bias] += g.sum(-1).square().sum((0, 1))
        for name, u in p.other.items():
            acc[name] += u.square().sum((0, 1))
        del p  # free this chunk before the next pass
    return acc


def full_curvature(run: Iterable[tuple[Pass, Tensor | None]], sel: ParamDict) -> Tensor:
    """Σ_{b,c} u_{b,c} u_{b,c}ᵀ as a dense [P, P] matrix (``types.flatten`` order)."""
    acc = None
    for p, _ in run:
        rows = pass_rows(p, sel)
        j = torch.cat([t.reshape(t.shape[0] * t.shape[1], -1) for t in rows.values()], dim=1)  # [B·C, P]
        acc = j.T @ j if acc is None else acc.addmm_(j.T, j)
    if acc is None:
        raise ValueError("x: no data")
    return acc


def kron_curvature(run: Iterable[tuple[Pass, Tensor | None]], sel: ParamDict) -> KronCurvature:
    """K-FAC (expand) factors A, G per Linear/Conv2d layer, exact diagonal elsewhere (module docstring)."""
    a_sum: dict[int, Tensor] = {}
    g_sum: dict[int, Tensor] = {}
    count: dict[int, int] = {}
    diag_names: list[str] = []
    layers = None
    acc_diag: dict[str, Tensor] = {}
    for p, _ in run:
        if layers is None:
            layers = p.layers
            block_params = {n for l in layers if l.weight is not None and l.kind != "bn"
                            for n in (l.weight, l.bias) if n}
            diag_names = [n for n in sel if n not in block_params]
            acc_diag = {n: torch.zeros_like(sel[n]) for n in diag_names}
        for name, u in p.other.items():
            if name not in acc_diag:
                raise NotImplementedError(
                    f"kron: parameter {name!r} belongs to a layer called more than once per forward "
                    "(weight sharing); K-FAC factors are undefined there — use structure 'diag' or 'full'")
            acc_diag[name] += u.square().sum((0, 1))
        for layer in layers:
            i = layer.index
            if layer.weight is None or layer.kind == "bn":  # exact diagonal
                if i in p.g:
                    jw, jb = p.layer_jacobian(i)
                    if layer.weight is not None:
                        acc_diag[layer.weight] += jw.square_().sum((0, 1))
                    if layer.bias is not None:
                        acc_diag[layer.bias] += jb.square_().sum((0, 1))
                continue
            d_in = layer.d_in + (1 if layer.bias is not None else 0)
            if i not in a_sum:
                like = sel[layer.weight]
                a_sum[i] = like.new_zeros(d_in, d_in)
                g_sum[i] = like.new_zeros(layer.d_out, layer.d_out)
                count[i] = 0
            if i not in p.g:
                continue
            a, g = p.a[i], p.g[i]  # [B, d_in, R], [B, C, d_out, R]
            b, _, r = a.shape
            if layer.bias is not None:
                a = torch.cat([a, a.new_ones(b, 1, r)], dim=1)
            am = a.transpose(0, 1).reshape(d_in, b * r)
            a_sum[i].addmm_(am, am.T)
            gm = g.permute(2, 0, 1, 3).reshape(layer.d_out, -1)
            g_sum[i].addmm_(gm, gm.T)
            count[i] += b * r
    if layers is None:
        raise ValueError("x: no data")
    blocks = []
    for layer in layers:
        if layer.weight is None or layer.kind == "bn":
            continue
        i = layer.index
        a = a_sum[i] / count[i] if count[i] > 0 else a_sum[i]
        blocks.append(KronBlock(layer.weight, layer.bias, a, g_sum[i]))
    return KronCurvature(blocks, acc_diag)


# ---------------------------------------------------------------------------------------------- hessian


def _hessian(model: nn.Module, x, y, sel: ParamDict, structure: Structure, likelihood: str, sigma: float,
             head: int | None, chunk: int) -> ParamDict | Tensor:
    """Exact Hessian of Σ_b ℓ_b (dense P×P via ``torch.func.hessian``; diag = its diagonal)."""
    if structure is Structure.KRON:
        raise ValueError("structure: 'kron' is not available for kind 'hessian'; use 'diag' or 'full'")
    device, dtype = model_device_dtype(model)
    kw = model_kwargs(model, head)
    acc = None
    chunk = chunk or 64
    with eval_mode(model):
        for xb, yb in iter_batches(x, y):
            xb = xb.to(device=device, dtype=dtype if xb.is_floating_point() else None)
            if yb is None:
                raise ValueError("y: the Hessian needs labels/targets")
            yb = yb.to(device)
            for s in range(0, xb.shape[0], chunk):
                xc, yc = xb[s:s + chunk], yb[s:s + chunk]

                def loss(flat: Tensor) -> Tensor:
                    f = functional_call(model, unflatten(flat, sel), (xc,), kw)
                    return lk.nll(f, yc, likelihood, sigma).sum()

                h = torch.func.hessian(loss)(flatten(sel))
                acc = h if acc is None else acc + h
    if acc is None:
        raise ValueError("x: no data")
    if structure is Structure.FULL:
        return acc
    return {n: t.clone() for n, t in unflatten(torch.diagonal(acc), sel).items()}
