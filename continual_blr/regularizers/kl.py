"""The KL term of variational continual learning (VCL, Nguyen et al. 2018).

Task t fits q_t(θ) = N(μ, diag(σ²)) by minimising the negative ELBO with the previous posterior as
the prior, divided by N_t because the loop works with the *mean* loss:

    (1/N_t) [ E_q Σ_i ℓ_i(θ) + KL(q ‖ q_{t−1}) ]  =  E_q[mean_i ℓ_i(θ)] + KL(q ‖ q_{t−1}) / N_t

For Gaussians with q = N(μ, Σ) and p = N(m₀, S₀⁻¹) over P scalars (closed form):

    KL(q ‖ p) = ½ [ tr(S₀ Σ) + (μ − m₀)ᵀ S₀ (μ − m₀) − P − log|Σ| − log|S₀| ]

With Σ = diag(σ²) the trace is Σ_j (S₀)_jj σ_j². :func:`kl_diag` (mean-field q, differentiable in μ and
log σ²) and :func:`kl_full` (full-covariance q via its Cholesky factor, dense, for small models) both
accept a diagonal or full prior. :class:`KLPrior` is the mean-field penalty as a regulariser.

Precision: the KL terms are computed in fp32 (or the prior's fp64) also inside an active ``torch.autocast``
(bf16 training runs VCL's sampled forward in bf16, never its KL; :func:`~continual_blr.mixed_precision.full_precision`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..data.stream import Task
from ..mixed_precision import full_precision
from ..posteriors import DiagPosterior, FullPosterior, GaussianPosterior, load_posterior
from ..types import Batch, ParamDict, params_of

__all__ = ["kl_diag", "kl_full", "KLPrior"]


def _precision_diag(prior: GaussianPosterior) -> ParamDict:
    """diag(S₀) as a ParamDict (diagonal and full priors)."""
    if isinstance(prior, DiagPosterior):
        return prior.precision
    if isinstance(prior, FullPosterior):
        from ..types import unflatten

        return unflatten(torch.diagonal(prior.precision), prior.mean)
    raise TypeError(f"prior: a diagonal or full Gaussian is needed here, got {type(prior).__name__}")


@full_precision
def kl_diag(mean: ParamDict, log_var: ParamDict, prior: GaussianPosterior) -> Tensor:
    """KL(N(μ, diag e^{log σ²}) ‖ prior) in closed form; differentiable in ``mean`` and ``log_var``.

    ``mean`` may hold more keys than the prior covers (they are ignored).
    """
    s0 = _precision_diag(prior)
    trace = sum((s0[k] * torch.exp(log_var[k])).sum() for k in prior.mean)
    logdet_cov = sum(log_var[k].sum() for k in prior.mean)
    quad = prior.quadratic(mean)
    return 0.5 * (trace + quad - prior.dim - logdet_cov - prior.logdet_precision())  # type: ignore[operator]


@full_precision
def kl_full(mean: Tensor, scale_tril: Tensor, prior: GaussianPosterior) -> Tensor:
    """KL(N(μ, L Lᵀ) ‖ prior) in closed form, dense (μ in ``types.flatten`` order of the prior's mean).

    Differentiable in ``mean`` and ``scale_tril`` (lower-triangular, positive diagonal). O(P²) memory.
    """
    m0, s0 = prior.to_dense()
    d = mean - m0
    trace = (s0 * (scale_tril @ scale_tril.mT)).sum()
    logdet_cov = 2 * torch.log(torch.diagonal(scale_tril)).sum()
    return 0.5 * (trace + d @ s0 @ d - mean.numel() - logdet_cov - prior.logdet_precision())


class KLPrior:
    """VCL's mean-field KL as a penalty on the mean loss:  KL(q_A ‖ p_A) / N.

    q = N(μ, diag e^{log σ²}): μ is the model's parameters (or ``params``), log σ² lives here as leaf
    tensors (``log_var``, trained by the same optimiser). N is ``n_data`` when set (e.g. a coreset made
    of several tasks' examples), else the current task's N_t. ``on_task_end`` makes q the prior.

    The KL covers only the *active* parameters A (``set_active``; default all): those some task started
    so far uses. A parameter no task has used yet (the head of a future task) has no likelihood term,
    so its exact posterior is its prior; it is left out of the KL (a KL term on it would pull its mean
    and variance to the prior's during earlier tasks) and out of the carried posterior, which keeps the
    prior's value there (``posterior`` returns the prior's mean and precision for it) until its task
    activates it. Since the KL factorises over parameters, KL(q ‖ p) = KL(q_A ‖ p_A) + KL(q_Ā ‖ p_Ā), and
    the second term is 0 at q_Ā = p_Ā.

    Args:
        prior: the first prior (a :class:`~continual_blr.posteriors.DiagPosterior`).
        log_var: initial log-variances of q (ParamDict over the prior's parameters).
    """

    def __init__(self, prior: DiagPosterior, log_var: ParamDict) -> None:
        self.prior = prior
        self.log_var = {k: v.detach().clone().requires_grad_(True) for k, v in log_var.items()}
        self.n_data: int | None = None
        self.active: list[str] = list(prior.mean)

    def set_active(self, names: list[str]) -> None:
        """The parameters the KL covers (in the prior's order); the rest keep the prior in ``posterior``.

        Raises:
            ValueError: a name the prior does not cover.
        """
        unknown = [k for k in names if k not in self.prior.mean]
        if unknown:
            raise ValueError(f"names: not covered by the prior: {unknown}")
        wanted = set(names)
        self.active = [k for k in self.prior.mean if k in wanted]

    def _active_prior(self) -> DiagPosterior:
        if len(self.active) == len(self.prior.mean):
            return self.prior
        return DiagPosterior({k: self.prior.mean[k] for k in self.active},
                             {k: self.prior.precision[k] for k in self.active})

    def posterior(self, model: nn.Module) -> DiagPosterior:
        """The current q as a (detached) DiagPosterior over all the prior's parameters: on the active ones
        mean = the model's weights and precision e^{−log σ²}; elsewhere the prior's mean and precision."""
        active = set(self.active)
        mean = params_of(model, self.active)
        return DiagPosterior(
            {k: mean[k].clone() if k in active else self.prior.mean[k] for k in self.prior.mean},
            {k: torch.exp(-self.log_var[k].detach()) if k in active else self.prior.precision[k]
             for k in self.prior.mean})

    @full_precision
    def penalty(self, model: nn.Module, batch: Batch, task: Task, params: ParamDict | None = None) -> Tensor:
        """KL(q_A ‖ p_A) / N, differentiable in μ (``params`` or the model's) and ``log_var``."""
        mean = params if params is not None else params_of(model, self.active, detach=False)
        n = self.n_data if self.n_data is not None else task.n_train
        return kl_diag(mean, self.log_var, self._active_prior()) / max(1, n)

    def on_task_start(self, model: nn.Module, task: Task) -> None:
        pass

    @full_precision
    def on_task_end(self, model: nn.Module, task: Task) -> None:
        """q_t becomes the prior of task t+1 (q keeps its value: a warm start; inactive parameters keep
        the prior they had)."""
        self.prior = self.posterior(model)

    def state_dict(self) -> dict[str, Any]:
        return {"prior": self.prior.state_dict(), "log_var": {k: v.detach() for k, v in self.log_var.items()},
                "active": list(self.active)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prior = load_posterior(state["prior"])  # type: ignore[assignment]
        with torch.no_grad():  # in place: an optimiser may hold these tensors
            for k, v in state["log_var"].items():
                self.log_var[k].copy_(v)
        self.active = list(state.get("active", self.prior.mean))
