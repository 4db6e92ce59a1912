"""Online Laplace (Ritter et al. 2018): the Laplace posterior after task t is the prior of task t+1.

With S_0 = δ I, m_0 = 0, and C_t the GGN of the summed loss Σ_i ℓ_i of task t at its MAP θ*_t:

    task t:   θ*_t = argmin_θ  (1/N_t) Σ_i ℓ_i(θ) + (1/(2 N_t)) (θ − m_{t−1})ᵀ S_{t−1} (θ − m_{t−1})
    then:     m_t = θ*_t,      S_t = S_{t−1} + C_t / T

The penalty is the negative log prior divided by N_t because the loop minimises the *mean* loss (so
the objective is (1/N_t) × the negative log joint and its minimiser is the MAP). T is a tempering
factor on the curvature: T = 1 is sequential Bayes under the Laplace approximation; T < 1 sharpens
the carried posterior (Ritter et al.'s λ = 1/T). Structures of S (``structure``):

* ``diag``: S = δI + Σ_t diag(C_t)/T — the exact diagonal of the GGN, off-diagonals dropped.
* ``kron``: per Linear/Conv2d layer S = δI + Σ_t (A_t ⊗ G_t)/T with K-FAC factors
  A_t = (1/N_t) Σ_i ã_i ã_iᵀ, G_t = Σ_i Σ_c g_ic g_icᵀ (``continual_blr.curvature``); the sum over tasks
  is kept term by term (the penalty only needs S v), cross-layer blocks are dropped. Exact for one
  example through a layer; otherwise K-FAC's E[ããᵀ ⊗ ggᵀ] ≈ E[ããᵀ] ⊗ E[ggᵀ].
* ``full``: S = δI + Σ_t C_t/T dense — exact, for small models or ``subset: last_layer``.

``subset: last_layer`` keeps the Gaussian over the output layer only (all heads of a multi-head
network); the body is then trained without a penalty. The penalty is the shared
:class:`~continual_blr.regularizers.weight_space.GaussianPrior`.

**Predictive** (``predictive``). ``map`` (default): softmax(f(x; `θ*_t`)), the network's own prediction. ``glm``: the
linearised (GLM) predictive of the carried posterior N(`θ*_t`, S_t⁻¹) with the probit approximation, logit by logit,

    p(y = k | x) ≈ softmax_k( f_k(x; θ*_t) / sqrt(1 + (π/8) · [J(x) S_t⁻¹ J(x)ᵀ]_kk ),

the variant laplace-torch 0.3 uses for ``pred_type='glm', link_approx='probit'`` (``kappa = 1/sqrt(1 + π/8 ·
diag(f_var))``, then ``softmax(kappa · f_mu)``). Σ = S_t⁻¹ as carried, S_t = δI + Σ_t C_t / T: the same as
laplace-torch's posterior precision H/T + δ with ``temperature=T`` (σ = 1). J from per-example ``torch.func``
Jacobians; S_t⁻¹ applied by the posterior (diagonal, Kronecker: no P×P matrix;
:mod:`continual_blr.posteriors.predictive`). Regression is unchanged (the GLM predictive mean is f(x; `θ*_t`)).

**Marginal-likelihood δ** (``marglik``). At the end of every task the prior precision `δ̂_t` that maximises the
Laplace evidence of all data seen so far is found, with `θ*_t` and H_t = Σ_{s≤t} C_s / T held fixed:

    log p(D_1:t | δ) ≈ log p(D_1:t | θ*_t) − ½ δ ‖θ*_t‖² + ½ P log δ − ½ log det(H_t + δI)

(m_0 = 0; one root of γ(δ) = δ ‖`θ*_t`‖², γ = Σ_i λ_i/(λ_i + δ) over the eigenvalues λ_i of H_t, from its diagonal /
Kronecker / dense structure; :mod:`continual_blr.posteriors.marglik`). ``report`` (default): recorded per task in
``results.json`` (``memory.marglik_prior_precision``, one δ̂ per finished task), nothing else changes. ``use``: the
carried posterior's δ is replaced by `δ̂_t` (`S_t = δ̂_t I + H_t`), which the next task's penalty and the GLM predictive
then use; a δ̂ of 0 or ∞ (no curvature, or `θ*_t` = 0) keeps the δ before it. ``off``: not computed.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..data.stream import Task, TaskStream
from ..posteriors import DiagPosterior, FullPosterior, GaussianPosterior, KronPosterior
from ..posteriors.marglik import marglik_prior_precision
from ..posteriors.predictive import PREDICTIVES, for_prediction, glm_logit_variance, probit_softmax
from ..regularizers.weight_space import GaussianPrior
from ..types import Curvature, Structure, parse_enum
from .base import Method, TrainConfig

__all__ = ["LaplaceParams", "LaplaceMethod", "SUBSETS", "PREDICTIVES", "MARGLIK", "DEFAULT_TEMPERATURE"]

SUBSETS = ("all", "last_layer")
# the temperature when ``LaplaceParams.temperature`` is None, by head layout (LaplaceParams' docstring: how chosen)
DEFAULT_TEMPERATURE = {"other": 0.01, "single_head_class": 0.002}
MARGLIK = ("off", "report", "use")


@dataclass
class LaplaceParams:
    """Parameters of online Laplace.

    Defaults: δ = 1e-6, and a temperature that depends on the head layout (``temperature: None``): T = 0.01 on
    multi-head (task-incremental) and domain-incremental streams, T = 0.002 on single-head class-incremental ones
    (:data:`DEFAULT_TEMPERATURE`). Both were chosen on validation splits of split digits in the README quickstart's
    form: T 0.01 in ``benchmarks/results/search/search_defaults_split_digits.md``; T 0.002 for the class scenario in
    ``search_defaults_laplace_class_temperature.md`` (fresh validation seeds 10-19: 47.1 against none's 11.6, after
    ``search_defaults_laplace_temperature.md`` found no single T above ``none`` in both scenarios). On one shared head
    every new class's gradient lowers the old classes' logits at old inputs, and only a colder prior holds them; a
    head per task receives no gradient from later tasks. A δ of order 1 is not harmless under Adam: once a task's
    data gradient has vanished, Adam rescales the prior's small pull toward 0 into steps of size lr (δ = 1: 88.9
    against none's 95.9 in the task scenario, with no carried curvature at all).

    Attributes:
        structure: ``"diag"``, ``"kron"`` (K-FAC) or ``"full"`` (small models / last layer).
        prior_precision: δ of the first prior N(0, δ⁻¹ I).
        temperature: T; the carried precision adds C_t / T (T < 1: a colder, stronger prior; None, the default: T
            0.01, or 0.002 on a single-head class-incremental stream, resolved at ``setup`` by :meth:`temperature_for`).
        curvature: ``"ggn"`` (default), ``"empirical_fisher"`` or ``"mc_fisher"``.
        subset: ``"all"`` parameters or the ``"last_layer"``.
        predictive: ``"map"`` (the network's softmax) or ``"glm"`` (linearised, probit; module docstring).
        marglik: the evidence-maximising δ per task: ``"off"``, ``"report"`` (recorded only) or ``"use"`` (it
            becomes the carried posterior's δ); module docstring.
    """

    structure: str = "kron"
    prior_precision: float = 1e-6
    temperature: float | None = None
    curvature: str = "ggn"
    subset: str = "all"
    predictive: str = "map"
    marglik: str = "report"

    def __post_init__(self) -> None:
        parse_enum(Structure, self.structure, "params.structure")
        if not self.prior_precision > 0:
            raise ValueError(f"params.prior_precision: must be > 0, got {self.prior_precision}")
        if self.temperature is not None and not (isinstance(self.temperature, (int, float))
                                                 and not isinstance(self.temperature, bool)
                                                 and 0 < self.temperature < math.inf):
            raise ValueError(f"params.temperature: must be a finite number > 0, or null (the default of the stream's "
                             f"head layout), got {self.temperature!r}")
        c = parse_enum(Curvature, self.curvature, "params.curvature")
        if c == Curvature.HESSIAN:
            raise ValueError("params.curvature: allowed: 'ggn', 'empirical_fisher', 'mc_fisher'")
        if self.subset not in SUBSETS:
            raise ValueError(f"params.subset: got {self.subset!r}; allowed: {', '.join(map(repr, SUBSETS))}")
        if self.predictive not in PREDICTIVES:
            raise ValueError(f"params.predictive: got {self.predictive!r}; allowed: "
                             f"{', '.join(map(repr, PREDICTIVES))}")
        if self.marglik not in MARGLIK:
            raise ValueError(f"params.marglik: got {self.marglik!r}; allowed: {', '.join(map(repr, MARGLIK))}")

    def temperature_for(self, scenario: str) -> float:
        """T on a stream of this scenario: the set ``temperature``, else :data:`DEFAULT_TEMPERATURE` of its head
        layout (``"class"``: one head over all classes; ``"task"`` and ``"domain"``: the rest)."""
        if self.temperature is not None:
            return float(self.temperature)
        return DEFAULT_TEMPERATURE["single_head_class" if scenario == "class" else "other"]


class LaplaceMethod(Method):
    """Online Laplace: Adam on (1/N_t)·(negative log joint); posterior → prior (module docstring)."""

    name = "laplace"

    def __init__(self, params: LaplaceParams | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.params = p = params or LaplaceParams()
        self.regularizer = GaussianPrior(
            structure=p.structure, curvature=p.curvature, mode="online", scale=1.0, divide_by_n=True,
            curvature_scale=1.0 / p.temperature_for("task"), prior_precision=p.prior_precision,
            param_names="last_layer" if p.subset == "last_layer" else None, generator=self.generator,
        )

        self.temperature = p.temperature_for("task")  # resolved again for the stream at setup
        self.delta = p.prior_precision  # the δ inside the carried precision (changes only with marglik: use)
        self.marglik_deltas: list[float] = []  # δ̂ of each finished task (marglik: report / use)
        self._predictive: tuple[GaussianPosterior, GaussianPosterior] | None = None  # (carried, prepared) cache

    def setup(self, model: nn.Module, stream: TaskStream, train: TrainConfig) -> None:
        """Resolve the temperature for the stream's head layout (no stream: not a class-incremental one), then start
        from the first prior."""
        self.temperature = self.params.temperature_for(getattr(stream, "scenario", "task"))
        self.regularizer.curvature_scale = 1.0 / self.temperature
        self.regularizer.setup(model)
        self.delta = self.params.prior_precision
        self.marglik_deltas = []

    def posterior(self, model: nn.Module | None = None) -> GaussianPosterior | None:
        """The carried Laplace posterior N(m_t, S_t⁻¹) (``model`` unused; see :meth:`BLRMethod.posterior`)."""
        return self.regularizer.posterior()

    def on_task_end(self, model: nn.Module, task: Task, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Fold the task into the posterior; then the marginal-likelihood δ̂ (module docstring)."""
        super().on_task_end(model, task, optimizer)
        post = self.posterior()
        if self.params.marglik == "off" or post is None:
            return
        delta = marglik_prior_precision(post, self.delta)
        self.marglik_deltas.append(delta)
        if self.params.marglik != "use":
            return
        if not 0 < delta < math.inf:
            warnings.warn(f"laplace: the marginal-likelihood δ of task {task.task_id} is {delta}; keeping δ = "
                          f"{self.delta}", RuntimeWarning, stacklevel=2)
            return
        self.regularizer.set_prior(_with_delta(post, self.delta, delta))
        self.delta = delta

    @torch.no_grad()
    def predict_proba(self, model: nn.Module, x: Tensor, head: int) -> Tensor:
        """``map``: softmax(f(x; θ)); ``glm``: the probit GLM predictive of the carried posterior (module docstring),
        linearised at the model's weights (`θ*_t` after a task)."""
        post = self.posterior() if self.params.predictive == "glm" else None
        if post is None:
            return super().predict_proba(model, x, head)
        if self._predictive is None or self._predictive[0] is not post:
            self._predictive = (post, for_prediction(post))
        f, var = glm_logit_variance(model, self._predictive[1], x, head=head)
        return probit_softmax(f, var).to(x.dtype if x.is_floating_point() else f.dtype)

    def memory_stats(self) -> dict[str, Any]:
        """No stored examples; ``temperature``: the T the run used (the head layout's default when the params say
        None); ``marglik_prior_precision``: δ̂ of each finished task (unless ``marglik: off``)."""
        stats = super().memory_stats() | {"temperature": self.temperature}
        if self.params.marglik != "off":
            stats["marglik_prior_precision"] = list(self.marglik_deltas)
        return stats

    def state_dict(self) -> dict[str, Any]:
        """Also δ and the δ̂ per task, as float64 tensors (compared with a tolerance, as FROMP's health records: a
        data-parallel run's curvature, hence δ̂, may differ from one process's in the last bits)."""
        return super().state_dict() | {"delta": torch.tensor(self.delta, dtype=torch.float64),
                                       "marglik_deltas": torch.tensor(self.marglik_deltas, dtype=torch.float64)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.delta = float(state.get("delta", self.params.prior_precision))  # absent in files from before marglik
        self.marglik_deltas = [float(d) for d in state.get("marglik_deltas", [])]


def _with_delta(post: GaussianPosterior, old: float, new: float) -> GaussianPosterior:
    """The posterior with precision S − old·I + new·I (the prior's δ replaced; the curvature kept)."""
    if isinstance(post, KronPosterior):
        return KronPosterior(post.mean, post.blocks, post.diag, new)
    if isinstance(post, DiagPosterior):
        return DiagPosterior(post.mean, {k: s + (new - old) for k, s in post.precision.items()})
    if isinstance(post, FullPosterior):
        eye = torch.eye(post.precision.shape[0], dtype=post.precision.dtype, device=post.precision.device)
        return FullPosterior(post.mean, post.precision + (new - old) * eye)
    raise TypeError(f"unsupported posterior type {type(post).__name__}")
