"""IVON (Shen et al. 2024; the ``ivon-opt`` package) with the previous posterior as the prior.

IVON keeps q = N(m, diag(1/(λ(h + w)))) with λ = ``ess`` and an isotropic prior N(0, 1/(λ w)) fixed
inside its update (w = weight decay). To carry q_{t−1} = N(m₀, diag s₀⁻¹) into task t we **add the
prior term to the loss** rather than rewrite IVON's update: task t minimises, at weight samples
θ ~ q drawn by IVON,

    E_q[ (1/N_t) Σ_i ℓ_i(θ) + (1/(2 N_t)) (θ − m₀)ᵀ diag(s₀) (θ − m₀) ]          λ = ess_factor · N_t

(the shared :class:`~continual_blr.regularizers.weight_space.GaussianPrior`, scaled by 1/N_t like every
Bayesian prior on the mean loss). Its gradient s₀ ∘ (θ − m₀)/N_t enters IVON's gradient; IVON's
reparameterisation ("price") Hessian estimate E[ĝ ∘ ε]/σ² then sees the prior's curvature s₀/N_t, so
λ h ≈ N_t h_data + s₀ and q's precision is data + prior as in the BLR. IVON's own weight decay w is
kept small (default 0) so that its fixed isotropic prior does not double-count. At a task start h is
warm-started at s₀/λ (the posterior starts at the prior); at its end q_t = N(m, λ(h + w)) becomes the
next prior.

The package is optional (``pip install ivon-opt==0.1.3``) and imported when the method is built.
Sampling uses the method's own ``torch.Generator`` (IVON's ``_sample_params`` is overridden for that);
the loop's ``loss`` → ``backward`` → ``step`` order is kept by drawing the sample in ``loss`` and
recording the gradient (IVON's ``_restore_param_average``) in ``step``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ..data.stream import Task, TaskStream
from ..posteriors import DiagPosterior, load_posterior
from ..regularizers.weight_space import GaussianPrior
from ..types import Batch, params_of, unflatten
from .base import Method, TrainConfig

__all__ = ["IVONParams", "IVONMethod", "import_ivon"]


def import_ivon():
    """The ``ivon`` module, or a one-line ImportError saying how to install it."""
    try:
        import ivon  # type: ignore[import-not-found]
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("method 'ivon' needs the optional package ivon-opt: pip install ivon-opt==0.1.3") from None
    return ivon


@dataclass
class IVONParams:
    """Parameters of IVON with a carried prior.

    Attributes:
        lr: IVON's learning rate.
        ess_factor: λ = ess_factor · N_t (< 1 tempers the likelihood).
        hess_init: IVON's initial h for task 1 (the posterior's precision starts at λ(h + w)).
        beta1: momentum of the gradient.
        beta2: decay of the Hessian estimate (upstream advice for short runs: ≈ 0.9999 or lower).
        weight_decay: w, IVON's own isotropic prior (kept small; the carried prior is a loss term).
        prior_precision: δ of the first prior N(0, δ⁻¹ I).
        clip_radius: IVON's update clipping.
        predict_samples: MC samples at prediction (0: the mean network).
    """

    lr: float = 0.1
    ess_factor: float = 1.0
    hess_init: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    prior_precision: float = 1.0
    clip_radius: float = 1e3
    predict_samples: int = 0

    def __post_init__(self) -> None:
        for name in ("lr", "ess_factor", "hess_init", "prior_precision", "clip_radius"):
            if not getattr(self, name) > 0:
                raise ValueError(f"params.{name}: must be > 0, got {getattr(self, name)}")
        if not 0 <= self.beta1 < 1:
            raise ValueError(f"params.beta1: must be in [0, 1), got {self.beta1}")
        if not 0 <= self.beta2 < 1:
            raise ValueError(f"params.beta2: must be in [0, 1), got {self.beta2}")
        if not self.weight_decay >= 0:
            raise ValueError(f"params.weight_decay: must be >= 0, got {self.weight_decay}")
        if self.predict_samples < 0:
            raise ValueError(f"params.predict_samples: must be >= 0, got {self.predict_samples}")


def _make_ivon_class():
    """A subclass of ``ivon.IVON`` that samples from a generator and splits sampling from the step."""
    ivon = import_ivon()

    class GeneratorIVON(ivon.IVON):
        def __init__(self, *args, generator: torch.Generator | None = None, **kwargs) -> None:
            self.generator = generator
            self._pending: tuple[Tensor, Tensor] | None = None
            super().__init__(*args, **kwargs)

        def _sample_params(self) -> tuple[Tensor, Tensor]:
            """IVON's sampler, drawing ε from ``self.generator``: θ = m + ε/√(λ(h + w))."""
            avgs, noises = [], []
            for group in self.param_groups:
                eps = torch.randn(group["numel"], generator=self.generator, dtype=self._dtype)
                noise = eps.to(self._device) / (group["ess"] * (group["hess"] + group["weight_decay"])).sqrt()
                off = 0
                for p in group["params"]:
                    avg = p.data.flatten()
                    avgs.append(avg)
                    p.data = (avg + noise[off : off + p.numel()]).view(p.shape)
                    off += p.numel()
                noises.append(noise)
            return torch.cat(avgs), torch.cat(noises)

        def begin_sample(self) -> None:
            """Load θ ~ q into the parameters (before the forward pass)."""
            if self._pending is not None:
                self.end_sample(train=False)
            self._pending = self._sample_params()

        def end_sample(self, train: bool = True) -> None:
            """Restore the mean; with ``train`` record the gradient at the sample for the next step."""
            if self._pending is None:
                return
            avg, noise = self._pending
            self._pending = None
            for group in self.param_groups:
                for p in group["params"]:
                    if train and p.grad is None:  # e.g. another task's head
                        p.grad = torch.zeros_like(p)
            self._restore_param_average(train, avg, noise)

        @torch.no_grad()
        def step(self, closure=None):  # type: ignore[override]
            if closure is not None:
                return super().step(closure)
            if self._pending is None:
                raise RuntimeError("IVON step without a weight sample: call begin_sample() before the forward pass")
            self.end_sample(train=True)
            return super().step()

        def precision(self) -> Tensor:
            """λ (h + w), flat."""
            g = self.param_groups[0]
            return g["ess"] * (g["hess"] + g["weight_decay"])

    return GeneratorIVON


class IVONMethod(Method):
    """IVON per task, the previous posterior as a loss-term prior (module docstring)."""

    name = "ivon"

    def __init__(self, params: IVONParams | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.params = params or IVONParams()
        self._ivon_cls = _make_ivon_class()  # fails early with an install hint
        self.regularizer = GaussianPrior(structure="diag", curvature=None, mode="online", scale=1.0, divide_by_n=True)
        self.prior: DiagPosterior | None = None
        self.optimizer: Any = None
        self._names: list[str] = []
        self._predict_generator = torch.Generator().manual_seed(seed + 31337)

    def setup(self, model: nn.Module, stream: TaskStream, train: TrainConfig) -> None:
        zeros = {k: torch.zeros_like(v) for k, v in params_of(model).items()}
        self.prior = DiagPosterior(zeros, self.params.prior_precision)
        self.regularizer.setup(model)
        self.regularizer.set_prior(self.prior)

    def make_optimizer(self, model: nn.Module, task: Task, train: TrainConfig) -> torch.optim.Optimizer:
        p = self.params
        assert self.prior is not None, "setup() must run first"
        ess = p.ess_factor * task.n_train
        names = list(self.prior.mean)
        named = dict(model.named_parameters())
        opt = self._ivon_cls([named[k] for k in names], lr=p.lr, ess=ess, hess_init=p.hess_init, beta1=p.beta1,
                             beta2=p.beta2, weight_decay=p.weight_decay, mc_samples=1, clip_radius=p.clip_radius,
                             generator=self.generator)
        if self.optimizer is not None:  # after task 1, warm start at the prior: λ(h + w) = s₀
            s0 = torch.cat([self.prior.precision[k].reshape(-1) for k in names])
            h = (s0 / ess - p.weight_decay).clamp_min(1e-8 * p.hess_init)
            opt.param_groups[0]["hess"] = h.to(opt.param_groups[0]["hess"])
        self.optimizer = opt
        self._names = names
        return opt

    def loss(self, model: nn.Module, batch: Batch, task: Task) -> Tensor:
        """Mean cross-entropy + prior term at a weight sample θ ~ q (drawn here, recorded in ``step``)."""
        self.optimizer.begin_sample()
        return super().loss(model, batch, task)

    def posterior(self, model: nn.Module) -> DiagPosterior:
        """q = N(m, diag λ(h + w)) with m the model's weights."""
        mean = {k: v.clone() for k, v in params_of(model, self._names).items()}
        return DiagPosterior(mean, unflatten(self.optimizer.precision(), mean))

    def on_task_end(self, model: nn.Module, task: Task, optimizer=None) -> None:
        self.optimizer.end_sample(train=False)
        self.prior = self.posterior(model)
        self.regularizer.set_prior(self.prior)

    @torch.no_grad()
    def predict_proba(self, model: nn.Module, x: Tensor, head: int) -> Tensor:
        if self.params.predict_samples == 0 or self.prior is None:
            return super().predict_proba(model, x, head)
        probs = torch.zeros((), dtype=x.dtype, device=x.device)
        for _ in range(self.params.predict_samples):
            theta = self.prior.sample(self._predict_generator)
            probs = probs + torch.softmax(functional_call(model, theta, (x,), {"head": head}), -1)
        return probs / self.params.predict_samples

    def state_dict(self) -> dict[str, Any]:
        return {"prior": self.prior.state_dict() if self.prior is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("prior") is not None:
            self.prior = load_posterior(state["prior"])  # type: ignore[assignment]
            self.regularizer.set_prior(self.prior)

