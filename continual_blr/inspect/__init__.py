"""Inspect a finished run: per-example memorability scores, figures and an HTML report (no retraining)."""

from .report import DEFAULT_TOP, MAX_IMAGES, Inspection, inspect_path, inspect_run, write_report
from .saved_run import RunNotFoundError, SavedRun, load_run, run_covariance, stored_memory
from .scores import ExampleScores, loo_shift, score_examples, softmax_scores

__all__ = [
    "DEFAULT_TOP",
    "MAX_IMAGES",
    "ExampleScores",
    "Inspection",
    "RunNotFoundError",
    "SavedRun",
    "inspect_path",
    "inspect_run",
    "load_run",
    "loo_shift",
    "run_covariance",
    "score_examples",
    "softmax_scores",
    "stored_memory",
    "write_report",
]
