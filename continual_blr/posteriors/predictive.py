"""The linearised (GLM) predictive of a Gaussian weight posterior, with the probit approximation.

Linearise the network at the weights `θ*` it holds, f(x; θ) ≈ f(x; `θ*`) + J(x)(θ − `θ*`), J(x) = ∂f(x)/∂θ [K, P].
Under q(θ) = N(`θ*`, Σ) the logits are Gaussian, f(x) ~ N(f(x; `θ*`), J(x) Σ J(x)ᵀ) (Immer et al. 2021, the
"GLM predictive"), and the class probabilities E[softmax(f)] are approximated by the probit rule, logit by logit:

    p(y = k | x) ≈ softmax_k( f_k(x; θ*) / sqrt(1 + (π/8) · v_k(x)) ),     v_k(x) = [J(x) Σ J(x)ᵀ]_kk

(MacKay 1992's probit approximation of the sigmoid–Gaussian integral, applied to each output with its own marginal
variance; the off-diagonal covariances are not used). This is exactly laplace-torch 0.3's
``pred_type='glm', link_approx='probit'``: ``kappa = 1 / sqrt(1 + π/8 · diag(f_var))``, ``softmax(kappa · f_mu)``.

How v is computed: per-example Jacobians from ``torch.func`` (:func:`~continual_blr.curvature.per_example_jacobians`,
over the posterior's parameters only), a chunk of points at a time, so that a chunk's [n, K, P] rows stay within
:data:`BUDGET` numbers. Then v_k = ⟨J_k, Σ J_k⟩ with Σ applied by the posterior itself: a diagonal Σ elementwise;
a Kronecker posterior by its ``covariance_matvec`` (per layer U_G((U_Gᵀ V U_A)/D)U_Aᵀ, or conjugate gradients when a
layer holds several Kronecker terms); a full posterior through its dense covariance. No P×P matrix is formed for the
diagonal or Kronecker structures.

The posterior is used as it is: Σ = S⁻¹ with S the method's carried precision (for ``laplace``:
S = δI + Σ_t C_t / T, so the temperature T scales the curvature, as laplace-torch's ``temperature`` does).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..curvature import eval_mode, per_example_jacobians
from ..curvature._engine import model_kwargs
from ..types import params_of
from .base import GaussianPosterior
from .diag import DiagPosterior
from .full import FullPosterior
from .kron import KronPosterior

__all__ = ["PREDICTIVES", "BUDGET", "probit_softmax", "glm_logit_variance", "glm_predictive", "for_prediction"]

PREDICTIVES = ("map", "glm")
"""``map``: softmax(f(x; `θ*`)), the network's own prediction; ``glm``: the linearised predictive with probit."""

BUDGET = 2**24
"""Numbers the Jacobian rows of one chunk of points may hold ([n, K, P]); more points are done in chunks."""


def probit_softmax(f: Tensor, var: Tensor) -> Tensor:
    """softmax(f / sqrt(1 + π/8 · var)) row-wise: f, var [N, K] (logit means and marginal variances)."""
    return torch.softmax(f / torch.sqrt(1.0 + (math.pi / 8.0) * var), dim=-1)


def for_prediction(posterior: GaussianPosterior) -> GaussianPosterior:
    """The same Gaussian, ready for many S⁻¹ v: a Kronecker posterior without its all-zero terms.

    A layer no task has used yet (another task's head) carries one zero term (A_k = 0 or G_k = 0) per task; two or
    more of them make the nearest-Kronecker preconditioner of ``KronPosterior`` undefined (0/0). Dropping them leaves
    S unchanged. Other structures are returned as they are. Keep the result while S is unchanged: it caches its
    eigendecompositions.
    """
    if not isinstance(posterior, KronPosterior):
        return posterior
    blocks = [(w, b, [(a, g) for a, g in terms if bool(a.any()) and bool(g.any())]) for w, b, terms in posterior.blocks]
    return KronPosterior(posterior.mean, blocks, posterior.diag, posterior.delta)


def _variances(jac: dict[str, Tensor], posterior: GaussianPosterior) -> Tensor:
    """v[b, k] = J_bk Σ J_bkᵀ from rows ``jac[name]`` [n, K, *shape] (the posterior's parameters)."""
    names = posterior.names
    n, k = next(iter(jac.values())).shape[:2]
    if isinstance(posterior, DiagPosterior):  # Σ = diag(1/s): v = Σ_p J_p² / s_p
        return sum((jac[name].pow(2) / posterior.precision[name]).reshape(n, k, -1).sum(-1) for name in names)
    if isinstance(posterior, FullPosterior):  # dense S⁻¹ (P ≤ 20 000 for this structure)
        rows = torch.cat([jac[name].reshape(n * k, -1) for name in names], dim=1)
        return ((rows @ posterior.covariance()) * rows).sum(-1).reshape(n, k)
    rows = {name: jac[name].reshape(n * k, *jac[name].shape[2:]) for name in names}  # a leading axis of n·K
    cov_rows = posterior.covariance_matvec(rows)  # Σ J_bkᵀ, e.g. Kronecker: per layer, batched over n·K
    return sum((rows[name] * cov_rows[name]).reshape(n * k, -1).sum(-1) for name in names).reshape(n, k)


def glm_logit_variance(model: nn.Module, posterior: GaussianPosterior, x: Tensor, *, head: int = 0,
                       chunk_size: int | None = None) -> tuple[Tensor, Tensor]:
    """The GLM predictive of the logits at ``x``: mean f(x; `θ*`) and marginal variances diag(J Σ Jᵀ).

    The model is linearised at the weights it holds (the posterior's mean for a Laplace posterior; only Σ is taken
    from ``posterior``) and runs in eval mode (flags restored).

    Args:
        model: the network; called as ``model(x, head=head)``.
        posterior: q(θ) over (a subset of) the model's parameters; Σ = its covariance (pass it through
            :func:`for_prediction` once when calling this repeatedly).
        x: inputs [N, ...].
        head: output head of a multi-head network.
        chunk_size: points per Jacobian pass (default: as many as :data:`BUDGET` allows).

    Returns:
        ``(f [N, K], v [N, K])`` in the posterior's dtype.
    """
    sel = params_of(model, posterior.names)
    missing = [name for name in posterior.names if name not in sel]
    if missing:
        raise ValueError(f"posterior: covers {missing[0]!r}, which is not a trainable parameter of the model")
    ref = next(iter(posterior.mean.values()))
    x = x.to(device=ref.device, dtype=ref.dtype if x.is_floating_point() else None)
    with torch.no_grad(), eval_mode(model):
        f = model(x, **model_kwargs(model, head)).to(ref.dtype)
    n, k = f.shape
    p = sum(t.numel() for t in sel.values())
    chunk = int(chunk_size) if chunk_size is not None else max(1, BUDGET // max(1, k * p))
    var = []
    for s in range(0, n, chunk):
        jac = per_example_jacobians(model, x[s : s + chunk], head=head, param_names=posterior.names,
                                    chunk_size=chunk)
        with torch.no_grad():
            var.append(_variances({name: t.to(ref.dtype) for name, t in jac.items()}, posterior))
    return f, torch.cat(var) if var else f.new_zeros(0, k)


def glm_predictive(model: nn.Module, posterior: GaussianPosterior, x: Tensor, *, head: int = 0,
                   chunk_size: int | None = None) -> Tensor:
    """Class probabilities of the GLM predictive with the probit approximation (module docstring), [N, K]."""
    f, var = glm_logit_variance(model, for_prediction(posterior), x, head=head, chunk_size=chunk_size)
    return probit_softmax(f, var)
