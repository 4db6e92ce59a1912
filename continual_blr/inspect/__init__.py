"""Memorable-example inspection: which past examples a network remembers, and why.

* :mod:`.scores` — per-example scores: relevance tr Λ (what FROMP selects on), prediction error,
  prediction covariance J Σ Jᵀ, the leave-one-out shift V e and the sensitivity (Nickl et al. 2023);
* :mod:`.saved_run` — :class:`SavedRun`, the objects an inspection reads (stream, network, method), Σ
  (:func:`run_covariance`) and the stored memory; loading a run folder into one is the runner layer's
  job (:func:`continual_blr.saved_run.load_run`): inspection never reads the run configuration;
* :mod:`.generalisation` — the leave-one-out estimate of a task's test NLL and accuracy from its training data alone;
* :mod:`.forgetting` — forgetting, predicted: each example's scores at its own task's end (the run's task
  boundaries) against its loss increase by the stream's end (Spearman ρ, AUROC for "forgotten");
* :mod:`.figures` — image grids, projections, memory maps, histograms, the memorable set across tasks, the
  forgetting ROC;
* :mod:`.report` — :func:`inspect_run`, :func:`write_report` (PNGs, ``scores.csv``, ``index.html``).

Layer: above the training loop and below the runner (``docs/concepts.md``): it imports the methods,
models, data and curvature, never ``config``, ``runner`` or the CLI.

Command line: ``continual-blr inspect RUN_DIR_OR_CONFIG [--method M] [--task T] [--top K] [--out DIR]
[--device D]`` (``docs/inspect.md``).
"""

from .forgetting import (
    PREDICTORS,
    Forgetting,
    ForgettingAnalysis,
    auroc,
    average_ranks,
    collect_forgetting,
    forgetting_table,
    roc_curve,
    score_forgetting,
    spearman,
    within_task_auroc,
)
from .generalisation import Generalisation, generalisation, loo_estimate, test_fit
from .report import DEFAULT_TOP, Inspection, inspect_run, write_report
from .saved_run import SavedRun, has_memory_store, memory_kind, run_covariance, stored_memory
from .scores import (
    DEFAULT_PRIOR_PRECISION,
    ExampleScores,
    diag_laplace_posterior,
    loo_shift,
    prediction_covariance,
    score_examples,
    softmax_scores,
)

__all__ = [
    "inspect_run",
    "write_report",
    "Inspection",
    "DEFAULT_TOP",
    "SavedRun",
    "has_memory_store",
    "memory_kind",
    "run_covariance",
    "stored_memory",
    "ExampleScores",
    "score_examples",
    "softmax_scores",
    "prediction_covariance",
    "loo_shift",
    "diag_laplace_posterior",
    "DEFAULT_PRIOR_PRECISION",
    "Generalisation",
    "generalisation",
    "loo_estimate",
    "test_fit",
    "PREDICTORS",
    "Forgetting",
    "ForgettingAnalysis",
    "score_forgetting",
    "collect_forgetting",
    "forgetting_table",
    "spearman",
    "auroc",
    "average_ranks",
    "roc_curve",
    "within_task_auroc",
]
