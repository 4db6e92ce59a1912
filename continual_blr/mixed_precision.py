"""Training precision: bf16 mixed precision for the training forward, fp32 (or fp64) everywhere else.

``train.precision`` (:class:`~continual_blr.methods.base.TrainConfig`, ``--precision`` on the CLI) is
``"fp32"`` (the default) or ``"bf16"``. With ``"bf16"`` the training step
(:func:`continual_blr.loop.train_step`) runs **the network's forward pass and the loss** inside
``torch.autocast(device_type, dtype=torch.bfloat16)``: matrix products and convolutions take bf16
operands, the loss is formed in fp32 (``cross_entropy`` is on autocast's fp32 list, and the BLR
closure casts the outputs to fp32 before :func:`~continual_blr.curvature.likelihoods.nll`). It is
mixed precision, not bf16 training: weights, gradients (with respect to the fp32 weights), optimiser
state and posteriors stay fp32.

What never runs in bf16, even when called inside an active autocast — each entry point is wrapped with
:func:`full_precision` (autocast switched off, bf16/fp16 tensor arguments cast to fp32):

* the curvature engine (:func:`~continual_blr.curvature.curvature`, kernels, per-example Jacobians and
  gradients): GGN / Fisher / K-FAC factors and DNN2GP kernels in fp32;
* the regularisers' penalties and task-end updates (FROMP's kernels and Cholesky factors, the
  weight-space Gaussian priors, VCL's KL);
* every method of a :class:`~continual_blr.posteriors.GaussianPosterior` (sampling, solves,
  log-determinants, KL);
* the BLR's step algebra (:meth:`~continual_blr.optim.blr.BayesianLearningRule.step`); only the
  closure's forward pass runs in bf16 (``BatchClosure(autocast_dtype=...)``).

Evaluation (``loop.evaluate_task``) is not autocast: predictions and their accumulation are fp32 / fp64.

**TF32.** On an Ampere-or-later GPU, PyTorch runs fp32 convolutions in TF32 by default
(``torch.backends.cudnn.conv.fp32_precision == "tf32"``): operands rounded to 10 mantissa bits, unit roundoff
u = 2⁻¹¹ ≈ 4.9 × 10⁻⁴ instead of fp32's 6 × 10⁻⁸. :func:`full_precision` switches TF32 off for cuDNN convolutions
and CUDA matrix products inside its block (and restores the caller's settings after), because "fp32" is what its
callers promise: FROMP's kernels K = J Σ Jᵀ on a memorised CifarNet span eigenvalues from ≈ 3 to ≈ 5 × 10³, and
Weyl's bound (|Δλ| ≤ ‖ΔK‖₂) allows TF32 an error of u · λ_max ≈ 2.7 in each of them (emulated on a CPU it moved K by
3.4 × 10⁻³ relative but left the smallest eigenvalue unchanged, ``benchmarks/results/traces/diagnose_fromp_tf32.md``;
no guarantee for other networks). The training forward outside these blocks keeps whatever the caller set (TF32 by
default on such GPUs: it is the data loss only).

**channels_last.** ``train.channels_last`` (None: on exactly when the precision is bf16) stores the
network's 4-D (convolution) weights in ``torch.channels_last`` memory format (``run_stream`` converts
the model once) and the training step converts 4-D inputs to the model's format
(:func:`match_input_format`). Networks without convolutions are unchanged.

Nothing here changes global state at import.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch import Tensor, nn

__all__ = ["PRECISIONS", "check_precision", "autocast_dtype", "training_autocast", "autocast_active",
           "full_precision", "full_precision_block", "ieee_fp32", "tf32_enabled", "full_precision_methods",
           "to_fp32", "channels_last_on", "to_channels_last", "is_channels_last", "match_input_format"]

PRECISIONS = ("fp32", "bf16")
_AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
_LOW = (torch.bfloat16, torch.float16)
_DEVICE_TYPES = ("cpu", "cuda")

F = TypeVar("F", bound=Callable[..., Any])


def check_precision(value: object, name: str = "train.precision") -> str:
    """``value`` if it is one of :data:`PRECISIONS`.

    Raises:
        ValueError: one line naming ``name`` and the allowed values.
    """
    if not isinstance(value, str) or value not in PRECISIONS:
        raise ValueError(f"{name}: got {value!r}; allowed: {', '.join(map(repr, PRECISIONS))}")
    return value


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a training precision (None for ``"fp32"``: no autocast)."""
    return _AUTOCAST_DTYPES[check_precision(precision)]


def training_autocast(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """The context the training forward and loss run in: ``torch.autocast(device.type, bfloat16)`` for
    ``"bf16"``, a no-op for ``"fp32"``. A new context on every call (enter it once)."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def autocast_active() -> bool:
    """Whether autocast is enabled for the CPU or CUDA in the calling context."""
    return any(torch.is_autocast_enabled(d) for d in _DEVICE_TYPES)


def active_autocast() -> tuple[str, torch.dtype] | None:
    """(device type, dtype) of the autocast enabled in the calling context (the first of CPU / CUDA), or None."""
    for d in _DEVICE_TYPES:
        if torch.is_autocast_enabled(d):
            return d, torch.get_autocast_dtype(d)
    return None


def resumed_autocast(state: tuple[str, torch.dtype] | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` as :func:`active_autocast` saw it (a no-op for None): inside a :func:`full_precision`
    function, the block of it that may run in the caller's low precision."""
    if state is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=state[0], dtype=state[1])


@contextlib.contextmanager
def full_precision_block() -> Iterator[None]:
    """Switch autocast off (for every device type where it is on) and TF32 off (:func:`ieee_fp32`) inside the
    block."""
    active = [d for d in _DEVICE_TYPES if torch.is_autocast_enabled(d)]
    with contextlib.ExitStack() as stack:
        for d in active:
            stack.enter_context(torch.autocast(device_type=d, enabled=False))
        stack.enter_context(ieee_fp32())
        yield


def _tf32_switches() -> list[tuple[Any, str, Any]]:
    """(backend object, attribute, its IEEE-fp32 value) for cuDNN convolutions and CUDA matrix products: the
    ``fp32_precision`` API where this torch has it (its getters resolve ``"none"`` through the parent switches;
    mixing it with the legacy ``allow_tf32`` flags raises), the legacy flags otherwise."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        return [(conv, "fp32_precision", "ieee"), (torch.backends.cuda.matmul, "fp32_precision", "ieee")]
    return [(torch.backends.cudnn, "allow_tf32", False), (torch.backends.cuda.matmul, "allow_tf32", False)]


def _is_tf32(obj: Any, name: str, ieee: Any) -> bool:
    """Whether the switch lets fp32 operations run in TF32."""
    return getattr(obj, name) not in (ieee, "none")


def tf32_enabled() -> bool:
    """Whether fp32 convolutions or matrix products on a CUDA device may run in TF32 in the calling context."""
    return any(_is_tf32(*switch) for switch in _tf32_switches())


@contextlib.contextmanager
def ieee_fp32() -> Iterator[None]:
    """IEEE fp32 (no TF32) for cuDNN convolutions and CUDA matrix products inside the block; the caller's
    settings are restored on exit, also on an exception. A no-op where TF32 is already off (and on the CPU,
    where the switches change nothing)."""
    changed = []
    for obj, name, ieee in _tf32_switches():
        if _is_tf32(obj, name, ieee):
            changed.append((obj, name, getattr(obj, name)))
            setattr(obj, name, ieee)
    try:
        yield
    finally:
        for obj, name, old in reversed(changed):
            setattr(obj, name, old)


def to_fp32(obj: Any) -> Any:
    """``obj`` with every bf16 / fp16 tensor cast to fp32: tensors, and the values of dicts, lists and tuples
    (named tuples such as ``Batch`` included), one level at a time; fp32 / fp64 tensors and anything else
    (modules, numbers) are returned as they are (the same object when nothing needed a cast)."""
    if isinstance(obj, Tensor):
        return obj.float() if obj.dtype in _LOW else obj
    if isinstance(obj, dict):
        out = {k: to_fp32(v) for k, v in obj.items()}
        return obj if all(out[k] is v for k, v in obj.items()) else out
    if isinstance(obj, (list, tuple)):
        items = [to_fp32(v) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if hasattr(obj, "_fields"):  # a named tuple
            return type(obj)(*items)
        return type(obj)(items)
    return obj


def full_precision(fn: F) -> F:
    """Decorator: ``fn`` computes in fp32 (or its own fp64) even when called inside an active autocast.

    Autocast is switched off for the call and bf16 / fp16 tensor arguments are cast to fp32
    (:func:`to_fp32`), and TF32 is switched off (:func:`ieee_fp32`) once CUDA is initialised (before that no CUDA
    kernel can run). Outside autocast, on the CPU or with TF32 off, with fp32 arguments it costs three checks.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args = tuple(to_fp32(a) for a in args)
        kwargs = {k: to_fp32(v) for k, v in kwargs.items()}
        if not autocast_active() and not (torch.cuda.is_initialized() and tf32_enabled()):
            return fn(*args, **kwargs)
        with full_precision_block():
            return fn(*args, **kwargs)

    wrapper.__full_precision__ = True  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def full_precision_methods(cls: type) -> type:
    """Wrap every public method, property getter, classmethod and staticmethod *defined in* ``cls`` (not
    inherited: those are wrapped where they are defined) with :func:`full_precision`. Returns ``cls``."""
    for name, attr in list(vars(cls).items()):
        if name.startswith("_"):
            continue
        if isinstance(attr, property) and attr.fget is not None and not hasattr(attr.fget, "__full_precision__"):
            setattr(cls, name, property(full_precision(attr.fget), attr.fset, attr.fdel, attr.__doc__))
        elif isinstance(attr, (classmethod, staticmethod)) and not hasattr(attr.__func__, "__full_precision__"):
            setattr(cls, name, type(attr)(full_precision(attr.__func__)))
        elif inspect.isfunction(attr) and not hasattr(attr, "__full_precision__"):
            setattr(cls, name, full_precision(attr))
    return cls


def channels_last_on(precision: str, channels_last: bool | None) -> bool:
    """Whether 4-D weights and inputs use ``torch.channels_last``: ``channels_last`` itself, or (None) exactly
    when ``precision`` is ``"bf16"``."""
    return (precision == "bf16") if channels_last is None else bool(channels_last)


def to_channels_last(model: nn.Module) -> nn.Module:
    """``model`` with its 4-D parameters and buffers in ``torch.channels_last`` format (in place; the
    Parameter objects are kept, so optimisers built before still hold them). Other tensors are unchanged."""
    return model.to(memory_format=torch.channels_last)


def is_channels_last(model: nn.Module) -> bool:
    """Whether the model's convolution weights are stored channels_last: decided by its first 4-D parameter
    whose two layouts differ (one with a single input channel and 1×1 kernel is both); False without one."""
    for p in model.parameters():
        if p.dim() == 4:
            dense, last = p.is_contiguous(), p.is_contiguous(memory_format=torch.channels_last)
            if dense != last:
                return last
    return False


def match_input_format(x: Tensor, model: nn.Module) -> Tensor:
    """A 4-D input in the memory format of ``model``'s convolution weights: ``channels_last`` when they are
    (:func:`is_channels_last`), else ``x`` unchanged (no copy). The values are the same either way."""
    if x.dim() == 4 and is_channels_last(model):
        return x.contiguous(memory_format=torch.channels_last)
    return x
