"""Interrupted runs: a run stopped by SIGINT (at a task boundary, mid-task, or by a real signal to a
subprocess) and resumed gives exactly the accuracy matrix and carried state of an uninterrupted run.

Oracle: the uninterrupted run with the same config and seed (CPU, bit-exact: ``torch.equal`` on every
saved tensor, ``==`` on the accuracy matrix). The run folder of an interrupted run is valid on its own:
``results.json`` parses, finished methods are complete, and ``load_run`` reloads them.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import continual_blr.loop as loop
from continual_blr.cli import main
from conftest import interrupt_at_call

CONFIG = """\
stream: {name: synthetic, options: {n_tasks: 3, n_train: 40}}
model: {hidden: [8]}
train: {epochs: 2, batch_size: 10}
seed: 3
methods:
  - {name: blr, params: {mc_samples: 2, predict_samples: 2}}
  - {name: ewc}
  - {name: fromp, params: {n_points: 6}}
  - {name: vcl, params: {coreset_size: 4, predict_samples: 2}}
"""
METHODS = ["blr", "ewc", "fromp", "vcl"]


def _same(a, b, where="") -> None:
    """Exact equality of nested saved states (tensors bit-equal, floats ==, NaN == NaN)."""
    assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _load(p: Path):
    return torch.load(p, map_location="cpu", weights_only=False)


def _matrices(run: Path) -> dict[str, list[list[float]]]:
    payload = json.loads((run / "results.json").read_text())
    return {r["method"]: r["acc_matrix"] for r in payload["results"]}


def _assert_same_run(ref: Path, run: Path) -> None:
    assert _matrices(ref) == _matrices(run)
    for m in METHODS:
        _same(_load(ref / m / "model.pt"), _load(run / m / "model.pt"), f"{m}/model")
        _same(_load(ref / m / "method.pt"), _load(run / m / "method.pt"), f"{m}/method")  # the carried posterior
        for log in ("train_log.csv", "accuracy.csv"):
            assert (ref / m / log).read_text() == (run / m / log).read_text(), f"{m}/{log}"


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("cfg") / "tiny.yaml"
    p.write_text(CONFIG)
    return p


@pytest.fixture(scope="module")
def reference(config, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "run"
    assert main(["run", str(config), "--out", str(out), "--no-progress", "--threads", "1"]) == 0
    return out


def _interrupt_after(monkeypatch, name: str, calls: int) -> None:
    """Raise KeyboardInterrupt (as SIGINT does) at the start of call number ``calls`` of ``loop.<name>``."""
    interrupt_at_call(monkeypatch, loop, name, calls)


@pytest.mark.parametrize("where, name, calls", [
    ("task boundary of the 2nd method (ewc before its task 2)", "fit_task", 3 + 2),
    ("mid-task of the 1st method (blr, step 3 of its task 1)", "train_step", 8 + 3),
    ("mid-task of the 4th method (vcl, 2nd task)", "train_step", 3 * 3 * 8 + 8 + 2),
])
def test_interrupted_then_resumed_equals_uninterrupted(config, reference, tmp_path, monkeypatch, capsys, where,
                                                       name, calls):
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        _interrupt_after(patch, name, calls)
        rc = main(["run", str(config), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 130, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"continual-blr run --resume {out}" in err
    # the interrupted folder is valid: results.json parses; finished methods complete with model/method state
    payload = json.loads((out / "results.json").read_text())
    complete = [m for m, p in payload["progress"].items() if p["complete"]]
    for m in complete:
        assert (out / m / "model.pt").is_file() and (out / m / "method.pt").is_file()
        assert _matrices(out)[m] == _matrices(reference)[m]
    if complete:
        from continual_blr import load_run

        assert load_run(out, method=complete[0]) is not None
    # a second plain run into the same folder refuses instead of overwriting it
    assert main(["run", str(config), "--out", str(out), "--no-progress"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["run", "--resume", str(out), "--no-progress"]) == 0
    _assert_same_run(reference, out)


def test_every_task_boundary_is_kept_as_it_was(config, reference, tmp_path, monkeypatch, capsys):
    """``<method>/tasks/after_task<t>.pt`` (``runner.boundary_checkpoint``) is the checkpoint of the boundary after
    task t, untouched by later tasks. Oracle: the ``checkpoint.pt`` a run interrupted right after that boundary
    holds (a separate run, same seed: bit-equal)."""
    n_tasks = 3
    for m in METHODS:
        kept = sorted(p.name for p in (reference / m / "tasks").iterdir())
        assert kept == [f"after_task{t}.pt" for t in range(n_tasks)], kept
        _same(_load(reference / m / "tasks" / f"after_task{n_tasks - 1}.pt"), _load(reference / m / "checkpoint.pt"), m)
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        _interrupt_after(patch, "fit_task", 2)  # blr, before its task 1: checkpoint.pt is the boundary after task 0
        assert main(["run", str(config), "--out", str(out), "--no-progress"]) == 130
    capsys.readouterr()
    early = _load(out / "blr" / "checkpoint.pt")
    assert early["progress"]["next_task"] == 1
    kept = _load(reference / "blr" / "tasks" / "after_task0.pt")
    for state in (early, kept):
        state["progress"].pop("task_times")  # wall-clock seconds: the one field two runs do not share
    _same(early, kept, "blr/after_task0")
    final = _load(reference / "blr" / "checkpoint.pt")
    assert not all(torch.equal(final["model"][k], early["model"][k]) for k in early["model"])


def test_interrupted_twice_and_resumed_equals_uninterrupted(config, reference, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    for calls in (5, 9):  # the 2nd interrupt hits the resumed run
        with monkeypatch.context() as patch:
            _interrupt_after(patch, "train_step", calls)
            args = ["run", "--resume", str(out)] if (out / "results.json").is_file() else ["run", str(config), "--out", str(out)]
            assert main(args + ["--no-progress"]) == 130
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--no-progress"]) == 0
    _assert_same_run(reference, out)


def test_sigint_to_a_subprocess_then_resume(config, reference, tmp_path):
    """A real SIGINT to ``continual-blr run`` once its first checkpoint exists: exit 130, one line on stderr
    with the resume command; resuming gives the uninterrupted run's results."""
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "continual_blr.cli", "run", str(config), "--out", str(out),
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while not (out / "blr" / "checkpoint.pt").is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the run finished before the signal arrived")  # a very fast machine; nothing to resume
    assert proc.returncode == 130, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"resume with: continual-blr run --resume {out}" in err
    assert main(["run", "--resume", str(out), "--no-progress"]) == 0
    _assert_same_run(reference, out)


def _count_calls(monkeypatch, name: str) -> dict[str, int]:
    """Count the calls of ``loop.<name>`` (patched through ``monkeypatch``)."""
    original, count = getattr(loop, name), {"n": 0}

    def counted(*args, **kwargs):
        count["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(loop, name, counted)
    return count


# The config's tasks are 4 steps an epoch, 2 epochs: train_step call 8 + 4 + 2 is blr's task 1, epoch 2, step 2. vcl
# (after 3 methods x 3 tasks x 8 steps) fine-tunes its coreset copy after each task through the same train_step (2
# steps), so its task 1, epoch 2, step 2 is call 72 + 8 + 2 + 4 + 2.
@pytest.mark.parametrize("calls", [8 + 4 + 2, 3 * 3 * 8 + 8 + 2 + 4 + 2],
                         ids=["blr task 1 epoch 2", "vcl task 1 epoch 2"])
def test_an_epoch_checkpoint_resumes_inside_the_task(config, reference, tmp_path, monkeypatch, capsys, calls):
    """``--checkpoint-every 0`` writes ``<method>/epoch_checkpoint.pt`` after every epoch but a task's last; a run
    stopped inside a task resumes from it and equals the uninterrupted run bit for bit (models, carried states,
    logs). Oracle for where it resumed: the same interrupted folder without the epoch checkpoint resumes from the
    task boundary, and redoes exactly the saved epochs' steps more. Planted: the task's optimiser state not loaded
    (Adam restarted mid-task) fails the vcl case (blr's optimiser is the method's, restored with its state); the log
    trim dropping the kept epochs' rows fails both."""
    import shutil

    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        _interrupt_after(patch, "train_step", calls)
        assert main(["run", str(config), "--out", str(out), "--no-progress", "--checkpoint-every", "0"]) == 130
    capsys.readouterr()
    saved = [m for m in METHODS if (out / m / "epoch_checkpoint.pt").is_file()]
    assert len(saved) == 1, saved  # the method under way (finished ones removed theirs at each task's end)
    progress = _load(out / saved[0] / "epoch_checkpoint.pt")["progress"]
    assert progress["task"] == 1 and progress["epochs_done"] >= 1, progress
    boundary = tmp_path / "boundary"
    shutil.copytree(out, boundary)
    (boundary / saved[0] / "epoch_checkpoint.pt").unlink()
    steps = {}
    for folder in (out, boundary):
        with monkeypatch.context() as patch:
            count = _count_calls(patch, "train_step")
            assert main(["run", "--resume", str(folder), "--no-progress"]) == 0
        steps[folder] = count["n"]
        _assert_same_run(reference, folder)
        assert not any((folder / m / "epoch_checkpoint.pt").exists() for m in METHODS)
    assert steps[boundary] - steps[out] == 4 * progress["epochs_done"], steps


def test_epoch_checkpoints_change_no_result(config, reference, tmp_path, capsys):
    """A run that writes a checkpoint after every epoch (``--checkpoint-every 0``: the state is read, never
    changed) equals one that writes them only at task boundaries, bit for bit."""
    out = tmp_path / "run"
    assert main(["run", str(config), "--out", str(out), "--no-progress", "--threads", "1",
                 "--checkpoint-every", "0"]) == 0
    capsys.readouterr()
    _assert_same_run(reference, out)


def test_an_epoch_checkpoint_inside_the_warm_up_resumes_exactly(tmp_path, monkeypatch, capsys):
    """A warm-up longer than an epoch (``train.warmup_steps`` 6, 4 steps an epoch) stopped in its second epoch: the
    resumed task takes the warm-up's remaining steps at the saved ramp, and equals the uninterrupted run. Planted:
    the warm-up counter not restored (the ramp restarted mid-task) fails."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("stream: {name: synthetic, options: {n_tasks: 2, n_train: 40}}\nmodel: {hidden: [8]}\n"
                   "train: {epochs: 3, batch_size: 10, warmup_steps: 6}\nseed: 2\nmethods: [ewc]\n")
    ref, out = tmp_path / "ref", tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(ref), "--no-progress"]) == 0
    with monkeypatch.context() as patch:
        _interrupt_after(patch, "train_step", 12 + 4 + 1)  # task 1, epoch 2, step 1: warm-up step 5 of 6
        assert main(["run", str(cfg), "--out", str(out), "--no-progress", "--checkpoint-every", "0"]) == 130
    assert _load(out / "ewc" / "epoch_checkpoint.pt")["progress"]["warmup_done"] == 4
    assert main(["run", "--resume", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    assert _matrices(ref) == _matrices(out)
    _same(_load(ref / "ewc" / "model.pt"), _load(out / "ewc" / "model.pt"), "model")


@pytest.mark.slow
def test_sigterm_is_an_interrupt_too(config, tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "continual_blr.cli", "run", str(config), "--out", str(out),
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while not (out / "results.json").is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the run finished before the signal arrived")
    assert proc.returncode == 130, err
    assert len(err.strip().splitlines()) == 1 and "--resume" in err, err
    json.loads((out / "results.json").read_text())  # still valid


def _run_interrupt_resume(tmp_path, monkeypatch, method: str, name: str, calls: int, every: list[str] | None = None,
                          n_train: int = 40):
    """A 3-task synthetic run of ``method`` (a YAML method entry; ``n_train`` examples a task, batches of 10, 2
    epochs) straight through and interrupted after ``calls`` calls of ``name`` then resumed; asserts equal accuracy
    matrices and returns the two run folders. ``every``: extra flags of the interrupted run (``--checkpoint-every
    0``: it resumes from an epoch checkpoint)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"stream: {{name: synthetic, options: {{n_tasks: 3, n_train: {n_train}}}}}\nmodel: {{hidden: [8]}}\n"
                   f"train: {{epochs: 2, batch_size: 10}}\nseed: 5\nmethods: [{method}]\n")
    ref, out = tmp_path / "ref", tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(ref), "--no-progress"]) == 0
    with monkeypatch.context() as patch:
        _interrupt_after(patch, name, calls)
        assert main(["run", str(cfg), "--out", str(out), "--no-progress", *(every or [])]) == 130
    if every:  # the resume below starts inside the task, from the epoch checkpoint
        assert list(out.glob("*/epoch_checkpoint.pt")), "no epoch checkpoint where the run stopped"
    assert main(["run", "--resume", str(out), "--no-progress"]) == 0
    assert _matrices(ref) == _matrices(out)
    return ref, out


@pytest.mark.slow
@pytest.mark.parametrize("name, calls, every", [("fit_task", 2, None), ("train_step", 16 + 3, None),
                                               ("train_step", 16 + 8 + 2, ["--checkpoint-every", "0"])],
                         ids=["boundary", "mid-task", "epoch checkpoint"])
@pytest.mark.parametrize("method", sorted(__import__("continual_blr.methods", fromlist=["METHODS"]).METHODS))
def test_every_method_resumes_exactly(method, name, calls, every, tmp_path, monkeypatch, capsys):
    """Every registered method, with its default parameters, interrupted at the start of / inside its 2nd
    task (or an auxiliary fit near it) and resumed: from the task boundary, or from the epoch checkpoint inside
    the task (8 steps an epoch: call 16 + 8 + 2 is in the 2nd epoch of task 1 where no auxiliary fit comes first).
    Tasks of 80 examples: VCL's default k-center coreset of 40 a task leaves 40 to train on (with 40, none)."""
    if every and method == "joint":  # joint's task 1 trains on tasks 0 and 1: 16 steps an epoch
        calls = 16 + 16 + 2
    ref, out = _run_interrupt_resume(tmp_path, monkeypatch, method, name, calls, every, n_train=80)
    _same(_load(ref / method / "model.pt"), _load(out / method / "model.pt"), "model")
    _same(_load(ref / method / "method.pt"), _load(out / method / "method.pt"), "method")


@pytest.mark.parametrize("name, calls", [("fit_task", 2), ("train_step", 8 + 3)], ids=["boundary", "mid-task"])
def test_the_kfac_carry_resumes_exactly(name, calls, tmp_path, monkeypatch):
    """The BLR with ``carry: kfac`` interrupted at / inside its 2nd task and resumed equals the uninterrupted run:
    the checkpoint carries the Kronecker prior, and the load reinstalls its diagonal and coupling. Planted, a load
    that ignores the saved Kronecker prior (the diagonal prior alone, no coupling) fails both cases."""
    method = "{name: blr, params: {carry: kfac, temperature: 0.1}}"
    ref, out = _run_interrupt_resume(tmp_path, monkeypatch, method, name, calls)
    _same(_load(ref / "blr" / "model.pt"), _load(out / "blr" / "model.pt"), "model")
    _same(_load(ref / "blr" / "method.pt"), _load(out / "blr" / "method.pt"), "method")


@pytest.mark.parametrize("name, calls", [("fit_task", 2), ("train_step", 8 + 3)], ids=["boundary", "mid-task"])
def test_the_merged_kfac_carry_with_a_reused_coupling_resumes_exactly(name, calls, tmp_path, monkeypatch):
    """IVON with ``kfac_terms: merged`` and ``coupling_every: 2`` (the native fused step is off here) interrupted
    at / inside task 2 resumes from task 2's start and equals the uninterrupted run: the checkpoint carries the
    merged Kronecker prior. Planted once, a load that ignores the saved Kronecker prior fails both cases. (The
    reused coupling is reset at every task end, so a boundary checkpoint never holds one; a mid-task optimiser
    state is checked in ``test_blr_structured_prior.py``.)"""
    method = "{name: ivon, params: {carry: kfac, kfac_terms: merged, coupling_every: 2, temperature: 0.1}}"
    ref, out = _run_interrupt_resume(tmp_path, monkeypatch, method, name, calls)
    _same(_load(ref / "ivon" / "model.pt"), _load(out / "ivon" / "model.pt"), "model")
    _same(_load(ref / "ivon" / "method.pt"), _load(out / "ivon" / "method.pt"), "method")


@pytest.mark.parametrize("name, calls", [("fit_task", 2), ("train_step", 8 + 3)], ids=["boundary", "mid-task"])
def test_the_pooled_weight_noise_resumes_exactly(name, calls, tmp_path, monkeypatch):
    """The BLR with ``noise: pooled`` (the pool redrawn every 3 steps, so redraws fall on both sides of the
    interruption) interrupted at / inside its 2nd task and resumed equals the uninterrupted run: the checkpoint
    carries the pool's (seed, age). Planted, a load that ignores the saved pool state fails both cases."""
    method = "{name: blr, params: {curvature: price, init_hess: 0.01, noise: pooled, noise_refresh: 3}}"
    ref, out = _run_interrupt_resume(tmp_path, monkeypatch, method, name, calls)
    _same(_load(ref / "blr" / "model.pt"), _load(out / "blr" / "model.pt"), "model")


VCL_CONFIG = """\
stream: {name: synthetic, options: {n_tasks: 3, n_train: 40}}
model: {hidden: [8]}
train: {epochs: 2, batch_size: 10}
seed: 3
methods:
  - {name: vcl, params: {optimizer: bbb, coreset_size: 4, predict_samples: 2, ml_init_epochs: 1, task_start: START}}
"""


@pytest.mark.parametrize("start", ["carry", "reinit"])
def test_vcl_resumed_at_a_task_boundary_keeps_its_coresets_and_task_count(tmp_path, monkeypatch, capsys, start):
    """VCL's state holds the coresets held out so far (every fine-tuning copy trains on all of them) and the number
    of tasks started (the ML start runs before task 1 only; task_start resets from task 2 on). Resumed before task
    3, the run equals the uninterrupted one; without them its last row differed (an ML start on task 3, task 3's
    coreset alone, no reset)."""
    cfg = tmp_path / "vcl.yaml"
    cfg.write_text(VCL_CONFIG.replace("START", start))
    ref, out = tmp_path / "ref", tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(ref), "--no-progress", "--threads", "1"]) == 0
    with monkeypatch.context() as patch:
        _interrupt_after(patch, "fit_task", 3)
        assert main(["run", str(cfg), "--out", str(out), "--no-progress"]) == 130
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--no-progress"]) == 0
    assert _matrices(out) == _matrices(ref)
    _same(_load(ref / "vcl" / "method.pt"), _load(out / "vcl" / "method.pt"), "vcl/method")
