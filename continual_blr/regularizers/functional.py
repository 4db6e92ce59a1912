"""Functional regularisation of the memorable past: FROMP, FRORP and FROMP-L2 (Pan et al., NeurIPS 2020).

The past enters the loss through the network's outputs at a few memorable inputs per past task, not
through its weights. With the DNN2GP view (Khan et al. 2019; :mod:`continual_blr.dnn2gp`) a network
with a Gaussian posterior N(θ_t, Σ) over its weights is a GP over its softmax outputs with mean
p_t(x) and kernel K(x, x') = Λ(x) J(x) Σ J(x')ᵀ Λ(x') = J_p(x) Σ J_p(x')ᵀ (J_p = ∂p/∂θ). Keeping the
function close to that GP prior at the memorable points gives, per minibatch,

    loss(θ) = mean_i ℓ(f_θ(x_i), y_i) + (τ/2) Σ_{s<t} Σ_c Δp_{s,c}ᵀ K_{s,c}⁻¹ Δp_{s,c},
    Δp_{s,c} = p_c(X_s; θ) − p_c(X_s; θ_{t−1})   (the M_s memorable points X_s of task s, class c).

Protocol (the reference code ``team-approx-bayes/fromp``; ``docs/anchors.md``):

* Σ = diag(1 / (F + δ)), F = Σ over **all past training data** of diag(J_fᵀ Λ J_f) — the diagonal GGN
  with logit Jacobians J_f and Λ = diag(p) − ppᵀ, computed at the end of each task with that task's
  weights and accumulated over tasks (not decayed);
* at the **start** of each task, with the current weights and the model in eval mode: the old
  predictions p(X_s; θ_{t−1}) and one kernel per (past task, class) K_{s,c} = J_{p_c} Σ J_{p_c}ᵀ + εI
  from the Jacobians of the softmax probabilities (cross-class terms dropped); their Cholesky factors
  are computed there once (in float64);
* the memorable points of task s are evaluated on task s's head (multi-head). On the single head of a
  class-incremental stream the comparison covers only task s's classes (``classes="task"``, the
  default; the probabilities are still the softmax over the whole head, restricted to those columns)
  or all the head's outputs (``classes="all"``). With ``"all"``, the classes task s never saw have
  p_c ≈ 0 at its points, so J_{p_c} ≈ 0, K_{s,c} ≈ εI, and any probability a new class gains there
  costs ~1/ε: later tasks are not learned. Multi-head and domain-incremental streams always compare
  the whole head (there the head's classes are the task's).

Kernel variants (``kernel=``):

* ``"classwise"`` — the paper / reference code (above).
* ``"full"`` — the full multi-output kernel K_s[(m,c),(n,d)] = J_{p_c}(x_m) Σ J_{p_d}(x_n)ᵀ. The softmax
  outputs sum to one, so J_p's rows at a point sum to zero and the full kernel over all C outputs is
  singular; it is built on the first C−1 outputs (the last is determined by them). This is exactly the
  ε → 0 limit of the full C-output form with jitter (Δp is orthogonal to the null space), i.e.
  Δpᵀ K_full⁺ Δp, without dividing by ε. With ``classes="task"`` the columns do not sum to one and all
  are kept. For a 2-way head it equals half the classwise penalty (K_0 = K_1, Δp_1 = −Δp_0).
* ``"kron"`` — classwise kernels with a Kronecker-factored Σ per Linear/Conv2d layer: the K-FAC
  factors of all past data pooled (A the mean of ããᵀ over all past examples that reached the layer,
  G the sum of the output-gradient outer products; ``curvature(structure="kron")``), damped as in
  Martens & Grosse (2015, Sec. 6.3) / Ritter et al. (2018): Σ_layer = (A + π√δ I)⁻¹ ⊗ (G + √δ/π I)⁻¹,
  π = √((tr A / dim A) / (tr G / dim G)). Σ is then exactly Kronecker (the engine's fast path); it
  approximates (A ⊗ G + δ I)⁻¹. Parameters outside such layers keep the diagonal 1/(F + δ).
* ``"identity"`` — FROMP-L2: K = I, the penalty is (τ/2) Σ_s ‖Δp_s‖² over all compared outputs; no
  curvature is computed.

Selection (``selection=``): ``"lambda"`` (FROMP: top tr Λ per class), ``"random"`` (FRORP),
``"lowest"`` (ablation), ``"sensitivity"`` (top memory-perturbation sensitivity ‖J Σ Jᵀ e‖₁ per class) and
``"stratified"`` (one random draw per stratum of the sensitivity range) — see :mod:`continual_blr.memory`. The
sensitivity needs Σ = diag(1 / (F + δ)) with the task just ended in F: it is computed in the pass that
accumulates F at the task's end (identity cotangents: the GGN diagonal and the per-example J Σ Jᵀ from one
backward; :mod:`continual_blr.curvature.prediction_covariance`), so the selection adds no Jacobian pass. With
``kernel="identity"`` no Σ is formed; the pass is then a diagonal GGN pass over the task's data, Σ its own
(F₀ = 0). ``kernel="kron"`` takes no sensitivity selection (its Σ is not diagonal).

Compared outputs (``output=``):

* ``"probs"`` — the paper: Δp and K over the softmax probabilities (above).
* ``"logits"`` — Δ and K over the **centred logits** f̃ = f − (1/C) Σ_c f_c of the C compared outputs (the logits
  up to the shift softmax ignores): `Δf̃_{s,c} = f̃_c(X_s; θ) − f̃_c(X_s; θ_{t−1})`, `K_{s,c} = J_{f̃_c} Σ J_{f̃_c}ᵀ + εI` —
  no λ = p(1 − p) factors, so a point the network has become certain of keeps its kernel diagonal and its
  gradient. τ is rescaled so that the penalty equals the probability kernel's at unsaturated points:
  J_p = Λ J_f with Λ = diag(p) − ppᵀ = Λ P (P the centring map, f̃ = P f), so in the linearised regime
  Δp = Λ Δf̃ and, for any invertible A, (AΔ)ᵀ (A K Aᵀ)⁻¹ (AΔ) = Δᵀ K⁻¹ Δ. Hence, with ε → 0,

        2-way head (any p):      Δp_cᵀ K_{p,c}⁻¹ Δp_c = Δm²/G = Δf̃_cᵀ K_{f̃,c}⁻¹ Δf̃_c    (m = f_0 − f_1, Λ = λ·[[1,−1],[−1,1]])
        C-way head at p = 1/C:   Λ = P / C,  Δp_c = Δf̃_c / C,  K_{p,c} = K_{f̃,c} / C²  → the same quadratic form,

  so for the kernel-weighted penalties (``classwise``, ``full``, ``kron``) the matching τ is **the same τ**
  (scale s = 1), exactly for 2-way heads and at the uniform prediction of a C-way head, approximately between.
  FROMP-L2 has no kernel to absorb the scale: ‖Δp‖² = ‖Δf̃‖² / C² at p = 1/C, so its logit penalty is
  (τ s / 2) Σ_s ‖Δf̃_s‖² with s = 1 / C² (C compared outputs). At a saturated point the two differ as intended:
  Δp² / (λ² G + ε) → Δp² / ε (up to τ/ε per unit Δp², with a gradient ∝ λ → 0: the plateau of a flipped
  point), while Δf̃² / (G + ε) stays the GP's own weight, quadratic in the logit change with a gradient that does
  not vanish. On a class-incremental head (``classes="task"``) the logits are centred over the task's own columns,
  so the logits later classes gain there do not enter the penalty (the probabilities' softmax over the whole head
  does); the rescaling is then approximate.

Kernel health at every rebuild (``jitter_relative=``, ``drop_below=``; both off by default, today's kernels). Per
kernel matrix (one per past task and class; one per task for ``full``) with diagonal d_i = (J Σ Jᵀ)_ii:

    ε' = max(ε, r · max_i d_i)             (r = ``jitter_relative``: the jitter follows the kernel's scale,
                                             floored at the absolute ε)
    point i kept  ⇔  d_i ≥ c · ε'          (c = ``drop_below``: 0 keeps every point)

A dropped (point, output) is left out of the penalty — its row and column of K are replaced by the identity's and
its Δ by 0, so the penalty is exactly (τ/2) Δ_keptᵀ (K_kept + ε'I)⁻¹ Δ_kept over the kept ones — instead of being
weighed by up to 1/ε' per unit Δ² with a Jacobian that has vanished. It stays in the memory (and in
``fromp-replay``'s replay of labels); the next rebuild, at new weights, checks it again. Every rebuild appends to
:attr:`FunctionalRegularizer.health` one record per stored task: its points, the points with a dropped output,
the (point, output) pairs dropped, the smallest and largest d_i and the largest ε' used.

τ in the kernel's units (``tau_scale=``). With ``"none"`` (the default, the paper) τ is absolute, so the penalty's
strength follows the kernel's scale: K = J Σ Jᵀ grows with Σ, and on a memorised task the logit kernel's diagonal
is 10⁵-10⁶ (Σ ≈ I/δ where the GGN has vanished) against the probability kernel's 10⁻¹-10³, so one τ means very
different pulls on different tasks and networks. With ``"kernel"`` each kernel matrix is first divided by its mean
diagonal d̄ = (1/n) tr K (one d̄ per matrix: per past task and class, per task for ``full``):

    (τ/2) Δᵀ (K / d̄ + ε'I)⁻¹ Δ  =  (τ d̄ / 2) Δᵀ (K + ε' d̄ I)⁻¹ Δ,

so τ is the weight per unit Δ² of a point of average kernel size, the jitter and the health rules apply to the
normalised kernel (ε and r relative to d̄), and the penalty does not change when Σ is multiplied by any constant.
The kernel's shape (which points and outputs are correlated, which are confident) is kept; only its size is
factored out. Not with ``kernel="identity"`` (it has no size). The health record holds d̄'s range as
``kernel_scale``.

Normalisation statistics (``norm_statistics``, set by the loop under ``train.batchnorm: per_task``; see
:class:`~continual_blr.memory.NormStatistics`): the old outputs, the kernels and the penalty's forward over task
s's memorable points run on the BatchNorm running statistics task s ended with, not on those the current task's
train-mode batches keep overwriting (then each stored task is its own forward). Without it (``shared``, the
default) they read the network's current statistics, as the reference code does.

Past tasks per step (``tasks_per_step=k``; 0, the default and the paper, uses all). With n stored tasks and
k < n, each step draws a set S of k of them uniformly without replacement (the regulariser's ``torch.Generator``)
and forms

    R̂(θ) = (n / k) · (τ/2) Σ_{s∈S} Σ_c Δp_{s,c}ᵀ K_{s,c}⁻¹ Δp_{s,c},

an unbiased estimate of the penalty and of its gradient: each task is in S with probability k / n, so
E_S[R̂] = (τ/2) Σ_s Σ_c Δp_{s,c}ᵀ K_{s,c}⁻¹ Δp_{s,c} (the same argument as a minibatch estimate of the data term).
The step then passes k·M memorable points forward and backward instead of n·M. The estimate's variance grows with
n / k; whether training loses accuracy for it is a question for validation (docs/fromp.md).

``task_estimator="saga"`` keeps the estimate unbiased but cuts its variance (SAGA, Defazio et al. 2014, over the n
per-task penalties): a table holds, per stored task, the gradient ĝ_s of its penalty when it was last drawn (0 at the
task's start, where every Δp = 0 and so every gradient is exactly 0), and the step's gradient is

    v = (n / k) Σ_{s∈S} (∇R_s(θ) − ĝ_s) + Σ_{s=1..n} ĝ_s,      then ĝ_s ← ∇R_s(θ) for s ∈ S,

with E_S[v] = ∇R(θ) for any table. Each past task pulls in every step (through its last gradient) instead of once
in n steps with weight n, whose spikes an Adam-type optimiser damps. The loss term it returns has the value of the
plain estimate and the gradient v. It needs the fresh per-task gradients, one ``torch.autograd.grad`` per drawn task,
so it is for the loop's optimisers (the model's parameters), not for ``params=`` closures.

Speed: a training step runs one forward (and, through autograd, one backward) over the memorable
points of each distinct head, then Σ_c ‖L_c⁻¹ Δp_c‖² with the precomputed Cholesky factors — no Jacobian of the
memorable points is formed in the step; the gradient Σ_c J_{p_c}ᵀ K_c⁻¹ Δp_c (times τ) is the
vector-Jacobian product autograd computes. That makes the regulariser a plain loss term: it composes
with any optimiser (Adam, SGD, the BLR optimisers through ``penalty(..., params=...)``, IVON).

One pass (``fused_forward=True``, :meth:`FunctionalRegularizer.penalty_and_outputs`): the minibatch and the memorable
points of every head go through the network together — the rows concatenated, the shared body run once, each block
through its own head (:func:`~continual_blr.memory.forward_parts`) — so a step runs one forward and one backward
instead of 1 + (distinct heads). The loss and its gradient are the same function; only the rounding of the summed
matrix products differs. On an MLP whose step is bound by its matrix products the extra work of the penalty is then
close to its floor, the memorable rows' share of the products (the penalty's own small operations aside). The
penalty's points are evaluated in eval mode and the minibatch in train mode, so within the pass every dropout and
BatchNorm module runs its train-mode forward on the minibatch's rows and its eval-mode forward on the rest
(:func:`~continual_blr.memory.eval_rows_after`): dropout draws its mask for the minibatch's rows only (the draws of
the minibatch's own pass) and passes the rest unchanged; BatchNorm normalises the minibatch by its batch statistics,
updates the running ones, and normalises the rest by those, as the separate eval pass after the minibatch's does.
Any other module whose mode is not known, in-place dropout and BatchNorm without running statistics are refused
(one-line error); so is ``train.batchnorm: per_task`` (each stored task on its own statistics).

Evaluation mode: the penalty's forward over the memorable points runs in eval mode (dropout off,
BatchNorm on running statistics), as in the reference code, whatever mode the model is in for the
minibatch; old predictions and kernels are computed in eval mode too, so Δp compares like with like
and is deterministic under dropout (p(X_s; θ) is the eval-mode prediction at both θ and θ_{t−1}).
The gradient still flows to θ through that forward; each module's own ``training`` flag is restored.

Precision: the penalty (its forward over the memorable points included), the kernels, their Cholesky factors
and the curvature accumulated at a task's end are computed in fp32 (fp64 for the inverses of the K-FAC factors)
also inside an active ``torch.autocast``: bf16 training runs only the minibatch's forward in bf16. Δp = p − p_old
is a difference of nearly equal probabilities that bf16's 8-bit mantissa would round away
(:func:`~continual_blr.mixed_precision.full_precision`).
"""

from __future__ import annotations

import math
import warnings
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from ..curvature import curvature, eval_mode, kernel
from ..data.stream import Task
from ..memory import (
    SELECTIONS,
    SENSITIVITY_SELECTIONS,
    MemoryEntry,
    MemoryStore,
    NormStatistics,
    forward,
    forward_parts,
    select_memorable,
    select_per_class,
    selection_scores,
    eval_rows_after,
    row_split_refusal,
)
from .context import context_sum, frozen_copy, kernel_mean_diagonal
from ..mixed_precision import active_autocast, full_precision, resumed_autocast, to_fp32
from ..types import Batch, KronBlock, KronCurvature, ParamDict, params_of

__all__ = ["FunctionalRegularizer", "KERNELS", "CLASS_CHOICES", "OUTPUTS", "TASK_ESTIMATORS", "TAU_SCALES",
           "condition_kernel"]

KERNELS = ("classwise", "full", "kron", "identity")
CLASS_CHOICES = ("task", "all")
OUTPUTS = ("probs", "logits")
FORWARD_PRECISIONS = ("fp32", "train")  # the memorable points' forward: always fp32, or the training step's
TASK_ESTIMATORS = ("unbiased", "saga")  # the penalty's gradient over tasks_per_step of the stored tasks
TAU_SCALES = ("none", "kernel")  # τ in absolute units, or in units of each kernel's mean diagonal
MAX_JITTER_RETRIES = 6
_SUBSET_CACHE = 64  # drawn subsets (tasks_per_step) whose stacked groups are kept until the next rebuild
"""If K + εI is not positive definite in float64, ε is multiplied by 10 up to this many times."""


def _prob_fn(columns: tuple[int, ...] | None, drop_last: bool, output: str = "probs"):
    """Row-wise map logits → the compared outputs: the softmax over the head (``"probs"``) or the logits
    (``"logits"``), restricted to the chosen columns; logits are then centred over those columns (f̃ = f − mean)."""
    idx = list(columns) if columns is not None else None

    def fn(f: Tensor) -> Tensor:
        p = torch.softmax(f, dim=-1) if output == "probs" else f
        if idx is not None:
            p = p[:, idx]
        if output == "logits":
            p = p - p.mean(-1, keepdim=True)
        return p[:, :-1] if drop_last else p

    return fn


def _unit_mean_diagonal(k: Tensor) -> tuple[Tensor, Tensor]:
    """Each kernel matrix of ``k`` ([..., n, n]) divided by its mean diagonal d̄ = tr K / n, in float64 (``tau_scale:
    kernel``); returns (K / d̄, d̄ [...]). A matrix with d̄ = 0 (no point has a Jacobian) is left as it is."""
    k64 = k.to(torch.float64)
    scale = torch.diagonal(k64, dim1=-2, dim2=-1).mean(-1)
    scale = torch.where(scale > 0, scale, torch.ones((), dtype=scale.dtype, device=scale.device))
    return k64 / scale[..., None, None], scale


def condition_kernel(k: Tensor, jitter: float, jitter_relative: float = 0.0, drop_below: float = 0.0
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """Kernel health at a rebuild: jitter, dropped points and the Cholesky factor, per kernel matrix, in float64.

    For each matrix K of ``k`` ([..., n, n]; the leading axes index the kernels, e.g. the classes) with diagonal
    d_i = K_ii:

        ε' = max(ε, r · max_i d_i),      keep_i = d_i ≥ c · ε'   (all kept when c = 0),
        K'_ij = K_ij keep_i keep_j + δ_ij (1 − keep_i),      returned: K' + ε'I and its lower Cholesky factor.

    A dropped index i is decoupled (row and column of the identity), so for any Δ with Δ_i = 0 at the dropped
    indices Δᵀ (K' + ε'I)⁻¹ Δ = Δ_keptᵀ (K_kept + ε'I)⁻¹ Δ_kept. If K' + ε'I is not positive definite, every ε' is
    multiplied by 10 (at most :data:`MAX_JITTER_RETRIES` times, with a warning).

    Args:
        k: symmetric kernels [..., n, n].
        jitter: ε, the absolute jitter (and the floor of the relative one).
        jitter_relative: r ≥ 0.
        drop_below: c ≥ 0, in units of ε'.

    Returns:
        ``(K' + ε'I, L, ε' [...], keep [..., n] bool or None when c = 0, d [..., n])``, all float64 but ``keep``.
    """
    k64 = k.to(torch.float64)
    k64 = 0.5 * (k64 + k64.mT)
    d = torch.diagonal(k64, dim1=-2, dim2=-1)
    eps = torch.clamp(jitter_relative * d.amax(-1), min=float(jitter))
    keep = None
    if drop_below > 0:
        keep = d >= drop_below * eps.unsqueeze(-1)
        both = keep.unsqueeze(-1) & keep.unsqueeze(-2)
        k64 = torch.where(both, k64, torch.zeros((), dtype=k64.dtype, device=k64.device))
        k64 = k64 + torch.diag_embed((~keep).to(k64.dtype))
    eye = torch.eye(k64.shape[-1], dtype=torch.float64, device=k64.device)
    e = eps
    for _ in range(MAX_JITTER_RETRIES + 1):
        kj = k64 + e[..., None, None] * eye
        chol, info = torch.linalg.cholesky_ex(kj)
        if not bool((info > 0).any()):
            if not torch.equal(e, eps):
                warnings.warn(f"FROMP kernel not positive definite with jitter {float(eps.max()):g}; used "
                              f"{float(e.max()):g}", stacklevel=3)
            return kj, chol, e, keep, d
        e = torch.clamp(e * 10.0, min=1e-12)
    raise RuntimeError(f"FROMP kernel is not positive definite even with jitter {float(e.max()) / 10:g}; check the "
                       "model outputs and prior_precision")


def _cholesky(k: Tensor, jitter: float) -> tuple[Tensor, Tensor, float]:
    """(K + εI, its lower Cholesky factor L, ε used) for a [.., n, n] symmetric K, factorised in float64."""
    k64 = k.to(torch.float64)
    k64 = 0.5 * (k64 + k64.mT)
    eye = torch.eye(k64.shape[-1], dtype=torch.float64, device=k64.device)
    eps = float(jitter)
    for _ in range(MAX_JITTER_RETRIES + 1):
        kj = k64 + eps * eye
        chol, info = torch.linalg.cholesky_ex(kj)
        if not bool((info > 0).any()):
            if eps != jitter:
                warnings.warn(f"FROMP kernel not positive definite with jitter {jitter:g}; used {eps:g}", stacklevel=3)
            return kj, chol, eps
        eps = max(eps * 10.0, 1e-12)
    raise RuntimeError(f"FROMP kernel is not positive definite even with jitter {eps / 10:g}; check the model "
                       "outputs and prior_precision")


def _shrink(e: MemoryEntry, keep: Tensor) -> MemoryEntry:
    """``e`` restricted to its points ``keep`` (sorted positions): inputs, labels, indices, scores, and the
    extras — p_old's rows, the kernel's principal sub-matrix (per class [C, M, M], or over (point, output)
    pairs [M·C', M·C'] indexed m·C' + c) and the Cholesky factor of that sub-matrix."""
    ex = dict(e.extras)
    if "p_old" in ex:
        ex["p_old"] = ex["p_old"][keep.to(ex["p_old"].device)]
    if "kernel" in ex:
        k = ex["kernel"]
        kp = keep.to(k.device)
        if k.dim() == 3:  # classwise
            sub = k[:, kp][:, :, kp]
        else:  # full: rows m·C' + c
            c = k.shape[-1] // len(e)
            idx = (kp[:, None] * c + torch.arange(c, device=k.device)).reshape(-1)
            sub = k[idx][:, idx]
        ex["kernel"] = sub
        ex["chol"] = torch.linalg.cholesky(sub.to(torch.float64)).to(sub.dtype)
        if "keep" in ex:  # [C, M] (classwise) or [M·C'] (full)
            kk = ex["keep"]
            ex["keep"] = kk[:, kp] if kk.dim() == 2 else kk.reshape(-1, c)[kp].reshape(-1)
    return MemoryEntry(e.task_id, e.head, e.x[keep.to(e.x.device)], e.y[keep.to(e.y.device)],
                       e.indices[keep.to(e.indices.device)], e.scores[keep.to(e.scores.device)], e.selection,
                       e.columns, ex)


def _match(t: Tensor | None, like: Tensor) -> Tensor:
    """An accumulated curvature entry shaped like the parameter ``like``: zeros where there is none (a head
    added after those tasks), zero-padded at the end of each axis where the parameter has grown (output
    units added by a growing classifier) — no past task's loss depended on the new entries."""
    if t is None:
        return torch.zeros_like(like)
    if t.shape == like.shape:
        return t
    if t.dim() == like.dim() and all(a <= b for a, b in zip(t.shape, like.shape)):
        out = torch.zeros_like(like)
        out[tuple(slice(0, s) for s in t.shape)] = t
        return out
    raise ValueError(f"FROMP: accumulated curvature of shape {tuple(t.shape)} cannot be matched to a parameter of "
                     f"shape {tuple(like.shape)} (a layer may only grow at the end of its axes)")


class FunctionalRegularizer:
    """FROMP / FRORP / FROMP-L2 as a :class:`~continual_blr.regularizers.base.Regularizer`.

    Args:
        tau: τ, the weight of the functional term ((τ/2) Σ Δpᵀ K⁻¹ Δp added to the *mean* minibatch
            loss). τ = 0 makes the penalty exactly zero.
        n_points: memorable points per task (split over its classes, see ``continual_blr.memory``).
        kernel: ``"classwise"`` | ``"full"`` | ``"kron"`` | ``"identity"`` (module docstring).
        selection: ``"lambda"`` | ``"random"`` | ``"lowest"``.
        prior_precision: δ in Σ = (F + δ)⁻¹.
        jitter: ε added to every kernel's diagonal before the Cholesky factorisation.
        classes: ``"task"`` | ``"all"`` — outputs compared on a single (class-incremental) head.
        class_incremental: whether the stream has one head over all classes (set by the FROMP method
            from the stream's scenario; only then does ``classes="task"`` restrict the columns).
        generator: ``torch.Generator`` for ``selection="random"``.
        chunk_size: examples per vectorised pass of the curvature engine (None: its default).
        memory_size: a budget of memorable points **in all** instead of ``n_points`` per task (None: off).
            After each task the budget is shared over every (task, class) group seen so far
            (:meth:`share_memory`): ⌊M / G⌋ points per group, the remainder one each to the newest groups;
            each past task keeps its groups' first (most memorable) points and the task just finished gets
            its share of newly selected ones, so the store never holds more than M points.
        output: ``"probs"`` (the paper) | ``"logits"`` (centred logits; module docstring: same τ for the kernels,
            τ / C² for ``kernel="identity"``).
        jitter_relative: r in ε' = max(ε, r · max_i K_ii) per kernel matrix (0: the absolute ε, as the paper).
        drop_below: c — a (point, output) whose K_ii < c · ε' at a rebuild is left out of the penalty until the next
            rebuild (0: none is). Counts in :attr:`health`.
        forward_precision: ``"fp32"`` (default: the penalty computes in fp32 even inside bf16 autocast) |
            ``"train"``: the forward over the memorable points (and its backward) runs in the training step's
            precision — bf16 under ``train.precision: bf16`` — and its outputs are cast to fp32 before the softmax,
            Δp, the solves with the fp32 Cholesky factors and the sum. For the cost of bf16 runs; the error it
            adds is measured by ``benchmarks/perf/perf_fromp_bf16.py``.
        tasks_per_step: k — each step's penalty is the unbiased estimate (n / k) · (τ/2) Σ_{s∈S} … over k of the
            n stored tasks drawn with ``generator`` (module docstring); 0 (default) or k ≥ n: every stored task.
        task_estimator: ``"unbiased"`` (default: the plain estimate) | ``"saga"`` (the same expectation with a
            table of each task's last gradient: lower variance; module docstring). Used only when k < n.
        fused_forward: the minibatch and every memorable point in one forward pass (:meth:`penalty_and_outputs`,
            module docstring); False (default): one pass for the minibatch and one per head for the penalty.
        tau_scale: ``"none"`` (default: τ absolute, the paper) | ``"kernel"`` (each kernel matrix divided by its
            mean diagonal before its jitter: τ in the kernel's units; module docstring).
        context_points: n — the functional prior is read at the first n rows of each minibatch too, against a
            frozen copy of the network taken at every rebuild, each stored task's outputs weighed by 1 / (its
            kernel's mean diagonal) with no covariances (:mod:`continual_blr.regularizers.context`); 0 (default, the
            paper): the memorable points only. Not with ``fused_forward`` or ``task_estimator="saga"``; under
            ``tasks_per_step`` every stored task enters the context term.
        context_weight: w, the context term's weight relative to τ: ``(τ w / 2) Σ_s Σ_c Σ_x Δo² / d̄_{s,c}``.

    Attributes:
        health: one list per rebuild, one dict per stored task: ``task_id``, ``points``, ``dropped_points`` (points
            with at least one output dropped), ``dropped_outputs`` ((point, output) pairs dropped), ``min_diag`` /
            ``max_diag`` (of J Σ Jᵀ, before jitter; under ``tau_scale="kernel"`` of the normalised kernel),
            ``jitter`` (the largest ε' used) and, under ``tau_scale="kernel"``, ``kernel_scale`` ([smallest,
            largest] mean diagonal d̄ of the task's kernel matrices, before normalising).
        norm_statistics: per-task BatchNorm statistics to evaluate each stored task on (None: the network's
            current ones); set by the loop under ``train.batchnorm: per_task``.
    """

    def __init__(
        self,
        *,
        tau: float = 10.0,
        n_points: int = 40,
        kernel: str = "classwise",
        selection: str = "lambda",
        prior_precision: float = 1e-3,
        jitter: float = 1e-6,
        classes: str = "task",
        class_incremental: bool = False,
        generator: torch.Generator | None = None,
        chunk_size: int | None = None,
        memory_size: int | None = None,
        output: str = "probs",
        jitter_relative: float = 0.0,
        drop_below: float = 0.0,
        forward_precision: str = "fp32",
        tasks_per_step: int = 0,
        task_estimator: str = "unbiased",
        fused_forward: bool = False,
        tau_scale: str = "none",
        context_points: int = 0,
        context_weight: float = 1.0,
    ) -> None:
        if not (isinstance(context_points, int) and not isinstance(context_points, bool) and context_points >= 0):
            raise ValueError(f"context_points: must be an integer >= 0 (0: none), got {context_points!r}")
        if not (isinstance(context_weight, (int, float)) and context_weight >= 0 and math.isfinite(context_weight)):
            raise ValueError(f"context_weight: must be a finite number >= 0, got {context_weight!r}")
        if context_points and (fused_forward or task_estimator == "saga"):
            raise ValueError("context_points: not with fused_forward or task_estimator 'saga'; allowed: 0, or the "
                             "separate passes with task_estimator 'unbiased'")
        if tau_scale not in TAU_SCALES:
            raise ValueError(f"tau_scale: got {tau_scale!r}; allowed: {', '.join(map(repr, TAU_SCALES))}")
        if tau_scale == "kernel" and kernel == "identity":
            raise ValueError("tau_scale: 'kernel' needs a kernel to take the scale of; kernel 'identity' (FROMP-L2) "
                             "allows 'none'")
        if not isinstance(fused_forward, bool):
            raise ValueError(f"fused_forward: must be true or false, got {fused_forward!r}")
        if fused_forward and task_estimator == "saga":
            raise ValueError("fused_forward: not with task_estimator 'saga' (its per-task gradients need one pass "
                             "per drawn task); allowed with 'unbiased'")
        if task_estimator not in TASK_ESTIMATORS:
            raise ValueError(f"task_estimator: got {task_estimator!r}; allowed: {', '.join(map(repr, TASK_ESTIMATORS))}")
        if not (isinstance(tasks_per_step, int) and not isinstance(tasks_per_step, bool) and tasks_per_step >= 0):
            raise ValueError(f"tasks_per_step: must be an integer >= 0 (0: every stored task), got {tasks_per_step!r}")
        if forward_precision not in FORWARD_PRECISIONS:
            raise ValueError(f"forward_precision: got {forward_precision!r}; allowed: "
                             f"{', '.join(map(repr, FORWARD_PRECISIONS))}")
        if output not in OUTPUTS:
            raise ValueError(f"output: got {output!r}; allowed: {', '.join(map(repr, OUTPUTS))}")
        for name, v in (("jitter_relative", jitter_relative), ("drop_below", drop_below)):
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name}: must be a finite number >= 0, got {v!r}")
        if kernel not in KERNELS:
            raise ValueError(f"kernel: got {kernel!r}; allowed: {', '.join(map(repr, KERNELS))}")
        if selection not in SELECTIONS:
            raise ValueError(f"selection: got {selection!r}; allowed: {', '.join(map(repr, SELECTIONS))}")
        if selection in SENSITIVITY_SELECTIONS and kernel == "kron":
            raise ValueError(f"selection: {selection!r} needs a diagonal Σ; kernel 'kron' allows 'lambda', 'random', "
                             "'lowest'")
        if classes not in CLASS_CHOICES:
            raise ValueError(f"classes: got {classes!r}; allowed: {', '.join(map(repr, CLASS_CHOICES))}")
        if not (isinstance(tau, (int, float)) and tau >= 0 and math.isfinite(tau)):
            raise ValueError(f"tau: must be a finite number >= 0, got {tau!r}")
        if int(n_points) < 1:
            raise ValueError(f"n_points: must be >= 1, got {n_points}")
        if not prior_precision > 0:
            raise ValueError(f"prior_precision: must be > 0, got {prior_precision}")
        if not jitter >= 0:
            raise ValueError(f"jitter: must be >= 0, got {jitter}")
        if memory_size is not None and int(memory_size) < 1:
            raise ValueError(f"memory_size: must be >= 1 or None, got {memory_size}")
        if (selection in ("random", "stratified") or tasks_per_step > 0) and generator is None:
            generator = torch.Generator().manual_seed(0)
        self.memory_size = None if memory_size is None else int(memory_size)
        self.tau = float(tau)
        self.n_points = int(n_points)
        self.kernel = kernel
        self.selection = selection
        self.prior_precision = float(prior_precision)
        self.jitter = float(jitter)
        self.classes = classes
        self.class_incremental = bool(class_incremental)
        self.generator = generator
        self.chunk_size = chunk_size
        self.output = output
        self.jitter_relative = float(jitter_relative)
        self.drop_below = float(drop_below)
        self.forward_precision = forward_precision
        self.tasks_per_step = int(tasks_per_step)
        self.task_estimator = task_estimator
        self.fused_forward = fused_forward
        self.tau_scale = tau_scale
        self.context_points = context_points
        self.context_weight = float(context_weight)
        self._snapshot: nn.Module | None = None  # θ_{t−1}, frozen at the last rebuild (context points only)
        self._fusable: tuple[int, int] | None = None  # (id, module count) of the model last checked for fusion
        self._saga: tuple[int, dict[int, ParamDict], ParamDict | None] = (-1, {}, None)  # (rebuild, ĝ_s, Σ ĝ)
        self.health: list[list[dict[str, Any]]] = []
        self._norm_statistics: NormStatistics | None = None
        self.memory = MemoryStore()
        self.fisher: ParamDict | None = None  # Σ_tasks diag GGN (classwise / full / kron's non-block part)
        self.kron: dict[str, dict[str, Any]] = {}  # weight → {"bias", "a_sum" (Σ N·A), "n", "g" (Σ G)}
        self._groups: list | None = None  # per head: (head, x_cat, parts), built from the memory
        self._subset_groups: dict[tuple[int, ...], tuple[list, list[int | None]]] = {}  # drawn subsets' groups
        self._group_tasks: list[int | None] = []  # per group: the task whose BatchNorm statistics it uses (or None)

    # ------------------------------------------------------------------------------------ state

    @property
    def norm_statistics(self) -> NormStatistics | None:
        """Per-task BatchNorm statistics each stored task is evaluated on (None: the network's current ones)."""
        return self._norm_statistics

    @norm_statistics.setter
    def norm_statistics(self, value: NormStatistics | None) -> None:
        self._norm_statistics = value
        self._clear_groups()  # the penalty's forwards are grouped by task when statistics are kept per task

    def _clear_groups(self) -> None:
        """Drop the penalty's cached groups (every task's and the drawn subsets'): the memory, its extras or the
        statistics they are evaluated on changed."""
        self._groups = None
        self._subset_groups = {}

    def reset(self) -> None:
        """Forget every past task (memory and accumulated curvature)."""
        self.memory.clear()
        self._snapshot = None
        self._saga = (-1, {}, None)
        self.fisher = None
        self.kron = {}
        self.health = []
        self._clear_groups()

    def _columns(self, task: Task) -> tuple[int, ...] | None:
        if self.class_incremental and self.classes == "task":
            return tuple(int(c) for c in task.classes)
        return None

    def _drop_last(self, entry: MemoryEntry) -> bool:
        """Whether the full kernel leaves out the last compared output: the probabilities over a whole head sum to
        one and centred logits to zero, so that output is determined by the others."""
        return self.kernel == "full" and (entry.columns is None or self.output == "logits")

    def _norm(self, model: nn.Module, task_id: int | None):
        """The block in which ``model`` runs on stored task ``task_id``'s BatchNorm statistics (if kept)."""
        if self.norm_statistics is None or task_id is None:
            return nullcontext()
        return self.norm_statistics.use(model, task_id)

    def _identity_scale(self, n_outputs: int) -> float:
        """s in FROMP-L2's (τ s / 2) ‖Δ‖²: 1 on probabilities, 1 / C² on the C compared centred logits."""
        return 1.0 if self.output == "probs" else 1.0 / float(n_outputs) ** 2

    # --------------------------------------------------------------------------- task boundaries

    @full_precision
    def on_task_end(self, model: nn.Module, task: Task) -> None:
        """Accumulate this task's curvature at the current weights, then store its memorable points (a sensitivity
        selection scores them in the curvature's own pass, module docstring)."""
        if self.selection in SENSITIVITY_SELECTIONS:
            prior = None
            if self.kernel != "identity" and self.fisher is not None:
                prior = {k: _match(self.fisher.get(k), p) for k, p in params_of(model).items()}
            all_scores, ggn = selection_scores(model, task.x_train, task.y_train, selection=self.selection,
                                               head=task.head, prior_precision=self.prior_precision,
                                               prior_ggn=prior, chunk_size=self.chunk_size)
            if self.kernel != "identity":
                old = self.fisher or {}
                self.fisher = {k: _match(old.get(k), v) + v.detach() for k, v in ggn.items()}
            n_points = self.n_points if self.memory_size is None else self.share_memory(task)
            idx = select_per_class(all_scores, task.y_train.to(all_scores.device), n_points,
                                   selection=self.selection, generator=self.generator)
            scores = all_scores
        else:
            if self.kernel in ("classwise", "full", "kron"):
                self._accumulate_curvature(model, task)
            n_points = self.n_points if self.memory_size is None else self.share_memory(task)
            idx, scores = select_memorable(model, task.x_train, task.y_train, n_points, head=task.head,
                                           selection=self.selection, generator=self.generator)
        self.memory.add(MemoryEntry(
            task_id=task.task_id, head=task.head, x=task.x_train[idx].detach().clone(),
            y=task.y_train[idx].clone(), indices=idx.clone(), scores=scores[idx].clone(),
            selection=self.selection, columns=self._columns(task),
        ))
        self._clear_groups()

    def share_memory(self, task: Task) -> int:
        """Shrink the stored tasks to their share of ``memory_size`` and return the new task's share.

        The G groups are the (task, class) pairs of the stored tasks and of ``task``; each gets
        q = ⌊M / G⌋ points and the r = M − qG left over go one each to the newest groups (``task``'s
        classes first, in the order :func:`~continual_blr.memory.select_per_class` gives them, then the
        stored tasks' from the latest back). A stored task keeps, per class, the first points of its
        entry — the most memorable ones for ``selection="lambda"`` (entries are in rank order per class).
        Its old predictions and kernels are cut to the kept points (a principal sub-matrix of K + εI, refactorised
        in float64), so the store stays usable as it is; :meth:`rebuild` recomputes them at the next task start."""
        assert self.memory_size is not None
        new_classes = sorted(int(c) for c in torch.unique(task.y_train).tolist())
        old_groups = [(i, c) for i, e in enumerate(self.memory)
                      for c in sorted(int(v) for v in torch.unique(e.y).tolist())]
        g = len(old_groups) + len(new_classes)
        q, r = divmod(self.memory_size, g)
        share_new = q * len(new_classes) + min(r, len(new_classes))
        left = r - min(r, len(new_classes))
        quota = {grp: q + (1 if k < left else 0) for k, grp in enumerate(reversed(old_groups))}
        entries = []
        for i, e in enumerate(self.memory):
            keep = []
            for c in sorted(int(v) for v in torch.unique(e.y).tolist()):
                keep.append((e.y == c).nonzero().squeeze(1)[: quota[(i, c)]])
            k = torch.cat(keep) if keep else e.y.new_zeros(0)
            if k.numel() == len(e):
                entries.append(e)
                continue
            entries.append(_shrink(e, torch.sort(k).values))  # the entry's order kept (by class, rank order)
        self.memory.entries = entries
        self._clear_groups()
        return max(share_new, 1)

    def _accumulate_curvature(self, model: nn.Module, task: Task) -> None:
        structure = "kron" if self.kernel == "kron" else "diag"
        c = curvature(model, task.x_train, kind="ggn", structure=structure, head=task.head,
                      chunk_size=self.chunk_size)
        diag = c.diag if isinstance(c, KronCurvature) else c
        old = self.fisher or {}
        self.fisher = {k: _match(old.get(k), v) + v.detach() for k, v in diag.items()}
        if isinstance(c, KronCurvature):
            n = task.n_train
            for blk in c.blocks:
                used = bool(blk.A.abs().sum() > 0)  # an unused head's layer has zero factors
                st = self.kron.setdefault(blk.weight, {"bias": blk.bias, "a_sum": torch.zeros_like(blk.A),
                                                       "n": 0, "g": torch.zeros_like(blk.G)})
                if st["a_sum"].shape != blk.A.shape:
                    raise ValueError(f"FROMP kron: the inputs of layer {blk.weight!r} changed size; only outputs may grow")
                st["g"] = _match(st["g"], blk.G)
                if used:
                    st["a_sum"] = st["a_sum"] + n * blk.A
                    st["n"] += n
                    st["g"] = st["g"] + blk.G

    def sigma(self, model: nn.Module) -> ParamDict | KronCurvature:
        """The weight covariance Σ the kernels use (ParamDict of variances, or Kronecker factors) over all the
        model's trainable parameters; parameters no past task reached have the prior variance 1/δ."""
        if self.fisher is None:
            raise RuntimeError("sigma: no curvature accumulated yet (no task has ended)")
        delta = self.prior_precision
        params = params_of(model)
        if self.kernel != "kron":
            return {k: 1.0 / (_match(self.fisher.get(k), p) + delta) for k, p in params.items()}
        blocks, in_blocks = [], set()
        sq = math.sqrt(delta)
        for w, st in self.kron.items():
            a = st["a_sum"] / st["n"] if st["n"] > 0 else st["a_sum"]
            g = st["g"]
            ta, tg = float(a.diagonal().mean()), float(g.diagonal().mean())
            pi = math.sqrt(ta / tg) if ta > 0 and tg > 0 else 1.0
            a64, g64 = a.to(torch.float64), g.to(torch.float64)
            ia = torch.eye(a.shape[0], dtype=torch.float64, device=a.device)
            ig = torch.eye(g.shape[0], dtype=torch.float64, device=g.device)
            a_cov = torch.linalg.inv(a64 + pi * sq * ia).to(a.dtype)
            g_cov = torch.linalg.inv(g64 + sq / pi * ig).to(g.dtype)
            blocks.append(KronBlock(w, st["bias"], 0.5 * (a_cov + a_cov.T), 0.5 * (g_cov + g_cov.T)))
            in_blocks.update([w, st["bias"]])
        diag = {k: 1.0 / (_match(self.fisher.get(k), p) + delta) for k, p in params.items() if k not in in_blocks}
        return KronCurvature(blocks, diag)

    def on_task_start(self, model: nn.Module, task: Task) -> None:
        """Rebuild old predictions, kernels and their factors at the current weights (eval mode)."""
        self.rebuild(model)

    @full_precision
    def rebuild(self, model: nn.Module) -> None:
        """For every stored task: the old outputs o_old = o(X_s; θ) (``p_old``: probabilities or centred logits),
        K_{s,c} + ε'I and its Cholesky factor, with the kernel health of the module docstring (a record per task
        appended to :attr:`health`). Each task's outputs and kernels use its own BatchNorm statistics when
        :attr:`norm_statistics` keeps them."""
        if not len(self.memory):
            return
        ref = next(p for p in model.parameters())
        sigma = self.sigma(model) if self.kernel != "identity" else None
        health = self.jitter_relative > 0 or self.drop_below > 0
        entries, records = [], []
        for entry in self.memory:
            e = entry.to(ref.device)
            x = e.x.to(dtype=ref.dtype) if e.x.is_floating_point() else e.x
            e.x = x
            record: dict[str, Any] = {"task_id": int(e.task_id), "points": len(e), "dropped_points": 0,
                                      "dropped_outputs": 0, "min_diag": None, "max_diag": None,
                                      "jitter": None}
            with self._norm(model, e.task_id):
                with torch.no_grad(), eval_mode(model):
                    e.extras = {"p_old": _prob_fn(e.columns, False, self.output)(forward(model, x, e.head)).detach()}
                if sigma is not None:
                    k = kernel(model, x, sigma, head=e.head,
                               output_fn=_prob_fn(e.columns, self._drop_last(e), self.output),
                               blockwise=self.kernel != "full", chunk_size=self.chunk_size)
            if sigma is not None:
                if self.tau_scale == "kernel":  # τ in the kernel's units: each matrix at unit mean diagonal
                    k, scale = _unit_mean_diagonal(k.detach())
                    e.extras["kernel_scale"] = scale
                    record["kernel_scale"] = [float(scale.min()), float(scale.max())]
                if not health:  # the paper's absolute jitter, exactly as before the health options existed
                    kj, chol, eps = _cholesky(k.detach(), self.jitter)
                    e.extras.update(kernel=kj.to(ref.dtype), chol=chol.to(ref.dtype),
                                    jitter=torch.tensor(eps, dtype=torch.float64))
                    d = torch.diagonal(k.detach().to(torch.float64), dim1=-2, dim2=-1)
                    keep, eps_max = None, eps
                else:
                    kj, chol, eps_t, keep, d = condition_kernel(k.detach(), self.jitter, self.jitter_relative,
                                                                self.drop_below)
                    eps_max = float(eps_t.max())
                    e.extras.update(kernel=kj.to(ref.dtype), chol=chol.to(ref.dtype),
                                    jitter=torch.tensor(eps_max, dtype=torch.float64), jitters=eps_t)
                    if keep is not None:
                        e.extras["keep"] = keep
                record.update(min_diag=float(d.min()), max_diag=float(d.max()), jitter=float(eps_max))
                if keep is not None:
                    per_point = (~keep).any(0) if keep.dim() == 2 else (~keep).reshape(len(e), -1).any(1)
                    record.update(dropped_points=int(per_point.sum()), dropped_outputs=int((~keep).sum()))
            if self.context_points:  # d̄ per compared output (context.py); FROMP-L2: 1 / its output scale
                n_out = e.extras["p_old"].shape[1]
                e.extras["context_scale"] = (kernel_mean_diagonal(k, n_out) if sigma is not None else
                                             torch.full((n_out,), 1.0 / self._identity_scale(n_out),
                                                        dtype=torch.float64))
            entries.append(e)
            records.append(record)
        self.memory.entries = entries
        self.health.append(records)
        self._clear_groups()
        if self.context_points:
            self._snapshot = frozen_copy(model)

    # ----------------------------------------------------------------------------------- penalty

    def _build_groups(self, device: torch.device, dtype: torch.dtype,
                      entries: list[MemoryEntry] | None = None) -> tuple[list, list[int | None]]:
        """Memorable points grouped by head (one forward per head and step); within a head, tasks with the
        same number of points and compared columns are stacked so that one batched triangular solve
        serves them all. Returns the groups and, per group, the task whose BatchNorm statistics it uses (or
        None). ``entries``: a subset of the memory (default: all of it)."""
        by_head: dict[tuple[int, int | None], dict[tuple, list[MemoryEntry]]] = {}
        per_task = self.norm_statistics is not None  # one forward per task: each on its own statistics
        for e in (self.memory if entries is None else entries):
            if "p_old" not in e.extras:
                raise RuntimeError("FROMP: kernels and old predictions are not built; call on_task_start (or "
                                   "rebuild) after on_task_end / load_state_dict")
            key = (len(e), e.extras["p_old"].shape[1], e.columns is None)
            by_head.setdefault((e.head, e.task_id if per_task else None), {}).setdefault(key, []).append(e)
        mode = "identity" if self.kernel == "identity" else ("full" if self.kernel == "full" else "classwise")
        groups, group_tasks = [], []
        for (head, task_id), buckets in by_head.items():
            xs, parts, start = [], [], 0
            for (m, _, no_cols), es in buckets.items():
                n = len(es) * m
                xs += [e.x.to(device=device, dtype=dtype if e.x.is_floating_point() else None) for e in es]
                cols = None if no_cols else torch.tensor([list(e.columns) for e in es], device=device)  # [E, C]
                p_old = torch.stack([e.extras["p_old"] for e in es]).to(device=device, dtype=dtype)  # [E, M, C]
                chol = (None if mode == "identity"
                        else torch.stack([e.extras["chol"] for e in es]).to(device=device, dtype=dtype))
                mask = None  # kept (point, output) pairs, shaped like the solve's right-hand side
                if chol is not None and any("keep" in e.extras for e in es):
                    mask = torch.stack([e.extras["keep"] if "keep" in e.extras
                                        else torch.ones(chol.shape[1:-1], dtype=torch.bool, device=device)
                                        for e in es]).to(device=device, dtype=dtype).unsqueeze(-1)
                parts.append((slice(start, start + n), len(es), m, cols, self._drop_last(es[0]), p_old, mask, chol))
                start += n
            groups.append((head, torch.cat(xs), parts))
            group_tasks.append(task_id)
        return groups, group_tasks

    def draw_tasks(self) -> list[int] | None:
        """The positions (in :attr:`memory`) of the stored tasks this step's penalty uses: k of the n drawn
        uniformly without replacement from the generator, sorted; None (every task, nothing drawn) when
        ``tasks_per_step`` is 0 or at least n."""
        n = len(self.memory)
        if self.tasks_per_step == 0 or self.tasks_per_step >= n:
            return None
        return sorted(torch.randperm(n, generator=self.generator)[: self.tasks_per_step].tolist())

    def penalty(self, model: nn.Module, batch: Batch, task: Task, params: ParamDict | None = None) -> Tensor:
        """(τ/2) Σ_s Σ_c Δp_{s,c}ᵀ K_{s,c}⁻¹ Δp_{s,c} at the model's parameters (or at ``params``).

        Δpᵀ K⁻¹ Δp = ‖L⁻¹ Δp‖² with the Cholesky factor L of K + εI: one batched triangular solve per group of
        tasks (it reads only L's triangle, half the memory traffic of a product with K⁻¹, forward and backward).
        In fp32 throughout, also inside autocast, except the memorable points' forward under
        ``forward_precision="train"``.

        With ``tasks_per_step`` k < n stored tasks, the unbiased estimate over k tasks drawn for this step
        (:meth:`draw_tasks`, module docstring).
        """
        outer = active_autocast() if self.forward_precision == "train" else None
        subset = self.draw_tasks() if (self.tau != 0.0 and len(self.memory)) else None
        if subset is not None and self.task_estimator == "saga":
            return self._saga_penalty(model, batch, task, params, outer, subset)
        return self._penalty(model, batch, task, params, outer, subset)

    def _saga_penalty(self, model: nn.Module, batch: Batch, task: Task, params: ParamDict | None,
                      outer: tuple[str, torch.dtype] | None, subset: list[int]) -> Tensor:
        """The plain estimate's value with the SAGA gradient v (module docstring) over the model's trainable
        parameters; updates the table of per-task gradients (cleared at every rebuild: Δp = 0 there)."""
        if params is not None:
            raise ValueError("task_estimator: 'saga' needs the model's own parameters (the loop's optimisers); "
                             "a params= closure (the BLR optimisers) allows 'unbiased'")
        named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
        rebuild, table, total = self._saga
        if rebuild != len(self.health):  # a new task start: every stored gradient is 0 again
            rebuild, table, total = len(self.health), {}, None
        n, k = len(self.memory), len(subset)
        if total is None:
            total = {name: torch.zeros_like(p) for name, p in named}
        value = None
        change = {name: torch.zeros_like(p) for name, p in named}  # D = Σ_S (∇R_s − ĝ_s^old)
        for i in subset:
            r = self._penalty(model, batch, task, None, outer, [i])  # = n · R_i
            grads = torch.autograd.grad(r, [p for _, p in named], allow_unused=True)
            fresh = {name: torch.zeros_like(p) if g is None else g / n for (name, p), g in zip(named, grads)}
            old = table.get(i)
            for name, _ in named:
                change[name] += fresh[name] if old is None else fresh[name] - old[name]
            table[i] = fresh
            value = r.detach() / k if value is None else value + r.detach() / k  # (n / k) Σ_S R_s
        v = {name: (n / k) * change[name] + total[name] for name, _ in named}  # uses Σ ĝ^old
        self._saga = (rebuild, table, {name: total[name] + change[name] for name, _ in named})
        return value + sum((v[name] * (p - p.detach())).sum() for name, p in named)  # value R̂, gradient v

    def _select_groups(self, ref: Tensor, subset: list[int] | None) -> tuple[list, list[int | None], float]:
        """The step's groups (every stored task's, cached until the next rebuild; or the drawn ``subset``'s), the
        task whose BatchNorm statistics each uses, and the estimate's scale n / |subset| (1 for every task)."""
        if subset is None:
            if (self._groups is None or self._groups[0][1].device != ref.device
                    or self._groups[0][1].dtype != ref.dtype):
                self._groups, self._group_tasks = self._build_groups(ref.device, ref.dtype)
            return self._groups, self._group_tasks, 1.0
        entries = list(self.memory)
        key = tuple(subset)
        cached = self._subset_groups.get(key)
        if cached is None or cached[0][0][1].device != ref.device or cached[0][0][1].dtype != ref.dtype:
            if len(self._subset_groups) >= _SUBSET_CACHE:  # many distinct draws (large n and k): start afresh
                self._subset_groups = {}
            cached = self._subset_groups[key] = self._build_groups(ref.device, ref.dtype,
                                                                   [entries[i] for i in subset])
        return cached[0], cached[1], len(entries) / len(subset)

    def _add_terms(self, total: Tensor, p: Tensor, parts: list) -> Tensor:
        """``total`` plus Σ over one group's stacked tasks of Σ_c ‖L_c⁻¹ Δ_c‖² (FROMP-L2: the scaled ‖Δ‖²), from
        the group's compared outputs ``p`` (probabilities or logits, one row per memorable point)."""
        for sl, n_tasks, m, cols, drop_last, p_old, mask, chol in parts:
            pe = p[sl].reshape(n_tasks, m, -1)
            if cols is not None:
                pe = torch.gather(pe, 2, cols.unsqueeze(1).expand(n_tasks, m, cols.shape[1]))
            if self.output == "logits":
                pe = pe - pe.mean(-1, keepdim=True)  # centred over the compared outputs, as p_old
            d = pe - p_old  # [E, M, C]
            if chol is None:  # FROMP-L2
                sq = (d * d).sum()
                total = total + (sq if self.output == "probs" else self._identity_scale(d.shape[-1]) * sq)
                continue
            if self.kernel == "full":  # one kernel over (point, output), index m·C' + c (C' = C − 1 if dropped)
                rhs = (d[..., :-1] if drop_last else d).reshape(n_tasks, -1, 1)
            else:  # one kernel per class
                rhs = d.transpose(1, 2).unsqueeze(-1)  # [E, C, M, 1]
            if mask is not None:  # dropped (point, output) pairs: Δ = 0 on their decoupled rows
                rhs = rhs * mask
            z = torch.linalg.solve_triangular(chol, rhs, upper=False)
            total = total + (z * z).sum()
        return total

    @full_precision
    def _penalty(self, model: nn.Module, batch: Batch, task: Task, params: ParamDict | None,
                 outer: tuple[str, torch.dtype] | None, subset: list[int] | None = None) -> Tensor:
        """The penalty over every stored task, or its estimate (n / |subset|) Σ_{s ∈ subset} over the tasks at
        the positions ``subset`` of :attr:`memory`."""
        ref = next(iter(params.values())) if params else next(p for p in model.parameters())
        zero = torch.zeros((), device=ref.device, dtype=ref.dtype)
        if self.tau == 0.0 or not len(self.memory):
            return zero
        groups, group_tasks, scale = self._select_groups(ref, subset)
        total = zero
        for (head, x, parts), task_id in zip(groups, group_tasks):
            with eval_mode(model), self._norm(model, task_id):  # as the reference: no dropout noise in Δp
                with resumed_autocast(outer):
                    f = forward(model, x, head, params)
                f = to_fp32(f)  # bf16 outputs of a resumed autocast; fp32 / fp64 ones stay as they are
                p = torch.softmax(f, dim=-1) if self.output == "probs" else f
            total = self._add_terms(total, p, parts)
        # every task: the same expression as before the option existed, so its records stay bit-identical
        out = 0.5 * self.tau * total if scale == 1.0 else (0.5 * self.tau * scale) * total
        if self.context_points:  # (τ w / 2) Σ over the stored tasks at the minibatch's first rows (context.py)
            out = out + (0.5 * self.tau * self.context_weight) * self._context(model, batch, params, outer)
        return out

    def _context(self, model: nn.Module, batch: Batch, params: ParamDict | None,
                 outer: tuple[str, torch.dtype] | None) -> Tensor:
        """``Σ_s Σ_c (1/d̄_{s,c}) Σ_x Δo²`` at the first ``context_points`` rows of the minibatch
        (:func:`~continual_blr.regularizers.context.context_sum`)."""
        if self._snapshot is None:
            raise RuntimeError("FROMP context points: no frozen network; call on_task_start (or rebuild) after "
                               "on_task_end / load_state_dict")
        x = batch.x[: self.context_points]
        return context_sum(model, self._snapshot, x, list(self.memory),
                           lambda cols: _prob_fn(cols, False, self.output), self._norm, params, outer,
                           per_task_norm=self.norm_statistics is not None)

    def penalty_and_outputs(self, model: nn.Module, batch: Batch, task: Task) -> tuple[Tensor, Tensor]:
        """(the minibatch's outputs ``model(batch.x, head=batch.head)``, :meth:`penalty`) from **one** forward pass
        over the minibatch and the memorable points of every head (``fused_forward``; module docstring).

        The same function and gradient as the separate passes, rounded differently: each weight's gradient sums the
        minibatch's and the memorable points' rows in one matrix product, and the small per-head passes become one
        large one (fewer, larger kernels). The penalty's points are evaluated in eval mode and the minibatch in the
        caller's: dropout and BatchNorm run each mode on its own rows (:func:`~continual_blr.memory.eval_rows_after`);
        a module of unknown mode is refused (:func:`~continual_blr.memory.row_split_refusal`). Inside a bf16
        autocast it needs ``forward_precision="train"`` (the pass runs in the training step's precision); the
        softmax, Δ, the solves and the sum run in fp32 as in :meth:`penalty`. The same tasks are drawn from the
        generator as :meth:`penalty` draws.

        Raises:
            ValueError: a mode-dependent module, per-task BatchNorm statistics, or an fp32 penalty under autocast.
        """
        if self.tau == 0.0 or not len(self.memory):
            return forward(model, batch.x, batch.head), self._penalty(model, batch, task, None, None)
        self._check_fusable(model)
        subset = self.draw_tasks()
        ref = next(p for p in model.parameters())
        groups, _, scale = self._select_groups(ref, subset)
        with eval_rows_after(model, batch.x.shape[0]):  # the minibatch's rows in the model's mode, the rest in eval
            outs = forward_parts(model, [batch.x] + [x for _, x, _ in groups],
                                 [batch.head] + [h for h, _, _ in groups])
        return outs[0], self._fused_penalty(outs[1:], groups, scale)

    @full_precision
    def _fused_penalty(self, outputs: list[Tensor], groups: list, scale: float) -> Tensor:
        """(τ/2) · scale · Σ over ``groups`` of their terms, from each group's outputs of the fused pass (fp32)."""
        total = torch.zeros((), device=outputs[0].device, dtype=outputs[0].dtype)
        for f, (_, _, parts) in zip(outputs, groups):
            total = self._add_terms(total, torch.softmax(f, dim=-1) if self.output == "probs" else f, parts)
        return 0.5 * self.tau * total if scale == 1.0 else (0.5 * self.tau * scale) * total

    def _check_fusable(self, model: nn.Module) -> None:
        """One-line ``ValueError`` when the fused pass would not compute the separate passes' function (the model's
        modules are checked once per model and module count)."""
        if self.norm_statistics is not None:
            raise ValueError("params.fused_forward: not with train.batchnorm 'per_task' (each stored task runs on its "
                             "own statistics); allowed: fused_forward false")
        if active_autocast() is not None and self.forward_precision != "train":
            raise ValueError("params.fused_forward: under train.precision bf16 the one pass runs in bf16, so it needs "
                             "forward_precision 'train'; allowed: forward_precision 'train', or fused_forward false")
        key = (id(model), sum(1 for _ in model.modules()))
        if self._fusable != key:
            which = row_split_refusal(model)
            if which is not None:
                raise ValueError(f"params.fused_forward: the model's {which} may compute differently in train and "
                                 "eval mode and cannot be split by rows, and the penalty's points run in eval mode; "
                                 "allowed: a model of mode-free layers, dropout (not in place) and BatchNorm with "
                                 "running statistics, or fused_forward false")
            self._fusable = key

    # ------------------------------------------------------------------------------ state_dict

    def config(self) -> dict[str, Any]:
        return {"tau": self.tau, "n_points": self.n_points, "kernel": self.kernel, "selection": self.selection,
                "prior_precision": self.prior_precision, "jitter": self.jitter, "classes": self.classes,
                "class_incremental": self.class_incremental, "memory_size": self.memory_size, "output": self.output,
                "jitter_relative": self.jitter_relative, "drop_below": self.drop_below,
                "forward_precision": self.forward_precision, "tasks_per_step": self.tasks_per_step,
                "task_estimator": self.task_estimator, "fused_forward": self.fused_forward,
                "context_points": self.context_points, "context_weight": self.context_weight}

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors / dicts / lists only (``torch.load(weights_only=True)`` reads it back)."""
        return {
            "config": self.config(),
            "fisher": None if self.fisher is None else dict(self.fisher),
            "kron": {w: dict(st) for w, st in self.kron.items()},
            "memory": self.memory.state_dict(),
            # floats as float64 tensors: statistics of kernels, compared with a tolerance (another device or a
            # data-parallel run rounds them differently), not as exact Python values
            "health": [[{k: torch.tensor(v, dtype=torch.float64) if isinstance(v, float) else v for k, v in r.items()}
                        for r in rebuild] for rebuild in self.health],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        cfg = state.get("config", {})
        if cfg and cfg.get("kernel") != self.kernel:
            raise ValueError(f"state: saved with kernel {cfg.get('kernel')!r}, this regulariser uses {self.kernel!r}")
        if cfg and cfg.get("output", "probs") != self.output:
            raise ValueError(f"state: saved with output {cfg.get('output', 'probs')!r}, this regulariser uses "
                             f"{self.output!r}")
        built = [e.get("extras", {}) for e in state.get("memory", {}).get("entries", [])]
        scaled = {"kernel_scale" in ex for ex in built if "chol" in ex}  # the stored factors' tau_scale
        if scaled and scaled != {self.tau_scale == "kernel"}:
            raise ValueError(f"state: its kernels were built with tau_scale {'kernel' if True in scaled else 'none'!r}, "
                             f"this regulariser uses {self.tau_scale!r}")
        self.health = [[{k: float(v) if isinstance(v, Tensor) else v for k, v in r.items()} for r in rebuild]
                       for rebuild in state.get("health", [])]
        self.class_incremental = bool(cfg.get("class_incremental", self.class_incremental))
        self.fisher = None if state.get("fisher") is None else dict(state["fisher"])
        self.kron = {w: dict(st) for w, st in state.get("kron", {}).items()}
        self.memory.load_state_dict(state["memory"])
        self._saga = (-1, {}, None)  # the SAGA table is cleared at the next rebuild anyway (Δp = 0 there)
        self._clear_groups()
