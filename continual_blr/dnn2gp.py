"""DNN2GP (Khan, Immer, Abedi & Korzepa, NeurIPS 2019): a trained network with a Gaussian posterior
over its weights, seen as a Gaussian process over its outputs.

Linearise the network at the posterior mean `θ*`: `f(x; θ) ≈ f(x; θ*) + J(x)(θ − θ*)`, `J(x) = ∂f(x)/∂θ`.
Under `q(θ) = N(θ*, Σ)` (a Laplace-GGN posterior, `Σ = (Σ_i J_iᵀ Λ_i J_i + δI)⁻¹`, or a VOGN / BLR
posterior) the outputs are jointly Gaussian: a GP with

    mean        m(x) = f(x; θ*)                       (``output="logits"``)
                m(x) = p(x) = softmax(f(x; θ*))       (``output="probs"``, classification)
    kernel      κ(x, x') = J(x) Σ J(x')ᵀ              (logits)
                κ(x, x') = Λ(x) J(x) Σ J(x')ᵀ Λ(x')   (probabilities; Λ = ∂p/∂f = diag(p) − ppᵀ,
                                                       so Λ J = J_p, the Jacobian of p — FROMP's kernel)

:meth:`DNN2GP.predict` returns the mean and the predictive (co)variance at new inputs (for regression
optionally with the observation noise σ²). For the Laplace-GGN posterior this *is* the linearised
Laplace predictive; on a linear model it is exact Bayesian linear regression.

Regression: the marginal likelihood that chooses the prior precision δ. The Laplace/GGN posterior
of the network equals the posterior of the linear model ỹ = J θ + ε, ε ~ N(0, σ² I), θ ~ N(0, δ⁻¹ I),
with pseudo-targets `ỹ_i = y_i − f(x_i; θ*) + J(x_i) θ*` (Khan et al. 2019, Sec. 3 with Λ = I/σ²).
Its evidence is the GP marginal likelihood with the DNN2GP prior kernel δ⁻¹ J Jᵀ:

    log p(ỹ | δ) = log N(ỹ; 0, δ⁻¹ J Jᵀ + σ² I)        (all N·K outputs, index n·K + k)

(:meth:`DNN2GP.log_marginal_likelihood`; :meth:`DNN2GP.select_prior_precision` maximises it over a
grid). On a linear model J θ* = f(x; θ*), so ỹ = y and this is the textbook evidence.

Σ may be given as a posterior (:class:`~continual_blr.posteriors.DiagPosterior`,
:class:`~continual_blr.posteriors.FullPosterior`, :class:`~continual_blr.posteriors.KronPosterior`) or in any
form :func:`continual_blr.curvature.kernel` takes (a ParamDict of variances, a dense [P, P]
covariance with ``param_names``, a KronCurvature of covariance factors). Diagonal and dense Σ use the
curvature engine's kernels; a Kronecker posterior (whose exact inverse is not a Kronecker product)
goes through Jacobian rows and ``covariance_matvec`` — exact, for small models and few points.
The model must hold the posterior mean (θ* is read from the model's parameters).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import jvp

from .curvature import curvature, eval_mode, kernel as _kernel, per_example_jacobians
from .memory import forward
from .posteriors import DiagPosterior, FullPosterior, GaussianPosterior, KronPosterior
from .types import KronCurvature, ParamDict, Structure, params_of, parse_enum

__all__ = ["DNN2GP", "LIKELIHOODS", "OUTPUTS"]

LIKELIHOODS = ("classification", "regression")
OUTPUTS = ("logits", "probs")
PREDICT_CHUNK = 64
"""Points per kernel call in :meth:`DNN2GP.predict` (a [chunk·K, chunk·K] block at a time)."""


def _softmax(f: Tensor) -> Tensor:
    return torch.softmax(f, dim=-1)


class DNN2GP:
    """The GP over a network's outputs implied by a Gaussian weight posterior (module docstring).

    Args:
        model: the network, holding the posterior mean θ*; called as ``model(x, head=head)`` (or
            ``model(x)`` when its forward takes no ``head``); outputs [N, K].
        posterior: a DiagPosterior / FullPosterior / KronPosterior over (a subset of) the model's
            parameters, or Σ directly: ParamDict of variances, dense [P, P] (then ``param_names``) or a
            KronCurvature of covariance factors.
        likelihood: ``"classification"`` (softmax cross-entropy) or ``"regression"`` (Gaussian).
        noise_std: σ of the Gaussian likelihood (regression).
        output: ``"logits"`` or ``"probs"`` (classification only); default: probabilities for
            classification, the outputs themselves for regression.
        head: output head of a multi-head network.
        param_names: the parameters a dense Σ is over.
        prior_precision: δ, recorded by :meth:`laplace` (the default for the marginal likelihood).
        chunk_size: examples per pass of the curvature engine.
    """

    def __init__(
        self,
        model: nn.Module,
        posterior: GaussianPosterior | ParamDict | Tensor | KronCurvature,
        *,
        likelihood: str = "classification",
        noise_std: float = 1.0,
        output: str | None = None,
        head: int = 0,
        param_names: Sequence[str] | None = None,
        prior_precision: float | None = None,
        chunk_size: int | None = None,
    ) -> None:
        if likelihood not in LIKELIHOODS:
            raise ValueError(f"likelihood: got {likelihood!r}; allowed: {', '.join(map(repr, LIKELIHOODS))}")
        output = output or ("probs" if likelihood == "classification" else "logits")
        if output not in OUTPUTS:
            raise ValueError(f"output: got {output!r}; allowed: {', '.join(map(repr, OUTPUTS))}")
        if output == "probs" and likelihood != "classification":
            raise ValueError("output: 'probs' needs likelihood 'classification'")
        if not noise_std > 0:
            raise ValueError(f"noise_std: must be > 0, got {noise_std}")
        self.model = model
        self.likelihood = likelihood
        self.noise_std = float(noise_std)
        self.output = output
        self.head = head
        self.prior_precision = prior_precision
        self.chunk_size = chunk_size
        self.posterior: GaussianPosterior | None = None
        self._generic = False
        if isinstance(posterior, GaussianPosterior):
            self._check_mean(posterior)
            self.posterior = posterior
            self.param_names = list(posterior.mean)
            if isinstance(posterior, DiagPosterior):
                self.sigma: ParamDict | Tensor | KronCurvature | None = posterior.covariance_diag()
            elif isinstance(posterior, FullPosterior):
                if list(params_of(model, self.param_names)) != self.param_names:
                    raise ValueError("posterior: a full posterior's parameters must be in the model's order")
                self.sigma = posterior.covariance()
            else:  # Kronecker (or any other posterior): rows of J and covariance_matvec
                self.sigma = None
                self._generic = True
        elif isinstance(posterior, dict):
            self.sigma, self.param_names = posterior, list(posterior)
        elif isinstance(posterior, KronCurvature):
            self.sigma = posterior
            self.param_names = [n for b in posterior.blocks for n in (b.weight, b.bias) if n] + list(posterior.diag)
        elif isinstance(posterior, Tensor):
            self.sigma = posterior
            self.param_names = list(param_names) if param_names is not None else list(params_of(model))
        else:
            raise TypeError("posterior: expected a GaussianPosterior, a ParamDict of variances, a dense covariance "
                            f"or a KronCurvature, got {type(posterior).__name__}")

    def _check_mean(self, posterior: GaussianPosterior) -> None:
        own = params_of(self.model, list(posterior.mean))
        for k, m in posterior.mean.items():
            if not torch.allclose(own[k], m.to(own[k]), rtol=1e-6, atol=1e-9):
                raise ValueError(f"posterior: its mean differs from the model's parameter {k!r}; load the "
                                 "posterior mean into the model first (DNN2GP linearises at θ*)")

    # --------------------------------------------------------------------------------- builders

    @classmethod
    def laplace(
        cls,
        model: nn.Module,
        x: Tensor,
        y: Tensor | None = None,
        *,
        prior_precision: float,
        likelihood: str = "classification",
        noise_std: float = 1.0,
        structure: Structure | str = Structure.DIAG,
        head: int = 0,
        output: str | None = None,
        param_names: list[str] | None = None,
        chunk_size: int | None = None,
    ) -> "DNN2GP":
        """Laplace-GGN posterior at the model's weights: precision Σ_i J_iᵀ Λ_i J_i + δI over the training
        inputs ``x`` (``y`` is not needed for the GGN), in ``diag`` / ``kron`` / ``full`` structure."""
        structure = parse_enum(Structure, structure, "structure")
        if not prior_precision > 0:
            raise ValueError(f"prior_precision: must be > 0, got {prior_precision}")
        ggn = curvature(model, x, kind="ggn", structure=structure, likelihood=likelihood, sigma=noise_std,
                        head=head, param_names=param_names, chunk_size=chunk_size)
        mean = params_of(model, param_names)
        if structure is Structure.DIAG:
            post: GaussianPosterior = DiagPosterior(mean, {k: v + prior_precision for k, v in ggn.items()})
        elif structure is Structure.FULL:
            eye = torch.eye(ggn.shape[0], dtype=ggn.dtype, device=ggn.device)
            post = FullPosterior(mean, ggn + prior_precision * eye)
        else:
            post = KronPosterior.from_curvature(mean, ggn, prior_precision)
        return cls(model, post, likelihood=likelihood, noise_std=noise_std, output=output, head=head,
                   prior_precision=prior_precision, chunk_size=chunk_size)

    # --------------------------------------------------------------------------------- the GP

    @property
    def output_fn(self) -> Callable[[Tensor], Tensor] | None:
        return _softmax if self.output == "probs" else None

    def _dtype_x(self, x: Tensor) -> Tensor:
        ref = next(iter(params_of(self.model).values()))
        return x.to(device=ref.device, dtype=ref.dtype if x.is_floating_point() else None)

    @torch.no_grad()
    def mean(self, x: Tensor) -> Tensor:
        """m(x): `f(x; θ*)` or `softmax(f(x; θ*))`, [N, K] (eval mode)."""
        with eval_mode(self.model):
            f = forward(self.model, self._dtype_x(x), self.head)
        return _softmax(f) if self.output == "probs" else f

    def kernel(self, x: Tensor, x2: Tensor | None = None, *, blockwise: bool = False) -> Tensor:
        """κ(x, x2) (``x2`` defaults to ``x``).

        Returns:
            ``blockwise=False``: [N·K, N2·K], index n·K + k (points outer, outputs inner);
            ``blockwise=True``: [K, N, N2], the per-output blocks κ_k(x, x2) (cross-output terms dropped).
        """
        x = self._dtype_x(x)
        n1 = x.shape[0]
        xs = x if x2 is None else torch.cat([x, self._dtype_x(x2)])
        k = self._kernel_all(xs, blockwise)
        if x2 is None:
            return k
        if blockwise:
            return k[:, :n1, n1:]
        c = k.shape[0] // xs.shape[0]
        return k[: n1 * c, n1 * c :]

    def _kernel_all(self, x: Tensor, blockwise: bool) -> Tensor:
        if not self._generic:
            names = self.param_names if isinstance(self.sigma, Tensor) else None
            return _kernel(self.model, x, self.sigma, head=self.head, output_fn=self.output_fn,
                           blockwise=blockwise, param_names=names, chunk_size=self.chunk_size)
        assert self.posterior is not None
        jac = per_example_jacobians(self.model, x, head=self.head, param_names=self.param_names,
                                    output_fn=self.output_fn, chunk_size=self.chunk_size)
        n, c = x.shape[0], next(iter(jac.values())).shape[1]
        rows = torch.cat([jac[k].reshape(n * c, -1) for k in self.param_names], dim=1)  # [N·K, P]
        cov_rows = []
        for r in range(n * c):
            u = self.posterior.covariance_matvec({k: jac[k].reshape(n * c, *jac[k].shape[2:])[r]
                                                  for k in self.param_names})
            cov_rows.append(torch.cat([u[k].reshape(-1) for k in self.param_names]))
        full = rows @ torch.stack(cov_rows).T
        if not blockwise:
            return full
        f4 = full.reshape(n, c, n, c)
        idx = torch.arange(c, device=full.device)
        return f4[:, idx, :, idx]

    def predict(self, x: Tensor, *, full_cov: bool = False, include_noise: bool = False) -> tuple[Tensor, Tensor]:
        """Predictive mean and (co)variance of the GP at each input (no cross-point terms).

        Args:
            x: inputs [N, ...].
            full_cov: return the per-point [K, K] covariances instead of the [K] variances.
            include_noise: add σ² I (regression: the predictive of y instead of f).

        Returns:
            ``(mean [N, K], var [N, K])`` or ``(mean [N, K], cov [N, K, K])``.
        """
        if include_noise and self.likelihood != "regression":
            raise ValueError("include_noise: only for likelihood 'regression'")
        x = self._dtype_x(x)
        mean = self.mean(x)
        covs = []
        for s in range(0, x.shape[0], PREDICT_CHUNK):
            xc = x[s : s + PREDICT_CHUNK]
            n = xc.shape[0]
            k4 = self._kernel_all(xc, blockwise=False).reshape(n, -1, n, mean.shape[1])
            idx = torch.arange(n, device=x.device)
            covs.append(k4[idx, :, idx, :])  # [n, K, K]
        cov = torch.cat(covs) if covs else mean.new_zeros(0, mean.shape[1], mean.shape[1])
        if include_noise:
            cov = cov + self.noise_std**2 * torch.eye(mean.shape[1], dtype=cov.dtype, device=cov.device)
        if full_cov:
            return mean, cov
        return mean, torch.diagonal(cov, dim1=-2, dim2=-1).clone()

    # ------------------------------------------------------------------------- marginal likelihood

    def evidence_terms(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """(J Jᵀ [N·K, N·K], ỹ [N·K]) at θ* for the regression marginal likelihood (module docstring)."""
        if self.likelihood != "regression":
            raise ValueError("log_marginal_likelihood: only for likelihood 'regression'")
        x = self._dtype_x(x)
        sel = params_of(self.model, self.param_names)
        ones = {k: torch.ones_like(v) for k, v in sel.items()}
        jjt = _kernel(self.model, x, ones, head=self.head, chunk_size=self.chunk_size, blockwise=False)
        frozen = {k: v for k, v in params_of(self.model).items() if k not in sel}
        with eval_mode(self.model):
            def f(p: ParamDict) -> Tensor:
                return forward(self.model, x, self.head, {**frozen, **p})

            fx, j_theta = jvp(f, (sel,), (sel,))  # f(x; θ*), J θ*
        y = y.to(fx).reshape(fx.shape)
        return jjt.detach(), (y - fx + j_theta).detach().reshape(-1)

    def log_marginal_likelihood(self, x: Tensor, y: Tensor, prior_precision: float | None = None) -> Tensor:
        """log N(ỹ; 0, δ⁻¹ J Jᵀ + σ² I) (regression; module docstring). δ defaults to the recorded one."""
        delta = prior_precision if prior_precision is not None else self.prior_precision
        if delta is None or not delta > 0:
            raise ValueError(f"prior_precision: must be > 0, got {delta}")
        jjt, yt = self.evidence_terms(x, y)
        return _gaussian_log_evidence(jjt, yt, float(delta), self.noise_std)

    def select_prior_precision(self, x: Tensor, y: Tensor, grid: Sequence[float]) -> tuple[float, Tensor]:
        """The δ of ``grid`` with the largest marginal likelihood, and the log evidence at every δ."""
        if len(grid) == 0:
            raise ValueError("grid: needs at least one prior precision")
        jjt, yt = self.evidence_terms(x, y)
        values = torch.stack([_gaussian_log_evidence(jjt, yt, float(d), self.noise_std) for d in grid])
        return float(grid[int(torch.argmax(values))]), values


def _gaussian_log_evidence(jjt: Tensor, yt: Tensor, delta: float, noise_std: float) -> Tensor:
    n = yt.shape[0]
    cov = jjt / delta + noise_std**2 * torch.eye(n, dtype=jjt.dtype, device=jjt.device)
    chol = torch.linalg.cholesky(0.5 * (cov + cov.T))
    alpha = torch.cholesky_solve(yt.unsqueeze(1), chol).squeeze(1)
    logdet = 2.0 * torch.log(torch.diagonal(chol)).sum()
    return -0.5 * (yt @ alpha) - 0.5 * logdet - 0.5 * n * math.log(2 * math.pi)
