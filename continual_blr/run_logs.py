"""Training logs of a run: per-epoch loss and per-task accuracies as CSV in the run folder, and optionally
TensorBoard events.

Files (per method, see ``docs/runs.md``):

    <run>/<method>/train_log.csv   task, epoch, train_loss[, clipped_fraction]   (one row per epoch; from 1)
    <run>/<method>/accuracy.csv    after_task, task, accuracy     (R[i, j] for j <= i, after each task i)
    <run>/<method>/generalisation.csv  after_task, task, train_nll, loo_nll, test_nll, nll_gap, train_acc, loo_acc,
                                   test_acc, seconds   (only with ``--log-loo``: the leave-one-out estimate of each
                                   seen task's test NLL from its training data, beside the measured one)
    <run>/tensorboard/<method>/    scalars train_loss/task<i>, accuracy/task<j>, avg_accuracy (with tensorboard=True)

Tasks count from 0, as ``task_id`` elsewhere. On resume the rows written after the checkpoint resumed from are dropped
(:meth:`TrainingLog.trim`), so the logs of a resumed run equal an uninterrupted run's.
"""

from __future__ import annotations

import math
from typing import Any

from .loop import LoopProgress
from .run_folder import RunFolder

__all__ = ["TrainingLog", "tensorboard_available", "TRAIN_LOG", "ACCURACY_LOG", "GENERALISATION_LOG"]

TRAIN_LOG = "train_log.csv"
ACCURACY_LOG = "accuracy.csv"
GENERALISATION_LOG = "generalisation.csv"
GENERALISATION_COLUMNS = ["after_task", "task", "train_nll", "loo_nll", "test_nll", "nll_gap", "train_acc", "loo_acc",
                          "test_acc", "seconds"]


def tensorboard_available() -> str | None:
    """None when ``torch.utils.tensorboard`` imports, else the one-line reason it does not."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure means "not available"
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".strip()
    return None


class TrainingLog:
    """The CSV (and optional TensorBoard) log of one method in a run folder.

    Args:
        folder: the run folder (all writes go through it).
        method: the method's name (its subfolder).
        tensorboard: also write TensorBoard scalars (needs ``torch.utils.tensorboard``; see
            :func:`tensorboard_available`).
    """

    def __init__(self, folder: RunFolder, method: str, tensorboard: bool = False) -> None:
        self.folder, self.method = folder, method
        self._tb: Any = None
        if tensorboard and folder.writes:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(folder.path / "tensorboard" / method))

    def trim(self, next_task: int, epochs_done: int = 0) -> None:
        """Drop the rows an interrupted run wrote after the checkpoint it resumes from: of tasks ``>= next_task``,
        except, for a mid-task checkpoint, task ``next_task``'s first ``epochs_done`` epochs."""
        self.folder.trim_csv(f"{self.method}/{TRAIN_LOG}", lambda r: int(r["task"]) < next_task
                             or (int(r["task"]) == next_task and int(r["epoch"]) <= epochs_done))
        self.folder.trim_csv(f"{self.method}/{ACCURACY_LOG}", lambda r: int(r["after_task"]) < next_task)
        self.folder.trim_csv(f"{self.method}/{GENERALISATION_LOG}", lambda r: int(r["after_task"]) < next_task)

    def epoch(self, task: int, epoch: int, loss: float, stats: dict[str, float] | None = None) -> None:
        """Record one epoch's mean training loss (``epoch`` 0-based as the loop counts; written 1-based) and the
        method's diagnostics (:meth:`Method.epoch_stats`, e.g. the BLR's ``clipped_fraction``), a column each."""
        stats = stats or {}
        self.folder.append_csv(f"{self.method}/{TRAIN_LOG}", ["task", "epoch", "train_loss", *stats],
                               [task, epoch + 1, repr(loss), *map(repr, stats.values())])
        if self._tb is not None:
            self._tb.add_scalar(f"train_loss/task{task}", loss, epoch + 1)
            for k, v in stats.items():
                self._tb.add_scalar(f"{k}/task{task}", v, epoch + 1)

    def task_end(self, progress: LoopProgress) -> None:
        """Record the accuracies after the task just finished (row ``progress.next_task - 1`` of R)."""
        i = progress.next_task - 1
        row = progress.acc_matrix[i]
        for j in range(i + 1):
            self.folder.append_csv(f"{self.method}/{ACCURACY_LOG}", ["after_task", "task", "accuracy"], [i, j, repr(row[j])])
        if self._tb is not None:
            for j in range(i + 1):
                self._tb.add_scalar(f"accuracy/task{j}", row[j], i)
            seen = [v for v in row[: i + 1] if not math.isnan(v)]
            if seen:
                self._tb.add_scalar("avg_accuracy", sum(seen) / len(seen), i)
            self._tb.flush()

    def generalisation(self, after_task: int, rows: list[Any], seconds: float) -> None:
        """Record the leave-one-out estimates at the end of task ``after_task``: one row per seen task
        (:class:`continual_blr.inspect.Generalisation`), ``seconds`` the time the estimate took (Σ and scores)."""
        for g in rows:
            self.folder.append_csv(f"{self.method}/{GENERALISATION_LOG}", GENERALISATION_COLUMNS,
                                   [after_task, g.task_id, *map(repr, (g.train_nll, g.loo_nll, g.test_nll, g.nll_gap,
                                                                       g.train_acc, g.loo_acc, g.test_acc)),
                                    f"{seconds:.3f}"])
        if self._tb is not None:
            for g in rows:
                self._tb.add_scalar(f"loo_nll/task{g.task_id}", g.loo_nll, after_task)
                self._tb.add_scalar(f"test_nll/task{g.task_id}", g.test_nll, after_task)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
