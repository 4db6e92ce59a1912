"""Figures people would rather look at than read: accuracy-matrix heatmaps and accuracy curves.

Uses matplotlib's object API with the Agg canvas, so importing or calling this never changes the
global backend.
"""

from __future__ import annotations

import math
from pathlib import Path

from .loop import StreamResult

__all__ = ["plot_accuracy_matrices", "plot_average_accuracy"]


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def plot_accuracy_matrices(results: list[StreamResult], path: str | Path) -> Path:
    """One heatmap of R[i, j] (rows: after training task i; columns: tested on task j) per result."""
    n = len(results)
    fig = _figure(3.4 * n + 0.6, 3.4)
    axes = fig.subplots(1, n, squeeze=False)[0]
    im = None
    for ax, r in zip(axes, results):
        t = len(r.acc_matrix)
        data = [[(100 * v if not math.isnan(v) else float("nan")) for v in row] for row in r.acc_matrix]
        im = ax.imshow(data, vmin=0.0, vmax=100.0, cmap="viridis")  # in %, as the cells
        for i in range(t):
            for j in range(t):
                v = r.acc_matrix[i][j]
                if not math.isnan(v):
                    ax.text(j, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=7,
                            color="white" if v < 0.6 else "black")
        ax.set_xticks(range(t), [str(j + 1) for j in range(t)])
        ax.set_yticks(range(t), [str(i + 1) for i in range(t)])
        ax.set_xlabel("tested on task")
        ax.set_ylabel("after training task")
        ax.set_title(f"{r.method}: avg {100 * r.avg_acc:.1f}%", fontsize=9)
    if im is not None:
        fig.colorbar(im, ax=list(axes), fraction=0.03, label="accuracy (%)")
    fig.suptitle(f"{results[0].stream} ({results[0].scenario}-incremental)", fontsize=10)
    path = Path(path)
    fig.savefig(path, bbox_inches="tight")
    return path


def plot_average_accuracy(curves: dict[str, list[list[float]]], path: str | Path, title: str = "") -> Path:
    """Average accuracy over the tasks seen so far, after each task: mean ± std over seeds per method."""
    fig = _figure(5.0, 3.4)
    ax = fig.subplots()
    for name, runs in curves.items():
        t = len(runs[0])
        mean = [sum(r[i] for r in runs) / len(runs) for i in range(t)]
        std = [math.sqrt(sum((r[i] - mean[i]) ** 2 for r in runs) / max(1, len(runs) - 1)) for i in range(t)]
        xs = list(range(1, t + 1))
        ax.plot(xs, [100 * m for m in mean], marker="o", label=name)
        ax.fill_between(xs, [100 * (m - s) for m, s in zip(mean, std)], [100 * (m + s) for m, s in zip(mean, std)], alpha=0.2)
    ax.set_xlabel("tasks trained")
    ax.set_ylabel("average accuracy (%)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    path = Path(path)
    fig.savefig(path, bbox_inches="tight")
    return path
