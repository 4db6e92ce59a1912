"""Sensitivities checked against retraining: ``continual-blr inspect RUN --validate N``.

The report's leave-one-out estimate (:mod:`.scores`, Nickl et al. 2023, the memory-perturbation equation) says how
far example i's own prediction would move if i were left out of training:

    plain       Δf_i ≈ V_i e_i,                          V_i = J_i Σ J_iᵀ,  e_i = p_i − onehot(y_i)
    leverage    Δf_i ≈ V_i (I − Λ_i V_i)⁻¹ e_i,           Λ_i = diag(p_i) − p_i p_iᵀ

The second is the first with Σ replaced by the covariance of the posterior without i, Σ_∖i = (Σ⁻¹ − J_iᵀ Λ_i J_i)⁻¹:
by Woodbury, J_i Σ_∖i J_iᵀ = V_i (I − Λ_i V_i)⁻¹ (the "leverage" correction of Cook's distance; for a Gaussian
likelihood it is the exact LOO residual e_i / (1 − h_ii)). The estimated deviation of the prediction is

    d̂_i = ‖softmax(f_i + Δf_i) − softmax(f_i)‖₁,

or, linearised in the probabilities, d̂_lin,i = ‖Λ_i Δf_i‖₁ (first order of the softmax: it does not saturate
when a weakly determined example's Δf is large); the true one, after retraining without i, d_i = ‖softmax(f_i^∖i) − softmax(f_i^ref)‖₁ (the MPE paper's Fig. 2
measures ‖·‖₁ of the probability change too).

**How the truth is measured.** For each of N examples of a task, drawn across the whole range of the sensitivity
(:func:`pick_examples`: one from each of N equal rank strata), the network is retrained *from the weights it ended
that task with* (a warm start, as the MPE paper does) with the run's own method as that task started (its memory,
prior, posterior: ``saved_run.load_boundary``) and the run's optimiser, learning rate and batch size, for
``epochs`` epochs, by the one training loop (:func:`continual_blr.loop.fit_task`) with example i left out of the
minibatch it was drawn into (``leave_out``): every other batch, and every random number, is the one of the
reference retraining that removes nothing. So f^ref − f^∖i is i's own effect, not minibatch noise.

**The noise floors.** ``noise_floor`` = ‖softmax(f^ref) − softmax(f)‖₁, how far the reference retraining itself
moves each validated example from the trained network (the warm start is not an exact optimum); ``seed_floor`` =
‖softmax(f^ref,seed+1) − softmax(f^ref,seed)‖₁, how far two reference retrainings with other minibatch orders
disagree. A true deviation below the floors is not resolved by this budget; the correlations are reported over
all N examples and over those whose true deviation is above the seed floor.

Layer: inspection (above the loop); the run folder is read by ``continual_blr.saved_run``, which hands a
``start()`` callable building the network and method at the task's boundaries.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..data.stream import Task
from ..loop import fit_task
from ..methods.base import Method, TrainConfig
from .forgetting import spearman
from .scores import Covariance, _logits, score_examples

__all__ = ["Validation", "validate_sensitivity", "pick_examples", "leverage_shift", "deviation", "spearman",
           "pearson", "DEFAULT_VALIDATE_EPOCHS"]

DEFAULT_VALIDATE_EPOCHS = 2
"""Epochs of each warm-started retraining (``--validate-epochs``)."""

Start = Callable[[], tuple[nn.Module, Method]]
"""``start()`` → a new (network, method): the weights the task ended with, the method as the task started."""


def leverage_shift(error: Tensor, covariance: Tensor, probs: Tensor) -> Tensor:
    """Δf = V (I − Λ V)⁻¹ e per example, Λ = diag(p) − ppᵀ: the LOO shift with Σ_∖i in place of Σ (Woodbury).

    Args:
        error: e, [N, K]. covariance: V, [N, K, K]. probs: p, [N, K].

    Returns:
        [N, K]. Computed in float64 (I − ΛV is close to singular for examples that dominate their own fit).
    """
    v, e, p = covariance.double(), error.double(), probs.double()
    lam = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    eye = torch.eye(v.shape[-1], dtype=v.dtype, device=v.device).expand_as(v)
    z = torch.linalg.solve(eye - lam @ v, e.unsqueeze(-1))
    return (v @ z).squeeze(-1).to(error.dtype)


def deviation(logits_a: Tensor, logits_b: Tensor) -> Tensor:
    """‖softmax(a) − softmax(b)‖₁ per row, [N]."""
    return (torch.softmax(logits_a.double(), -1) - torch.softmax(logits_b.double(), -1)).abs().sum(-1)


def _linear_deviation(probs: Tensor, shift: Tensor) -> Tensor:
    """‖Λ Δf‖₁ per row, Λ = diag(p) − ppᵀ: the first-order change of softmax(f) under the logit shift Δf."""
    p, d = probs.double(), shift.double()
    return (p * d - p * (p * d).sum(-1, keepdim=True)).abs().sum(-1)


def pearson(a: Tensor, b: Tensor) -> float:
    """Pearson's r (float64); NaN when either has no spread or fewer than 2 values."""
    a, b = a.double().flatten(), b.double().flatten()
    if a.numel() < 2:
        return math.nan
    a, b = a - a.mean(), b - b.mean()
    den = float(a.norm() * b.norm())
    return float((a * b).sum()) / den if den > 0 else math.nan


def pick_examples(score: Tensor, n: int, generator: torch.Generator) -> Tensor:
    """``n`` row positions spread over the whole range of ``score``: the rows sorted by score are cut into ``n``
    strata of (nearly) equal size and one row is drawn uniformly from each (``generator``). Sorted by score."""
    m = score.numel()
    n = min(int(n), m)
    order = torch.argsort(score.double().cpu(), stable=True)
    edges = torch.linspace(0, m, n + 1, dtype=torch.float64).round().long()
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    pos = edges[:-1] + (u * (edges[1:] - edges[:-1]).double()).long().clamp(min=0)
    return order[pos.clamp(max=m - 1)]


@dataclass
class Validation:
    """Estimated against true leave-one-out deviations for N examples of one task.

    Attributes:
        task_id: the task. rows: the examples' positions in its training set, [N].
        sensitivity: the report's score ‖V e‖₁, [N].
        estimated: d̂ with the plain shift V e, [N]. estimated_leverage: d̂ with V (I − ΛV)⁻¹ e, [N].
        estimated_linear: d̂_lin = ‖Λ V e‖₁, [N].
        true: d = ‖softmax(f^∖i) − softmax(f^ref)‖₁ (same batches and random numbers without i), [N].
        true_vs_trained: ‖softmax(f^∖i) − softmax(f)‖₁, against the trained network, [N].
        noise_floor: ‖softmax(f^ref) − softmax(f)‖₁, [N]. seed_floor: ‖softmax(f^ref,seed+1) − softmax(f^ref)‖₁, [N].
        loss_change: ℓ_i(f^∖i) − ℓ_i(f^ref), the true rise of i's own loss, [N].
        estimated_loss_change: −log softmax(f + V e)_y + log p_y, [N].
        epochs, batch_size, lr, seed: the retraining budget. seconds: wall time of the retrainings.
        sigma_source: where Σ came from.
    """

    task_id: int
    rows: Tensor
    sensitivity: Tensor
    estimated: Tensor
    estimated_leverage: Tensor
    estimated_linear: Tensor
    true: Tensor
    true_vs_trained: Tensor
    noise_floor: Tensor
    seed_floor: Tensor
    loss_change: Tensor
    estimated_loss_change: Tensor
    epochs: int
    batch_size: int
    lr: float
    seed: int
    seconds: float
    cpu_seconds: float
    sigma_source: str = ""

    def __len__(self) -> int:
        return int(self.rows.numel())

    def summary(self) -> dict[str, float]:
        """Correlations (Pearson, Spearman) of each estimate with the truth, over all N examples and over those
        above the seed floor; the floors' medians; the loss-change correlation; the cost."""
        above = self.true > self.seed_floor
        out: dict[str, float] = {"n": float(len(self)), "n_above_seed_floor": float(int(above.sum())),
                                 "epochs": float(self.epochs), "seconds": self.seconds,
                                 "cpu_seconds": self.cpu_seconds,
                                 "seconds_per_retrain": self.seconds / max(len(self) + 2, 1)}
        for name, est in (("plain", self.estimated), ("leverage", self.estimated_leverage),
                          ("linear", self.estimated_linear), ("sensitivity", self.sensitivity)):
            out[f"spearman_{name}"] = spearman(est, self.true)
            out[f"pearson_{name}"] = pearson(est, self.true)
            out[f"spearman_{name}_above_floor"] = spearman(est[above], self.true[above])
        out["spearman_loss_change"] = spearman(self.estimated_loss_change, self.loss_change)
        for name in ("true", "true_vs_trained", "noise_floor", "seed_floor", "estimated", "estimated_leverage"):
            out[f"median_{name}"] = float(getattr(self, name).double().median())
        return out

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: (v.tolist() if isinstance(v, Tensor) else v) for k, v in d.items()} | {"summary": self.summary()}


def _retrain(start: Start, task: Task, previous: Sequence[Task], train: TrainConfig, seed: int,
             leave_out: Tensor | None, rows: Tensor) -> Tensor:
    """Logits of ``task``'s training examples ``rows`` after one warm-started retraining (without ``leave_out``)."""
    model, method = start()
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # dropout masks etc.: the same in every retraining of one seed
        fit_task(model, task, method, train, seen=[*previous, task], generator=torch.Generator().manual_seed(seed),
                 progress=False, end_task=False, leave_out=leave_out)
    return _logits(model, task.x_train[rows], task.head)


def validate_sensitivity(
    start: Start,
    task: Task,
    sigma: Covariance,
    train: TrainConfig,
    n: int,
    *,
    previous: Sequence[Task] = (),
    epochs: int = DEFAULT_VALIDATE_EPOCHS,
    seed: int = 0,
    rows: Tensor | None = None,
    sigma_source: str = "",
    progress: bool = False,
) -> Validation:
    """Retrain without each of ``n`` examples of ``task`` and compare the true deviation with the estimate.

    Args:
        start: builds a new (network, method): the weights ``task`` ended with, the method as ``task`` started.
        task: the task whose examples are left out, one at a time.
        sigma: the weight covariance Σ of the estimate (the report's).
        train: the run's training settings (optimiser, lr, batch size, clipping); ``epochs`` replaces its epochs.
        n: how many examples (:func:`pick_examples` over the sensitivity, unless ``rows`` is given).
        previous: the tasks before ``task`` (a replay or joint method trains on them too).
        epochs: epochs of each retraining. seed: the retrainings' seed (the seed floor uses seed + 1).
        rows: the examples' positions in ``task``'s training set (default: drawn by :func:`pick_examples`).
        progress: a tqdm bar over the retrainings.

    Returns:
        A :class:`Validation`. Cost: n + 2 retrainings of ``epochs`` epochs each, plus one scoring pass.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"validate: the number of examples must be a positive integer; got {n!r}")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"validate epochs: must be a positive integer; got {epochs!r}")
    model, _ = start()
    scores = score_examples(model, task.x_train, task.y_train, sigma, head=task.head, task_id=task.task_id)
    if rows is None:
        rows = pick_examples(scores.sensitivity, n, torch.Generator().manual_seed(seed))
    rows = rows.long().cpu()
    f = _logits(model, task.x_train[rows], task.head)
    e, cov, p = scores.error[rows], scores.covariance[rows], scores.probs[rows]
    plain, lev = scores.loo_shift[rows], leverage_shift(e, cov, p)
    y = task.y_train[rows].long().to(f.device)
    idx = torch.arange(rows.numel(), device=f.device)
    retrain = dataclasses.replace(train, epochs=int(epochs))
    t0, c0 = time.perf_counter(), time.process_time()
    bar = tqdm(total=rows.numel() + 2, desc=f"validate task {task.task_id}", leave=False,
               disable=None if progress else True)
    ref = _retrain(start, task, previous, retrain, seed, None, rows)
    bar.update()
    ref2 = _retrain(start, task, previous, retrain, seed + 1, None, rows)
    bar.update()
    left = torch.empty_like(ref)
    for k, r in enumerate(rows.tolist()):
        out = torch.tensor([r], device=task.x_train.device)
        left[k] = _retrain(start, task, previous, retrain, seed, out, rows[k : k + 1])[0]
        bar.update()
    bar.close()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    nll = lambda logits: -torch.log_softmax(logits.double(), -1)[idx, y]  # noqa: E731
    return Validation(
        task_id=task.task_id, rows=rows, sensitivity=scores.sensitivity[rows].cpu(),
        estimated=deviation(f + plain, f).cpu(), estimated_leverage=deviation(f + lev, f).cpu(),
        estimated_linear=_linear_deviation(p, plain).cpu(),
        true=deviation(left, ref).cpu(), true_vs_trained=deviation(left, f).cpu(),
        noise_floor=deviation(ref, f).cpu(), seed_floor=deviation(ref2, ref).cpu(),
        loss_change=(nll(left) - nll(ref)).cpu(), estimated_loss_change=(nll(f + plain) - nll(f)).cpu(),
        epochs=int(epochs), batch_size=int(train.batch_size), lr=float(train.lr), seed=int(seed),
        seconds=seconds, cpu_seconds=cpu, sigma_source=sigma_source)


def validation_covariance(run, task: Task, previous: Sequence[Task], prior_precision: float | None = None
                          ) -> tuple[Covariance, str]:
    """Σ for the estimate of a retraining on ``task``: the method's own (as the report's, at the task's end), else a
    diagonal Laplace–GGN posterior over the data the method trains on in that task (``method.train_tasks``: the
    task alone for ``none``), at the weights the task ended with. A penalty's own curvature (EWC's Fisher) is
    left out of the fallback.

    Args:
        run: a :class:`~.saved_run.SavedRun` holding the network and method as ``task`` ended.
    """
    from .saved_run import run_covariance

    trained = run.method.train_tasks(task, [*previous, task])
    return run_covariance(run, prior_precision, tasks=[t.task_id for t in trained])


def plot_validation(v: Validation, path) -> None:
    """Scatter of the estimated against the true deviation (log–log), one panel per estimate: the report's
    sensitivity ‖V e‖₁, the plain d̂, the linearised d̂_lin and the leverage-corrected d̂; the noise floor's median
    dashed. Values ≤ 0 are drawn at the panel's smallest positive value."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    s = v.summary()
    panels = [("sensitivity ‖V e‖₁", v.sensitivity, "sensitivity"), ("plain d̂", v.estimated, "plain"),
              ("linearised ‖Λ V e‖₁", v.estimated_linear, "linear"),
              ("leverage-corrected d̂", v.estimated_leverage, "leverage")]
    true = v.true.double().numpy()
    pos = true[true > 0]
    floor_true = pos.min() if pos.size else 1e-12
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.3), dpi=110, layout="constrained")
    for ax, (label, est, key) in zip(axes, panels):
        e = est.double().numpy()
        ep = e[e > 0]
        floor_e = ep.min() if ep.size else 1e-12
        ax.scatter(e.clip(min=floor_e), true.clip(min=floor_true), s=10, alpha=0.7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.axhline(max(s["median_seed_floor"], floor_true), color="grey", ls="--", lw=0.8)
        ax.set_xlabel(f"estimated: {label}")
        ax.set_title(f"Spearman {s[f'spearman_{key}']:.2f}", fontsize=9)
    axes[0].set_ylabel("true ‖softmax(f∖i) − softmax(f ref)‖₁")
    fig.suptitle(f"task {v.task_id + 1}: {len(v)} examples left out, {v.epochs} epochs each "
                 f"(dashed: median seed floor)", fontsize=10)
    fig.savefig(path)
    plt.close(fig)
