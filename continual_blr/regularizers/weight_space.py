"""Weight-space Gaussian priors: EWC, (online) Laplace and L2 as **one** penalty.

Every method of this family adds to the mean minibatch loss of task t the same quadratic

    penalty(θ) = (c / 2) · Σ_k (θ − m_k)ᵀ S_k (θ − m_k),        c = scale / N_t   or   c = scale

with one term (m_k, S_k) per past task (``mode="separate"``) or a single running term
(``mode="online"``). Each term is a :class:`~continual_blr.posteriors.GaussianPosterior` in any
structure (diag / kron / full); the penalty only needs S v, i.e. ``posterior.quadratic``. What differs
between the methods is how a term is built at the end of task t from the curvature C_t of the summed
loss Σ_i ℓ_i at θ*_t (``continual_blr.curvature``):

| method       | term update at the end of task t                                    | c         |
|--------------|---------------------------------------------------------------------|-----------|
| EWC separate | append `(θ*_t, C_t / N_t)` (diag Fisher, a mean)                    | λ         |
| EWC online   | `(θ*_t, γ S_{t−1} + C_t / N_t)` (Schwarz et al. 2018)               | λ         |
| Laplace      | `(θ*_t, S_{t−1} + C_t / T)`, `S_0 = δ I`, `m_0 = 0`                 | `1 / N_t` |
| L2           | `(θ*_t, diag(u))`, `u_j = 1` if a past task used `θ_j`, else 0      | λ         |

Scaling. The loop minimises the *mean* loss (1/N_t) Σ_i ℓ_i + penalty. A Bayesian prior term
½ (θ − m)ᵀ S (θ − m) belongs next to the *summed* loss, so Laplace divides it by the current task's N_t
(``divide_by_n=True``): the objective is then (1/N_t) × the negative log joint, and its minimiser is
the MAP of sequential Bayes. EWC uses the per-example-mean Fisher `F̄_t = C_t / N_t` (Kirkpatrick et al.
2017) and no `1/N_t`, so `λ = N_{t−1} / N_t` reproduces the Bayesian weight and λ ≫ 1 over-counts the past.

Parameters: ``penalty(..., params=...)`` evaluates at a ParamDict (functional calls, e.g. inside the
BLR's ``torch.func`` transforms); without ``params`` it uses the model's own parameters.

Precision: the penalty, the task's curvature and the new term are computed in fp32 (the posteriors' own
dtype) also inside an active ``torch.autocast`` (bf16 training; :func:`~continual_blr.mixed_precision.full_precision`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..curvature import curvature as curvature_of
from ..data.stream import Task
from ..mixed_precision import full_precision
from ..posteriors import DiagPosterior, FullPosterior, GaussianPosterior, KronPosterior, kron_layers, load_posterior
from ..types import Batch, Curvature, ParamDict, Structure, params_of, parse_enum

__all__ = ["GaussianPrior", "MODES", "IDENTITY", "used_parameters", "last_layer_names"]

MODES = ("separate", "online")
IDENTITY = "identity"  # the "curvature" of L2: the identity on the parameters a task used


def used_parameters(model: nn.Module, task: Task, names: list[str]) -> set[str]:
    """Names in ``names`` on which the task's loss depends (e.g. the body and the task's own head).

    Found structurally: one backward pass on two training examples, ``allow_unused=True``; a
    parameter that is not in the graph (another task's head) gets ``None``.
    """
    named = dict(model.named_parameters())
    x, y = task.x_train[:2], task.y_train[:2]
    with torch.enable_grad():
        out = model(x, head=task.head)
        loss = nn.functional.cross_entropy(out, y) if out.dim() == 2 and y.dtype == torch.long else out.sum()
        grads = torch.autograd.grad(loss, [named[k] for k in names], allow_unused=True)
    return {k for k, g in zip(names, grads) if g is not None}


def last_layer_names(model: nn.Module) -> list[str]:
    """The output layer's parameter names: every head of a multi-head network (``heads.*``), else the
    parameters of the model's last Linear layer."""
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    heads = [k for k in names if k.startswith("heads.")]
    if heads:
        return heads
    layers = kron_layers(model)
    if not layers:
        raise ValueError("subset 'last_layer': the model has no Linear/Conv2d layer")
    w, b = layers[-1]
    return [w] + ([b] if b is not None else [])


def _scaled(post: GaussianPosterior, gamma: float) -> GaussianPosterior:
    """The same Gaussian with precision γ S (the decay of online EWC)."""
    if gamma == 1.0:
        return post
    if isinstance(post, DiagPosterior):
        return DiagPosterior(post.mean, {k: gamma * v for k, v in post.precision.items()})
    if isinstance(post, FullPosterior):
        return FullPosterior(post.mean, gamma * post.precision)
    if isinstance(post, KronPosterior):
        blocks = [(w, b, [(gamma * a, g) for a, g in terms]) for w, b, terms in post.blocks]
        return KronPosterior(post.mean, blocks, {k: gamma * v for k, v in post.diag.items()}, gamma * post.delta)
    raise TypeError(f"unsupported posterior type {type(post).__name__}")


class GaussianPrior:
    """The weight-space Gaussian prior penalty shared by EWC, Laplace, L2 and IVON (module docstring).

        penalty(θ) = (c/2) Σ_k (θ − m_k)ᵀ S_k (θ − m_k),   c = scale / N_t if ``divide_by_n`` else scale

    At the end of task t (``on_task_end``) the curvature C_t of Σ_i ℓ_i at `θ*_t` (the model's weights) is
    computed by ``continual_blr.curvature`` and becomes the new precision contribution
    ``curvature_scale · C_t`` (``curvature_scale="mean"`` means 1/N_t):

    * ``mode="separate"``: append the term `(θ*_t, curvature_scale · C_t)`;
    * ``mode="online"``: replace the single term by `(θ*_t, γ S_{t−1} + curvature_scale · C_t)`, starting
      from `S_0 = δ I`, `m_0 = 0` when ``prior_precision`` δ > 0 (then task 1 is penalised too).

    Args:
        structure: ``diag`` | ``kron`` | ``full`` — the precision structure of every term.
        curvature: a :class:`~continual_blr.types.Curvature` name (``ggn``, ``empirical_fisher``,
            ``mc_fisher``), ``"identity"`` (L2: the identity on the parameters any past task used;
            online mode keeps the union, ignoring ``decay``), or
            None when the owner sets the terms itself (:meth:`set_prior`, used by IVON).
        mode: ``"separate"`` or ``"online"``.
        scale: λ (or 1 for Laplace); the penalty's coefficient before the optional 1/N_t.
        divide_by_n: divide by the current task's number of training examples (Bayesian scaling).
        curvature_scale: a float multiplying C_t (1/T for a tempered Laplace), or ``"mean"`` for 1/N_t.
        decay: γ ∈ [0, 1] of the online mode.
        prior_precision: δ ≥ 0 of the initial prior N(0, δ⁻¹ I) (online mode only).
        param_names: the covered parameters (default all trainable ones); ``"last_layer"`` for the
            output layer (see :func:`last_layer_names`).
        likelihood, sigma: passed to the curvature engine (``"classification"`` or ``"regression"``).
        chunk_size: examples per vectorised curvature pass (bounds memory).
        generator: random stream for ``mc_fisher``.
    """

    def __init__(
        self,
        *,
        structure: Structure | str = Structure.DIAG,
        curvature: str | None = Curvature.GGN.value,
        mode: str = "online",
        scale: float = 1.0,
        divide_by_n: bool = True,
        curvature_scale: float | str = 1.0,
        decay: float = 1.0,
        prior_precision: float = 0.0,
        param_names: list[str] | str | None = None,
        likelihood: str = "classification",
        sigma: float = 1.0,
        chunk_size: int | None = 256,
        generator: torch.Generator | None = None,
    ) -> None:
        self.structure = parse_enum(Structure, structure, "structure")
        if curvature is not None and curvature != IDENTITY:
            curvature = parse_enum(Curvature, curvature, "curvature").value
            if curvature == Curvature.HESSIAN.value and self.structure == Structure.KRON:
                raise ValueError("curvature: 'hessian' has no Kronecker form; use 'ggn' or a Fisher")
        if curvature == IDENTITY and self.structure != Structure.DIAG:
            raise ValueError("curvature: 'identity' (L2) needs structure 'diag'")
        if mode not in MODES:
            raise ValueError(f"mode: got {mode!r}; allowed: {', '.join(map(repr, MODES))}")
        if not scale >= 0:
            raise ValueError(f"scale: must be >= 0, got {scale}")
        if not (curvature_scale == "mean" or (isinstance(curvature_scale, (int, float)) and curvature_scale > 0)):
            raise ValueError(f"curvature_scale: must be > 0 or 'mean', got {curvature_scale!r}")
        if not 0 <= decay <= 1:
            raise ValueError(f"decay: must be in [0, 1], got {decay}")
        if not prior_precision >= 0:
            raise ValueError(f"prior_precision: must be >= 0, got {prior_precision}")
        if prior_precision > 0 and mode != "online":
            raise ValueError("prior_precision: an initial prior needs mode 'online'")
        self.curvature = curvature
        self.mode = mode
        self.scale = float(scale)
        self.divide_by_n = bool(divide_by_n)
        self.curvature_scale = curvature_scale
        self.decay = float(decay)
        self.prior_precision = float(prior_precision)
        self.param_names = param_names
        self.likelihood = likelihood
        self.sigma = sigma
        self.chunk_size = chunk_size
        self.generator = generator
        self.terms: list[GaussianPosterior] = []
        self._names: list[str] | None = None  # resolved covered parameters
        self._ready = False

    # ----- covered parameters and the initial prior ---------------------------------------------
    def names(self, model: nn.Module) -> list[str]:
        """The covered parameter names (resolved once from ``param_names``)."""
        if self._names is None:
            if self.param_names == "last_layer":
                self._names = last_layer_names(model)
            elif isinstance(self.param_names, str):
                raise ValueError(f"param_names: got {self.param_names!r}; allowed: a list of names, 'last_layer' or None")
            else:
                self._names = list(params_of(model, self.param_names))
            if self.structure == Structure.FULL:
                p = sum(dict(model.named_parameters())[k].numel() for k in self._names)
                if p > 20_000:
                    raise ValueError(f"structure: 'full' over {p} parameters needs a {p}×{p} matrix; "
                                     "use param_names='last_layer', 'kron' or 'diag'")
        return self._names

    def _isotropic(self, model: nn.Module, mean: ParamDict, delta: float) -> GaussianPosterior:
        """N(mean, δ⁻¹ I) in the prior's structure (δ may be 0 for a zero start)."""
        ref = next(iter(mean.values()))
        if self.structure == Structure.DIAG:
            return DiagPosterior(mean, {k: torch.full_like(v, delta) for k, v in mean.items()})
        if self.structure == Structure.FULL:
            p = sum(v.numel() for v in mean.values())
            return FullPosterior(mean, delta * torch.eye(p, dtype=ref.dtype, device=ref.device))
        return KronPosterior(mean, [(w, b, []) for w, b in kron_layers(model, list(mean))], None, delta)

    def setup(self, model: nn.Module) -> None:
        """Install the initial prior N(0, δ⁻¹ I) (online mode with δ > 0); clears any earlier terms."""
        names = self.names(model)
        self.terms = []
        self._ready = True
        if self.mode == "online" and self.prior_precision > 0 and self.curvature is not None:
            zeros = {k: torch.zeros_like(p) for k, p in params_of(model, names).items()}
            self.terms = [self._isotropic(model, zeros, self.prior_precision)]

    def set_prior(self, prior: GaussianPosterior | None) -> None:
        """Replace all terms by one Gaussian (for owners that compute the posterior themselves)."""
        self.terms = [] if prior is None else [prior]
        self._ready = True

    def posterior(self) -> GaussianPosterior | None:
        """The running Gaussian of the online mode (None before the first task without a prior)."""
        if self.mode != "online":
            raise ValueError("posterior: only the online mode carries one Gaussian")
        return self.terms[0] if self.terms else None

    # ----- the regulariser protocol ---------------------------------------------------------------
    def coefficient(self, task: Task) -> float:
        """c = scale / N_t (``divide_by_n``) or scale."""
        return self.scale / max(1, task.n_train) if self.divide_by_n else self.scale

    @full_precision
    def penalty(self, model: nn.Module, batch: Batch, task: Task, params: ParamDict | None = None) -> Tensor:
        """(c/2) Σ_k (θ − m_k)ᵀ S_k (θ − m_k); differentiable in θ (``params`` or the model's)."""
        if not self.terms or self.scale == 0:
            return torch.zeros((), dtype=batch.x.dtype, device=batch.x.device)
        theta = params if params is not None else params_of(model, self.names(model), detach=False)
        quad = sum(term.quadratic(theta) for term in self.terms)
        return 0.5 * self.coefficient(task) * quad  # type: ignore[return-value]

    def on_task_start(self, model: nn.Module, task: Task) -> None:
        if not self._ready:
            self.setup(model)

    @full_precision
    def task_curvature(self, model: nn.Module, task: Task) -> Any:
        """C_t · curvature_scale at the model's weights on the task's training data (in the structure)."""
        names = self.names(model)
        if self.curvature == IDENTITY:
            used = used_parameters(model, task, names)
            return {k: torch.full_like(p, 1.0 if k in used else 0.0) for k, p in params_of(model, names).items()}
        c = curvature_of(
            model, task.x_train, task.y_train, kind=self.curvature, structure=self.structure,
            likelihood=self.likelihood, sigma=self.sigma, head=task.head, param_names=names,
            chunk_size=self.chunk_size, generator=self.generator,
        )
        a = 1.0 / max(1, task.n_train) if self.curvature_scale == "mean" else float(self.curvature_scale)
        if a == 1.0:
            return c
        if isinstance(c, dict):
            return {k: a * v for k, v in c.items()}
        if isinstance(c, Tensor):
            return a * c
        return type(c)([blk._replace(A=a * blk.A) for blk in c.blocks], {k: a * v for k, v in c.diag.items()})

    @full_precision
    def on_task_end(self, model: nn.Module, task: Task) -> None:
        """Fold task t into the prior: a new term (separate) or the running term (online)."""
        if self.curvature is None:
            return
        if not self._ready:
            self.setup(model)
        names = self.names(model)
        theta = {k: v.clone() for k, v in params_of(model, names).items()}
        c = self.task_curvature(model, task)
        if self.mode == "separate" or not self.terms:
            term = self._isotropic(model, theta, 0.0).add_precision(c)  # type: ignore[attr-defined]
        elif self.curvature == IDENTITY:  # L2: u = union of the parameters past tasks used
            prev = self.terms[0]
            assert isinstance(prev, DiagPosterior)
            term = DiagPosterior(theta, {k: torch.maximum(prev.precision[k], c[k]) for k in theta})
        else:
            term = _scaled(self.terms[0], self.decay).with_mean(theta).add_precision(c)  # type: ignore[attr-defined]
        self.terms = self.terms + [term] if self.mode == "separate" else [term]

    def state_dict(self) -> dict[str, Any]:
        return {"terms": [t.state_dict() for t in self.terms], "names": self._names}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.terms = [load_posterior(s) for s in state["terms"]]
        self._names = state.get("names")
        self._ready = True

