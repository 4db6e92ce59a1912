"""The diagonal BLR's precision state on flat buffers, and its update as one pure function.

State of the diagonal step (all flat vectors over the covered parameters, with per-parameter views that
the optimiser exposes as ParamDicts):

* S₀, m₀ — the prior (rebuilt when the prior object changes);
* D — the **step's** data part: the preconditioner S₀ + D of the mean step and the precision weight
  samples are drawn with. It may start at a data-scale value N h₀ (``init_hess``) and, for the Price
  estimator, carries IVON's positivity correction;
* D̄ — the **carried** data part: the debiased average of the task's curvature estimates ĥ alone,
  D̄_t = Σ_s w_s ĥ_s with w the weights of an exponential average at rate ρ normalised to sum to 1
  (Adam's bias correction). Neither the start nor the positivity correction enters it, so
  E[D̄] = E[ĥ] whenever E[ĥ] is stationary, and a parameter no example touched (ĝ = ĥ = 0) keeps
  D̄ = 0, i.e. exactly its prior. The posterior the optimiser reports and carries to the next task is
  N(m, S₀ + max(D̄, 0)); the clamp only acts where a noisy Price average is negative;
* the momentum u of the natural-gradient direction.

When D and D̄ would be equal (a non-negative curvature, the debiased rate, so D₁ = ĥ₁ whatever the
start) they share one buffer.

The update (one line of the algorithm per line; :func:`diag_update`):

    ĥ = ĝ_data ∘ ε / r                       (Price, one sample: θ − m = ε r, r = (S₀ + D)^{-1/2})
    d = ĝ + S₀ ∘ (m − m₀);   u ← u + (1 − β₁)(d − u)
    D ← D + ρ_t (ĥ − D)  [+ ½ ρ_t² (D − ĥ)² ⊘ (S₀ + D)   positivity, Price]
    D̄ ← D̄ + ρ̄_t (ĥ − D̄)                      (ρ̄_t = ρ / (1 − (1 − ρ)ⁿ), n = estimates so far)
    m ← m − α/(1 − β₁ᵗ) · clip_r(u ⊘ (S₀ + D + Nγ))

The clip bounds the preconditioned momentum *before* Adam's bias correction 1/(1 − β₁ᵗ) (IVON clips
after it): in a task's first steps the bound is r/(1 − β₁ᵗ), r after a few tens of steps. Every tuned
configuration of this project was chosen with this order; clipping after the correction made the first
steps of a task 10× shorter and cost short runs their plasticity (a class-incremental test's third task
stayed at 0.50).

The positivity correction is IVON's (Shen et al. 2024, Alg. 1 line 6, with the prior precision in the
denominator: h + δ there, S₀ + D here). It keeps S₀ + D > 0 for any sign of ĥ (the new value is at least
half the old one) and biases the step's D upward by ½ρ E[(D − ĥ)²]/(S₀ + D) at stationarity, a bias the
carried D̄ does not have.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

from ..posteriors import DiagPosterior
from ..types import ParamDict

__all__ = ["FlatDiagState", "FlatWeights", "diag_update", "fused_diag_update"]


def diag_update(g: Tensor, h: Tensor, mean: Tensor, m0: Tensor, s0: Tensor, data: Tensor, avg: Tensor, mom: Tensor,
                eps: Tensor, r: Tensor, one_minus_beta1: float | Tensor, rho: float | Tensor,
                rho_avg: float | Tensor, unbias: float | Tensor, lr: float | Tensor, radius: float | Tensor,
                damp: float | Tensor, *,
                positivity: bool, h_from_sample: bool, momentum: bool, clip: bool, damping: bool,
                fresh: bool = True, separate: bool = False
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The diagonal BLR update after the estimates, on flat vectors (the module docstring's algorithm).

    Args:
        g: ĝ (data term and penalty, scaled to the data set).
        h: ĥ; with ``h_from_sample`` the data gradient ĝ_data, from which the Price estimate
            ĥ = ĝ_data ∘ ε / r is formed here.
        mean, m0, s0: m, m₀, S₀.
        data: the step's data part D.
        avg: the carried average D̄ (ignored unless ``separate``).
        mom: the momentum u (ignored unless ``momentum``).
        eps, r: the sample's ε and r = (S₀ + D)^{-1/2} (only with ``h_from_sample``).
        one_minus_beta1, rho, rho_avg: 1 − β₁, the step's rate ρ_t and the average's ρ̄_t.
        unbias: 1 / (1 − β₁ᵗ), Adam's bias correction of u (only with ``momentum``).
        lr: α.
        radius, damp: the clip radius r and N γ.
        positivity: IVON's correction on D (Price).
        fresh: False on a step without a curvature estimate (``curvature_every``): D, D̄ kept, ``h`` ignored.
        separate: D̄ is its own buffer (else D̄ is D).

    Returns:
        (m, u, D, D̄, S₀ + D, Σĝ + Σĥ, number of clipped coordinates) as new tensors; the fifth is the
        caller's finiteness check, made before anything is kept. The inputs are never written, so
        ``torch.compile`` can fuse the whole update (:func:`fused_diag_update`); compiled, the scalars are
        0-d tensors (inductor 2.14 miscompiled symbolic float scalars here).
    """
    if h_from_sample:
        h = torch.mul(h, eps).div_(r)
    check = g.sum() + h.sum() if fresh else g.sum()
    d = torch.sub(mean, m0).mul_(s0).add_(g)
    u = torch.lerp(mom, d, one_minus_beta1) if momentum else d
    if fresh and positivity:
        diff = torch.sub(data, h)
        data = diff.square().div_(torch.add(s0, data)).mul_(0.5 * rho * rho).add_(data).sub_(diff.mul_(rho))
    elif fresh:
        data = torch.lerp(data, h, rho)
    if separate:
        avg = torch.lerp(avg, h, rho_avg) if fresh else avg
    else:
        avg = data
    s = torch.add(s0, data)
    step = torch.div(u, torch.add(s, damp) if damping else s)
    if clip:
        n_clip = (step.abs() > radius).sum()
        step.clamp_(-radius, radius)
    else:
        n_clip = torch.zeros((), dtype=torch.int64, device=g.device)
    if momentum:  # Adam's bias correction after the clip (IVON corrects before it; see the module docstring)
        step.mul_(unbias)
    return step.mul_(-lr).add_(mean), u, data, avg, s, check, n_clip


_COMPILED_UPDATES: dict[tuple, Callable] = {}


def fused_diag_update() -> Callable:
    """:func:`diag_update` compiled by inductor (one C++/Triton loop), built on first use per setting and shape.

    The update is traced once per (flags, input shapes, dtypes, devices) by ``make_fx`` and handed to
    ``torch._inductor.compile``: the same graph ``torch.compile`` would lower, called without Dynamo's guard and
    AOTAutograd wrappers (about half a millisecond a step on CPU at 269k parameters; the outputs are the same
    to the bit, ``tests/test_blr_engine.py``)."""
    return _fused_call


def _fused_call(*args: Tensor, **flags: bool) -> tuple[Tensor, ...]:
    key = (tuple(sorted(flags.items())), tuple((a.shape, a.dtype, a.device) for a in args))
    fn = _COMPILED_UPDATES.get(key)
    if fn is None:
        from torch._inductor import compile as inductor_compile  # imported on first use: heavy
        from torch.fx.experimental.proxy_tensor import make_fx

        graph = make_fx(functools.partial(diag_update, **flags))(*args)
        fn = _COMPILED_UPDATES[key] = inductor_compile(graph, list(args))
    return tuple(fn(*args))


class FlatDiagState:
    """Flat buffers of the diagonal step: S₀ and m₀ of one prior, the step's D, the carried D̄ (``avg``; None
    when it is D itself) and the momentum, each with per-parameter views (the optimiser's ParamDict state).
    """

    def __init__(self, prior: DiagPosterior, names: list[str], numels: list[int], shapes: list[torch.Size]) -> None:
        self.prior, self.names, self.numels, self.shapes = prior, names, numels, shapes
        self.s0 = torch.cat([prior.precision[k].reshape(-1) for k in names])
        self.m0 = torch.cat([prior.mean[k].reshape(-1) for k in names])
        self.data: Tensor = self.s0.new_zeros(0)
        self.s: Tensor | None = None  # S₀ + D, valid while neither changed
        self.r: Tensor | None = None  # (S₀ + D)^{-1/2}, kept by the native step (diag_step), valid likewise
        self.data_views: ParamDict | None = None
        self.avg: Tensor | None = None
        self.avg_views: ParamDict | None = None
        self.mom: Tensor | None = None
        self.mom_views: ParamDict | None = None

    def split(self, flat: Tensor) -> tuple[Tensor, ...]:
        return flat.split(self.numels)

    def views(self, flat: Tensor) -> ParamDict:
        """Per-parameter views of a flat vector (no copy)."""
        return {k: v.view(s) for k, v, s in zip(self.names, self.split(flat), self.shapes)}

    def cat(self, d: ParamDict) -> Tensor:
        """One flat vector from a ParamDict (a copy)."""
        return torch.cat([d[k].reshape(-1) for k in self.names])

    def sync(self, data: ParamDict, avg: ParamDict | None, momentum: ParamDict | None) -> None:
        """Adopt the optimiser's ParamDict state where it was replaced (``set_prior``, ``load_state_dict``,
        the ``init_hess`` start): flat copies with views, so later steps and the ParamDicts stay one object."""
        if data is not self.data_views:
            self.data = self.cat(data)
            self.data_views = self.views(self.data)
            self.s = self.r = None
        if avg is None:
            self.avg = self.avg_views = None
        elif avg is not self.avg_views:
            self.avg = self.cat(avg)
            self.avg_views = self.views(self.avg)
        if momentum is None:
            self.mom = self.mom_views = None
        elif momentum is not self.mom_views:
            self.mom = self.cat(momentum)
            self.mom_views = self.views(self.mom)


class FlatWeights:
    """The covered parameters' storage as one flat vector: each parameter's ``.data`` becomes a view of
    ``weights``, and ``grad_views`` are views of one gradient vector ``grads`` that a backward fills when they are
    set as the parameters' ``.grad``. The native diagonal step (:mod:`continual_blr.optim.diag_step`) writes the
    weight sample θ into ``weights`` with one operation and the new mean with another, where the per-parameter
    path splits, views and copies every parameter twice a step. ``mean`` is a vector for the mean while the
    weights hold θ.

    Nothing else changes for the model: the parameters keep their shapes, dtypes and autograd identity, and any
    code may write into them. :meth:`linked` tells whether they are still views of ``weights`` (a load with
    ``assign=True`` or a move to another device rebinds them; the step then links anew).
    """

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        with torch.no_grad():
            self.weights = torch.cat([p.detach().reshape(-1) for p in params])
            for p, w in zip(params, self.weights.split([p.numel() for p in params])):
                p.data = w.view_as(p)
        self.grads = torch.zeros_like(self.weights)
        self.grad_views = [g.view_as(p) for p, g in zip(params, self.grads.split([p.numel() for p in params]))]
        self.mean = torch.empty_like(self.weights)
        self._ptrs = [p.data_ptr() for p in params]

    def linked(self, params: list[torch.nn.Parameter]) -> bool:
        """Whether ``params`` are the parameters this buffer was made for, still views of ``weights``."""
        return len(params) == len(self._ptrs) and all(p.data_ptr() == q for p, q in zip(params, self._ptrs))
