"""FROMP and its ablations as methods: the functional regulariser of
:mod:`continual_blr.regularizers.functional` trained with the loop's Adam / SGD.

Registry names (``continual_blr.methods.METHODS``), all with :class:`FROMPParams` fields and different
defaults:

| name       | kernel            | selection |
|------------|-------------------|-----------|
| fromp      | classwise (paper) | lambda    |
| frorp      | classwise         | random    |
| fromp-l2   | identity (K = I)  | lambda    |
| fromp-full | full multi-output | lambda    |
| fromp-kron | classwise, Kron Σ | lambda    |

Gradient clipping is the loop's ``train.grad_clip`` (the reference code clips at 0.1 on split MNIST).

Every FROMP-type method (these and ``fromp-replay``) also takes ``output`` (``probs`` | ``logits``),
``jitter_relative`` and ``drop_below`` (kernel health at each rebuild), ``tau_scale`` (τ in the kernel's units;
:mod:`continual_blr.regularizers.functional`), ``context_points`` / ``context_weight`` (the prior read at the
current minibatch too; :mod:`continual_blr.regularizers.context`),
and logs per epoch (``epoch_stats``, the run's ``train_log.csv``) the penalty apart from the rest of the loss:
``data_loss`` and ``penalty`` (their minibatch-size-weighted means over the epoch, which add up to the loop's
``train_loss``), ``data_loss_max`` and ``penalty_max`` (the largest of one step in the epoch: which part rose first
when a run blows up; the data part is the minibatch's loss, without fromp-replay's replay term),
``kernel_dropped`` (memorable points left out at this task's rebuild, summed over the stored tasks)
and ``kernel_min_diag`` (the smallest diagonal of J Σ Jᵀ there; NaN before the first rebuild). ``memory_stats``
(``results.json``) carries every rebuild's per-task record as ``kernel_health``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..data.stream import Task, TaskStream
from ..memory import SELECTIONS, SENSITIVITY_SELECTIONS
from ..regularizers.functional import (
    CLASS_CHOICES,
    FORWARD_PRECISIONS,
    KERNELS,
    OUTPUTS,
    TAU_SCALES,
    TASK_ESTIMATORS,
    FunctionalRegularizer,
)
from ..types import Batch
from .base import Method, TrainConfig, mean_nll

__all__ = ["FROMPParams", "FRORPParams", "FROMPL2Params", "FROMPFullParams", "FROMPKronParams", "FROMPMethod",
           "memory_store_stats", "FunctionalParams", "PenaltyLog"]


def memory_store_stats(reg: FunctionalRegularizer) -> dict[str, Any]:
    """``Method.memory_stats`` of a functional regulariser's store: the memorable points, the bytes of their
    inputs and labels, and ``derived_bytes`` — what was rebuilt from them (old predictions, kernels, factors)."""
    entries = list(reg.memory)
    return {"stored_examples": sum(len(e) for e in entries),
            "stored_bytes": sum(int(e.x.numel() * e.x.element_size() + e.y.numel() * e.y.element_size())
                                for e in entries),
            "derived_bytes": sum(int(t.numel() * t.element_size()) for e in entries for t in e.extras.values()),
            "selection": reg.selection,
            "kernel_health": [[dict(r) for r in rebuild] for rebuild in reg.health]}


class PenaltyLog:
    """The epoch's loss split into the functional penalty and the rest, for ``Method.epoch_stats``.

    Sums Σ_b B_b · data_b and Σ_b B_b · penalty_b over the epoch's steps (B_b the minibatch size, as the loop
    weighs its ``train_loss``), kept on the loss's device (no host synchronisation per step) and read once per
    epoch by :meth:`pop`, together with the kernel health of the regulariser's latest rebuild.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.data: Tensor | float = 0.0
        self.penalty: Tensor | float = 0.0
        self.data_max: Tensor | float = -math.inf
        self.penalty_max: Tensor | float = -math.inf
        self.n = 0

    def add(self, data: Tensor, penalty: Tensor, n: int) -> None:
        d, p = data.detach().float(), penalty.detach().float()
        self.data = self.data + d * n
        self.penalty = self.penalty + p * n
        self.data_max = d if isinstance(self.data_max, float) else torch.maximum(self.data_max, d)
        self.penalty_max = p if isinstance(self.penalty_max, float) else torch.maximum(self.penalty_max, p)
        self.n += int(n)

    def pop(self, reg: FunctionalRegularizer, started: bool) -> dict[str, float]:
        """``data_loss``, ``penalty`` (means over the epoch), ``data_loss_max``, ``penalty_max`` (the largest of one
        step: where a blow-up starts), ``kernel_dropped``, ``kernel_min_diag`` (this task's rebuild, if it had one:
        ``started``); resets the sums."""
        n = max(self.n, 1)
        out = {"data_loss": float(self.data) / n, "penalty": float(self.penalty) / n,
               "data_loss_max": float(self.data_max) if self.n else math.nan,
               "penalty_max": float(self.penalty_max) if self.n else math.nan}
        last = reg.health[-1] if (reg.health and started) else []
        diags = [r["min_diag"] for r in last if r["min_diag"] is not None]
        out["kernel_dropped"] = float(sum(r["dropped_points"] for r in last))
        out["kernel_min_diag"] = float(min(diags)) if diags else math.nan
        self.reset()
        return out


def functional_loss(method: Method, reg: FunctionalRegularizer, log: PenaltyLog, model: nn.Module, batch: Batch,
                    task: Task) -> tuple[Tensor, Tensor]:
    """(1/B) Σ_i ℓ_i + the penalty — the sum ``Method.loss`` forms, in the same order — returned as (that sum, the
    penalty) after adding both parts to ``log``. With ``reg.fused_forward`` the minibatch's outputs and the penalty
    come from one forward pass (:meth:`FunctionalRegularizer.penalty_and_outputs`)."""
    if reg.fused_forward:
        outputs, penalty = reg.penalty_and_outputs(model, batch, task)
        loss = mean_nll(outputs, batch.y, method.likelihood, method.sigma)
    else:
        loss = mean_nll(model(batch.x, head=batch.head), batch.y, method.likelihood, method.sigma)
        penalty = reg.penalty(model, batch, task)
    log.add(loss, penalty, batch.y.shape[0])
    return loss + penalty, penalty


@dataclass
class FunctionalParams:
    """The parameters every FROMP-type method shares (FROMP and its ablations, FROMP with replay).

    Attributes:
        tau: τ, weight of (τ/2) Σ Δpᵀ K⁻¹ Δp relative to the mean cross-entropy (0: no regulariser).
        kernel: ``"classwise"`` | ``"full"`` | ``"kron"`` | ``"identity"`` (FROMP-L2).
        selection: ``"lambda"`` (top tr Λ) | ``"random"`` (FRORP) | ``"lowest"`` | ``"sensitivity"`` (top
            ‖J Σ Jᵀ e‖₁, the memory-perturbation sensitivity, scored in the task-end pass that forms Σ) |
            ``"stratified"`` (one random draw per stratum of the sensitivity range); :mod:`continual_blr.memory`.
        prior_precision: δ in Σ = diag(1 / (F + δ)).
        jitter: ε added to each kernel's diagonal.
        output: ``"probs"`` (the paper: Δp, K over softmax probabilities) | ``"logits"`` (centred logits: no
            λ = p(1 − p) factors; the same τ matches the probability kernel at unsaturated points, τ / C² for
            ``kernel: identity``).
        jitter_relative: r — each kernel's jitter is ε' = max(jitter, r · its largest diagonal) (0: the absolute
            jitter, as the paper).
        drop_below: c — at each rebuild a memorable (point, output) whose kernel diagonal is below c · ε' is left
            out of the penalty; the run log counts them (0: none is).
        classes: single-head class-incremental streams only — compare only a past ``"task"``'s own
            classes at its points (default), or ``"all"`` the head's outputs. With ``"all"`` the
            kernels of classes the task never saw are ≈ εI (p_c ≈ 0 there, so J_{p_c} ≈ 0), K⁻¹ ≈ 1/ε
            forbids any new class from gaining probability at old points, and without replay later tasks
            are not learned (split digits, class scenario: 32 % vs 82 %, benchmarks/results/tables/split_digits.md).
            On real split MNIST both collapse and the order flips (33.2 % vs 28.5 %, split_mnist_class.md);
            with replay of the points' labels ``"all"`` is the better choice there (docs/replay.md).
        chunk_size: examples per pass of the curvature engine (None: its default).
        forward_precision: ``"fp32"`` (default) | ``"train"``: the memorable points' forward and backward in the
            training step's precision (bf16 under ``train.precision: bf16``), everything after the network's outputs
            in fp32 (``FunctionalRegularizer``; cost and error: ``benchmarks/perf/perf_fromp_bf16.py``).
        tasks_per_step: k — each step's penalty is the unbiased estimate (n / k) Σ over k of the n stored past
            tasks, drawn from the method's generator (k·M memorable points through the network per step instead of
            n·M; :mod:`continual_blr.regularizers.functional`); 0 (default, the paper): every stored task.
        task_estimator: with ``tasks_per_step`` — ``"unbiased"`` (default) | ``"saga"`` (the same expectation, a
            table of each task's last penalty gradient lowering its variance; the loop's optimisers only).
        fused_forward: the minibatch and all memorable points in one forward pass (the same function and
            gradient, rounded differently; fewer and larger matrix products); dropout and BatchNorm run their train
            forward on the minibatch's rows and their eval forward on the memorable ones
            (:func:`continual_blr.memory.eval_rows_after`). False (default): the separate passes of the paper.
        tau_scale: ``"none"`` (default, the paper: τ absolute) | ``"kernel"``: each kernel matrix is divided by its
            mean diagonal before its jitter, so τ weighs a unit Δ² at a point of average kernel size whatever the
            posterior's scale ((τ/2) Δᵀ (K/d̄ + ε'I)⁻¹ Δ; not with ``kernel: identity``).
        context_points: n — also read the functional prior at the first n rows of each minibatch, against the
            network frozen at the task's start, each past task's outputs weighed by 1 / (its kernel's mean diagonal)
            without covariances: ``(τ w / 2) Σ_s Σ_c Σ_x Δo² / d̄_{s,c}`` (S-FSVI's context points;
            :mod:`continual_blr.regularizers.context`). 0 (default, the paper): memorable points only.
        context_weight: w in the context term (default 1).
    """

    tau: float = 10.0
    kernel: str = "classwise"
    selection: str = "lambda"
    prior_precision: float = 1e-3
    jitter: float = 1e-6
    classes: str = "task"
    chunk_size: int | None = None
    output: str = "probs"
    jitter_relative: float = 0.0
    drop_below: float = 0.0
    forward_precision: str = "fp32"
    tasks_per_step: int = 0
    task_estimator: str = "unbiased"
    fused_forward: bool = False
    tau_scale: str = "none"
    context_points: int = 0
    context_weight: float = 1.0

    def __post_init__(self) -> None:
        """One-line ``ValueError`` naming the field and what is allowed."""
        if self.kernel not in KERNELS:
            raise ValueError(f"params.kernel: got {self.kernel!r}; allowed: {', '.join(map(repr, KERNELS))}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"params.selection: got {self.selection!r}; allowed: {', '.join(map(repr, SELECTIONS))}")
        if self.selection in SENSITIVITY_SELECTIONS and self.kernel == "kron":
            raise ValueError(f"params.selection: {self.selection!r} needs a diagonal Σ; with kernel 'kron' allowed: "
                             "'lambda', 'random', 'lowest'")
        if self.classes not in CLASS_CHOICES:
            raise ValueError(f"params.classes: got {self.classes!r}; allowed: {', '.join(map(repr, CLASS_CHOICES))}")
        if not self.tau >= 0:
            raise ValueError(f"params.tau: must be >= 0, got {self.tau}")
        if not self.prior_precision > 0:
            raise ValueError(f"params.prior_precision: must be > 0, got {self.prior_precision}")
        if not self.jitter >= 0:
            raise ValueError(f"params.jitter: must be >= 0, got {self.jitter}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"params.chunk_size: must be >= 1 or null, got {self.chunk_size}")
        if self.output not in OUTPUTS:
            raise ValueError(f"params.output: got {self.output!r}; allowed: {', '.join(map(repr, OUTPUTS))}")
        if self.forward_precision not in FORWARD_PRECISIONS:
            raise ValueError(f"params.forward_precision: got {self.forward_precision!r}; allowed: "
                             f"{', '.join(map(repr, FORWARD_PRECISIONS))}")
        if isinstance(self.tasks_per_step, bool) or not isinstance(self.tasks_per_step, int) \
                or self.tasks_per_step < 0:
            raise ValueError(f"params.tasks_per_step: must be an integer >= 0 (0: every stored task), got "
                             f"{self.tasks_per_step!r}")
        if self.task_estimator not in TASK_ESTIMATORS:
            raise ValueError(f"params.task_estimator: got {self.task_estimator!r}; allowed: "
                             f"{', '.join(map(repr, TASK_ESTIMATORS))}")
        if not isinstance(self.fused_forward, bool):
            raise ValueError(f"params.fused_forward: must be true or false, got {self.fused_forward!r}")
        if self.fused_forward and self.task_estimator == "saga":
            raise ValueError("params.fused_forward: not with task_estimator 'saga' (its per-task gradients need one "
                             "pass per drawn task); allowed with task_estimator 'unbiased'")
        if self.tau_scale not in TAU_SCALES:
            raise ValueError(f"params.tau_scale: got {self.tau_scale!r}; allowed: {', '.join(map(repr, TAU_SCALES))}")
        if self.tau_scale == "kernel" and self.kernel == "identity":
            raise ValueError("params.tau_scale: 'kernel' needs a kernel to take the scale of; with kernel 'identity' "
                             "(FROMP-L2) allowed: 'none'")
        if isinstance(self.context_points, bool) or not isinstance(self.context_points, int) \
                or self.context_points < 0:
            raise ValueError(f"params.context_points: must be an integer >= 0 (0: none), got {self.context_points!r}")
        if not (isinstance(self.context_weight, (int, float)) and self.context_weight >= 0
                and math.isfinite(self.context_weight)):
            raise ValueError(f"params.context_weight: must be a finite number >= 0, got {self.context_weight!r}")
        if self.context_points and (self.fused_forward or self.task_estimator == "saga"):
            raise ValueError("params.context_points: not with fused_forward or task_estimator 'saga'; allowed: 0, "
                             "or the separate passes with task_estimator 'unbiased'")
        for name in ("jitter_relative", "drop_below"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"params.{name}: must be a finite number >= 0, got {v}")


@dataclass
class FROMPParams(FunctionalParams):
    """Parameters of FROMP (defaults: the reference code's split-MNIST protocol); the shared ones in
    :class:`FunctionalParams`.

    Attributes:
        n_points: memorable points per task (split evenly over its classes).
    """

    n_points: int = 40

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_points < 1:
            raise ValueError(f"params.n_points: must be >= 1, got {self.n_points}")


@dataclass
class FRORPParams(FROMPParams):
    """FRORP: FROMP with memorable points drawn at random per class (seeded)."""

    selection: str = "random"


@dataclass
class FROMPL2Params(FROMPParams):
    """FROMP-L2: the kernel replaced by the identity, (τ/2) Σ ‖Δp‖²."""

    kernel: str = "identity"


@dataclass
class FROMPFullParams(FROMPParams):
    """FROMP with the full multi-output kernel (cross-class terms kept)."""

    kernel: str = "full"


@dataclass
class FROMPKronParams(FROMPParams):
    """FROMP with a Kronecker-factored (K-FAC) weight covariance Σ."""

    kernel: str = "kron"


class FROMPMethod(Method):
    """Functional regularisation of the memorable past with the loop's Adam / SGD."""

    name = "fromp"

    def __init__(self, params: FROMPParams | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.params = params or FROMPParams()
        kw = asdict(self.params)
        self.regularizer: FunctionalRegularizer = FunctionalRegularizer(**kw, generator=self.generator)
        self.penalty_log = PenaltyLog()
        self._rebuilt = False

    def setup(self, model: nn.Module, stream: TaskStream, train: TrainConfig) -> None:
        """Start from an empty memory; single-head class-incremental streams may restrict the columns."""
        self.regularizer.reset()
        self.regularizer.class_incremental = stream.scenario == "class"

    def on_task_start(self, model: nn.Module, task: Task) -> None:
        """Rebuild the kernels (the regulariser's hook) and start the epoch's penalty log afresh."""
        self.penalty_log.reset()
        self._rebuilt = len(self.regularizer.memory) > 0
        super().on_task_start(model, task)

    def loss(self, model: nn.Module, batch: Batch, task: Task) -> Tensor:
        """(1/B) Σ_i ℓ_i + (τ/2) Σ Δᵀ K⁻¹ Δ, as ``Method.loss``; both parts go to the epoch's log."""
        return functional_loss(self, self.regularizer, self.penalty_log, model, batch, task)[0]

    def epoch_stats(self) -> dict[str, float]:
        """``data_loss``, ``penalty``, ``kernel_dropped``, ``kernel_min_diag`` (module docstring)."""
        return self.penalty_log.pop(self.regularizer, self._rebuilt)

    def memory_stats(self) -> dict[str, Any]:
        return memory_store_stats(self.regularizer) | {"points_per_task": self.params.n_points}
