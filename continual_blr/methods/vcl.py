"""Variational continual learning (VCL, Nguyen et al. 2018): mean-field Gaussian q, prior = last q.

Task t fits q_t(θ) = N(μ, diag σ²) to the task's data minus its coreset C_t, with prior q_{t−1}
(q_0 = N(0, δ⁻¹ I)), by minimising the negative ELBO per example

    E_{q}[ (1/N_t) Σ_{i ∉ C_t} ℓ_i(θ) ] + KL(q ‖ q_{t−1}) / N_t            (N_t = |D_t \\ C_t|)

with one of two optimisers (``optimizer``):

* ``"vogn"`` — the BLR's natural-gradient update (VOGN, ``continual_blr.optim.blr``; weight samples
  θ ~ q, squared per-example gradients as curvature): the ``"blr"`` method with a diagonal posterior,
  started at precision e^{−init_log_variance}.
* ``"bbb"`` — Bayes-by-backprop: Adam on (μ, log σ²) with the reparameterisation gradient of the
  objective above, θ_s = μ + σ ∘ ε_s, ``mc_samples`` draws per step, the KL in closed form
  (:class:`~continual_blr.regularizers.kl.KLPrior`); log σ² starts at ``init_log_variance`` (−6 in the
  paper). The means start from the network's initialisation (the paper starts task 1 from a
  maximum-likelihood fit; with log σ² = −6 the first steps are nearly maximum likelihood anyway).

Predictions average the softmax over ``predict_samples`` draws θ ~ q. With a coreset
(``coreset_size`` > 0 examples per task, ``coreset_kind`` ``"random"`` or ``"kcenter"`` — greedy
farthest-point on the inputs) the held-out points of all tasks so far fine-tune a *copy* of q_t for
``coreset_epochs`` with prior q_t (the same objective, N = total coreset size); that copy only makes
the predictions, and q_t, not the copy, is propagated to task t+1 — as in the paper.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn import functional as F

from ..data.stream import Task, TaskStream
from ..posteriors import DiagPosterior
from ..regularizers.kl import KLPrior
from ..types import Batch, params_of
from .base import Method, TrainConfig
from .blr import BLRMethod, BLRParams

__all__ = ["VCLParams", "VCLMethod", "select_coreset", "OPTIMIZERS", "CORESETS"]

OPTIMIZERS = ("vogn", "bbb")
CORESETS = ("random", "kcenter")


@dataclass
class VCLParams:
    """Parameters of VCL.

    Attributes:
        optimizer: ``"vogn"`` (BLR natural gradient) or ``"bbb"`` (reparameterisation gradient + Adam).
        prior_precision: δ of the first prior N(0, δ⁻¹ I).
        init_log_variance: log σ² of q at the start of task 1.
        mc_samples: weight samples per step (ELBO estimate for bbb, VOGN's samples for vogn).
        predict_samples: Monte-Carlo samples averaged at prediction (0: the mean network).
        lr: bbb: Adam's step (None: ``train.lr``); vogn: the BLR's mean step α (None: 0.05).
        log_var_lr: bbb only: Adam's step on log σ² (None: the same as ``lr``).
        rho: vogn only: the precision rate ρ.
        beta1: vogn only: momentum on the mean direction.
        coreset_size: held-out examples per task (0: no coreset).
        coreset_kind: ``"random"`` or ``"kcenter"``.
        coreset_epochs: fine-tuning epochs on the coresets before prediction (None: ``train.epochs``;
            0: hold the coreset out but predict with q_t).
    """

    optimizer: str = "vogn"
    prior_precision: float = 1.0
    init_log_variance: float = -6.0
    mc_samples: int = 1
    predict_samples: int = 20
    lr: float | None = None
    log_var_lr: float | None = None
    rho: float = 0.05
    beta1: float = 0.9
    coreset_size: int = 0
    coreset_kind: str = "random"
    coreset_epochs: int | None = None

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"params.optimizer: got {self.optimizer!r}; allowed: {', '.join(map(repr, OPTIMIZERS))}")
        if not self.prior_precision > 0:
            raise ValueError(f"params.prior_precision: must be > 0, got {self.prior_precision}")
        if self.mc_samples < 1:
            raise ValueError(f"params.mc_samples: must be >= 1, got {self.mc_samples}")
        if self.predict_samples < 0:
            raise ValueError(f"params.predict_samples: must be >= 0, got {self.predict_samples}")
        for name in ("lr", "log_var_lr"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"params.{name}: must be > 0 or null, got {v}")
        if not 0 < self.rho <= 1:
            raise ValueError(f"params.rho: must be in (0, 1], got {self.rho}")
        if not 0 <= self.beta1 < 1:
            raise ValueError(f"params.beta1: must be in [0, 1), got {self.beta1}")
        if self.coreset_size < 0:
            raise ValueError(f"params.coreset_size: must be >= 0, got {self.coreset_size}")
        if self.coreset_kind not in CORESETS:
            raise ValueError(f"params.coreset_kind: got {self.coreset_kind!r}; allowed: {', '.join(map(repr, CORESETS))}")
        if self.coreset_epochs is not None and self.coreset_epochs < 0:
            raise ValueError(f"params.coreset_epochs: must be >= 0 or null, got {self.coreset_epochs}")


def select_coreset(x: Tensor, size: int, kind: str, generator: torch.Generator) -> Tensor:
    """Indices of ``size`` coreset points among the rows of ``x``.

    ``random``: a uniform subset. ``kcenter``: greedy farthest-point (Gonzalez 1985) on the flattened
    inputs from a random first point — each next point maximises its distance to the chosen ones.
    """
    n = x.shape[0]
    size = min(size, n)
    if kind == "random":
        return torch.randperm(n, generator=generator)[:size].to(x.device)
    if kind != "kcenter":
        raise ValueError(f"kind: got {kind!r}; allowed: {', '.join(map(repr, CORESETS))}")
    flat = x.reshape(n, -1)
    first = int(torch.randint(n, (1,), generator=generator))
    chosen = [first]
    dist = torch.cdist(flat, flat[first : first + 1]).squeeze(1)
    for _ in range(size - 1):
        nxt = int(torch.argmax(dist))
        chosen.append(nxt)
        dist = torch.minimum(dist, torch.cdist(flat, flat[nxt : nxt + 1]).squeeze(1))
    return torch.tensor(chosen, device=x.device)


def _subset(task: Task, idx: Tensor, name: str) -> Task:
    return dataclasses.replace(task, x_train=task.x_train[idx], y_train=task.y_train[idx], name=name)


class VCLMethod(Method):
    """VCL with a VOGN or Bayes-by-backprop optimiser, MC predictive and optional coreset (module docstring)."""

    name = "vcl"

    def __init__(self, params: VCLParams | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.params = params or VCLParams()
        self._blr: BLRMethod | None = None  # vogn
        self.kl: KLPrior | None = None  # bbb; the whole ELBO is in `loss`, so no loop regulariser
        self.coresets: list[Task] = []
        self._train_task: Task | None = None
        self._tasks_override: list[Task] | None = None  # fine-tuning trains on all coresets
        self._train: TrainConfig | None = None
        self._predictive: DiagPosterior | None = None
        self._predict_generator = torch.Generator().manual_seed(seed + 31337)  # predictions draw apart

    # ----- state ---------------------------------------------------------------------------------
    def _blr_params(self) -> BLRParams:
        p = self.params
        return BLRParams(structure="diag", prior_precision=p.prior_precision,
                         init_precision=math.exp(-p.init_log_variance), lr=p.lr if p.lr is not None else 0.05,
                         rho=p.rho, beta1=p.beta1, mc_samples=p.mc_samples, predict_samples=0)

    def setup(self, model: nn.Module, stream: TaskStream | None, train: TrainConfig) -> None:
        p = self.params
        self._train = train
        if p.optimizer == "vogn":
            self._blr = BLRMethod(self._blr_params(), seed=self.seed)
            self._blr.setup(model, stream, train)  # type: ignore[arg-type]
        else:
            zeros = {k: torch.zeros_like(v) for k, v in params_of(model).items()}
            log_var = {k: torch.full_like(v, p.init_log_variance) for k, v in zeros.items()}
            self.kl = KLPrior(DiagPosterior(zeros, p.prior_precision), log_var)

    def posterior(self, model: nn.Module) -> DiagPosterior:
        """q_t: the posterior carried to the next task (mean = the model's weights)."""
        if self._blr is not None:
            return self._blr.posterior()  # type: ignore[return-value]
        assert self.kl is not None, "setup() must run first"
        return self.kl.posterior(model)

    def prior(self) -> DiagPosterior:
        """q_{t−1}: the prior of the task being trained."""
        if self._blr is not None:
            assert self._blr.optimizer is not None
            return self._blr.optimizer.prior  # type: ignore[return-value]
        assert self.kl is not None
        return self.kl.prior

    # ----- the loop's hooks ----------------------------------------------------------------------
    def on_task_start(self, model: nn.Module, task: Task) -> None:
        """Hold the coreset out of the task's training data."""
        p = self.params
        if p.coreset_size > 0:
            idx = select_coreset(task.x_train, p.coreset_size, p.coreset_kind, self.generator)
            keep = torch.ones(task.n_train, dtype=torch.bool, device=task.x_train.device)
            keep[idx] = False
            self.coresets.append(_subset(task, idx, f"{task.name}-coreset"))
            self._train_task = _subset(task, keep.nonzero().squeeze(1), task.name)
        else:
            self._train_task = task

    def train_tasks(self, task: Task, seen: list[Task]) -> list[Task]:
        if self._tasks_override is not None:
            return self._tasks_override
        return [self._train_task if self._train_task is not None else task]

    def _n_data(self, task: Task) -> int:
        return sum(t.n_train for t in self.train_tasks(task, [task]))

    def make_optimizer(self, model: nn.Module, task: Task, train: TrainConfig) -> torch.optim.Optimizer:
        n = self._n_data(task)
        if self._blr is not None:
            opt = self._blr.make_optimizer(model, task, train)
            self._blr.optimizer.n_data = n  # type: ignore[union-attr]
            return opt
        assert self.kl is not None, "setup() must run first"
        self.kl.n_data = n
        lr = self.params.lr if self.params.lr is not None else train.lr
        lv_lr = self.params.log_var_lr if self.params.log_var_lr is not None else lr
        return torch.optim.Adam([{"params": list(model.parameters()), "lr": lr},
                                 {"params": list(self.kl.log_var.values()), "lr": lv_lr}])

    def loss(self, model: nn.Module, batch: Batch, task: Task) -> Tensor:
        """Bayes-by-backprop: (1/S) Σ_s mean_i ℓ_i(μ + σ ∘ ε_s) + KL(q ‖ q_{t−1}) / N."""
        assert self.kl is not None, "loss() is the bbb objective; vogn trains through the BLR optimiser"
        mean = params_of(model, list(self.kl.prior.mean), detach=False)
        nll = 0.0
        for _ in range(self.params.mc_samples):
            theta = {}
            for k, m in mean.items():
                eps = torch.randn(m.shape, generator=self.generator, dtype=m.dtype, device=m.device)
                theta[k] = m + torch.exp(0.5 * self.kl.log_var[k]) * eps
            logits = functional_call(model, theta, (batch.x,), {"head": batch.head})
            nll = nll + F.cross_entropy(logits, batch.y)
        return nll / self.params.mc_samples + self.kl.penalty(model, batch, task)  # type: ignore[return-value]

    def on_task_end(self, model: nn.Module, task: Task, optimizer: torch.optim.Optimizer | None = None) -> None:
        """q_t becomes the prior; with a coreset, fine-tune a copy of q_t for prediction."""
        if self._blr is not None:
            self._blr.on_task_end(model, task, optimizer)
        else:
            assert self.kl is not None
            self.kl.on_task_end(model, task)
        self._predictive = None
        epochs = self.params.coreset_epochs
        if self.coresets and self._tasks_override is None and (epochs is None or epochs > 0):
            self._predictive = self._finetune(model, task)

    def _finetune(self, model: nn.Module, task: Task) -> DiagPosterior:
        """Train a copy of q_t on all coresets with prior q_t; returns the copy (model untouched)."""
        from ..loop import fit_task  # the one training loop (imported here: loop imports methods)

        assert self._train is not None
        epochs = self.params.coreset_epochs if self.params.coreset_epochs is not None else self._train.epochs
        train = dataclasses.replace(self._train, epochs=epochs)
        seed = self.seed + 1009 * (task.task_id + 1)  # own random streams: the main run is unaffected
        twin = copy.deepcopy(model)
        inner = VCLMethod(dataclasses.replace(self.params, coreset_size=0), seed=seed)
        inner.setup(twin, None, train)
        prior = self.posterior(model)
        if inner._blr is not None:
            assert inner._blr.optimizer is not None
            inner._blr.optimizer.set_prior(prior, reset_precision=True)
        else:
            assert inner.kl is not None and self.kl is not None
            inner.kl.prior = prior
            with torch.no_grad():
                for k, v in inner.kl.log_var.items():
                    v.copy_(self.kl.log_var[k])
        inner._tasks_override = list(self.coresets)
        fit_task(twin, self.coresets[-1], inner, train, seen=list(self.coresets),
                 generator=torch.Generator().manual_seed(seed), progress=False)
        return inner.posterior(twin)

    @torch.no_grad()
    def predict_proba(self, model: nn.Module, x: Tensor, head: int) -> Tensor:
        """(1/S) Σ_s softmax f(x; θ_s), θ_s ~ q (the coreset-tuned copy when there is one)."""
        post = self._predictive if self._predictive is not None else self.posterior(model)
        if self.params.predict_samples == 0:
            return torch.softmax(functional_call(model, post.mean, (x,), {"head": head}), -1)
        probs = torch.zeros((), dtype=x.dtype, device=x.device)
        for _ in range(self.params.predict_samples):
            theta = post.sample(self._predict_generator)
            probs = probs + torch.softmax(functional_call(model, theta, (x,), {"head": head}), -1)
        return probs / self.params.predict_samples

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self._blr is not None:
            state["blr"] = self._blr.state_dict()
        if self.kl is not None:
            state["kl"] = self.kl.state_dict()
        if self._predictive is not None:
            state["predictive"] = self._predictive.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._blr is not None and "blr" in state:
            self._blr.load_state_dict(state["blr"])
        if self.kl is not None and "kl" in state:
            self.kl.load_state_dict(state["kl"])
        if "predictive" in state:
            self._predictive = DiagPosterior.from_state_dict(state["predictive"])
