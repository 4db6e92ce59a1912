"""Variational continual learning (VCL, Nguyen et al. 2018): mean-field Gaussian q, prior = last q.

Task t fits q_t(θ) = N(μ, diag σ²) to the task's data minus its coreset C_t, with prior q_{t−1}
(q_0 = N(0, δ⁻¹ I)), by minimising the negative ELBO per example (the paper's eq. 4 divided by N_t)

    E_{q}[ (1/N_t) Σ_{i ∉ C_t} ℓ_i(θ) ] + KL(q ‖ q_{t−1}) / N_t            (N_t = |D_t \\ C_t|)

with ℓ_i the stream's likelihood (``Method.likelihood``: softmax cross-entropy, or the Gaussian
‖f − y‖²/(2σ²)). **Parameters no task has used yet** (the heads of future tasks in the multi-head
scenario, found structurally: they get no gradient from the task's loss) have no likelihood term, so
their exact posterior is the prior: they stay out of the KL and out of the carried posterior (which
keeps q_0 = N(0, δ⁻¹) for them) until their own task starts; then they enter with prior N(0, δ⁻¹) and
q started at (the network's initial weights, log σ² = ``init_log_variance``), as in the paper's code.

Two optimisers (``optimizer``):

* ``"vogn"`` — the BLR's natural-gradient update (VOGN, ``continual_blr.optim.blr``): the ``"blr"``
  method with a diagonal posterior (every :class:`~continual_blr.methods.blr.BLRParams` field passed
  from :class:`VCLParams`, none left to its default), over the active parameters; a new head starts at
  precision e^{−init_log_variance}, the others at q_{t−1} (a warm start).
* ``"bbb"`` — Bayes-by-backprop: Adam on (μ, log σ²) with the reparameterisation gradient of the
  objective above, θ_s = μ + σ ∘ ε_s, ``mc_samples`` draws per step, the KL in closed form
  (:class:`~continual_blr.regularizers.kl.KLPrior`); log σ² starts at ``init_log_variance`` (−6 in the
  paper) and q_t starts at q_{t−1}. ``estimator`` picks how E_q[ℓ] is estimated: ``"weights"`` draws θ_s
  (one draw shared by the minibatch, the paper's code); ``"local"`` draws each linear layer's
  pre-activations per example (the local reparameterisation, :mod:`continual_blr.methods.local_reparam`):
  the same expectation with a lower-variance gradient and no weight matrix drawn, for networks whose
  sampled parameters are all ``nn.Linear``'s (the MLPs).

**Why log σ² has its own Adam step (``log_var_lr``).** Adam divides each coordinate's gradient by its
running RMS, so when a gradient keeps its sign the coordinate moves by ≈ lr per step whatever the
gradient's size: T steps move log σ² by at most ≈ lr·T. The ELBO's optimum is at
1/σ_j² = s₀_j + N_t E_q[∂²ℓ̄/∂θ_j²] (s₀: the prior's precision): for a weight the data barely constrain
it is the prior's variance, log σ² ≈ 0, i.e. 6 away from the start −6, and the KL's gradient there,
½(s₀σ² − 1)/N_t, has the same sign at every step. With Adam lr 1e-3 on both μ and log σ², split MNIST's
1,485 steps of task 1 moved *every* log σ² by the same +1.48 (−6 → −4.52): the variances were set by
the step budget, not by the data, and the carried prior was isotropic. (The paper's code takes 120
full-batch Adam steps at 1e-3 per task, ≤ 0.12 of movement: its variances do not learn either.) So
log σ² gets its own step ``log_var_lr``, sized so that lr·T covers that distance (0.01 on split MNIST:
up to 15 per task, and task 1's log σ² then sit within a median 0.07 of the fixed point
−log(δ + E_q[diag GGN])). It is still Adam on the same objective, so its fixed point is the ELBO's
optimum; the price of a larger step is Adam's stationary jitter around it (the test suite measures both
on the linear-Gaussian oracle, where the mean-field optimum is known in closed form). Approaching from
above is slower: the gradient there scales with σ², and Adam's second moment remembers the larger
early gradients. On split digits (~100 steps per task) validation chose 0.03 with 0.01 on the means:
the variances travel ≤ 3 there, a compromise with the jitter.

What this does to the benchmarks (``benchmarks/results/archive/vcl_split_mnist.md``): on split MNIST the learnt
variances are a far better ELBO (task 1: −ELBO/N 0.91 against the natural-gradient form's 49.7) whose
weights mostly keep the prior's variance, so the carried prior holds few weights and VCL-bbb forgets
(79.9; 93.6 with the old step); the ``vogn`` form scores 98.3 (99.2 with the coreset).

**Task-1 means from a maximum-likelihood fit** (``ml_init_epochs`` > 0, the paper's recipe): before
task 1, the network is trained for ``ml_init_epochs`` epochs on task 1's data (all of it, the future
coreset included, as in the paper's code) with the plain likelihood (the ``"none"`` method, the train
config's optimiser) through the one training loop; VCL then starts from those means with
log σ² = ``init_log_variance``.

**Where q starts a task** (``task_start``, bbb): the paper's code starts task t at q_{t−1} (``"carry"``). Improved VCL
(Swaroop et al. 2019; its released code, ``benchmarks/results/search/vcl_reference_differences.md``) starts every
task afresh — means redrawn, log σ² back to its initial value — with q_{t−1} still the prior. ``"reinit"`` does that
(means from the library's initialisation U(±1/√fan_in), not the released code's N(0, 0.1²)); ``"reinit_variance"``
resets only log σ². The objective, and so its optimum, is the same; a warm start's weights whose q reverted to the
prior's variance start the next task with that noise, a reset one at e^{init_log_variance}.

Predictions average the softmax (regression: the outputs) over ``predict_samples`` draws θ ~ q. With a
coreset (``coreset_size`` > 0 examples per task, ``coreset_kind`` ``"random"`` or ``"kcenter"`` — greedy
farthest-point on the inputs), after task t a *copy* of q_t is fine-tuned for ``coreset_epochs`` with
prior q_t (the same objective, N = the coreset's size) and only that copy predicts; q_t, not the copy,
is carried to task t+1 — as in the paper. In the multi-head (``"task"``) scenario each seen task j
gets its own copy, fine-tuned on C_j alone, which predicts task j (the paper's code does this); in
the class / domain scenarios one copy is fine-tuned on all coresets together. The copies train through
the one training loop (``methods.base.fit_auxiliary``) with random streams of their own.
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

from ..data.stream import Task, TaskStream
from ..posteriors import DiagPosterior
from ..regularizers.kl import KLPrior
from ..regularizers.weight_space import used_parameters
from ..types import Batch, params_of
from . import local_reparam
from .base import Method, TrainConfig, fit_auxiliary, mean_nll
from .blr import BLRMethod, BLRParams, redraw_layers

__all__ = ["VCLParams", "VCLMethod", "select_coreset", "OPTIMIZERS", "CORESETS", "VOGN_CURVATURES", "ESTIMATORS",
           "TASK_STARTS"]

OPTIMIZERS = ("vogn", "bbb")
TASK_STARTS = ("carry", "reinit", "reinit_variance")
ESTIMATORS = ("weights", "local")
CORESETS = ("random", "kcenter")
VOGN_CURVATURES = ("empirical_fisher", "ggn", "mc_fisher", "gauss_newton")


@dataclass
class VCLParams:
    """Parameters of VCL.

    Defaults: the natural-gradient (VOGN) form with VCL's coreset, 40 examples per task chosen by k-center
    (Nguyen et al. 2018's split-MNIST coreset size), fine-tuned on before prediction. Chosen on validation splits
    of split digits in the README quickstart's form (``benchmarks/results/search/search_defaults_split_digits.md``):
    without a coreset no setting of the grid beat ``none`` in the task scenario (the T = 1 posterior of ~200
    examples per task is wide, and its samples underfit); ``coreset_size: 0`` is VCL without one.

    Attributes:
        optimizer: ``"vogn"`` (BLR natural gradient) or ``"bbb"`` (reparameterisation gradient + Adam).
        prior_precision: δ of the first prior N(0, δ⁻¹ I) (also every new head's prior).
        init_log_variance: log σ² of q at the start of task 1 and of every new head.
        mc_samples: weight samples per step (the ELBO estimate for bbb, ≥ 1; VOGN's samples for vogn,
            0 being the delta method θ = μ).
        predict_samples: Monte-Carlo samples averaged at prediction (0: the mean network).
        lr: bbb: Adam's step on μ (None: ``train.lr``); vogn: the BLR's mean step α (None: 0.1, chosen on
            split digits validation: ``benchmarks/results/search/search_defaults_redo.md``).
        log_var_lr: bbb only: Adam's step on log σ² (module docstring; None: the same as ``lr``).
        estimator: bbb only: ``"weights"`` (θ_s = μ + σ ∘ ε_s shared by the minibatch) or ``"local"`` (the
            local reparameterisation: per-example pre-activation draws; only for ``nn.Linear`` parameters).
        rho: vogn only: the precision rate ρ.
        beta1: vogn only: momentum on the mean direction.
        curvature: vogn only: ĥ of the BLR step (``"empirical_fisher"``: VOGN's squared per-example
            gradients; ``"ggn"``, ``"mc_fisher"``, ``"gauss_newton"``; see :mod:`continual_blr.optim.blr`).
        precision_debias: vogn only: the BLR's bias-corrected precision rate.
        clip_radius: vogn only: the BLR's elementwise bound on the preconditioned step (None: none).
        damping: vogn only: γ ≥ 0, the BLR's step-only damping N γ (the carried posterior does not depend on it).
        fused_step: vogn only: the BLR's update as one compiled loop (BLRParams.fused_step).
        curvature_every: vogn only: the BLR's curvature on every k-th step only (BLRParams.curvature_every).
        ml_init_epochs: epochs of maximum-likelihood training of the means before task 1 (0: off).
        coreset_size: held-out examples per task (0: no coreset).
        coreset_kind: ``"random"`` or ``"kcenter"``.
        coreset_epochs: fine-tuning epochs on the coresets before prediction (None: ``train.epochs``;
            0: hold the coreset out but predict with q_t).
        task_start: bbb only — where q starts each task after the first (the prior q_{t−1} is the same either way):
            ``"carry"`` (default, the VCL paper's code: q_t starts at q_{t−1}), ``"reinit_variance"`` (every active
            log σ² set back to ``init_log_variance``, the means kept) or ``"reinit"`` (that, and the means of every
            active Linear / Conv2d layer redrawn from U(±1/√fan_in), the library's initialisation; improved VCL's
            released code redraws them from N(0, 0.1²) and starts every task so). Only the optimisation's start
            moves; the objective E_q[ℓ] + KL(q ‖ q_{t−1}) / N is unchanged.
    """

    optimizer: str = "vogn"
    prior_precision: float = 1.0
    init_log_variance: float = -6.0
    mc_samples: int = 1
    predict_samples: int = 20
    lr: float | None = None
    log_var_lr: float | None = None
    estimator: str = "weights"
    rho: float = 0.05
    beta1: float = 0.9
    curvature: str = "empirical_fisher"
    precision_debias: bool = False
    clip_radius: float | None = None
    damping: float = 0.0
    fused_step: bool = False
    curvature_every: int = 1
    ml_init_epochs: int = 0
    coreset_size: int = 40
    coreset_kind: str = "kcenter"
    coreset_epochs: int | None = None
    task_start: str = "carry"

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"params.optimizer: got {self.optimizer!r}; allowed: {', '.join(map(repr, OPTIMIZERS))}")
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"params.estimator: got {self.estimator!r}; allowed: {', '.join(map(repr, ESTIMATORS))}")
        if self.estimator != "weights" and self.optimizer != "bbb":
            raise ValueError(f"params.estimator: {self.estimator!r} is for optimizer 'bbb' only (vogn draws weights)")
        if not self.prior_precision > 0:
            raise ValueError(f"params.prior_precision: must be > 0, got {self.prior_precision}")
        min_samples = 1 if self.optimizer == "bbb" else 0
        if self.mc_samples < min_samples:
            raise ValueError(f"params.mc_samples: must be >= {min_samples} with optimizer {self.optimizer!r}, "
                             f"got {self.mc_samples}")
        if self.predict_samples < 0:
            raise ValueError(f"params.predict_samples: must be >= 0, got {self.predict_samples}")
        for name in ("lr", "log_var_lr", "clip_radius"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"params.{name}: must be > 0 or null, got {v}")
        if not 0 < self.rho <= 1:
            raise ValueError(f"params.rho: must be in (0, 1], got {self.rho}")
        if not 0 <= self.beta1 < 1:
            raise ValueError(f"params.beta1: must be in [0, 1), got {self.beta1}")
        if self.curvature not in VOGN_CURVATURES:
            raise ValueError(f"params.curvature: got {self.curvature!r}; allowed: {', '.join(map(repr, VOGN_CURVATURES))}")
        if not self.damping >= 0:
            raise ValueError(f"params.damping: must be >= 0, got {self.damping}")
        if self.ml_init_epochs < 0:
            raise ValueError(f"params.ml_init_epochs: must be >= 0, got {self.ml_init_epochs}")
        if self.coreset_size < 0:
            raise ValueError(f"params.coreset_size: must be >= 0, got {self.coreset_size}")
        if self.coreset_kind not in CORESETS:
            raise ValueError(f"params.coreset_kind: got {self.coreset_kind!r}; allowed: {', '.join(map(repr, CORESETS))}")
        if self.coreset_epochs is not None and self.coreset_epochs < 0:
            raise ValueError(f"params.coreset_epochs: must be >= 0 or null, got {self.coreset_epochs}")
        if self.task_start not in TASK_STARTS:
            raise ValueError(f"params.task_start: got {self.task_start!r}; allowed: {', '.join(map(repr, TASK_STARTS))}")
        if self.task_start != "carry" and self.optimizer != "bbb":
            raise ValueError(f"params.task_start: {self.task_start!r} is for optimizer 'bbb' only; allowed with "
                             f"{self.optimizer!r}: 'carry'")


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
        self.active: list[str] = []  # parameters some started task uses (the KL's and the posterior's)
        self.per_task_coresets = False  # multi-head: one fine-tuned copy per task (set by setup)
        self._carried: DiagPosterior | None = None  # q_{t−1} over every parameter (q_0 where inactive)
        self._n_started = 0
        self._train_task: Task | None = None
        self._tasks_override: list[Task] | None = None  # a fine-tuning copy trains on coresets
        self._train: TrainConfig | None = None
        self._predictive: DiagPosterior | None = None  # pooled coreset copy (class / domain)
        self._predictive_heads: dict[int, DiagPosterior] = {}  # per-task copies (task scenario), by head
        self._predict_generator = torch.Generator().manual_seed(seed + 31337)  # predictions draw apart

    # ----- state ---------------------------------------------------------------------------------
    def _blr_values(self) -> dict[str, Any]:
        """Every :class:`BLRParams` field for ``optimizer: vogn``, set here (none left to the BLR's defaults,
        which may change): a diagonal posterior (mean-field VCL), untempered (``ess_factor`` 1,
        ``temperature`` 1: plain sequential Bayes), δ and the task-1 start from VCL's, no BLR-side
        prediction (VCL predicts itself)."""
        p = self.params
        return dict(
            structure="diag",
            prior_precision=p.prior_precision,
            init_precision=math.exp(-p.init_log_variance),
            lr=p.lr if p.lr is not None else 0.1,
            rho=p.rho,
            beta1=p.beta1,
            mc_samples=p.mc_samples,
            ess_factor=1.0,
            predict_samples=0,
            temperature=1.0,
            clip_radius=p.clip_radius,
            curvature=p.curvature,
            precision_debias=p.precision_debias,
            damping=p.damping,
            init_hess=None,  # VCL's own start: q_{t−1} warm, e^{−init_log_variance} for a new head
            fused_step=p.fused_step,
            curvature_every=p.curvature_every,
            carry="average",  # q_t itself is carried (VCL's posterior; the BLR's carried average D̄)
            carry_examples=None,
            noise="gaussian",  # fresh N(0, I) weight samples each step (optim.noise)
            noise_refresh=64,
            task_start_mean="carry",  # VCL starts each task at q_{t−1}'s mean
            kfac_terms="all",  # no Kronecker carry: q_t is mean-field
            coupling_every=1,
            coupling_rank=None,
            coupling_correction_rank=None,
        )

    def blr_params(self) -> BLRParams:
        """The BLR method's parameters for ``optimizer: vogn`` (:meth:`_blr_values`)."""
        return BLRParams(**self._blr_values())

    def setup(self, model: nn.Module, stream: TaskStream | None, train: TrainConfig) -> None:
        super().setup(model, stream, train)
        p = self.params
        self._train = train
        self.per_task_coresets = stream is not None and stream.scenario == "task"
        zeros = {k: torch.zeros_like(v) for k, v in params_of(model).items()}
        self._carried = DiagPosterior(zeros, p.prior_precision)
        self.active = []
        self._n_started = 0
        if p.optimizer == "vogn":
            self._blr = BLRMethod(self.blr_params(), seed=self.seed)
            self._blr.use_likelihood(self.likelihood, self.sigma)
            self._blr.setup(model, stream, train)  # type: ignore[arg-type]
        else:
            log_var = {k: torch.full_like(v, p.init_log_variance) for k, v in zeros.items()}
            self.kl = KLPrior(self._carried, log_var)
            self.kl.set_active([])

    def _complete(self, post: DiagPosterior) -> DiagPosterior:
        """q over every parameter: ``post`` on the active ones, the carried prior's values elsewhere (q_0 on
        parameters no task has used yet)."""
        assert self._carried is not None
        c, active = self._carried, set(self.active)
        return DiagPosterior({k: post.mean[k] if k in active else c.mean[k] for k in c.mean},
                             {k: post.precision[k] if k in active else c.precision[k] for k in c.mean})

    def posterior(self, model: nn.Module) -> DiagPosterior:
        """q_t over every parameter (mean = the model's weights on the active ones; q_0 elsewhere)."""
        if self._blr is not None:
            assert self._blr.optimizer is not None, "setup() must run first"
            return self._complete(self._blr.optimizer.posterior())  # type: ignore[arg-type]
        assert self.kl is not None, "setup() must run first"
        return self.kl.posterior(model)

    def epoch_stats(self) -> dict[str, float]:
        """vogn: the BLR's ``clipped_fraction`` (see :meth:`BLRMethod.epoch_stats`)."""
        return self._blr.epoch_stats() if self._blr is not None else {}

    def prior(self) -> DiagPosterior:
        """q_{t−1}: the prior of the task being trained (q_0 = N(0, δ⁻¹ I) on parameters not yet active)."""
        assert self._carried is not None, "setup() must run first"
        return self._carried

    # ----- the loop's hooks ----------------------------------------------------------------------
    def on_task_start(self, model: nn.Module, task: Task) -> None:
        """ML start of task 1 (optional), activate the task's parameters, hold the coreset out."""
        p = self.params
        assert self._carried is not None and self._train is not None, "setup() must run first"
        if self._n_started == 0 and p.ml_init_epochs > 0:
            self._ml_init(model, task)
        self._n_started += 1
        self._activate(model, task)
        if self._n_started > 1 and p.task_start != "carry":
            self._restart(model)
        if p.coreset_size > 0:
            idx = select_coreset(task.x_train, p.coreset_size, p.coreset_kind, self.generator)
            keep = torch.ones(task.n_train, dtype=torch.bool, device=task.x_train.device)
            keep[idx] = False
            self.coresets.append(_subset(task, idx, f"{task.name}-coreset"))
            self._train_task = _subset(task, keep.nonzero().squeeze(1), task.name)
        else:
            self._train_task = task

    def _ml_init(self, model: nn.Module, task: Task) -> None:
        """Maximum-likelihood training of the means on task 1 (plain likelihood, the train config's
        optimiser, ``ml_init_epochs`` epochs) through the one training loop."""
        assert self._train is not None
        inner = Method(seed=self.seed + 4409)
        inner.use_likelihood(self.likelihood, self.sigma)
        train = dataclasses.replace(self._train, epochs=self.params.ml_init_epochs)
        fit_auxiliary(model, task, inner, train, seen=[task], seed=self.seed + 4409)

    def _activate(self, model: nn.Module, task: Task) -> None:
        """Add the parameters ``task``'s loss uses to the active set; a newly active one enters the KL
        with prior N(0, δ⁻¹) and q started at (its current weight, e^{init_log_variance}).

        vogn: the BLR covers every parameter (as ``BLRMethod`` does, and as the Avalanche plugin expects);
        it is rebuilt here with prior q_{t−1} and a warm start (D = 0) on the active parameters, the start
        precision e^{−init_log_variance} on the new ones, and on the inactive ones the prior N(w, δ⁻¹)
        centred on their own weight w with D = 0. Their data gradient and curvature are 0, so the
        natural-gradient direction ĝ + δ(w − w) and the data part stay 0: they do not move, and their KL
        term KL(N(w, δ⁻¹) ‖ N(w, δ⁻¹)) stays exactly 0 — out of the KL, as in bbb.
        """
        assert self._carried is not None
        self._cover(model)
        names = list(self._carried.mean)
        used = used_parameters(model, task, names)
        new = [k for k in names if k in used and k not in self.active]
        self.active = [k for k in names if k in used or k in self.active]
        if self._blr is not None:
            opt = self._blr.optimizer
            assert opt is not None
            c, active, delta = self._carried, set(self.active), self.params.prior_precision
            weights = dict(model.named_parameters())
            mean = {k: c.mean[k] if k in active else weights[k].detach().clone() for k in names}
            prec = {k: c.precision[k] if k in active else torch.full_like(c.precision[k], delta) for k in names}
            start = math.exp(-self.params.init_log_variance)
            init = {k: torch.full_like(v, start) if k in new else v for k, v in prec.items()}
            opt.rebuild(model, DiagPosterior(mean, prec), DiagPosterior(mean, init))
        else:
            assert self.kl is not None
            with torch.no_grad():
                for k in new:
                    self.kl.log_var[k].fill_(self.params.init_log_variance)
            self.kl.set_active(self.active)

    def _restart(self, model: nn.Module) -> None:
        """``task_start`` other than ``"carry"`` (bbb): q's start for this task moves, its prior does not. Every
        active log σ² is set to ``init_log_variance``; with ``"reinit"`` the active Linear / Conv2d layers' means
        are also redrawn from U(±1/√fan_in) with the method's generator (``blr.redraw_layers``)."""
        assert self.kl is not None
        with torch.no_grad():
            for k in self.active:
                self.kl.log_var[k].fill_(self.params.init_log_variance)
        if self.params.task_start == "reinit":
            redraw_layers(model, set(self.active), self.generator)

    def _cover(self, model: nn.Module) -> None:
        """Extend q_0 (and bbb's log σ²) to trainable parameters that appeared since ``setup`` (e.g. a head an
        Avalanche model added): they enter as not yet active, with q_0 = N(0, δ⁻¹)."""
        assert self._carried is not None
        named = {k: p for k, p in model.named_parameters() if p.requires_grad}
        missing = [k for k in named if k not in self._carried.mean]
        if not missing:
            return
        c = self._carried
        mean = dict(c.mean) | {k: torch.zeros_like(named[k]).detach() for k in missing}
        prec = dict(c.precision) | {k: torch.full_like(named[k], self.params.prior_precision).detach() for k in missing}
        self._carried = DiagPosterior(mean, prec)
        if self.kl is not None:
            self.kl.prior = self._carried
            for k in missing:
                self.kl.log_var[k] = torch.full_like(named[k], self.params.init_log_variance).detach().requires_grad_(True)

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
        named = dict(model.named_parameters())
        return torch.optim.Adam([{"params": [named[k] for k in self.active], "lr": lr},
                                 {"params": [self.kl.log_var[k] for k in self.active], "lr": lv_lr}])

    def loss(self, model: nn.Module, batch: Batch, task: Task) -> Tensor:
        """Bayes-by-backprop: (1/S) Σ_s mean_i ℓ_i(μ + σ ∘ ε_s) + KL(q ‖ q_{t−1}) / N (active parameters;
        the others are not sampled — the task's loss does not use them). With ``estimator: local`` the S
        draws are of each example's pre-activations instead (the same expectation)."""
        assert self.kl is not None, "loss() is the bbb objective; vogn trains through the BLR optimiser"
        mean = params_of(model, self.active, detach=False)
        if self.params.estimator == "local":
            S = self.params.mc_samples
            var = {k: torch.exp(self.kl.log_var[k]) for k in mean}
            out = local_reparam.expected_outputs(model, mean, var, batch.x, S, self.generator,
                                                 {"head": batch.head})
            y = batch.y.repeat(S, *([1] * (batch.y.dim() - 1)))
            nll = mean_nll(out, y, self.likelihood, self.sigma)
            return nll + self.kl.penalty(model, batch, task)  # type: ignore[return-value]
        nll = 0.0
        for _ in range(self.params.mc_samples):
            theta = {}
            for k, m in mean.items():
                eps = torch.randn(m.shape, generator=self.generator, dtype=m.dtype, device=m.device)
                theta[k] = m + torch.exp(0.5 * self.kl.log_var[k]) * eps
            out = functional_call(model, theta, (batch.x,), {"head": batch.head})
            nll = nll + mean_nll(out, batch.y, self.likelihood, self.sigma)
        return nll / self.params.mc_samples + self.kl.penalty(model, batch, task)  # type: ignore[return-value]

    def on_task_end(self, model: nn.Module, task: Task, optimizer: torch.optim.Optimizer | None = None) -> None:
        """q_t becomes the prior; with a coreset, fine-tune copies of q_t for prediction."""
        if self._blr is not None:
            self._blr.on_task_end(model, task, optimizer)
            assert self._blr.optimizer is not None
            self._carried = self._complete(self._blr.optimizer.prior)  # type: ignore[arg-type]
        else:
            assert self.kl is not None
            self.kl.on_task_end(model, task)
            self._carried = self.kl.prior
        self._predictive, self._predictive_heads = None, {}
        epochs = self.params.coreset_epochs
        if not self.coresets or self._tasks_override is not None or epochs == 0:
            return
        if self.per_task_coresets:
            for j, core in enumerate(self.coresets):
                self._predictive_heads[core.head] = self._finetune(model, task, [core], salt=j + 1)
        else:
            self._predictive = self._finetune(model, task, list(self.coresets))

    def _finetune(self, model: nn.Module, task: Task, coresets: list[Task], salt: int = 0) -> DiagPosterior:
        """A copy of q_t trained on ``coresets`` with prior q_t (same objective, N = their total size)
        through the one training loop; returns the copy's q (model and q_t untouched)."""
        assert self._train is not None and self._carried is not None
        epochs = self.params.coreset_epochs if self.params.coreset_epochs is not None else self._train.epochs
        train = dataclasses.replace(self._train, epochs=epochs)
        seed = self.seed + 1009 * (task.task_id + 1) + 7 * salt  # own random streams: the main run is unaffected
        twin = copy.deepcopy(model)
        # the copy starts at q_t whatever this run's task_start: it fine-tunes q_t, it does not start a new task
        inner = VCLMethod(dataclasses.replace(self.params, coreset_size=0, ml_init_epochs=0, task_start="carry"),
                          seed=seed)
        inner.use_likelihood(self.likelihood, self.sigma)
        inner.setup(twin, None, train)
        q_t = self._carried  # on_task_end made q_t the carried prior
        inner._carried = q_t
        # the copy's KL and optimiser cover what the coresets' loss uses (one task's body and head in the
        # task scenario): every other parameter of the copy stays exactly at q_t
        used: set[str] = set()
        for core in coresets:
            used |= used_parameters(twin, core, self.active)
        inner.active = [k for k in self.active if k in used]
        inner._n_started = self._n_started
        # the copy's on_task_start (inside fit_task) starts q at q_t: vogn rebuilds its BLR with prior q_t
        # and D = 0 (no parameter is new to it); bbb starts from the log σ² copied here
        if inner.kl is not None:
            assert self.kl is not None
            inner.kl.prior = q_t
            inner.kl.set_active(inner.active)
            with torch.no_grad():
                for k, v in inner.kl.log_var.items():
                    v.copy_(self.kl.log_var[k])
        inner._tasks_override = list(coresets)
        fit_auxiliary(twin, coresets[-1], inner, train, seen=list(coresets), seed=seed)
        return inner.posterior(twin)

    def _predictive_for(self, model: nn.Module, head: int) -> DiagPosterior:
        if head in self._predictive_heads:
            return self._predictive_heads[head]
        return self._predictive if self._predictive is not None else self.posterior(model)

    def _outputs(self, model: nn.Module, x: Tensor, head: int, fn) -> Tensor:
        """(1/S) Σ_s fn(f(x; θ_s)), θ_s ~ q (the coreset-tuned copy for ``head`` when there is one)."""
        post = self._predictive_for(model, head)
        if self.params.predict_samples == 0:
            return fn(functional_call(model, post.mean, (x,), {"head": head}))
        total = torch.zeros((), dtype=x.dtype, device=x.device)
        for _ in range(self.params.predict_samples):
            theta = post.sample(self._predict_generator)
            total = total + fn(functional_call(model, theta, (x,), {"head": head}))
        return total / self.params.predict_samples

    @torch.no_grad()
    def predict_proba(self, model: nn.Module, x: Tensor, head: int) -> Tensor:
        """(1/S) Σ_s softmax f(x; θ_s), θ_s ~ q (the coreset-tuned copy when there is one)."""
        return self._outputs(model, x, head, lambda f: torch.softmax(f, -1))

    @torch.no_grad()
    def predict_mean(self, model: nn.Module, x: Tensor, head: int) -> Tensor:
        """(1/S) Σ_s f(x; θ_s), θ_s ~ q: the predictive mean of the outputs (regression)."""
        return self._outputs(model, x, head, lambda f: f)

    def memory_stats(self) -> dict[str, Any]:
        """The coresets held out of training (inputs and labels) — VCL's stored examples."""
        return {"stored_examples": sum(c.n_train for c in self.coresets),
                "stored_bytes": sum(int(c.x_train.numel() * c.x_train.element_size()
                                        + c.y_train.numel() * c.y_train.element_size()) for c in self.coresets),
                "points_per_task": self.params.coreset_size}

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"active": list(self.active), "generator": self.generator.get_state(),
                                 "predict_generator": self._predict_generator.get_state(),
                                 # tasks started (the ML start and task_start read it) and the coresets held out so
                                 # far (every later fine-tuning copy trains on all of them)
                                 "n_started": self._n_started,
                                 # (their examples and heads: what fine-tuning reads; a stream's or Avalanche's
                                 # names and class lists are not state)
                                 "coresets": [{"task_id": c.task_id, "x": c.x_train, "y": c.y_train, "head": c.head}
                                              for c in self.coresets]}
        if self._carried is not None:
            state["carried"] = self._carried.state_dict()
        if self._blr is not None:
            state["blr"] = self._blr.state_dict()
        if self.kl is not None:
            state["kl"] = self.kl.state_dict()
        if self._predictive is not None:
            state["predictive"] = self._predictive.state_dict()
        if self._predictive_heads:
            state["predictive_heads"] = {h: q.state_dict() for h, q in self._predictive_heads.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.active = list(state.get("active", self.active))
        self._n_started = int(state.get("n_started", self._n_started))
        if "coresets" in state:
            self.coresets = [Task(int(c["task_id"]), c["x"], c["y"], c["x"][:0], c["y"][:0], (), int(c["head"]),
                                  f"task{int(c['task_id'])}-coreset") for c in state["coresets"]]
        if "generator" in state:  # the random streams: a reloaded VCL draws the samples the saved one would
            self.generator.set_state(state["generator"])
            self._predict_generator.set_state(state["predict_generator"])
        if "carried" in state:
            self._carried = DiagPosterior.from_state_dict(state["carried"])
        if self.kl is not None and "kl" in state:
            self.kl.load_state_dict(state["kl"])
        if self._blr is not None and "blr" in state:
            self._blr.load_state_dict(state["blr"])
        self._predictive = DiagPosterior.from_state_dict(state["predictive"]) if "predictive" in state else None
        self._predictive_heads = {int(h): DiagPosterior.from_state_dict(s)
                                  for h, s in state.get("predictive_heads", {}).items()}
