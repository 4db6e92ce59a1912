"""Inspect a finished run and write the report: PNG figures, ``scores.csv`` and ``index.html``.

    from continual_blr.saved_run import load_run
    from continual_blr.inspect import inspect_run, write_report
    run = load_run("runs/latest", prefer_memory=True)      # the runner's layer reads the folder
    index = write_report(inspect_run(run, top=40), "runs/latest/inspect")

(``continual_blr.saved_run.inspect_path`` does the three steps; ``continual-blr inspect`` calls it.)

:func:`inspect_run` computes the scores of every training example of the chosen tasks (see
:mod:`.scores`) and marks the memorable points with FROMP's own selection function
(:func:`continual_blr.memory.select_memorable`, top-k by tr Λ per class at the final weights) and, when
the run stored a memory, with the points it holds. :func:`write_report` draws the figures and writes
the CSV and a self-contained HTML page (figures embedded as data URIs, and also written beside it).

"Memorable" in the report: the run's stored memory for a task when there is one (what the network is
actually regularised to remember, or an ER / DER replay buffer's examples of the task), else the top-k by
tr Λ at the final weights. For the last task of
a FROMP run the two coincide exactly (the memory was chosen at the final weights).
"""

from __future__ import annotations

import base64
import contextlib
import csv
import html
import json
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..data.stream import Task
from ..memory import select_memorable, select_per_class
from . import figures
from .forgetting import PREDICTORS, ForgettingAnalysis, score_forgetting
from .generalisation import Generalisation, generalisation
from .saved_run import SavedRun, memory_kind, run_covariance, stored_memory
from .scores import ExampleScores, score_examples
from .validate import Validation, plot_validation

__all__ = ["Inspection", "inspect_run", "write_report", "DEFAULT_TOP", "MAX_IMAGES", "grid_predictor"]

DEFAULT_TOP = 40
"""Memorable points per task when the run stored none (FROMP's split-MNIST protocol: 20 per class)."""

MAX_IMAGES = 40
"""Examples drawn per grid (the CSV holds all of them)."""

_STORED_NAME = {"fromp": "stored FROMP memory", "replay": "stored replay buffer"}


@dataclass
class Inspection:
    """The scores of a run's tasks and what produced them.

    Attributes:
        run: the reloaded run.
        tasks: the inspected tasks (stream order).
        scores: one :class:`ExampleScores` per inspected task.
        top: memorable points per task (k of the top-k, split over classes as FROMP does).
        sigma_source: where Σ came from (one line).
        has_memory: whether the run stored past examples (memorable points or a replay buffer).
        timings: seconds spent per stage.
        memory_kind: ``"fromp"`` (memorable points), ``"replay"`` (an ER / DER replay buffer) or ``""``.
        generalisation: per inspected task, the leave-one-out estimate of its test NLL and accuracy from its training
            data at the final weights, beside the measured ones (:mod:`.generalisation`).
        forgetting: every task scored at its own task's end and at the stream's end (:mod:`.forgetting`); None when
            not computed (one task, ``forgetting=False``, or a run folder without task boundaries).
        forgetting_note: why :attr:`forgetting` is None (one line; empty when it is not).
        validation: the sensitivities checked against retraining (:mod:`.validate`, ``inspect --validate N``); None
            when not asked for. The report's first screen cites it, and ``validation.json`` / ``validation.png`` hold it.
    """

    run: SavedRun
    tasks: list[Task]
    scores: list[ExampleScores]
    top: int
    sigma_source: str
    has_memory: bool
    timings: dict[str, float] = field(default_factory=dict)
    memory_kind: str = ""
    generalisation: list[Generalisation] = field(default_factory=list)
    forgetting: ForgettingAnalysis | None = None
    forgetting_note: str = ""
    validation: Validation | None = None

    def task_label(self, i: int) -> str:
        t = self.tasks[i]
        return f"task {t.task_id + 1}" + (f" ({t.name})" if t.name else "")

    def class_name(self, i: int, label: int) -> str:
        """The original class of a label (task-incremental labels are renumbered within a task)."""
        t = self.tasks[i]
        if self.run.stream.scenario == "task" and 0 <= label < len(t.classes):
            return str(t.classes[label])
        return str(label)


def inspect_run(
    run: SavedRun,
    *,
    tasks: Sequence[int] | None = None,
    top: int | None = None,
    prior_precision: float | None = None,
    progress: bool = False,
    forgetting: bool = True,
) -> Inspection:
    """Score every training example of the chosen tasks of a reloaded run (no retraining).

    The data follow the network's device (a run loaded with ``device="cuda"`` is scored there).

    Args:
        run: a :class:`SavedRun` (e.g. from :func:`continual_blr.saved_run.load_run`).
        tasks: task ids (0-based, stream order); default all.
        top: memorable points per task (FROMP's ``n_points``: split evenly over the task's classes);
            default: what the run's memory holds per task, else :data:`DEFAULT_TOP`.
        prior_precision: δ of the diagonal Laplace posterior for methods without their own Σ.
        progress: show a progress bar (tqdm) over Σ and the tasks.
        forgetting: also score every task at its own task's end (the run's task boundaries,
            :meth:`SavedRun.at_boundary`) for the forgetting analysis (:mod:`.forgetting`) and the leave-one-out
            estimate at each task's end; a run without boundaries gets a one-line note instead. It costs one Σ
            and one scoring pass per task (about the scores' time again).

    Returns:
        An :class:`Inspection`.
    """
    t0 = time.perf_counter()
    n_tasks = len(run.stream.tasks)
    ids = list(range(n_tasks)) if tasks is None else [int(t) for t in tasks]
    bad = [t for t in ids if not 0 <= t < n_tasks]
    if bad:
        raise ValueError(f"tasks: the stream has {n_tasks} tasks, allowed indices 0..{n_tasks - 1} "
                         f"(0-based: the report's task k is index k − 1); got {bad[0]}")
    memory = stored_memory(run)
    if top is None:
        top = max((m["n"] for m in memory.values()), default=DEFAULT_TOP)
    if int(top) < 1:
        raise ValueError(f"top: must be >= 1, got {top}")
    chosen = [run.stream.tasks[i] for i in ids]
    dev = next(run.model.parameters()).device
    bar = tqdm(total=len(chosen) + 1, desc=f"inspect {run.method_name}", unit="step",
               disable=None if progress else True,
               leave=False)
    try:
        bar.set_postfix_str("covariance")
        sigma, source = run_covariance(run, prior_precision)
        bar.update(1)
        t_sigma = time.perf_counter()
        out = []
        for task in chosen:
            bar.set_postfix_str(f"task {task.task_id + 1}")
            x, y = task.x_train.to(dev), task.y_train.to(dev)
            s = score_examples(run.model, x, y, sigma, head=task.head, task_id=task.task_id)
            # FROMP's own selection (the function FROMPMethod calls at a task's end), at the final weights
            idx, lam = select_memorable(run.model, x, y, int(top), head=task.head)
            s.topk_now[idx.cpu()] = True
            s.lowest[select_per_class(lam, y.to(lam.device), int(top), selection="lowest").cpu()] = True
            if task.task_id in memory:
                s.stored_memory[memory[task.task_id]["indices"]] = True
                s.memorable = s.stored_memory.clone()
            else:
                s.memorable = s.topk_now.clone()
            out.append(s)
            bar.update(1)
        gens = [generalisation(run.model, task, s) for task, s in zip(chosen, out)]
        t_scores = time.perf_counter()
        analysis, note = None, ""
        if forgetting and n_tasks < 2:
            note = "the stream has one task: nothing to forget"
        elif forgetting:
            bar.total += n_tasks
            bar.refresh()

            def step(label: str) -> None:
                bar.set_postfix_str(label)
                bar.update(1)

            try:
                analysis = score_forgetting(run, prior_precision=prior_precision, progress=step)
            except (LookupError, FileNotFoundError) as err:
                note = str(err).splitlines()[0]
    finally:
        bar.close()
    timings = {"covariance": t_sigma - t0, "scores": t_scores - t_sigma}
    if forgetting:
        timings["forgetting"] = time.perf_counter() - t_scores
    return Inspection(run, chosen, out, int(top), source, bool(memory), timings,
                      memory_kind(run.method) if memory else "", gens, analysis, note)


# ---------------------------------------------------------------------------------------- CSV


def _csv(insp: Inspection, path: Path) -> Path:
    k_max = max(s.n_outputs for s in insp.scores)
    head = (["task", "task_id", "head", "index", "label", "class", "pred", "prob_true", "relevance", "error_norm",
             "variance_total"] + [f"variance_{k}" for k in range(k_max)]
            + ["sensitivity", "sensitivity_diag", "loo_loss_increase", "loo_prob_true", "loo_delta_prob_true"]
            + [f"loo_shift_{k}" for k in range(k_max)] + ["memorable", "topk_now", "stored_memory", "lowest"]
            + list(FORGETTING_COLUMNS))
    forgetting = _forgetting_rows(insp)
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(head)
        for i, s in enumerate(insp.scores):
            cols = {n: getattr(s, n).detach().cpu().double().tolist() for n in
                    ("prob_true", "relevance", "error_norm", "variance_total", "sensitivity", "sensitivity_diag",
                     "loo_loss_increase", "loo_prob_true", "loo_delta_prob_true")}
            var = s.variance.detach().cpu().double().tolist()
            shift = s.loo_shift.detach().cpu().double().tolist()
            label, pred, index = s.label.tolist(), s.pred.tolist(), s.index.tolist()
            masks = [m.tolist() for m in (s.memorable, s.topk_now, s.stored_memory, s.lowest)]
            pad = [""] * (k_max - s.n_outputs)
            for r in range(len(s)):
                w.writerow([s.task_id + 1, s.task_id, s.head, index[r], label[r], insp.class_name(i, label[r]),
                            pred[r]] + [f"{cols[n][r]:.9g}" for n in ("prob_true", "relevance", "error_norm",
                                                                        "variance_total")]
                           + [f"{v:.9g}" for v in var[r]] + pad
                           + [f"{cols[n][r]:.9g}" for n in ("sensitivity", "sensitivity_diag", "loo_loss_increase",
                                                            "loo_prob_true", "loo_delta_prob_true")]
                           + [f"{v:.9g}" for v in shift[r]] + pad + [int(m[r]) for m in masks]
                           + forgetting.get((s.task_id, index[r]), _NO_FORGETTING))
    return path


FORGETTING_COLUMNS = ("relevance_task_end", "variance_task_end", "sensitivity_task_end", "memory_task_end",
                      "loss_task_end", "loss_final", "loss_increase", "correct_task_end", "correct_final", "forgotten")
"""The forgetting analysis's columns of ``scores.csv`` (:mod:`.forgetting`): scores at the example's task's end,
its loss at the stream's end, and the flags; empty for the last task and when the analysis was not computed."""
_NO_FORGETTING = [""] * len(FORGETTING_COLUMNS)


def _forgetting_rows(insp: Inspection) -> dict[tuple[int, int], list]:
    """``(task_id, index)`` → the :data:`FORGETTING_COLUMNS` cells of that example."""
    if insp.forgetting is None:
        return {}
    f = insp.forgetting.forgetting
    cols = [f.relevance.tolist(), f.variance.tolist(), f.sensitivity.tolist(), f.memory.int().tolist(),
            f.loss_task_end.tolist(), f.loss_final.tolist(), f.loss_increase.tolist(),
            f.correct_task_end.int().tolist(), f.correct_final.int().tolist(), f.forgotten.int().tolist()]
    tids, idx = f.task_id.tolist(), f.index.tolist()
    return {(tids[r], idx[r]): [f"{c[r]:.9g}" if isinstance(c[r], float) else c[r] for c in cols]
            for r in range(len(f))}


# -------------------------------------------------------------------------------------- figures


def _grids(insp: Inspection, i: int, out: Path) -> list[tuple[str, Path]]:
    s, task = insp.scores[i], insp.tasks[i]
    t = task.task_id + 1
    correct = (s.pred == s.label).tolist()

    def caption(r: int, score: str) -> str:
        y = int(s.label[r])
        line2 = {"relevance": f"trΛ={float(s.relevance[r]):.3g}",
                 "sensitivity": f"s={float(s.sensitivity[r]):.2g}"}[score]
        return f"y={insp.class_name(i, y)} p={float(s.prob_true[r]):.2f}\n{line2}"

    def rows_of(mask: torch.Tensor, score: str, descending: bool) -> list[int]:
        order = s.order(score, descending).tolist()
        return [r for r in order if bool(mask[r])][:MAX_IMAGES]

    sections = [
        ("most memorable", "most_memorable", rows_of(s.memorable, "relevance", True), "relevance",
         _STORED_NAME.get(insp.memory_kind, "stored memory") if bool(s.stored_memory.any())
         else f"top-{insp.top} by tr Λ"),
        ("least memorable", "least_memorable", rows_of(s.lowest, "relevance", False), "relevance",
         f"lowest {insp.top} by tr Λ"),
        ("most sensitive", "most_sensitive", s.order("sensitivity", True).tolist()[:min(MAX_IMAGES, insp.top)],
         "sensitivity", "largest leave-one-out logit shift ‖V e‖₁"),
    ]
    written = []
    if figures.is_image_shape(insp.run.stream.input_shape):
        x = task.x_train.cpu()
        for title, stem, rows, score, how in sections:
            idx = s.index[rows] if rows else torch.zeros(0, dtype=torch.long)
            path = figures.plot_example_grid(
                x[idx], [caption(r, score) for r in rows], out / f"task{t}_{stem}.png",
                title=f"{insp.task_label(i)}: {title} — {how}", bad=[not correct[r] for r in rows])
            written.append((f"{title}", path))
    else:
        sens = torch.zeros(len(s), dtype=torch.bool)
        sens[sections[2][2]] = True
        marks = {"memorable": s.memorable, "lowest": s.lowest, "sensitive": sens}
        if bool(s.stored_memory.any()) and not torch.equal(s.topk_now, s.stored_memory):
            marks["top-k now"] = s.topk_now
        names = [insp.class_name(i, int(c)) for c in torch.unique(s.label).tolist()]
        path = figures.plot_projection(task.x_train[s.index], s.label, out / f"task{t}_projection.png",
                                       marks=marks, title=f"{insp.task_label(i)}: 2-D PCA projection",
                                       class_names=names)
        written.append(("projection", path))
    return written


# ------------------------------------------------------------------------- generalisation and forgetting

FORGETTING_GRID_PREDICTORS = ("relevance", "variance", "sensitivity")
"""The scores the "predicted to forget" grid may rank by: the one with the highest AUROC in the run (stated)."""


def grid_predictor(table: dict) -> str:
    """The score of :data:`FORGETTING_GRID_PREDICTORS` with the highest pooled AUROC (ties: the first)."""
    best, best_auc = FORGETTING_GRID_PREDICTORS[0], -1.0
    for z in FORGETTING_GRID_PREDICTORS:
        a = table["predictors"].get(z, {}).get("auroc", float("nan"))
        if not math.isnan(a) and a > best_auc:
            best, best_auc = z, a
    return best


def _forgetting_figures(insp: Inspection, table: dict, out: Path) -> list[tuple[str, Path]]:
    """The ROC / scatter figure and, for image inputs, the forgotten examples beside those predicted to forget."""
    f = insp.forgetting.forgetting  # type: ignore[union-attr]
    run = insp.run
    z = grid_predictor(table)
    written = [("roc", figures.plot_forgetting(
        f, out / "forgetting.png", predictors=PREDICTORS, scatter=z,
        title=f"{run.method_name} on {run.stream.name}: does a score at an example's task's end predict its forgetting?"))]
    if not figures.is_image_shape(run.stream.input_shape):
        return written
    forgotten = f.forgotten
    inc = f.loss_increase
    rows_f = [r for r in torch.sort(inc, descending=True, stable=True).indices.tolist() if bool(forgotten[r])]
    n = min(MAX_IMAGES, max(len(rows_f), 1))
    risk = f.correct_task_end
    score = f.score(z)
    rows_p = [r for r in torch.sort(score, descending=True, stable=True).indices.tolist() if bool(risk[r])][:n]
    rows_f = rows_f[:n]
    tasks = run.stream.tasks

    def images(rows: list[int]) -> torch.Tensor:
        if not rows:
            return torch.zeros(0, *run.stream.input_shape)
        return torch.stack([tasks[int(f.task_id[r])].x_train[int(f.index[r])].cpu() for r in rows])

    def caption(r: int, line2: str) -> str:
        t = int(f.task_id[r])
        label = int(f.label[r])
        cls = tasks[t].classes[label] if run.stream.scenario == "task" and label < len(tasks[t].classes) else label
        return f"T{t + 1} y={cls}\n{line2}"

    caps_f = [caption(r, f"Δloss={float(inc[r]):.2g}") for r in rows_f]
    written.append(("forgotten", figures.plot_example_grid(
        images(rows_f), caps_f, out / "forgotten.png",
        title=f"forgotten: correct at their task's end, wrong at the stream's end — {len(rows_f)} of "
              f"{int(forgotten.sum())} with the largest loss increase Δℓ", bad=[True] * len(rows_f))))
    short = {"relevance": "trΛ", "variance": "trV", "sensitivity": "s"}.get(z, z)
    caps_p = [caption(r, f"{short}={float(score[r]):.2g}") for r in rows_p]
    hit = [bool(forgotten[r]) for r in rows_p]
    written.append(("predicted", figures.plot_example_grid(
        images(rows_p), caps_p, out / "predicted_to_forget.png",
        title=f"predicted to forget: the {len(rows_p)} highest {z} at their task's end (correct then); "
              f"red: forgotten ({sum(hit)} of {len(rows_p)})", bad=hit)))
    return written


def _generalisation_html(insp: Inspection) -> str:
    e = html.escape
    ends = {g.task_id: g for g in insp.forgetting.at_task_end} if insp.forgetting is not None else {}
    rows = []
    for i, g in enumerate(insp.generalisation):
        t = ends.get(g.task_id)
        cells = [e(insp.task_label(i))]
        for x in ([t] if ends else []) + [g]:
            if x is None:
                cells += ["–"] * 6
                continue
            cells += [_fmt(x.train_nll), _fmt(x.loo_nll), _fmt(x.test_nll), f"{x.nll_gap:+.3g}",
                      _fmt(x.loo_acc), _fmt(x.test_acc)]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    sub = ("<th>train NLL</th><th>LOO NLL</th><th>test NLL</th><th>gap LOO − test</th><th>LOO acc</th>"
           "<th>test acc</th>")
    groups = ([("at its task's end", sub)] if ends else []) + [("at the stream's end", sub)]
    head = ("<tr><th rowspan=2>task</th>" + "".join(f"<th colspan=6>{g}</th>" for g, _ in groups) + "</tr><tr>"
            + "".join(h for _, h in groups) + "</tr>")
    note = ("" if ends else f"<p>At each task's end: not available ({e(insp.forgetting_note)}).</p>"
            if insp.forgetting_note else "")
    return f"""<h2>Generalisation from training data alone</h2>
<p>The leave-one-out estimate of each task's test NLL and accuracy, from its training examples alone: the logits
example i would get from the network trained without it, f<sub>i</sub> + V<sub>i</sub> e<sub>i</sub>
(Nickl et al. 2023), give LOO NLL = mean −log softmax(f<sub>i</sub> + V<sub>i</sub>e<sub>i</sub>)<sub>y<sub>i</sub></sub>
and LOO acc = mean 1[argmax = y<sub>i</sub>]; beside the plug-in train NLL (each example fitted: optimistic) and the
network's measured softmax NLL and accuracy on the task's test set. A positive gap: the estimate is pessimistic.
The estimate is only as good as Σ is the inverse Hessian of the training objective (Σ: {e(insp.sigma_source)}).</p>
<table>{head}{''.join(rows)}</table>{note}"""


def _forgetting_html(insp: Inspection, table: dict, figs: list[tuple[str, Path]]) -> str:
    e = html.escape
    if insp.forgetting is None:
        return (f"<h2>Forgetting, predicted</h2><p>Not computed: {e(insp.forgetting_note)}.</p>"
                if insp.forgetting_note else "")
    per_task = table["per_task"]
    tids = sorted(per_task)
    head = ("<tr><th>score at the task's end</th><th>Spearman ρ with the loss increase</th>"
            "<th>AUROC for 'forgotten' (pooled)</th><th>AUROC within tasks</th>"
            + "".join(f"<th>AUROC task {t + 1}</th>" for t in tids) + "</tr>")
    rows = []
    for z in PREDICTORS:
        v = table["predictors"][z]
        cells = [e(figures.PREDICTOR_LABELS.get(z, z)), _fmt(v["spearman"]), _fmt(v["auroc"]), _fmt(v["auroc_within"])]
        cells += [_fmt(per_task[t]["predictors"][z]["auroc"]) for t in tids]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    counts = ("<tr><td>forgotten / correct at task end</td><td colspan=3>"
              f"{table['n_forgotten']} / {table['n_correct_task_end']}</td>"
              + "".join(f"<td>{per_task[t]['n_forgotten']} / {per_task[t]['n_correct_task_end']}</td>" for t in tids)
              + "</tr>")
    imgs = "".join(_img(p, {"roc": "ROC for 'forgotten' per score; loss increase against a score",
                            "forgotten": "the examples the run forgot",
                            "predicted": "the examples it was predicted to forget"}[k]) for k, p in figs)
    sources = sorted(set(insp.forgetting.sigma_sources))
    return f"""<h2>Forgetting, predicted</h2>
<p>Every training example of tasks 1–{len(insp.run.stream.tasks) - 1} scored at <b>its own task's end</b> (the run's
task boundary <code>tasks/after_task&lt;t&gt;.pt</code>: the network then, and the method as the next task started,
with Σ of that boundary) and at <b>the stream's end</b>. Forgotten = correct at its task's end, wrong at the
stream's end: {table['n_forgotten']} of {table['n_correct_task_end']} ({100 * table['forgotten_fraction']:.2f} %);
mean loss increase {table['mean_loss_increase']:.3g}. Spearman ρ over all {table['n']} examples; AUROC among those
correct at their task's end (0.5: chance; a constant score, as 'in the memory' for a method without one, is exactly
0.5); within tasks: the per-task AUROCs averaged with weights the tasks' forgotten counts (the pooled one also rewards
telling the tasks apart). The "predicted to forget" grid ranks by {e(grid_predictor(table))}, the score with the highest AUROC here.</p>
<table>{head}{''.join(rows)}{counts}</table>
<p><b>What this predicts, and what not.</b> The scores are properties of an example under the network of its own
task's end: how uncertain (tr Λ), how weakly determined (tr V), how influential (‖V e‖₁), how poorly fitted (loss) it
is, and whether the method keeps it. They do not see the later tasks, so they cannot say which directions later
training will move; an AUROC above 0.5 says that the examples the run lost were already fragile at their task's end.
The pooled numbers mix tasks that are forgotten more (usually the first) with the others: the per-task AUROCs show the
ranking within a task. Σ at the boundaries: {e('; '.join(sources[:2]))}{' …' if len(sources) > 2 else ''}.
Per example: the <code>*_task_end</code>, <code>loss_final</code>, <code>loss_increase</code> and
<code>forgotten</code> columns of <a href="scores.csv">scores.csv</a>.</p>
{imgs}"""


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _fmt(v: float) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3g}"


@contextlib.contextmanager
def _held_interrupts():
    """Ignore SIGINT / SIGTERM while the finished report is moved into place (milliseconds): the report is then
    complete, and the command ends as if the interrupt had come a moment later."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in old:
        signal.signal(s, signal.SIG_IGN)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def write_report(insp: Inspection, out: str | Path, *, progress: bool = False) -> Path:
    """Write the figures, ``scores.csv`` and ``index.html`` into ``out``; returns the HTML path.

    The report is written into a hidden folder beside ``out`` and moved into ``out`` once complete, so an
    interrupt (Ctrl-C) or an error leaves no partial report behind (an earlier report in ``out`` stays as it was).

    Args:
        insp: from :func:`inspect_run`.
        out: the report folder (created).
        progress: show a progress bar (tqdm) over the figures.
    """
    t0 = time.perf_counter()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: {out} is a file; allowed: a folder")
    base = out.parent
    while not base.is_dir():  # the nearest existing folder: nothing is created before the report is complete
        base = base.parent
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=base))
    try:
        html_path = _write_report(insp, work, progress, t0)
        with _held_interrupts():
            out.mkdir(parents=True, exist_ok=True)
            for f in sorted(work.iterdir()):
                os.replace(f, out / f.name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out / html_path.name


def _write_report(insp: Inspection, out: Path, progress: bool, t0: float) -> Path:
    labels = [insp.task_label(i) for i in range(len(insp.scores))]
    bar = tqdm(total=4 + len(insp.scores), desc="report", unit="figure", disable=None if progress else True, leave=False)
    try:
        csv_path = _csv(insp, out / "scores.csv")
        bar.update(1)
        maps = figures.plot_memory_maps(insp.scores, out / "memory_maps.png", task_labels=labels)
        bar.update(1)
        hists = figures.plot_score_histograms(insp.scores, out / "score_histograms.png", task_labels=labels)
        bar.update(1)
        across = figures.plot_memory_across_tasks(insp.scores, out / "memory_across_tasks.png")
        bar.update(1)
        grids = []
        for i in range(len(insp.scores)):
            grids.append(_grids(insp, i, out))
            bar.update(1)
        extra = _generalisation_html(insp) if insp.generalisation else ""
        if insp.forgetting is not None:
            table = insp.forgetting.table()
            extra += _forgetting_html(insp, table, _forgetting_figures(insp, table, out))
        else:
            extra += _forgetting_html(insp, {}, [])
        validation_png = None
        if insp.validation is not None:
            (out / "validation.json").write_text(json.dumps(insp.validation.to_dict(), indent=1))
            validation_png = out / "validation.png"
            plot_validation(insp.validation, validation_png)
    finally:
        bar.close()
    insp.timings["figures"] = time.perf_counter() - t0
    html_path = out / "index.html"
    html_path.write_text(_html(insp, csv_path, maps, hists, across, grids, extra, validation_png))
    return html_path


MEASURED_TRUST = ("On split MNIST (task 5; docs/inspect.md, benchmarks/results/tables/inspect_validation.md), 400 "
                  "examples each left out of a warm-started retraining moved in the order of their sensitivity: "
                  "Spearman 0.93 (FROMP) and 0.92 (none) between the sensitivity and the true change of the "
                  "prediction; the magnitudes are not literal.")
"""What the report says of the scores when the run itself was not validated (measured, with its source)."""


def _trust_html(insp: Inspection, figure: Path | None = None) -> str:
    """The first screen's answer to "how far can I trust these scores?": this run's own check when there is one
    (with its scatter ``figure``), else the library's measurement."""
    v = insp.validation
    if v is None:
        return (f"<b>How far to trust the scores</b>: not checked on this run (<code>continual-blr inspect RUN "
                f"--validate N</code> retrains N examples and shows the check here). {html.escape(MEASURED_TRUST)}<br>")
    s = v.summary()
    img = _img(figure, "estimated against true leave-one-out deviation, one point per left-out example") if figure else ""
    return (f"<b>How far to trust the scores — checked on this run</b>: {len(v)} examples of task {v.task_id + 1}, "
            f"drawn across the sensitivity range, were each left out of a retraining ({v.epochs} epochs from the "
            f"weights the task ended with, the run's method and optimiser; {s['seconds']:.0f} s). Spearman's ρ between "
            f"the estimate and the true change ‖softmax(f∖i) − softmax(f ref)‖₁ of the example's prediction: "
            f"<b>{s['spearman_sensitivity']:.2f}</b> for the sensitivity ‖V e‖₁, {s['spearman_linear']:.2f} linearised "
            f"‖Λ V e‖₁, {s['spearman_plain']:.2f} plain, {s['spearman_leverage']:.2f} leverage-corrected "
            f"(Pearson of the linearised: {s['pearson_linear']:.2f}). Median true change {s['median_true']:.2g}; median "
            f"noise floor (how far the reference retraining itself moves an example) {s['median_noise_floor']:.2g}. "
            f"Rankings within this run are as good as ρ says; the magnitudes are not literal. "
            f'<a href="validation.json">validation.json</a>.<br>{img}')


def _img(path: Path, alt: str, width: str = "100%") -> str:
    name = html.escape(path.name)
    return (f'<figure><a href="{name}"><img src="{_data_uri(path)}" alt="{html.escape(alt)}" '
            f'style="max-width:{width}"></a><figcaption>{html.escape(alt)} — <a href="{name}">{name}</a>'
            f"</figcaption></figure>")


def _html(insp: Inspection, csv_path: Path, maps: Path, hists: Path, across: Path,
          grids: list[list[tuple[str, Path]]], extra: str = "", validation_png: Path | None = None) -> str:
    run, e = insp.run, html.escape
    res = run.result
    acc = res.get("acc_matrix") or []
    last = acc[-1] if acc else []
    rows = []
    for i, s in enumerate(insp.scores):
        m = s.memorable
        tid = s.task_id
        test_acc = last[tid] if tid < len(last) and last[tid] is not None else float("nan")
        overlap = (f"{int((s.stored_memory & s.topk_now).sum())}/{int(s.stored_memory.sum())}"
                   if bool(s.stored_memory.any()) else "–")
        rows.append(
            "<tr>" + "".join(f"<td>{c}</td>" for c in [
                e(insp.task_label(i)), len(s), int(m.sum()), _fmt(float((s.pred == s.label).double().mean())),
                _fmt(test_acc), _fmt(float(s.relevance.mean())), _fmt(float(s.relevance[m].mean()) if bool(m.any()) else float("nan")),
                _fmt(float(s.sensitivity.mean())), _fmt(float(s.sensitivity[m].mean()) if bool(m.any()) else float("nan")),
                overlap]) + "</tr>")
    grid_html = []
    for i, items in enumerate(grids):
        # one grid per line, drawn at its own pixel size (at most the page's width): captions stay legible
        cells = "".join(f'<div class="grid">{_img(p, f"{insp.task_label(i)}: {title}")}</div>' for title, p in items)
        grid_html.append(f"<h3>{e(insp.task_label(i))}</h3>{cells}")
    if insp.memory_kind == "replay":
        rule = getattr(getattr(run.method, "buffer", None), "selection", "reservoir")
        memory_note = (f"The run stored a replay buffer ({e(rule)} sampling over the whole stream): <b>memorable</b> "
                       "= the buffer's examples of each task; <b>top-k now</b> = the top-k by tr Λ at the final "
                       "weights (FROMP's selection function, for comparison: the buffer is not chosen by it).")
    elif insp.has_memory:
        memory_note = ("The run stored a FROMP memory: <b>memorable</b> = the points it holds per task (chosen by "
                       "<code>continual_blr.memory.select_memorable</code> when each task ended); <b>top-k now</b> "
                       "= the same function at the final weights.")
    else:
        memory_note = (f"The run stored no memory: <b>memorable</b> = the top-{insp.top} by tr Λ per task at the final "
                       "weights, from FROMP's own selection function "
                       "<code>continual_blr.memory.select_memorable</code>.")
    stats = run.method.memory_stats() if hasattr(run.method, "memory_stats") else {}
    n_stored = int(stats.get("stored_examples", 0))
    memory_note += (f" What the method stores of past examples: <b>{n_stored}</b> in all, "
                    f"{int(stats.get('stored_bytes', 0)):,} bytes of inputs and labels"
                    + (f" (+ {int(stats['derived_bytes']):,} bytes derived from them: old predictions, kernels)"
                       if stats.get("derived_bytes") else "") + "." if n_stored else
                    " The method stores no past examples.")
    timing = ", ".join(f"{k} {v:.1f} s" for k, v in insp.timings.items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>Memorable examples — {e(run.method_name)} on {e(run.stream.name)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.9em; }} td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
th {{ background: #f0f0f0; }} figure {{ margin: 0.5em 0; }} figcaption {{ font-size: 0.8em; color: #555; }}
.row {{ display: flex; flex-wrap: wrap; gap: 1em; }} .cell {{ flex: 1 1 30%; min-width: 300px; }}
.grid {{ margin: 0.5em 0 1.2em; }} .grid img {{ width: auto; max-width: 100%; height: auto; }}
code {{ background: #f5f5f5; padding: 0 3px; }} .defs li {{ margin: 0.2em 0; }}
</style></head><body>
<h1>Which past examples does the network remember, and why?</h1>
<p><b>Run</b> <code>{e(str(run.path))}</code> — method <b>{e(run.method_name)}</b> on <b>{e(run.stream.name)}</b>
({e(run.stream.scenario)}-incremental, {len(run.stream.tasks)} tasks), seed {run.seed};
final average test accuracy {_fmt(res.get("avg_acc", float("nan")))}.<br>
<b>Σ</b>: {e(insp.sigma_source)}.<br>{memory_note}<br>
{_trust_html(insp, validation_png)}
All scores: <a href="{e(csv_path.name)}">{e(csv_path.name)}</a> (one row per training example).
<small>Time: {e(timing)}.</small></p>
<h2>Per task</h2>
<table><tr><th>task</th><th>train examples</th><th>memorable</th><th>train acc</th><th>test acc (final)</th>
<th>mean tr Λ</th><th>mean tr Λ (memorable)</th><th>mean sensitivity</th><th>mean sensitivity (memorable)</th>
<th>stored ∩ top-k now</th></tr>
{''.join(rows)}</table>
{extra}
<h2>Memory maps</h2>{_img(maps, "prediction error against prediction variance, coloured by sensitivity")}
<h2>Score histograms</h2>{_img(hists, "tr Λ and sensitivity per task", "760px")}
<h2>The memorable set across tasks</h2>{_img(across, "memorable points vs all, per task")}
<h2>Examples</h2>
<p>Under each example: its class, the probability p the network gives it, and the score it was ranked by
(red: misclassified).</p>
{''.join(grid_html)}
<h2>Definitions</h2>
<ul class="defs">
<li>p = softmax(f(x)) on the task's head; <b>relevance</b> tr Λ(x) = Σ<sub>k</sub> p<sub>k</sub>(1 − p<sub>k</sub>) — what FROMP selects on (top-k per class).</li>
<li><b>error</b> e = p − onehot(y); the map shows ‖e‖₂.</li>
<li><b>prediction covariance</b> V = J Σ Jᵀ (logits, J = ∂f/∂θ); <b>variance</b> v = diag V, the map shows tr V.</li>
<li><b>leave-one-out shift</b> Δf ≈ V e (Nickl et al. 2023: removing x moves its own logits by error × variance);
<b>sensitivity</b> = ‖V e‖₁; <code>sensitivity_diag</code> = Σ<sub>k</sub>|e<sub>k</sub> v<sub>k</sub>| (diagonal form);
<code>loo_prob_true</code> = softmax(f + V e)<sub>y</sub>; <code>loo_loss_increase</code> = eᵀ V e.</li>
</ul>
</body></html>
"""
