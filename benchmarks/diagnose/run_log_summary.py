"""Per-task summary of a run folder's logs: what issue 43 asks a FROMP run to show, one row per task.

Run:

    python benchmarks/diagnose/run_log_summary.py RUN_DIR [RUN_DIR ...] [--bar 10]

``RUN_DIR`` is a method's run folder (the one holding ``train_log.csv`` and ``accuracy.csv``, e.g.
``<work-dir>/split_cifar10/bf16/task/full/fromp_penalty_bf16_seed0/fromp``). For each task it prints, from
``train_log.csv``: the epochs logged, the largest epoch-mean train loss (data + penalty) and its epoch, that
epoch's penalty, the largest single-step penalty of the task, the smallest kernel diagonal at the task's rebuild
(FROMP-type methods only; the columns are blank for others); and from ``accuracy.csv`` the accuracies after the
task. The last line says whether any epoch's mean train loss is above ``--bar`` (issue 43's divergence bar, 10).
Markdown on stdout; nothing is written.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _num(row: dict[str, str], key: str) -> float:
    v = row.get(key, "")
    return float(v) if v not in ("", None) else math.nan


def _fmt(v: float, digits: int = 3) -> str:
    if math.isnan(v):
        return ""
    if v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e4):
        return f"{v:.2e}"
    return f"{v:.{digits}f}"


def summarise(run: Path, bar: float = 10.0) -> str:
    """The markdown table of one run folder (see the module docstring)."""
    log = _rows(run / "train_log.csv")
    acc = _rows(run / "accuracy.csv") if (run / "accuracy.csv").is_file() else []
    tasks = sorted({int(r["task"]) for r in log})
    lines = [f"**{run}**", "",
             "| task | epochs logged | largest epoch-mean train loss (epoch) | its penalty | largest single-step "
             "penalty | smallest kernel diagonal | accuracy after the task (tasks 1..t, %) |",
             "|---|---|---|---|---|---|---|"]
    worst = -math.inf
    for t in tasks:
        rows = [r for r in log if int(r["task"]) == t]
        top = max(rows, key=lambda r: _num(r, "train_loss"))
        worst = max(worst, _num(top, "train_loss"))
        pen_max = max((_num(r, "penalty_max") for r in rows), default=math.nan)
        diags = [_num(r, "kernel_min_diag") for r in rows if not math.isnan(_num(r, "kernel_min_diag"))]
        after = sorted((int(r["task"]), float(r["accuracy"])) for r in acc if int(r["after_task"]) == t)
        lines.append(f"| {t + 1} | {len(rows)} | {_fmt(_num(top, 'train_loss'))} ({top['epoch']}) | "
                     f"{_fmt(_num(top, 'penalty'), 4)} | {_fmt(pen_max)} | {_fmt(min(diags)) if diags else ''} | "
                     f"{' / '.join(f'{100 * a:.2f}' for _, a in after)} |")
    lines += ["", f"Largest epoch-mean train loss: {_fmt(worst)} ({'above' if worst > bar else 'not above'} the bar "
              f"of {bar:g})."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders holding train_log.csv (and accuracy.csv)")
    ap.add_argument("--bar", type=float, default=10.0, help="divergence bar on the epoch-mean train loss (10)")
    args = ap.parse_args(argv)
    for run in args.runs:
        if not (run / "train_log.csv").is_file():
            print(f"error: {run}: no train_log.csv there (give the method's run folder)", file=sys.stderr)
            return 2
        print(summarise(run, args.bar))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
