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
from .saved_run import SavedRun, memory_kind, run_covariance, stored_memory
from .scores import ExampleScores, score_examples

__all__ = ["Inspection", "inspect_run", "write_report", "DEFAULT_TOP", "MAX_IMAGES"]

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
    """

    run: SavedRun
    tasks: list[Task]
    scores: list[ExampleScores]
    top: int
    sigma_source: str
    has_memory: bool
    timings: dict[str, float] = field(default_factory=dict)
    memory_kind: str = ""

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
    finally:
        bar.close()
    t_scores = time.perf_counter()
    return Inspection(run, chosen, out, int(top), source, bool(memory),
                      {"covariance": t_sigma - t0, "scores": t_scores - t_sigma},
                      memory_kind(run.method) if memory else "")


# ---------------------------------------------------------------------------------------- CSV


def _csv(insp: Inspection, path: Path) -> Path:
    k_max = max(s.n_outputs for s in insp.scores)
    head = (["task", "task_id", "head", "index", "label", "class", "pred", "prob_true", "relevance", "error_norm",
             "variance_total"] + [f"variance_{k}" for k in range(k_max)]
            + ["sensitivity", "sensitivity_diag", "loo_loss_increase", "loo_prob_true", "loo_delta_prob_true"]
            + [f"loo_shift_{k}" for k in range(k_max)] + ["memorable", "topk_now", "stored_memory", "lowest"])
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
                           + [f"{v:.9g}" for v in shift[r]] + pad + [int(m[r]) for m in masks])
    return path


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
    finally:
        bar.close()
    insp.timings["figures"] = time.perf_counter() - t0
    html_path = out / "index.html"
    html_path.write_text(_html(insp, csv_path, maps, hists, across, grids))
    return html_path


def _img(path: Path, alt: str, width: str = "100%") -> str:
    name = html.escape(path.name)
    return (f'<figure><a href="{name}"><img src="{_data_uri(path)}" alt="{html.escape(alt)}" '
            f'style="max-width:{width}"></a><figcaption>{html.escape(alt)} — <a href="{name}">{name}</a>'
            f"</figcaption></figure>")


def _html(insp: Inspection, csv_path: Path, maps: Path, hists: Path, across: Path,
          grids: list[list[tuple[str, Path]]]) -> str:
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
All scores: <a href="{e(csv_path.name)}">{e(csv_path.name)}</a> (one row per training example).
<small>Time: {e(timing)}.</small></p>
<h2>Per task</h2>
<table><tr><th>task</th><th>train examples</th><th>memorable</th><th>train acc</th><th>test acc (final)</th>
<th>mean tr Λ</th><th>mean tr Λ (memorable)</th><th>mean sensitivity</th><th>mean sensitivity (memorable)</th>
<th>stored ∩ top-k now</th></tr>
{''.join(rows)}</table>
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
