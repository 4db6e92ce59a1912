"""A compiled training step: the model's forward (and, through AOTAutograd, its backward) under ``torch.compile``.

Why. On a GPU a small network's step is bound by the host, not the device: a reduced ResNet-18 step of batch 256
takes about 11 ms on an H200, almost all of it Python and kernel launches (``benchmarks/perf/perf_train.py
--device cuda``). ``torch.compile`` fuses the elementwise work of the forward and backward into few kernels;
``"reduce-overhead"`` also replays them as CUDA graphs, one launch per graph.

What is compiled. Only while a task's minibatches are trained (:func:`continual_blr.loop.fit_task`), the model's
``forward`` is replaced on the instance by its compiled version (:func:`compiled_forward`); it is put back before
the task's end (curvature, memorable points, BatchNorm statistics) and before evaluation, which run eagerly. The
loss, the penalty's solves, the gradient clip and the optimiser step stay eager; on CUDA the compiled step uses
Adam's fused kernel (``methods.base.make_torch_optimizer``). The same module object is trained, so its
``state_dict`` keys, checkpoints and hooks are unchanged. A compiled step computes the eager step's function:
kernels are fused and reordered, so numbers agree to round-off, not bit for bit (``tests/test_compiled_step.py``
bounds the difference). Dropout is the exception: TorchInductor draws its masks from its own generator, so a
network with dropout (CifarNet) trains on other, equally distributed masks than the eager run of the same seed.

Modes (``train.compile``):

* ``"off"`` (default): eager.
* ``"default"``: ``torch.compile(mode="default")`` (TorchInductor; on a CPU it compiles C++ kernels with the
  system compiler, seconds per graph).
* ``"reduce-overhead"``: TorchInductor with CUDA graphs (on a CPU the same as ``"default"``).
* ``"aot_eager"``: traced by Dynamo and AOTAutograd but run by eager kernels: no code generation, for checking a
  compiled run's numbers cheaply.

Each head, train / eval mode (FROMP's penalty runs its points in eval mode) and batch size (the last minibatch of
an epoch) is a graph of its own; Dynamo marks a size that changes as dynamic. The BLR optimisers differentiate
per-example functions under ``torch.func`` and are refused (:func:`check_compile`).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn

COMPILE_MODES = ("off", "default", "reduce-overhead", "aot_eager")
# model → (mode, its compiled forward): kept beside the module, not on it, so that copying or pickling a model
# never meets a compiled function
_COMPILED: "weakref.WeakKeyDictionary[nn.Module, tuple[str, Callable[..., Any]]]" = weakref.WeakKeyDictionary()


def check_compile(value: object, name: str = "train.compile") -> str:
    """``value`` if it is one of :data:`COMPILE_MODES`, else a one-line ``ValueError`` naming ``name``."""
    if value not in COMPILE_MODES:
        raise ValueError(f"{name}: got {value!r}; allowed: {', '.join(map(repr, COMPILE_MODES))}")
    return str(value)


def _compile_kwargs(mode: str) -> dict:
    if mode == "aot_eager":
        return {"backend": "aot_eager"}
    return {"mode": mode}


@contextlib.contextmanager
def compiled_forward(model: nn.Module, mode: str) -> Iterator[nn.Module]:
    """Inside the block ``model(x, ...)`` runs ``torch.compile(model.forward)``; after it, the eager forward.

    The compiled function is kept (beside the module, weakly) and reused by the next task's block, so each graph
    compiles once per run, not once per task.

    Args:
        model: the network; its class's ``forward`` is what gets compiled.
        mode: one of :data:`COMPILE_MODES`; ``"off"`` leaves the model alone.
    """
    check_compile(mode)
    if mode == "off":
        yield model
        return
    cache = _COMPILED.get(model)
    if cache is None or cache[0] != mode:
        cache = (mode, torch.compile(type(model).forward.__get__(model), **_compile_kwargs(mode)))
        _COMPILED[model] = cache
    had = "forward" in model.__dict__
    previous = model.__dict__.get("forward")
    model.__dict__["forward"] = cache[1]
    try:
        yield model
    finally:
        if had:
            model.__dict__["forward"] = previous
        else:
            del model.__dict__["forward"]
