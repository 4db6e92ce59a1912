"""Data parallelism of the BLR step: which scale each rank's part of the estimates takes, and one all-reduce.

With a ``torch.distributed`` process group of W > 1 processes (IVON's ``sync=True`` pattern), rank r
evaluates its b_r of the minibatch's B examples and forms its part of the estimates with the *global*
scale N/B (:meth:`DataParallelStep.scales`):

    ĝ_r = (N/B) Σ_{i∈r} ∇ℓ_i + N (b_r/B) ∇penalty,   ĥ_r = (N/B) Σ_{i∈r} H_i,

and one all-reduce per weight sample adds (loss, ĝ, ĥ) over the ranks (:meth:`DataParallelStep.reduce`),
so they are one process's on the global batch. In one process every method here is the identity
(N/b, weight 1, the mean loss, no collective).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import distributed
from ..curvature.estimates import curvature_tensors
from .closures import BatchClosure

__all__ = ["DataParallelStep"]


class DataParallelStep:
    """Per-step state of a data-parallel BLR step (set by :meth:`begin` at every step).

    Attributes:
        active: whether ĝ, ĥ are all-reduced this step (a process group of W > 1).
        total: B, the global batch (None until known: from the closure, or one all-reduce).
        empty: this rank has no example this step (it computes one example's estimates with weight 0).
        rank_samples: each rank draws its own weight sample (seeds ``base · W + rank``; IVON's per-rank seeds)
            instead of every rank drawing the same one.
    """

    def __init__(self) -> None:
        self.active, self.total, self.empty = False, None, False
        self.rank_samples = False
        self.rank_generator: torch.Generator | None = None

    def begin(self, closure: object) -> None:
        """Per step: whether the estimates are all-reduced, and B when the closure knows it."""
        self.active = distributed.is_distributed()
        self.total = None
        self.empty = False
        if self.active and isinstance(closure, BatchClosure):
            if closure.sharded:
                self.total = closure.batch_size
            if closure.x.shape[0] == 0:  # no examples on this rank: one example's computation, weight 0
                closure.x, closure.y = closure.x_global[:1], closure.y_global[:1]
                self.empty = True

    def sample_generator(self, generator: torch.Generator | None) -> torch.Generator | None:
        """Where weight samples come from: ``generator`` (the same state on every rank), or with
        ``rank_samples`` in a data-parallel step a generator of this rank's own, seeded
        ``base · W + rank`` (:func:`continual_blr.distributed.rank_seed`) with ``base`` drawn once from
        ``generator`` (so the seeds derive from the run's seed)."""
        if not (self.rank_samples and self.active) or generator is None:
            return generator
        if self.rank_generator is None:
            base = int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device))
            self.rank_generator = torch.Generator(device=generator.device).manual_seed(distributed.rank_seed(base))
        return self.rank_generator

    def scales(self, b: int, n_data: int) -> tuple[float, float]:
        """(N/B, b/B): the data term's scale and the penalty's weight of this rank's b examples (N/b, 1 in
        one process). B is the global batch (all-reduced once per step when the closure does not know it)."""
        if not self.active:
            return n_data / b, 1.0
        if self.total is None:
            self.total = round(distributed.all_reduce_float(b, "batch size"))
        total = max(self.total, 1)
        if self.empty:
            return 0.0, 0.0
        return n_data / total, b / total

    def mean_loss(self, losses: Tensor, n_data: int) -> Tensor:
        """(1/B) Σ_{i∈rank} ℓ_i: this rank's part of the global mean loss (the mean in one process)."""
        if not self.active:
            return losses.mean()
        return losses.sum() * (self.scales(losses.shape[0], n_data)[0] / n_data)

    def reduce(self, loss: Tensor, g: object, h: object) -> Tensor:
        """All-reduce (loss, ĝ, ĥ) in place with one collective; returns the loss as a tensor (no-op in one process)."""
        if not self.active:
            return loss
        loss = loss.detach().reshape(1).clone()
        tensors = [loss] + list(g.values()) if isinstance(g, dict) else [loss] + list(g)  # type: ignore[arg-type]
        if isinstance(h, tuple):
            blocks, diag = h
            tensors += [t for pair in blocks.values() for t in pair] + list(diag.values())
        elif isinstance(h, dict):
            tensors += list(h.values())
        elif isinstance(h, list):
            tensors += h
        else:
            tensors += curvature_tensors(h)  # type: ignore[arg-type]
        distributed.all_reduce_sum_(tensors, "blr step")
        return loss[0]
