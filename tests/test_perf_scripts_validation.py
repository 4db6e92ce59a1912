"""Perf scripts time runs; the accuracy they print beside the times must come from held-out training data, never
the test set (docs/benchmarks.md, the protocol). Planted once: without the validation line in perf_fromp's config
builder, this fails."""

from __future__ import annotations

import argparse
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


def test_end_to_end_reports_go_to_an_explicit_out(tmp_path, monkeypatch):
    """``perf_blr.py --end-to-end --out F`` (and perf_fromp's) writes F, not the default report, which may hold other
    rows (the permuted-MNIST ivon table was nearly overwritten this way). Planted once: ``write_end_to_end`` ignoring
    ``--out`` wrote the default file and this test failed."""
    perf_fromp = _load("perf_fromp")
    default_root = tmp_path / "root"
    monkeypatch.setattr(perf_fromp, "ROOT", default_root)
    out = tmp_path / "mine" / "table.md"
    for script in ("blr", "fromp"):
        args = argparse.Namespace(no_write=False, out=str(out), benchmark="permuted_mnist", quick=False)
        perf_fromp.write_end_to_end(script, args, f"table of {script}")
        assert out.read_text() == f"table of {script}"
        assert not default_root.exists()
    args = argparse.Namespace(no_write=False, out=None, benchmark="permuted_mnist", quick=True)
    perf_fromp.write_end_to_end("blr", args, "default")
    assert (default_root / "benchmarks/results/perf/perf_blr_end_to_end_permuted_mnist_quick.md").read_text() == "default"


def test_perf_train_compiled_rows_run_the_compiled_forward(monkeypatch):
    """``perf_train.py --compile`` must time the step with the compiled forward installed. Its context was once entered
    and dropped, so the generator closed at once and the compiled rows timed the eager step. ``torch.compile`` is
    replaced by a counting wrapper (no graph is built: the test runs in a second); the compiled step must call it
    on every step and the eager step never. Planted once: the context entered without being kept, this fails."""
    import gc

    import continual_blr.compiled as compiled

    calls = {"n": 0}

    def fake_compile(fn, **kwargs):
        def counted(*args, **kw):
            calls["n"] += 1
            return fn(*args, **kw)
        return counted

    monkeypatch.setattr(compiled.torch, "compile", fake_compile)
    perf = _load("perf_train")
    monkeypatch.setattr(perf, "BATCH", 4)
    step = perf._step_fn("cifarnet", "fp32", False, seed=0, compile="default")
    gc.collect()
    for _ in range(3):
        step()
    assert calls["n"] == 3
    eager = perf._step_fn("cifarnet", "fp32", False, seed=0)
    eager()
    assert calls["n"] == 3
