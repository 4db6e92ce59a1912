"""Forgetting, predicted: do an example's scores at its own task's end predict how much the stream makes it forget?

For a finished run of T tasks, every training example i of a task t < T − 1 is scored twice:

* at **its task's end** — the network and method as they stood when task t ended (the run folder's
  ``<method>/tasks/after_task<t>.pt``; :meth:`SavedRun.at_boundary`), with that boundary's Σ_t
  (:func:`~.saved_run.run_covariance` of the boundary, a fallback Laplace over tasks 0..t only):

      relevance    r_i = tr Λ_i = Σ_k p_ik (1 − p_ik)            (what FROMP selects its memory on)
      variance     tr V_i,  V_i = J_i Σ_t J_iᵀ                   (how weakly the weights determine f_i)
      sensitivity  s_i = ‖V_i e_i‖₁,  e_i = p_i − onehot(y_i)    (Nickl et al. 2023: the leave-one-out shift)
      memory       m_i = 1 if the method stores example i as task t + 1 starts (FROMP's memorable points, a
                   replay buffer's examples), else 0
      loss         ℓ_i^t = −log p_{i,y_i}                          (a baseline predictor: the fit itself)
      correct      c_i^t = 1[argmax p_i = y_i]

* at **the stream's end** — the final network: ℓ_i^T and c_i^T (its task's head; no Σ needed).

The target quantities are the loss increase Δℓ_i = ℓ_i^T − ℓ_i^t and "forgotten" = c_i^t ∧ ¬c_i^T. For each predictor
z (``PREDICTORS``) :func:`forgetting_table` reports, pooled over the examples of tasks 0..T − 2:

      ρ_z   = Spearman(z, Δℓ)                   the Pearson correlation of the average ranks (ties share their mean rank)
      AUC_z = P(z_i > z_j) + ½ P(z_i = z_j)     i forgotten, j not, both correct at their task's end
            = (R₊ − n₊(n₊ + 1)/2) / (n₊ n₋)     (Mann–Whitney; R₊ the sum of the forgotten examples' average ranks)

AUC 0.5 is chance; a constant predictor (no memory: m ≡ 0) has AUC exactly 0.5 and ρ undefined (NaN). The pooled AUC
also rewards a score for telling the tasks apart (tr V of an early boundary's Σ is larger, and early tasks are forgotten
more); :func:`within_task_auroc` averages the per-task AUCs instead, weighted by each task's forgotten examples.

What it predicts and what it does not: the scores are properties of an example under the network of its own task's
end — how uncertain (r), how weakly determined (tr V), how influential (s), how poorly fitted (ℓ) it is. They do not
see the later tasks, so they cannot predict *which* directions the later tasks will move; a high AUC says that the
examples a method later loses were already fragile at their task's end, not that the score is a forecast of the
stream. Correlations are pooled over tasks, so tasks that are forgotten more (typically the first) contribute
between-task as well as within-task ranking; :func:`forgetting_table` also returns them per task.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .generalisation import LOG_FLOOR, Generalisation, generalisation
from .saved_run import SavedRun, run_covariance, stored_memory
from .scores import ExampleScores, score_examples

__all__ = [
    "PREDICTORS",
    "Forgetting",
    "average_ranks",
    "spearman",
    "auroc",
    "roc_curve",
    "example_loss",
    "collect_forgetting",
    "forgetting_table",
    "within_task_auroc",
    "score_forgetting",
    "ForgettingAnalysis",
]

PREDICTORS = ("relevance", "variance", "sensitivity", "memory", "loss")
"""The task-end scores tested as predictors of forgetting (``Forgetting.score``)."""


@dataclass
class Forgetting:
    """Every training example of tasks 0..T − 2, scored at its task's end and at the stream's end (module docstring).

    Attributes:
        task_id, index, label: the example (task, position in the task's training set, head-local label), [N].
        relevance, variance, sensitivity: tr Λ, tr V, ‖V e‖₁ at the task's end, float64 [N].
        memory: stored by the method as the next task starts, bool [N].
        loss_task_end, loss_final: −log p_y at the task's end and at the stream's end, float64 [N].
        correct_task_end, correct_final: argmax p = y then, bool [N].
    """

    task_id: Tensor
    index: Tensor
    label: Tensor
    relevance: Tensor
    variance: Tensor
    sensitivity: Tensor
    memory: Tensor
    loss_task_end: Tensor
    loss_final: Tensor
    correct_task_end: Tensor
    correct_final: Tensor

    def __len__(self) -> int:
        return int(self.index.shape[0])

    @property
    def loss_increase(self) -> Tensor:
        """Δℓ = ℓ^T − ℓ^t, float64 [N]."""
        return self.loss_final - self.loss_task_end

    @property
    def forgotten(self) -> Tensor:
        """Correct at its task's end, wrong at the stream's end, bool [N]."""
        return self.correct_task_end & ~self.correct_final

    def score(self, name: str) -> Tensor:
        """A predictor as float64 [N]: ``relevance``, ``variance``, ``sensitivity``, ``memory`` (0/1), ``loss``
        (the task-end loss)."""
        if name == "memory":
            return self.memory.double()
        if name == "loss":
            return self.loss_task_end
        if name in ("relevance", "variance", "sensitivity"):
            return getattr(self, name)
        raise ValueError(f"score: got {name!r}; allowed: {', '.join(PREDICTORS)}")

    def select(self, mask: Tensor) -> "Forgetting":
        """The examples where ``mask`` holds."""
        return Forgetting(**{k: getattr(self, k)[mask] for k in self.__dataclass_fields__})


def average_ranks(x: Tensor) -> Tensor:
    """1-based ranks of ``x`` (float64), ties given the mean of the ranks they span (``scipy.stats.rankdata``'s
    ``"average"``)."""
    x = x.detach().cpu().double().reshape(-1)
    n = x.shape[0]
    if n == 0:
        return x.clone()
    order = torch.sort(x, stable=True).indices
    xs = x[order]
    # a run of equal values [a, b) gets rank (a + 1 + b) / 2
    new = torch.ones(n, dtype=torch.bool)
    new[1:] = xs[1:] != xs[:-1]
    group = torch.cumsum(new.long(), 0) - 1
    starts = torch.nonzero(new).reshape(-1)
    ends = torch.cat([starts[1:], torch.tensor([n])])
    mean_rank = (starts + 1 + ends).double() / 2.0
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[order] = mean_rank[group]
    return ranks


def spearman(a: Tensor, b: Tensor) -> float:
    """Spearman's ρ with ties: Pearson's correlation of :func:`average_ranks` of ``a`` and ``b``,

        ρ = Σ_i (R_i − R̄)(S_i − S̄) / sqrt(Σ_i (R_i − R̄)² Σ_i (S_i − S̄)²);

    NaN when either is constant (or fewer than 2 values)."""
    ra, rb = average_ranks(a), average_ranks(b)
    if ra.shape != rb.shape:
        raise ValueError(f"spearman: a has {ra.shape[0]} values, b {rb.shape[0]}")
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = math.sqrt(float((ra * ra).sum()) * float((rb * rb).sum()))
    return float((ra * rb).sum()) / den if den > 0 else float("nan")


def auroc(score: Tensor, positive: Tensor) -> float:
    """The area under the ROC curve of ``score`` for the boolean label ``positive``, exactly, with ties:

        AUC = (1/(n₊ n₋)) Σ_{i∈+} Σ_{j∈−} (1[s_i > s_j] + ½ 1[s_i = s_j]) = (R₊ − n₊(n₊ + 1)/2) / (n₊ n₋),

    R₊ the sum of the positives' :func:`average_ranks` among all scores (the Mann–Whitney U over n₊ n₋).
    NaN when there are no positives or no negatives."""
    pos = positive.detach().cpu().bool().reshape(-1)
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    r = average_ranks(score)
    if r.shape[0] != pos.shape[0]:
        raise ValueError(f"auroc: {r.shape[0]} scores, {pos.shape[0]} labels")
    u = float(r[pos].sum()) - n_pos * (n_pos + 1) / 2.0
    return u / (n_pos * n_neg)


def roc_curve(score: Tensor, positive: Tensor) -> tuple[Tensor, Tensor]:
    """The ROC curve's corners (false-positive rate, true-positive rate), float64, from (0, 0) to (1, 1): one corner
    per distinct score, thresholds from the highest down (tied scores step diagonally, so the trapezoid area under
    it equals :func:`auroc`)."""
    s = score.detach().cpu().double().reshape(-1)
    pos = positive.detach().cpu().bool().reshape(-1)
    n_pos, n_neg = max(int(pos.sum()), 1), max(int((~pos).sum()), 1)
    order = torch.sort(s, descending=True, stable=True).indices
    s, p = s[order], pos[order].double()
    tp, fp = torch.cumsum(p, 0), torch.cumsum(1.0 - p, 0)
    last = torch.ones(s.shape[0], dtype=torch.bool)
    last[:-1] = s[1:] != s[:-1]  # the last element of each run of equal scores
    zero = torch.zeros(1, dtype=torch.float64)
    return torch.cat([zero, fp[last] / n_neg]), torch.cat([zero, tp[last] / n_pos])


def example_loss(probs: Tensor, label: Tensor) -> Tensor:
    """−log p_{i,y_i} in float64, p clamped at :data:`~.generalisation.LOG_FLOOR`, [N]."""
    y = label.detach().cpu().long()
    p = probs.detach().cpu().double()[torch.arange(y.shape[0]), y]
    return -p.clamp_min(LOG_FLOOR).log()


def collect_forgetting(task_end: Sequence[ExampleScores], final_probs: Sequence[Tensor]) -> Forgetting:
    """Pool the task-end scores of tasks 0..T − 2 with the final network's probabilities of the same examples.

    Args:
        task_end: one :class:`ExampleScores` per task, scored at that task's end (``stored_memory`` filled from the
            boundary's memory).
        final_probs: the final network's probabilities [N_t, K] of the same examples, in the same row order.
    """
    if len(task_end) != len(final_probs):
        raise ValueError(f"collect_forgetting: {len(task_end)} tasks of scores, {len(final_probs)} of probabilities")
    cols: dict[str, list[Tensor]] = {k: [] for k in Forgetting.__dataclass_fields__}
    for s, pf in zip(task_end, final_probs):
        if pf.shape[0] != len(s):
            raise ValueError(f"collect_forgetting: task {s.task_id}: {len(s)} scored examples, {pf.shape[0]} final")
        y = s.label.detach().cpu().long()
        cols["task_id"].append(torch.full((len(s),), int(s.task_id), dtype=torch.long))
        cols["index"].append(s.index.detach().cpu().long())
        cols["label"].append(y)
        cols["relevance"].append(s.relevance.detach().cpu().double())
        cols["variance"].append(s.variance_total.detach().cpu().double())
        cols["sensitivity"].append(s.sensitivity.detach().cpu().double())
        cols["memory"].append(s.stored_memory.detach().cpu().bool())
        cols["loss_task_end"].append(example_loss(s.probs, y))
        cols["loss_final"].append(example_loss(pf, y))
        cols["correct_task_end"].append(s.pred.detach().cpu().long() == y)
        cols["correct_final"].append(pf.detach().cpu().argmax(-1) == y)
    empty = {"task_id": torch.long, "index": torch.long, "label": torch.long, "memory": torch.bool,
             "correct_task_end": torch.bool, "correct_final": torch.bool}
    return Forgetting(**{k: torch.cat(v) if v else torch.zeros(0, dtype=empty.get(k, torch.float64))
                         for k, v in cols.items()})


def forgetting_table(f: Forgetting, predictors: Sequence[str] = PREDICTORS) -> dict[str, Any]:
    """Spearman's ρ of each predictor with the loss increase (all examples) and its AUROC for "forgotten" (among the
    examples correct at their task's end), pooled and per task; with the counts.

    Returns:
        A dict with ``n``, ``n_correct_task_end``, ``n_forgotten``, ``forgotten_fraction``, ``mean_loss_increase``,
        ``predictors`` (``{z: {"spearman": ρ, "auroc": AUC, "auroc_within": within_task_auroc}}``) and ``per_task``
        (``{t: the same for task t}``, without ``auroc_within``).
    """
    def one(g: Forgetting) -> dict[str, Any]:
        at_risk = g.correct_task_end
        forgotten = g.forgotten[at_risk]
        inc = g.loss_increase
        return {
            "n": len(g),
            "n_correct_task_end": int(at_risk.sum()),
            "n_forgotten": int(g.forgotten.sum()),
            "forgotten_fraction": float(g.forgotten.sum()) / max(1, int(at_risk.sum())),
            "mean_loss_increase": float(inc.mean()) if len(g) else float("nan"),
            "predictors": {z: {"spearman": spearman(g.score(z), inc), "auroc": auroc(g.score(z)[at_risk], forgotten)}
                           for z in predictors},
        }

    out = one(f)
    out["per_task"] = {int(t): one(f.select(f.task_id == t)) for t in torch.unique(f.task_id).tolist()}
    for z in predictors:
        out["predictors"][z]["auroc_within"] = within_task_auroc(out["per_task"], z)
    return out


def within_task_auroc(per_task: dict[int, dict[str, Any]], predictor: str) -> float:
    """The per-task AUROCs of ``predictor`` averaged with weights n₊_t (the task's forgotten examples),

        AUC_within = Σ_t n₊_t AUC_t / Σ_t n₊_t        (tasks with no forgotten example, or none kept, left out),

    so that it ranks examples only against examples of the same task: the pooled AUROC also counts which *task* an
    example belongs to (a score that differs between tasks and a task that is forgotten more move it). NaN when no
    task has an AUROC."""
    num = den = 0.0
    for v in per_task.values():
        a = v["predictors"][predictor]["auroc"]
        if a is not None and not math.isnan(a):
            num += v["n_forgotten"] * a
            den += v["n_forgotten"]
    return num / den if den > 0 else float("nan")


@dataclass
class ForgettingAnalysis:
    """What :func:`score_forgetting` computed for a run.

    Attributes:
        forgetting: the pooled per-example table (tasks 0..T − 2).
        task_end: the :class:`ExampleScores` of every task at its own task's end (the last task's end is the
            stream's end; it is scored too, for the generalisation table).
        at_task_end: :class:`Generalisation` of every task at its task's end (LOO estimate vs measured test).
        sigma_sources: where each boundary's Σ came from (one line per task).
        timings: seconds (``boundaries``: loading, ``scores``: Σ and scores, ``final``: the final network's pass).
    """

    forgetting: Forgetting
    task_end: list[ExampleScores]
    at_task_end: list[Generalisation]
    sigma_sources: list[str]
    timings: dict[str, float] = field(default_factory=dict)

    def table(self, predictors: Sequence[str] = PREDICTORS) -> dict[str, Any]:
        """:func:`forgetting_table` of :attr:`forgetting`."""
        return forgetting_table(self.forgetting, predictors)


@torch.no_grad()
def _probs(model, x: Tensor, head: int, batch: int = 1024) -> Tensor:
    from ..curvature import eval_mode
    from ..curvature._engine import model_kwargs

    ref = next(model.parameters())
    kw = model_kwargs(model, head)
    with eval_mode(model):
        return torch.cat([torch.softmax(model(x[s : s + batch].to(device=ref.device, dtype=ref.dtype), **kw), -1)
                          for s in range(0, x.shape[0], batch)]).cpu()


def score_forgetting(run: SavedRun, boundary: Callable[[int], SavedRun] | None = None, *,
                     prior_precision: float | None = None,
                     progress: Callable[[str], None] | None = None) -> ForgettingAnalysis:
    """Score every task's training examples at its own task's end and at the stream's end (module docstring).

    Args:
        run: the finished run (its network is the stream's end).
        boundary: ``boundary(t)`` → the run as it stood when task t ended (default ``run.at_boundary``;
            :func:`continual_blr.saved_run.load_boundary` for a run folder).
        prior_precision: δ of the fallback diagonal Laplace Σ (methods without their own Σ), over tasks 0..t.
        progress: called with a short label before each task (e.g. a progress bar's postfix).

    Raises:
        LookupError: ``run`` keeps no task boundaries (a :class:`SavedRun` built in a script).
        FileNotFoundError: a run folder written before boundaries were kept
            (:class:`continual_blr.saved_run.RunNotFoundError`).
    """
    boundary = boundary or run.at_boundary
    tasks = run.stream.tasks
    dev = next(run.model.parameters()).device
    t_load = t_scores = 0.0
    task_end, at_end, sources, finals = [], [], [], []
    for t, task in enumerate(tasks):
        if progress is not None:
            progress(f"task {t + 1} at its end")
        t0 = time.perf_counter()
        b = boundary(t)
        t1 = time.perf_counter()
        sigma, source = run_covariance(b, prior_precision, tasks=range(t + 1))
        x, y = task.x_train.to(dev), task.y_train.to(dev)
        s = score_examples(b.model, x, y, sigma, head=task.head, task_id=task.task_id)
        mem = stored_memory(b).get(int(task.task_id))
        if mem is not None:
            s.stored_memory[mem["indices"]] = True
        at_end.append(generalisation(b.model, task, s))
        task_end.append(s)
        sources.append(source)
        t_load += t1 - t0
        t_scores += time.perf_counter() - t1
        del b
    t0 = time.perf_counter()
    for task in tasks[:-1]:
        finals.append(_probs(run.model, task.x_train.to(dev), task.head))
    t_final = time.perf_counter() - t0
    f = collect_forgetting(task_end[:-1], finals)
    return ForgettingAnalysis(f, task_end, at_end, sources,
                              {"boundaries": t_load, "scores": t_scores, "final": t_final})
