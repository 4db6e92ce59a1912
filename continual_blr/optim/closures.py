"""The BLR's minibatch closure: per-example losses of one minibatch, and the minibatch itself for the
curvature engine.

``closure(params)`` follows torch.optim's ``step(closure)`` contract as the BLR uses it (see
:mod:`continual_blr.optim.blr`): it receives a ParamDict of the covered parameters and returns the
**per-example** negative log-likelihoods ``[B]`` computed with them, or a pair ``(losses, penalty)``
where ``penalty`` is an extra differentiable term relative to the *mean* loss (e.g. FROMP).

Data parallel (``continual_blr.distributed``): a closure built with ``data_parallel=True`` over the
*global* minibatch (the same on every rank) evaluates only this rank's contiguous part of it
(``x``, ``y``); ``x_global`` / ``y_global``, ``batch_size`` (B) and ``start`` describe the whole, and the
BLR optimiser all-reduces ĝ and ĥ with the weights that make them one process's.

Mixed precision (``train.precision: bf16``, :mod:`continual_blr.mixed_precision`): a closure built with
``autocast_dtype=torch.bfloat16`` runs the network's forward under ``torch.autocast`` and casts the outputs
to fp32 before the loss; the penalty, the gradients (with respect to the fp32 parameters) and everything
the optimiser does with them stay fp32.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call

from .. import distributed
from ..curvature import likelihoods as lk
from ..types import ParamDict

__all__ = ["BatchClosure"]


class BatchClosure:
    """The BLR closure over one minibatch, exposing the batch to the curvature engine.

    ``closure(params)`` returns the per-example negative log-likelihoods ℓ_i of ``model(x, head=head)``
    evaluated with ``params`` (``torch.func.functional_call``), or ``(losses, penalty(params))`` when a
    ``penalty`` is given (a term relative to the mean loss, e.g. a functional regulariser).

    Likelihoods (:mod:`continual_blr.curvature.likelihoods`): ``"classification"``,
    ℓ_i = −log softmax(f_i)_{y_i}; ``"regression"``, ℓ_i = ‖f_i − y_i‖² / (2σ²) (the constant (K/2) log 2πσ² left out).

    Args:
        model: the network (``model(x, head=h) -> outputs``).
        x: inputs [B, ...].
        y: integer labels [B] (classification) or real targets [B] / [B, K] (regression).
        head: the output head the batch uses.
        penalty: optional ``penalty(params) -> scalar``.
        likelihood: ``"classification"`` or ``"regression"``.
        sigma: the Gaussian noise standard deviation (regression).
        data_parallel: in a multi-process run, ``x`` and ``y`` are the global batch and the closure
            evaluates this rank's part (``self.x``, ``self.y``); without a process group it changes nothing.
        autocast_dtype: run the forward under ``torch.autocast`` with this dtype (``torch.bfloat16``);
            None: in the parameters' dtype (fp32). The outputs are cast to fp32 before the loss.

    Attributes:
        x, y: the examples this closure evaluates (this rank's part).
        x_global, y_global: the whole minibatch.
        batch_size: B, the number of examples in the whole minibatch.
        start: the index of ``x[0]`` in the whole minibatch.
        sharded: True when ``x`` is a rank's part of a larger batch whose ĝ, ĥ must be all-reduced.
        autocast_dtype: the forward's autocast dtype (None: no autocast).
    """

    def __init__(self, model: nn.Module, x: Tensor, y: Tensor, head: int = 0,
                 penalty: Callable[[ParamDict], Tensor] | None = None, likelihood: str = "classification",
                 sigma: float = 1.0, data_parallel: bool = False,
                 autocast_dtype: torch.dtype | None = None) -> None:
        lk.check_likelihood(likelihood, sigma)
        self.model, self.head, self.penalty = model, int(head), penalty
        self.x_global, self.y_global, self.batch_size = x, y, int(x.shape[0])
        self.sharded = bool(data_parallel) and distributed.is_distributed()
        self.start, stop = distributed.shard_bounds(self.batch_size) if self.sharded else (0, self.batch_size)
        self.x, self.y = x[self.start:stop], y[self.start:stop]
        self.likelihood, self.sigma = likelihood, float(sigma)
        self.autocast_dtype = autocast_dtype

    def in_full_precision(self) -> "BatchClosure":
        """A copy of this closure whose forward runs in the parameters' dtype (no autocast); ``self`` if it has none."""
        if self.autocast_dtype is None:
            return self
        other = copy.copy(self)
        other.autocast_dtype = None
        return other

    def module_losses(self) -> Tensor:
        """ℓ_i of ``self.model`` with the weights it holds: ``closure(params)``'s losses when ``params`` are the
        model's own (the same forward, with the same autocast). The diagonal Price step writes the weight sample
        into the model and calls this, so that one ``backward`` lands in gradient views of one flat buffer
        (:mod:`continual_blr.optim.diag_step`)."""
        return self._losses(lambda: self.model(self.x, head=self.head))

    def _losses(self, forward: Callable[[], Tensor]) -> Tensor:
        """ℓ_i of ``forward()``'s outputs, the forward run under the closure's autocast (outputs cast to fp32)."""
        if self.autocast_dtype is None:
            f = forward()
        else:
            with torch.autocast(device_type=self.x.device.type, dtype=self.autocast_dtype):
                f = forward()
            f = f.float()
        return lk.nll(f, self.y, self.likelihood, self.sigma)

    def __call__(self, params: ParamDict) -> "Tensor | tuple[Tensor, Tensor]":
        losses = self._losses(lambda: functional_call(self.model, params, (self.x,), {"head": self.head}))
        return losses if self.penalty is None else (losses, self.penalty(params))
