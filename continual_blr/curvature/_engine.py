"""The backpropagation engine every estimate and kernel is built on (private).

One *pass* over a chunk of B examples takes cotangent vectors ``v`` of shape [B, C, K] (C vectors per
example, K outputs) and returns, for every selected parameter θ, the per-example vector-Jacobian
products

    u_{b,c} = J_bᵀ v_{b,c}   with   J_b = ∂f(x_b)/∂θ ∈ R^{K×P}

in a *factored* form where that is exact, so the B×C×P array is only formed when asked for:

* **Linear, Conv2d and (eval-mode, affine) BatchNorm layers** — the "tapped" layers. A zero tensor
  ``t`` is added to the layer's output (a forward hook); ``torch.func.vjp`` of the batched
  ``functional_call`` with respect to ``t`` gives the backpropagated output gradient
  ``g_{b,c} = ∂(v_{b,c}ᵀ f_b)/∂y_b`` of the layer output y for every example at once (examples do not
  interact in eval mode). With the layer input a (unfolded to patches for Conv2d, R = number of output
  positions; R = 1 for a Linear on [B, d_in]):

      ∂(v_{b,c}ᵀ f_b)/∂W = Σ_r g_{b,c,r} a_{b,r}ᵀ ,      ∂(v_{b,c}ᵀ f_b)/∂bias = Σ_r g_{b,c,r},

  and for BatchNorm ∂/∂γ = Σ_r g ⊙ x̂, ∂/∂β = Σ_r g with x̂ the input normalised by the running
  statistics. The weights themselves are *not* differentiated (they are constants of the functional
  call), so the pass costs two forwards and C backward passes through the activations only.
* **Every other selected parameter** (LayerNorm, a Linear called twice in one forward, …):
  differentiated directly, with ``vmap`` over examples of ``vjp`` of the single-example function
  ``θ ↦ f(x_b[None])[0]`` and ``vmap`` over the C cotangents of its pullback ([B, C, *shape]).

The model must treat examples independently (BatchNorm on running statistics, dropout off):
:func:`eval_mode` arranges that.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap

from ..types import ParamDict, params_of

__all__ = [
    "eval_mode",
    "model_kwargs",
    "iter_batches",
    "resolve_chunk",
    "Layer",
    "find_layers",
    "Pass",
    "backprop",
    "forward",
    "DEFAULT_CHUNK",
    "auto_chunk",
]

DEFAULT_CHUNK = 256
"""Points per pass of the kernels when ``chunk_size`` is None."""
CHUNK_BUDGET = 2**26
"""Numbers one pass may hold when the chunk size is chosen automatically (256 MiB in float32)."""
MAX_CHUNK = 4096


# ----------------------------------------------------------------------------------------- modes / calls


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put every submodule in eval mode (BatchNorm uses running statistics, dropout is off) and restore
    each module's own ``training`` flag on exit, also when the body raises."""
    mods = list(model.modules())
    flags = [m.training for m in mods]
    # Fast path (the FROMP penalty enters this once per training step): when no module overrides
    # ``train``, eval() only sets the flags, so set them directly instead of through nn.Module.__setattr__.
    plain = all(type(m).train is nn.Module.train for m in mods)
    try:
        if plain:
            for m in mods:
                object.__setattr__(m, "training", False)
        else:
            model.eval()
        yield model
    finally:
        for m, flag in zip(mods, flags):
            object.__setattr__(m, "training", flag)


def model_kwargs(model: nn.Module, head: int | None) -> dict:
    """Keyword arguments for ``model(x, **kw)``: ``{"head": head}`` when the model's ``forward`` accepts
    ``head`` (the package's call convention), ``{}`` for plain modules (then ``head`` must be 0/None)."""
    try:
        sig = inspect.signature(model.forward)
        accepts = "head" in sig.parameters or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()
        )
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        accepts = False
    if accepts:
        return {"head": 0 if head is None else int(head)}
    if head not in (None, 0):
        raise ValueError(f"head: got {head!r}, but {type(model).__name__}.forward takes no 'head' argument")
    return {}


def iter_batches(x: Tensor | Iterable, y: Tensor | None) -> Iterator[tuple[Tensor, Tensor | None]]:
    """Yield ``(x, y)`` batches from a tensor pair or from an iterable of ``(x, y, ...)`` items
    (tuples, lists, :class:`~continual_blr.types.Batch`; extra fields such as a task id are ignored)."""
    if isinstance(x, Tensor):
        yield x, y
        return
    if y is not None:
        raise ValueError("y: must be None when x is an iterable of (x, y) batches")
    for item in x:
        if isinstance(item, Tensor):
            yield item, None
        else:
            yield item[0], (item[1] if len(item) > 1 else None)


def resolve_chunk(chunk_size: int | None, batch_size: int | None = None) -> int | None:
    """Validate the chunk size (``batch_size`` is accepted as an alias); None means automatic."""
    if chunk_size is not None and batch_size is not None and chunk_size != batch_size:
        raise ValueError(f"chunk_size={chunk_size} and batch_size={batch_size} disagree; pass one of them")
    c = chunk_size if chunk_size is not None else batch_size
    if c is None:
        return None
    if int(c) < 1:
        raise ValueError(f"chunk_size: got {c}; must be a positive integer")
    return int(c)


def auto_chunk(model: nn.Module, layers: list[Layer], x: Tensor, kw: dict, dense: int = 0,
               budget: int | None = None) -> int:
    """Examples per pass so that one pass holds about ``budget`` numbers, from a probe forward on one
    example: per example and cotangent (C ≈ K) the tapped layers' outputs plus the largest Conv2d
    weight (its per-example gradient is formed) plus ``dense`` (numbers per example and cotangent the
    caller forms, e.g. P for full Jacobian rows), plus the layers' input patches."""
    budget = CHUNK_BUDGET if budget is None else budget
    with _Taps(layers) as taps:
        taps.mode = "record"
        try:
            with torch.no_grad():
                f = forward(model, x[:1], kw)
        finally:
            taps.mode = None
        outs = sum(int(torch.Size(s[1:]).numel()) for s in taps.out_shapes.values())
        patches = sum(int(l.patches(taps.inputs[l.index]).numel()) for l in layers if l.index in taps.inputs)
        taps.inputs.clear()
    conv = max([l.module.weight.numel() for l in layers if l.kind == "conv"], default=0)
    per_example = f.shape[1] * (outs + conv + dense) + patches
    return int(max(1, min(MAX_CHUNK, budget // max(1, per_example))))


def model_device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    for p in model.parameters():
        return p.device, p.dtype
    raise ValueError("model has no parameters")


# ----------------------------------------------------------------------------------------------- layers


@dataclass
class Layer:
    """A module whose selected parameters are handled by the tap (factored) path.

    kind ``linear`` / ``conv``: Θ = [W.reshape(d_out, -1) | b]; ``bn``: a BatchNorm in eval mode with
    affine parameters, y = γ ⊙ x̂ + β, x̂ = (x − running_mean)/√(running_var + eps).
    """

    index: int
    name: str
    module: nn.Module
    kind: str
    weight: str | None  # parameter name when selected
    bias: str | None

    @property
    def is_conv(self) -> bool:
        return self.kind == "conv"

    @property
    def d_out(self) -> int:
        m = self.module
        if self.kind == "conv":
            return m.out_channels
        if self.kind == "bn":
            return m.num_features
        return m.out_features

    @property
    def d_in(self) -> int:
        """Columns of Θ without the bias: in_features, or C_in·k_h·k_w (1 for BatchNorm)."""
        return self.module.weight[0].numel()

    def patches(self, inp: Tensor) -> Tensor:
        """The layer input as [B, d_in, R]: unfolded patches for Conv2d, R = trailing positions for Linear,
        the normalised input x̂ as [B, channels, R] for BatchNorm."""
        m = self.module
        b = inp.shape[0]
        if self.kind == "conv":
            return F.unfold(inp, m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride)
        if self.kind == "bn":
            shape = (1, -1) + (1,) * (inp.dim() - 2)
            xhat = (inp - m.running_mean.view(shape)) * torch.rsqrt(m.running_var.view(shape) + m.eps)
            return xhat.reshape(b, m.num_features, -1)
        return inp.reshape(b, -1, inp.shape[-1]).transpose(1, 2)

    def out_grads(self, g: Tensor) -> Tensor:
        """Backpropagated output gradients [B, C, *out] → [B, C, d_out, R]."""
        b, c = g.shape[:2]
        if self.kind in ("conv", "bn"):
            return g.reshape(b, c, self.d_out, -1)
        return g.reshape(b, c, -1, self.d_out).transpose(2, 3)


def _kind(m: nn.Module) -> str | None:
    if isinstance(m, nn.Linear):
        return "linear"
    if isinstance(m, nn.Conv2d):
        ok = m.groups == 1 and m.padding_mode == "zeros" and not isinstance(m.padding, str)
        return "conv" if ok else None
    if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine and m.running_mean is not None:
        return "bn"
    return None


def find_layers(model: nn.Module, selected: ParamDict) -> list[Layer]:
    """Linear, Conv2d (groups = 1, zero padding) and affine BatchNorm modules owning a selected parameter.

    Raises ValueError for a BatchNorm without running statistics: it normalises with batch statistics
    even in eval mode, so examples are not independent and per-example quantities are undefined.
    """
    layers = []
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is None:
            raise ValueError(f"module {name!r}: BatchNorm with track_running_stats=False uses batch statistics in "
                             "eval mode, so examples are not independent; use running statistics")
        kind = _kind(m)
        if kind is None:
            continue
        prefix = f"{name}." if name else ""
        w = prefix + "weight" if prefix + "weight" in selected else None
        b = prefix + "bias" if m.bias is not None and prefix + "bias" in selected else None
        if w is None and b is None:
            continue
        layers.append(Layer(len(layers), name, m, kind, w, b))
    return layers


class _Taps:
    """Forward hooks on the tapped layers: 'record' mode stores inputs and counts calls,
    'tap' mode adds the current tap tensor to the layer output. Removed on exit (also on errors)."""

    def __init__(self, layers: list[Layer]) -> None:
        self.layers = layers
        self.mode: str | None = None
        self.inputs: dict[int, Tensor] = {}
        self.out_shapes: dict[int, torch.Size] = {}
        self.calls: dict[int, int] = {}
        self.taps: dict[int, Tensor] | None = None
        self._handles: list = []

    def __enter__(self) -> "_Taps":
        try:
            for layer in self.layers:
                self._handles.append(layer.module.register_forward_hook(self._hook(layer.index)))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, idx: int) -> Callable:
        def hook(module: nn.Module, inp: tuple, out: Tensor) -> Tensor | None:
            if self.mode == "record":
                self.calls[idx] = self.calls.get(idx, 0) + 1
                self.inputs[idx] = inp[0]
                self.out_shapes[idx] = out.shape
            elif self.mode == "tap" and self.taps is not None and idx in self.taps:
                return out + self.taps[idx]
            return None

        return hook


# ------------------------------------------------------------------------------------------------ passes


@dataclass
class Pass:
    """Result of :func:`backprop` on one chunk (see the module docstring for the maths).

    Attributes:
        logits: [B, K] model outputs (before any ``output_fn``).
        layers: the tapped layers of this call.
        a: per tapped layer reached once by the forward: its input patches [B, d_in, R] (no bias
            column; x̂ for BatchNorm).
        g: per such layer: backpropagated output gradients [B, C, d_out, R].
        unused: indices of tapped layers the forward did not reach (zero Jacobian, e.g. other heads).
        other: per-example VJPs [B, C, *shape] of every selected parameter not handled by a tap.
    """

    logits: Tensor
    layers: list[Layer]
    a: dict[int, Tensor] = field(default_factory=dict)
    g: dict[int, Tensor] = field(default_factory=dict)
    unused: set[int] = field(default_factory=set)
    other: ParamDict = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.logits.shape[0]

    def layer_jacobian(self, idx: int) -> tuple[Tensor, Tensor | None]:
        """Per-example VJPs of one tapped layer: weight [B, C, d_out, d_in] ([B, C, d_out] for BatchNorm)
        and bias [B, C, d_out] (or None). Materialises B·C·(number of the layer's weights) numbers."""
        layer = self.layers[idx]
        g, a = self.g[idx], self.a[idx]
        b, c, o, r = g.shape
        if layer.kind == "bn":
            jw = (g * a.unsqueeze(1)).sum(-1)
        else:
            jw = torch.bmm(g.reshape(b, c * o, r), a.transpose(1, 2)).reshape(b, c, o, -1)
        jb = g.sum(-1) if layer.bias is not None else None
        return jw, jb


def forward(model: nn.Module, x: Tensor, kw: dict) -> Tensor:
    out = model(x, **kw)
    if out.dim() != 2:
        raise ValueError(f"model output: expected [batch, outputs], got shape {tuple(out.shape)}")
    return out


def backprop(
    model: nn.Module,
    selected: ParamDict,
    layers: list[Layer],
    x: Tensor,
    cotangents: Callable[[Tensor], Tensor],
    kw: dict,
) -> Pass:
    """One pass over the chunk ``x``: forward, cotangents v = ``cotangents(logits)`` ([B, C, K]), and
    the per-example VJPs J_bᵀ v_{b,c} in factored form (see :class:`Pass`). The model must already be in
    eval mode (examples independent); ``selected`` are the detached parameters to differentiate.

    Tapped layers: one ``vjp`` of the batched forward with respect to the taps (examples do not
    interact, so the gradient of Σ_b v_{b,c}ᵀ f_b at layer outputs of example b is example b's own),
    pulled back once per cotangent index c. Other parameters: ``vmap`` over examples of the vjp of
    the single-example function, ``vmap`` over c of its pullback.
    """
    with _Taps(layers) as taps:
        # 1) record pass: layer inputs, output shapes and call counts; logits for the cotangents.
        taps.mode = "record"
        try:
            with torch.no_grad():
                logits = forward(model, x, kw)
        finally:
            taps.mode = None
        v = cotangents(logits)
        if v.dim() != 3 or v.shape[0] != x.shape[0] or v.shape[2] != logits.shape[1]:
            raise ValueError(f"cotangents: expected [B, C, {logits.shape[1]}], got {tuple(v.shape)}")
        v = v.to(logits.dtype)
        unused = {l.index for l in layers if taps.calls.get(l.index, 0) == 0}
        shared = {l.index for l in layers if taps.calls.get(l.index, 0) > 1}
        tapped = [l for l in layers if l.index not in unused | shared]
        handled = {n for l in layers if l.index not in shared for n in (l.weight, l.bias) if n is not None}
        other = {n: t for n, t in selected.items() if n not in handled}
        frozen = {n: t for n, t in params_of(model).items() if n not in other}
        params = {**frozen, **other}
        out = Pass(logits=logits, layers=layers, unused=unused)

        # 2) tapped layers: batched vjp with respect to zero taps added to the layer outputs.
        if tapped:
            tap0 = {l.index: logits.new_zeros(taps.out_shapes[l.index]) for l in tapped}

            def batched(tp: dict[int, Tensor]) -> Tensor:
                taps.mode, taps.taps = "tap", tp
                try:
                    return functional_call(model, params, (x,), kw)
                finally:
                    taps.mode, taps.taps = None, None

            _, pullback = vjp(batched, tap0)
            n_c = v.shape[1]
            gbuf = {i: t.new_empty((t.shape[0], n_c) + t.shape[1:]) for i, t in tap0.items()}  # [B, C, *out]
            for c in range(n_c):  # one pullback per cotangent index; written in place (no stacked copies)
                (gr,) = pullback(v[:, c])
                for i, t in gr.items():
                    gbuf[i][:, c] = t
                del gr
            del pullback
            for l in tapped:
                out.a[l.index] = l.patches(taps.inputs[l.index].detach())
                out.g[l.index] = l.out_grads(gbuf.pop(l.index))
        taps.inputs.clear()

        # 3) other parameters: per-example vjp (vmap over examples and cotangents).
        if other:
            def single(x_i: Tensor, v_i: Tensor) -> ParamDict:
                def f(oth: ParamDict) -> Tensor:
                    return functional_call(model, {**frozen, **oth}, (x_i.unsqueeze(0),), kw)[0]

                _, pb = vjp(f, other)
                return vmap(pb)(v_i)[0]

            out.other = dict(vmap(single)(x, v))
    return out
