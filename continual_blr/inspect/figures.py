"""Figures of the memorable-example inspection (PNG, matplotlib's object API on the Agg canvas; the
global backend is never touched).

* :func:`plot_example_grid` — a mosaic of input images with label, probability and a score under each;
* :func:`plot_projection` — for non-image inputs: a 2-D PCA projection with the chosen points marked;
* :func:`plot_memory_maps` — prediction error against prediction variance per task (Tailor et al.),
  coloured by sensitivity, memorable points ringed;
* :func:`plot_score_histograms` — tr Λ and sensitivity histograms per task, memorable points stacked;
* :func:`plot_memory_across_tasks` — how the memorable set compares across tasks (its scores, the
  accuracy on it, and the overlap between the stored memory and the top-k at the final weights);
* :func:`plot_forgetting` — forgetting, predicted: the ROC curve of each task-end score for "forgotten" and the
  loss increase against one score (:mod:`.forgetting`).

Grids draw one image per figure (all examples tiled into one array), so a 40-example grid costs one
axes, not forty.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .scores import ExampleScores

__all__ = [
    "is_image_shape",
    "plot_example_grid",
    "plot_projection",
    "plot_memory_maps",
    "plot_score_histograms",
    "plot_memory_across_tasks",
    "plot_forgetting",
    "PREDICTOR_LABELS",
]

MEMORABLE_COLOR = "#d62728"
STORED_COLOR = "#ff7f0e"
LOWEST_COLOR = "#7f7f7f"

GRID_COLUMNS = 8
"""Images per row of an example grid."""
GRID_CELL_IN = 1.3
"""Width of one grid cell in inches."""
GRID_DPI = 100
"""Pixels per inch of the grid PNGs: GRID_COLUMNS × GRID_CELL_IN × GRID_DPI = 1040 px ≤ :data:`GRID_MAX_PX`."""
GRID_FONT_PT = 8.5
"""Caption size: at GRID_DPI and shown unscaled, about 12 screen pixels per line."""
GRID_MAX_PX = 1150
"""The widest grid the report shows unscaled (its page is 1200 px wide)."""


def _figure(width: float, height: float, dpi: int = 110, layout: str | None = None):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    fig.savefig(path, bbox_inches="tight")
    return path


def is_image_shape(shape: Sequence[int]) -> bool:
    """(C, H, W) with C ∈ {1, 3} or (H, W), both sides ≥ 4: drawn as images; anything else is projected."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 3:
        return shape[0] in (1, 3) and min(shape[1:]) >= 4
    return len(shape) == 2 and min(shape) >= 4


def _as_hwc(x: Tensor) -> np.ndarray:
    """Images [N, C, H, W] / [N, H, W] → float [N, H, W, C] in [0, 1] (min-max scaled if outside)."""
    x = x.detach().to("cpu", torch.float32)
    if x.dim() == 3:
        x = x.unsqueeze(1)
    lo, hi = float(x.min()), float(x.max())
    if lo < 0.0 or hi > 1.0:
        x = (x - lo) / max(hi - lo, 1e-12)
    return x.permute(0, 2, 3, 1).numpy()


def plot_example_grid(
    images: Tensor,
    captions: Sequence[str],
    path: str | Path,
    *,
    title: str = "",
    bad: Sequence[bool] | None = None,
    columns: int = GRID_COLUMNS,
) -> Path:
    """A mosaic of images with a caption under each.

    Sized to be shown at its own pixel size on a page at most :data:`GRID_MAX_PX` wide (the HTML report
    does not scale it down), so that the :data:`GRID_FONT_PT` captions stay legible.

    Args:
        images: [N, C, H, W] (C = 1 or 3) or [N, H, W].
        captions: N short strings (lines separated by ``\\n``).
        path: the PNG to write.
        title: the figure title.
        bad: N flags; flagged captions are drawn in red (e.g. misclassified examples).
        columns: images per row.
    """
    n = int(images.shape[0])
    imgs = _as_hwc(images) if n else np.zeros((0, 8, 8, 1))
    h, w, c = imgs.shape[1:] if n else (8, 8, 1)
    cols = max(1, min(columns, n))
    rows = max(1, math.ceil(n / cols))
    n_lines = max((s.count("\n") + 1 for s in captions), default=1)
    pad = max(1, h // 8)
    pitch_x = w + 2 * pad
    # caption band under each image, in pixels of the mosaic: n_lines lines of GRID_FONT_PT at 1.3 spacing
    cap = int(math.ceil(n_lines * 1.3 * GRID_FONT_PT / 72 / GRID_CELL_IN * pitch_x)) + pad
    pitch_y = h + cap + pad
    mosaic = np.ones((rows * pitch_y, cols * pitch_x, c), dtype=np.float32)
    grey = c == 1
    if grey:
        mosaic[:] = 0.0  # drawn with gray_r: 0 is white
    for i in range(n):
        r, q = divmod(i, cols)
        y0, x0 = r * pitch_y + pad, q * pitch_x + pad
        mosaic[y0 : y0 + h, x0 : x0 + w] = imgs[i]
    cell_in = GRID_CELL_IN
    fig = _figure(cols * cell_in, rows * cell_in * pitch_y / pitch_x + (0.35 if title else 0.0), dpi=GRID_DPI)
    ax = fig.add_axes((0, 0, 1, 1))
    if grey:
        ax.imshow(mosaic[..., 0], cmap="gray_r", vmin=0.0, vmax=1.0, interpolation="nearest")
    else:
        ax.imshow(mosaic, interpolation="nearest")
    ax.set_axis_off()
    for i, text in enumerate(captions[:n]):
        r, q = divmod(i, cols)
        ax.text(q * pitch_x + pitch_x / 2, r * pitch_y + pad + h + pad * 0.5, text, ha="center", va="top",
                fontsize=GRID_FONT_PT, family="monospace", color="#c00000" if bad is not None and bad[i] else "black")
    if title:
        fig.suptitle(title, fontsize=9, y=1.0, va="bottom")
    if n == 0:
        ax.text(0.5, 0.5, "no examples", transform=ax.transAxes, ha="center")
    return _save(fig, path)


def plot_projection(
    x: Tensor,
    labels: Tensor,
    path: str | Path,
    *,
    marks: dict[str, Tensor],
    title: str = "",
    class_names: Sequence[str] | None = None,
) -> Path:
    """Non-image inputs: scatter of the first two principal components, coloured by label.

    Args:
        x: inputs [N, ...] (flattened); projected on the top-2 right singular vectors of centred x.
        labels: [N] class labels (0..K−1 or any ints).
        marks: name → boolean mask [N] of points to mark: ``"memorable"`` (red rings), ``"stored"``
            (orange rings), ``"lowest"`` (grey crosses), ``"sensitive"`` (black triangles).
    """
    z = x.detach().reshape(x.shape[0], -1).to("cpu", torch.float64)
    z = z - z.mean(0, keepdim=True)
    if z.shape[1] >= 2:
        _, _, vh = torch.linalg.svd(z, full_matrices=False)
        proj = (z @ vh[:2].T).numpy()
    else:
        proj = torch.cat([z, torch.zeros_like(z)], 1).numpy()
    lab = labels.cpu().numpy()
    fig = _figure(5.2, 4.4)
    ax = fig.subplots()
    for j, cls in enumerate(np.unique(lab)):
        sel = lab == cls
        name = class_names[j] if class_names is not None and j < len(class_names) else str(cls)
        ax.scatter(proj[sel, 0], proj[sel, 1], s=9, alpha=0.45, label=f"class {name}", color=f"C{j % 10}")
    style = {
        "memorable": dict(s=70, facecolors="none", edgecolors=MEMORABLE_COLOR, linewidths=1.3, marker="o"),
        "stored": dict(s=120, facecolors="none", edgecolors=STORED_COLOR, linewidths=1.0, marker="o"),
        "lowest": dict(s=30, color=LOWEST_COLOR, marker="x", linewidths=1.0),
        "sensitive": dict(s=34, facecolors="none", edgecolors="black", marker="^", linewidths=1.0),
    }
    for name, mask in marks.items():
        m = mask.cpu().numpy().astype(bool)
        if m.any():
            ax.scatter(proj[m, 0], proj[m, 1], label=name, **style.get(name, {}))
    ax.set_xlabel("principal component 1")
    ax.set_ylabel("principal component 2")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="best", framealpha=0.8)
    ax.grid(alpha=0.25)
    return _save(fig, path)


def _panel_grid(n: int, width: float = 3.3, height: float = 2.9, max_cols: int = 3):
    cols = max(1, min(max_cols, n))
    rows = max(1, math.ceil(n / cols))
    fig = _figure(width * cols, height * rows, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).reshape(-1)
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _pos(t: Tensor) -> np.ndarray:
    """Values for log axes: non-positive entries raised to the smallest positive one (or 1e-12)."""
    a = t.detach().to("cpu", torch.float64).numpy().copy()
    pos = a[a > 0]
    a[a <= 0] = pos.min() if pos.size else 1e-12
    return a


def plot_memory_maps(scores: Sequence[ExampleScores], path: str | Path, *, task_labels: Sequence[str]) -> Path:
    """Memory maps (Tailor et al.): prediction error ‖p − onehot(y)‖ against prediction variance tr(J Σ Jᵀ),
    one panel per task, coloured by the sensitivity ‖V e‖₁; memorable points ringed in red."""
    from matplotlib.colors import LogNorm

    fig, axes = _panel_grid(len(scores))
    sens_all = np.concatenate([_pos(s.sensitivity) for s in scores]) if scores else np.ones(1)
    norm = LogNorm(vmin=max(sens_all.min(), sens_all.max() * 1e-8), vmax=sens_all.max())
    sc = None
    for ax, s, name in zip(axes, scores, task_labels):
        err, var, sens = _pos(s.error_norm), _pos(s.variance_total), _pos(s.sensitivity)
        order = np.argsort(sens)  # most sensitive drawn last (on top)
        sc = ax.scatter(err[order], var[order], c=sens[order], s=8, cmap="viridis", norm=norm, alpha=0.85,
                        linewidths=0)
        mem = s.memorable.cpu().numpy().astype(bool)
        ax.scatter(err[mem], var[mem], s=42, facecolors="none", edgecolors=MEMORABLE_COLOR, linewidths=1.0,
                   label=f"memorable ({int(mem.sum())})")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("prediction error ‖p − onehot(y)‖", fontsize=8)
        ax.set_ylabel("prediction variance tr JΣJᵀ", fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.tick_params(which="both", labelsize=7)
        ax.grid(alpha=0.25, which="both", lw=0.4)
        ax.legend(fontsize=7, loc="lower left", framealpha=0.8)
    if sc is not None:
        fig.colorbar(sc, ax=list(axes), shrink=0.9, label="sensitivity ‖V e‖₁")
    fig.suptitle("Memory maps: high error = hard to fit; high variance = weakly determined; "
                 "sensitivity ≈ error × variance", fontsize=9)
    return _save(fig, path)


def plot_score_histograms(scores: Sequence[ExampleScores], path: str | Path, *, task_labels: Sequence[str]) -> Path:
    """Per task: histograms of tr Λ (what FROMP selects on) and of the sensitivity, memorable points
    stacked in red; the top-k threshold at the final weights dashed."""
    n = len(scores)
    fig = _figure(7.4, 2.2 * max(1, n))
    axes = fig.subplots(max(1, n), 2, squeeze=False)
    for (ax_r, ax_s), s, name in zip(axes, scores, task_labels):
        mem = s.memorable.cpu().numpy().astype(bool)
        rel = s.relevance.detach().cpu().double().numpy()
        bins = np.linspace(0.0, max(rel.max(), 1e-6), 31)
        ax_r.hist([rel[~mem], rel[mem]], bins=bins, stacked=True, color=["#4c72b0", MEMORABLE_COLOR],
                  label=["others", "memorable"])
        if bool(s.topk_now.any()):
            thr = float(s.relevance[s.topk_now].min())
            ax_r.axvline(thr, color="black", ls="--", lw=0.8, label="top-k threshold now")
        ax_r.set_yscale("log")
        ax_r.set_xlabel("relevance tr Λ(x) = Σ p(1 − p)", fontsize=8)
        ax_r.set_ylabel(name, fontsize=8)
        ax_r.tick_params(which="both", labelsize=7)
        sens = _pos(s.sensitivity)
        lo, hi = np.log10(sens.min()), np.log10(sens.max())
        sbins = np.logspace(lo, hi if hi > lo else lo + 1, 31)
        ax_s.hist([sens[~mem], sens[mem]], bins=sbins, stacked=True, color=["#55a868", MEMORABLE_COLOR],
                  label=["others", "memorable"])
        ax_s.set_xscale("log")
        ax_s.set_yscale("log")
        ax_s.set_xlabel("sensitivity ‖V e‖₁ (leave-one-out logit shift)", fontsize=8)
        ax_s.tick_params(which="both", labelsize=7)
    if n:
        axes[0, 0].legend(fontsize=7)
        axes[0, 1].legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


def plot_memory_across_tasks(scores: Sequence[ExampleScores], path: str | Path) -> Path:
    """How the memorable set compares across tasks, at the final weights.

    Panels: (1) mean tr Λ of the memorable points vs all points per task; (2) mean sensitivity, same
    split; (3) training accuracy on the memorable points vs all points; (4) when the run stored a
    memory: the fraction of the stored points (chosen when each task ended) that are still in the
    top-k by tr Λ now — low overlap means later tasks moved the decision boundary of that task.
    """
    stored = any(bool(s.stored_memory.any()) for s in scores)
    n_panels = 4 if stored else 3
    fig = _figure(3.0 * n_panels, 2.9)
    axes = fig.subplots(1, n_panels, squeeze=False)[0]
    xs = np.arange(len(scores))
    wdt = 0.38

    def split_mean(values: Sequence[Tensor]) -> tuple[list[float], list[float]]:
        mem, allv = [], []
        for s, v in zip(scores, values):
            v = v.detach().double().cpu()
            m = s.memorable.cpu()
            mem.append(float(v[m].mean()) if bool(m.any()) else float("nan"))
            allv.append(float(v.mean()))
        return mem, allv

    panels = [
        ("mean tr Λ", [s.relevance for s in scores], False),
        ("mean sensitivity", [s.sensitivity for s in scores], True),
        ("train accuracy", [(s.pred == s.label).double() for s in scores], False),
    ]
    for ax, (label, values, log) in zip(axes, panels):
        mem, allv = split_mean(values)
        ax.bar(xs - wdt / 2, mem, wdt, color=MEMORABLE_COLOR, label="memorable")
        ax.bar(xs + wdt / 2, allv, wdt, color="#4c72b0", label="all")
        if log:
            ax.set_yscale("log")
        ax.set_title(label, fontsize=9)
    if stored:
        ax = axes[3]
        frac = []
        for s in scores:
            st = s.stored_memory.cpu()
            frac.append(float((st & s.topk_now.cpu()).sum()) / max(1, int(st.sum())) if bool(st.any()) else float("nan"))
        ax.bar(xs, frac, 0.6, color=STORED_COLOR)
        ax.set_ylim(0, 1.05)
        ax.set_title("stored memory still in top-k now", fontsize=9)
    for ax in axes:
        ax.set_xticks(xs, [f"T{s.task_id + 1}" for s in scores], fontsize=7)
        ax.set_xlabel("task", fontsize=8)
        ax.tick_params(which="both", labelsize=7)
        ax.grid(alpha=0.25, axis="y")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


PREDICTOR_LABELS = {
    "relevance": "relevance tr Λ",
    "variance": "variance tr V",
    "sensitivity": "sensitivity ‖V e‖₁",
    "memory": "in the memory",
    "loss": "loss −log p_y",
}
"""How the forgetting figure and table name the predictors of :mod:`.forgetting`."""


def plot_forgetting(forgetting, path: str | Path, *, predictors: Sequence[str], scatter: str = "variance",
                    title: str = "") -> Path:
    """Forgetting, predicted (:mod:`.forgetting`): (1) the ROC curve of each task-end predictor for "forgotten"
    (correct at its task's end, wrong at the stream's), among the examples correct at their task's end, with its AUROC;
    (2) the loss increase ℓ^T − ℓ^t against the ``scatter`` predictor at the task's end (log x), forgotten examples
    in red.

    Args:
        forgetting: a :class:`~continual_blr.inspect.forgetting.Forgetting`.
        path: the PNG to write.
        predictors: the predictors to draw (names of ``Forgetting.score``).
        scatter: the predictor on the scatter's x axis.
        title: the figure title.
    """
    from .forgetting import auroc, roc_curve

    fig = _figure(9.6, 3.8, layout="constrained")
    ax_roc, ax_sc = fig.subplots(1, 2)
    risk = forgetting.correct_task_end
    target = forgetting.forgotten[risk]
    colors = ["#4c72b0", "#55a868", "#c44e52", "#8172b2", "#937860", "#da8bc3"]
    for z, col in zip(predictors, colors):
        s = forgetting.score(z)[risk]
        fpr, tpr = roc_curve(s, target)
        ax_roc.plot(fpr.numpy(), tpr.numpy(), color=col, lw=1.3,
                    label=f"{PREDICTOR_LABELS.get(z, z)}: AUROC {auroc(s, target):.3f}")
    ax_roc.plot([0, 1], [0, 1], color="#999999", lw=0.8, ls="--")
    ax_roc.set_xlabel("false-positive rate (kept examples flagged)", fontsize=8)
    ax_roc.set_ylabel("true-positive rate (forgotten examples flagged)", fontsize=8)
    ax_roc.set_title(f"ROC for 'forgotten' ({int(target.sum())} of {int(risk.sum())} correct at their task's end)",
                     fontsize=9)
    ax_roc.legend(fontsize=7, loc="lower right")
    ax_roc.tick_params(labelsize=7)
    ax_roc.grid(alpha=0.25, lw=0.4)
    x = _pos(forgetting.score(scatter))
    y = forgetting.loss_increase.numpy()
    forg = forgetting.forgotten.numpy().astype(bool)
    ax_sc.scatter(x[~forg], y[~forg], s=3, color="#4c72b0", alpha=0.35, linewidths=0, label="kept or never correct")
    ax_sc.scatter(x[forg], y[forg], s=5, color=MEMORABLE_COLOR, alpha=0.7, linewidths=0,
                  label=f"forgotten ({int(forg.sum())})")
    ax_sc.set_xscale("log")
    ax_sc.set_yscale("symlog", linthresh=1e-2)
    ax_sc.set_xlabel(f"{PREDICTOR_LABELS.get(scatter, scatter)} at its task's end", fontsize=8)
    ax_sc.set_ylabel("loss increase: −log p_y at the stream's end − at its task's end", fontsize=8)
    ax_sc.set_title("loss increase against the score at the task's end", fontsize=9)
    ax_sc.legend(fontsize=7, loc="upper left", markerscale=3)
    ax_sc.tick_params(which="both", labelsize=7)
    ax_sc.grid(alpha=0.25, lw=0.4)
    if title:
        fig.suptitle(title, fontsize=9)
    return _save(fig, path)
