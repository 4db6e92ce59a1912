"""The diagonal BLR step on flat buffers: the hot path of ``BayesianLearningRule`` for a diagonal prior.

One kernel per line of the algorithm over all covered parameters (one compiled loop with ``fused``; on the
Price step's module path on CPU the native in-place loop of :mod:`continual_blr.optim.native`, with the weights
as views of one flat vector, :class:`~continual_blr.optim.diag_state.FlatWeights`):
the mean is gathered into one vector and written back once; S₀, m₀, the step's D, the carried D̄ and the
momentum live in :class:`~continual_blr.optim.diag_state.FlatDiagState`, whose per-parameter views are
the optimiser's ParamDict state; the update after the estimates is
:func:`~continual_blr.optim.diag_state.diag_update`. The algebra is the generic step's
(:mod:`continual_blr.optim.blr`); ``tests/test_blr_fixed_points.py`` checks it against an independent
replica of IVON's Algorithm 1 with a prior.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from ..posteriors import DiagPosterior
from ..types import DivergenceError
from .diag_state import FlatDiagState, FlatWeights, diag_update, fused_diag_update
from .closures import BatchClosure
from .estimators import gradients
from .native import native_update
from .noise import PooledNoise, gaussian_noise
from .precision import data_like

__all__ = ["DiagStepMixin"]


def _write(weights: list[Tensor], flat: FlatDiagState, vector: Tensor) -> None:
    """Copy a flat vector into the parameters' storage (``weights`` are their detached tensors)."""
    torch._foreach_copy_(weights, [v.view_as(w) for v, w in zip(flat.split(vector), weights)])


def _flat_pull(flat: FlatDiagState, pulled: dict[str, Tensor], mean: Tensor) -> Tensor:
    """A coupling's output as one flat vector in ``flat``'s order, zero on the parameters it does not name."""
    return torch.cat([pulled[k].reshape(-1) if k in pulled else torch.zeros(n, dtype=mean.dtype, device=mean.device)
                      for k, n in zip(flat.names, flat.numels)])


class DiagStepMixin:
    """The diagonal step and the clip's count, mixed into :class:`~continual_blr.optim.blr.BayesianLearningRule`
    (which owns the state these methods read: ``prior``, ``names``, ``_data``, ``_avg``, ``_momentum``,
    ``_parallel``, the settings)."""

    _flat: FlatDiagState | None
    _clip_count: Tensor | int | None
    _clip_total: int
    _pool: PooledNoise | None
    prior_coupling: Callable | None
    prior_correction: Callable | None
    _correction_flat: tuple | None = None  # (names, numels, flat operator or None, m − m_s, R̃(m − m_s)) of _correction_term
    _flat_weights: FlatWeights | None = None
    prior: Any
    names: list[str]

    def _flat_state(self, mean: list[Tensor]) -> FlatDiagState:
        """The diagonal step's flat buffers, rebuilt only when the prior, D, D̄ or the momentum were replaced
        (``set_prior``, ``load_state_dict``, ``rebuild``, the ``init_hess`` start)."""
        flat = self._flat
        if flat is None or flat.prior is not self.prior or flat.numels != [m.numel() for m in mean]:
            if len({(m.dtype, m.device) for m in mean}) != 1:
                raise ValueError("the diagonal BLR step needs every covered parameter in one dtype and on one "
                                 f"device; got {sorted({(str(m.dtype), str(m.device)) for m in mean})}")
            prior = self.prior
            assert isinstance(prior, DiagPosterior)
            flat = FlatDiagState(prior, self.names, [m.numel() for m in mean], [m.shape for m in mean])
            self._flat = flat
        if self._separate and self._avg is None:
            self._avg = data_like(self.prior, 0.0)  # type: ignore[assignment]
        flat.sync(self._data, self._avg if self._separate else None, self._momentum)  # type: ignore[arg-type]
        self._data, self._avg = flat.data_views, flat.avg_views  # type: ignore[assignment]
        self._momentum = flat.mom_views
        return flat

    def _diag_step(self, closure: Callable, lr: float, rho: float, beta1: float) -> Tensor:
        """The diagonal step on flat vectors (:mod:`continual_blr.optim.diag_state`): one kernel per line of
        the algorithm over all parameters; with ``fused`` one compiled loop: on the module path on CPU the native
        in-place update (:meth:`_native_step`), else :func:`fused_diag_update`.

        Weight samples are drawn from the step's Gaussian N(m, (S₀ + D)⁻¹) (IVON's); the carried D̄ averages
        the estimates made at them.
        """
        mean_list = [p.detach() for p in self._param_list]
        flat = self._flat_state(mean_list)
        n_mc = max(1, self.mc_samples)
        fresh = self._t % self.curvature_every == 0  # estimate ĥ on this step (every step unless curvature_every)
        price = self.curvature == "price"
        # The module path (one sample, one process, no penalty, every trainable weight covered, a plain BatchClosure:
        # a subclass may do more in its __call__): θ is written into
        # the model's weights, the model's own forward runs and one backward fills gradient views of one flat
        # buffer — no functional_call, no concatenation. Same operations as the closure path, so the same numbers
        # (tests/test_blr_engine.py); the weights hold θ until the update writes the new mean (or the mean again if
        # anything fails before).
        module = (price and n_mc == 1 and self.module_step and self._covers_all and not self._parallel.active
                  and type(closure) is BatchClosure and closure.penalty is None and closure.model is self.model)
        if module and self.fused:  # on CPU with a C compiler: the native loop (native.py)
            kernel = native_update(mean_list[0].dtype, mean_list[0].device, positivity=True, h_from_sample=True,
                                   momentum=beta1 > 0, clip=self.clip_radius is not None, damping=self.damping > 0,
                                   fresh=fresh, separate=flat.avg is not None)
            if kernel is not None:
                return self._native_step(kernel, closure, flat, lr, rho, beta1, fresh)
        mean = torch.cat([m.reshape(-1) for m in mean_list])
        if flat.s is None:  # S = S₀ + D (kept from the last update while neither was replaced)
            flat.s = flat.s0 + flat.data
        try:
            loss_sum, g_sum, h_sum, eps, r = self._samples(closure, flat, mean, mean_list, n_mc, fresh, price, module)
            return self._diag_update(flat, mean, mean_list, loss_sum, g_sum, h_sum, eps, r, n_mc, price, lr, rho,
                                     beta1, fresh)
        except BaseException:  # nothing was kept (the new mean is the update's last write): the weights hold the mean
            if module:
                _write(mean_list, flat, mean)
            raise

    def _noise(self, mean: Tensor) -> Tensor:
        """The step's ε ∈ ℝⁿ (``noise``, :mod:`continual_blr.optim.noise`): fresh N(0, I) or the pooled draw."""
        generator = self._parallel.sample_generator(self.generator)
        if self._pool is None:
            return gaussian_noise(mean.numel(), generator, mean.dtype, mean.device)
        return self._pool(mean.numel(), generator, mean.dtype, mean.device)

    def _samples(self, closure: Callable, flat: FlatDiagState, mean: Tensor, mean_list: list[Tensor], n_mc: int,
                 fresh: bool, price: bool, module: bool):
        """(Σ loss, Σ ĝ, Σ ĥ, ε, r) over the step's weight samples (ĥ None where not estimated)."""
        loss_sum, g_sum, h_sum = 0.0, None, None
        eps = r = None
        with torch.enable_grad():
            for _ in range(n_mc):
                if self.mc_samples == 0:
                    eps, r, theta = None, None, mean
                else:  # θ = m + ε / √S, one draw for all parameters
                    eps = self._noise(mean)
                    r = torch.rsqrt(flat.s)
                    theta = torch.addcmul(mean, eps, r)
                if module:  # ĝ_data = (N/B) ∇ Σ_i ℓ_i(θ), one backward into flat gradient views
                    g_data = torch.zeros_like(mean)
                    _write(mean_list, flat, theta)
                    views = [v.view_as(m) for v, m in zip(flat.split(g_data), mean_list)]
                    loss = self._module_backward(closure, views)  # type: ignore[arg-type]
                    g, h = g_data, g_data  # ĥ is formed inside the update (h_from_sample)
                    loss_sum, g_sum, h_sum = loss, g, h
                    continue
                theta_d = flat.views(theta)
                if price:  # ĥ = ĝ_data ∘ (θ − m) ∘ S = ĝ_data ∘ ε ∘ √S, one backward pass
                    losses, g_data_d, g_d, pen = gradients(closure, theta_d, self.names, self.n_data, self._parallel)
                    loss = self._parallel.mean_loss(losses, self.n_data) + pen
                    g_data = flat.cat(g_data_d)
                    g = g_data if g_d is g_data_d else flat.cat(g_d)
                    # one sample in one process: ĥ is formed inside the update (diag_update's h_from_sample)
                    h = g_data if n_mc == 1 and not self._parallel.active else torch.mul(g_data, eps).div_(r)  # type: ignore[arg-type]
                elif fresh:
                    loss, g_d, h_d = self._estimates(closure, theta_d)
                    g, h = flat.cat(g_d), flat.cat(h_d)  # type: ignore[arg-type]
                else:  # a step without a curvature estimate (curvature_every): the gradient only
                    losses, _, g_d, pen = gradients(closure, theta_d, self.names, self.n_data, self._parallel)
                    loss, g, h = self._parallel.mean_loss(losses, self.n_data) + pen, flat.cat(g_d), None
                loss = self._parallel.reduce(loss, [g], [h] if h is not None else [])
                loss_sum = loss_sum + loss
                if g_sum is None:
                    g_sum, h_sum = g, h
                else:
                    g_sum.add_(g)
                    if h is not None:
                        h_sum.add_(h)  # type: ignore[union-attr]
        return loss_sum, g_sum, h_sum, eps, r

    def _diag_update(self, flat: FlatDiagState, mean: Tensor, mean_list: list[Tensor], loss_sum: Any, g_sum: Any,
                     h_sum: Any, eps: Any, r: Any, n_mc: int, price: bool, lr: float, rho: float, beta1: float,
                     fresh: bool) -> Tensor:
        """The update after the estimates (the second half of :meth:`_diag_step`)."""
        assert g_sum is not None
        if n_mc > 1:
            g_sum.div_(n_mc)
            if h_sum is not None:
                h_sum.div_(n_mc)
        if self.prior_coupling is not None:  # a structured prior's off-diagonal pull R(m − m₀), at the mean (set_prior)
            # not in place: the Price ĥ formed from the sample (h_sum may be g_sum's tensor) keeps the data gradient alone
            g_sum = g_sum + self._coupling_term(flat, mean)
        h_from_sample = price and n_mc == 1 and not self._parallel.active
        t, use_mom, scalars = self._step_scalars(flat, lr, rho, beta1, fresh)
        update = fused_diag_update() if self.fused else diag_update
        if self.fused:
            scalars = tuple(torch.tensor(v, dtype=mean.dtype, device=mean.device) for v in scalars)
        separate = flat.avg is not None
        new_mean, mom, data, avg, s, check, n_clip = update(
            g_sum, h_sum if h_sum is not None else g_sum, mean, flat.m0, flat.s0, flat.data,
            flat.avg if separate else mean, flat.mom if use_mom else g_sum, eps if h_from_sample else mean,
            r if h_from_sample else mean, *scalars, positivity=price, h_from_sample=h_from_sample,
            momentum=use_mom, clip=self.clip_radius is not None, damping=self.damping > 0,
            fresh=h_sum is not None, separate=separate)
        if not bool(torch.isfinite(check + loss_sum)):  # nothing kept yet: name the culprit and stop
            h_d = flat.views(h_sum * eps / r if h_from_sample else h_sum if h_sum is not None else 0 * g_sum)  # type: ignore[operator]
            self._check_finite(loss_sum, flat.views(g_sum), h_d)  # type: ignore[arg-type]
            raise DivergenceError(f"BLR step {t}: the update is not finite; lower lr (α), or bound the "
                                  "step with damping or clip_radius")
        self._t = t
        if h_sum is not None:
            self._n_est += 1
        flat.data, flat.s, flat.r = data, s, None
        flat.data_views = self._data = flat.views(data)
        if separate:
            flat.avg = avg
            flat.avg_views = self._avg = flat.views(avg)
        if use_mom:
            flat.mom = mom
            flat.mom_views = self._momentum = flat.views(mom)
        if self.clip_radius is not None:
            self._count_clipped(n_clip, mean.numel())
        _write(mean_list, flat, new_mean)
        return loss_sum / n_mc  # type: ignore[return-value]

    def _coupling_term(self, flat: FlatDiagState, mean: Tensor) -> Tensor:
        """R(m − m₀) as one flat vector (zero on the parameters the coupling does not name), computed on the task's
        steps t ≡ 0 (mod ``coupling_every``) and otherwise the vector of the last one (``BayesianLearningRule``),
        plus R̃(m − m_s) where a correction is set (``BayesianLearningRule.set_prior``)."""
        cached = self._coupling_cache
        if cached is not None and self._t % self.coupling_every != 0 and cached.shape == mean.shape:
            anchor = self._coupling_anchor
            if self.prior_correction is None or anchor is None:
                return cached
            return self._correction_term(flat, mean, anchor).add_(cached)
        term = _flat_pull(flat, self.prior_coupling(flat.views(mean - flat.m0)), mean)  # type: ignore[misc]
        self._coupling_cache = term if self.coupling_every > 1 else None
        self._coupling_anchor = mean.clone() if self.coupling_every > 1 and self.prior_correction is not None else None
        return term

    def _correction_term(self, flat: FlatDiagState, mean: Tensor, anchor: Tensor) -> Tensor:
        """R̃(m − m_s) as one flat vector, in a buffer the next call overwrites. A correction with a flat form
        (:meth:`~continual_blr.posteriors.kron_coupling.KronCoupling.flat`) reads m − m_s and writes R̃(m − m_s)
        in place, with no per-parameter dictionaries (it runs on every step between two exact couplings); its
        operator and buffers are made once per prior and flat layout. Any other correction goes through its
        parameter dicts."""
        cache = self._correction_flat
        if cache is None or cache[0] is not flat.names or cache[1] != flat.numels:
            make = getattr(self.prior_correction, "flat", None)
            op = make(flat.names, flat.numels) if make is not None else None
            cache = self._correction_flat = (flat.names, list(flat.numels), op, torch.empty_like(mean),
                                             torch.zeros_like(mean))
        _, _, op, diff, out = cache
        if op is None:
            return _flat_pull(flat, self.prior_correction(flat.views(mean - anchor)), mean)  # type: ignore[misc]
        torch.sub(mean, anchor, out=diff)
        return op(diff, out)

    def _module_backward(self, closure: BatchClosure, grads: list[Tensor]) -> Tensor:
        """The module path's forward at the weights the model holds and one backward of (N/B) Σ_i ℓ_i into
        ``grads`` (zeroed views, set as the covered parameters' ``.grad`` for the call); returns the mean loss."""
        try:
            for p, v in zip(self._param_list, grads):
                p.grad = v
            losses = closure.module_losses()
            scale, _ = self._parallel.scales(losses.shape[0], self.n_data)
            (scale * losses.sum()).backward()
        finally:
            for p in self._param_list:
                p.grad = None
        return self._parallel.mean_loss(losses.detach(), self.n_data)

    def _step_scalars(self, flat: FlatDiagState, lr: float, rho: float, beta1: float,
                      fresh: bool) -> tuple[int, bool, tuple[float, ...]]:
        """(t, whether momentum is on, the update's scalars (1 − β₁, ρ_t, ρ̄_t, 1/(1 − β₁ᵗ), α, radius, Nγ)) for the
        step about to be made; makes u₀ = 0 on the first step with momentum (the first average is (1 − β₁) d)."""
        t = self._t + 1
        rho_step, rho_avg = self._rates(rho, fresh)
        use_mom = beta1 > 0
        if use_mom and flat.mom is None:
            flat.mom = torch.zeros_like(flat.s0)
            flat.mom_views = self._momentum = flat.views(flat.mom)
        unbias = 1 / (1 - beta1**t) if use_mom else 1.0
        return t, use_mom, (1 - beta1, rho_step, rho_avg, unbias, lr, self.clip_radius or 0.0,
                            self.n_data * self.damping)

    def _native_step(self, kernel: Callable, closure: BatchClosure, flat: FlatDiagState, lr: float, rho: float,
                     beta1: float, fresh: bool) -> Tensor:
        """The module path's one-sample Price step with the native in-place update (:mod:`continual_blr.optim.native`).

        The covered parameters are views of one flat vector W (:class:`~continual_blr.optim.diag_state.FlatWeights`):
        the mean is copied out of W, θ = m + ε ∘ r is written into W with one ``addcmul``, one backward fills the
        flat gradient, and the update writes the new mean into W and D, D̄, u and the next r = (S₀ + D)^{-1/2} into
        the optimiser's flat state, whose per-parameter views therefore stay the same objects from step to step.
        The algebra is :meth:`_diag_update`'s (rounded as the C loop writes it, ``tests/test_blr_native.py``); a
        non-finite loss or ĝ stops the step before anything is written, with the weights back at the mean.
        """
        link = self._flat_weights
        if link is None or not link.linked(self._param_list):
            link = self._flat_weights = FlatWeights(self._param_list)
        w, mean, g = link.weights, link.mean, link.grads
        mean.copy_(w)
        eps = self._noise(mean)
        if flat.r is None:
            flat.r = torch.rsqrt(flat.s0 + flat.data)
        torch.addcmul(mean, eps, flat.r, out=w)
        try:
            g.zero_()
            with torch.enable_grad():
                loss = self._module_backward(closure, link.grad_views)
            t, use_mom, scalars = self._step_scalars(flat, lr, rho, beta1, fresh)
            # a structured prior's pull R(m − m₀) joins the direction only; ĥ is formed from the data gradient g
            g_dir = g if self.prior_coupling is None else g + self._coupling_term(flat, mean)
            ok, n_clip = False, 0
            if bool(torch.isfinite(loss)):
                ok, n_clip = kernel(g_dir, g, mean, w, flat.m0, flat.s0, flat.data, flat.avg if flat.avg is not None else g,
                                    flat.mom if use_mom else g, eps, flat.r, scalars)
        except BaseException:
            w.copy_(mean)
            raise
        if not ok:  # nothing was written: name the culprit and stop with the weights at the mean
            w.copy_(mean)
            self._check_finite(loss, flat.views(g), flat.views(g * eps / flat.r))
            raise DivergenceError(f"BLR step {t}: the update is not finite; lower lr (α), or bound the "
                                  "step with damping or clip_radius")
        self._t = t
        if fresh:
            self._n_est += 1
        flat.s = None  # S₀ + D is not kept on this path (r is)
        if self.clip_radius is not None:
            self._count_clipped(n_clip, flat.s0.numel())
        return loss

    def _count_clipped(self, n_clip: Tensor | int, numel: int) -> None:
        """Accumulate the number of clipped coordinates (read by :meth:`pop_clipped_fraction`): a tensor on
        the torch paths (no sync here), an int from the native step."""
        self._clip_count = n_clip if self._clip_count is None else self._clip_count + n_clip
        self._clip_total += numel

    def pop_clipped_fraction(self) -> float | None:
        """The fraction of coordinates whose preconditioned step the clip bounded since the last call (None
        without a clip or before any step), and reset the count. The clip moves the fixed point when
        weights are sampled (see the module docstring), so the loop logs this per epoch."""
        if self._clip_count is None or self._clip_total == 0:
            return None
        frac = float(self._clip_count) / self._clip_total
        self._clip_count, self._clip_total = None, 0
        return frac
