"""Perf scripts time runs; the accuracy they print beside the times must come from held-out training data, never
the test set (docs/benchmarks.md, the protocol). Planted once: without the validation line in perf_fromp's config
builder, this fails."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "perf" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_end_to_end_perf_runs_use_the_validation_stream():
    perf = _load("perf_fromp")  # perf_blr --end-to-end builds its configs with the same function
    for method in ("none", "fromp", "blr"):
        cfg = perf._split_mnist_config(method, None, True, "split_digits")
        assert cfg.stream.validation == 0.1, method
