"""Memorable-example inspection: which past examples a network remembers, and why.

* :mod:`.scores` — per-example scores: relevance tr Λ (what FROMP selects on), prediction error,
  prediction covariance J Σ Jᵀ, the leave-one-out shift V e and the sensitivity (Nickl et al. 2023);
* :mod:`.saved_run` — reload a finished run (stream, network, method state, Σ, stored memory);
* :mod:`.figures` — image grids, projections, memory maps, histograms, the memorable set across tasks;
* :mod:`.report` — :func:`inspect_run`, :func:`write_report` (PNGs, ``scores.csv``, ``index.html``).

Command line: ``continual-blr inspect RUN_DIR_OR_CONFIG [--task T] [--top K] [--out DIR]``
(``docs/inspect.md``).
"""

from .report import DEFAULT_TOP, Inspection, inspect_path, inspect_run, write_report
from .saved_run import RunNotFoundError, SavedRun, load_run, run_covariance, stored_memory
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
    "inspect_path",
    "inspect_run",
    "write_report",
    "Inspection",
    "DEFAULT_TOP",
    "load_run",
    "SavedRun",
    "RunNotFoundError",
    "run_covariance",
    "stored_memory",
    "ExampleScores",
    "score_examples",
    "softmax_scores",
    "prediction_covariance",
    "loo_shift",
    "diag_laplace_posterior",
    "DEFAULT_PRIOR_PRECISION",
]
