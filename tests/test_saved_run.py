"""Save → load → predict: ``continual_blr.load_run`` and ``continual-blr predict`` on a run folder.

The reloaded network and method must reproduce what the run measured before it saved them: the
accuracy matrix's last row (computed by the run on its in-memory model) is recomputed from the folder.
"""

from __future__ import annotations

import csv
import io
import json
import shutil

import numpy as np
import pytest
import torch

import continual_blr
from continual_blr.cli import main
from continual_blr.saved_run import LoadedRun, RunNotFoundError, load_run, saved_methods

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A split-digits run of ``none``, ``fromp`` and ``blr`` with posterior-sampled predictions (1 epoch)."""
    out = tmp_path_factory.mktemp("saved") / "run"
    cfg = tmp_path_factory.mktemp("cfg") / "c.yaml"
    cfg.write_text(f"out: {out}\nstream: {{name: split_digits}}\ntrain: {{epochs: 1}}\nprogress: false\nmethods:\n  - none\n  - fromp\n"
                   "  - {name: blr, params: {predict_samples: 4}}\n")
    assert main(["run", str(cfg)]) == 0
    return out


def _final_row(run: LoadedRun) -> list[float]:
    accs = []
    for task in run.stream.tasks:
        pred = run.predict(task.x_test, head=task.head)
        accs.append(float((pred.cpu() == task.y_test).double().mean()))
    return accs


@pytest.mark.parametrize("name", ["none", "fromp"])
def test_loaded_run_reproduces_the_final_accuracies(run_dir, name):
    run = continual_blr.load_run(run_dir, name, data=True)
    assert isinstance(run, LoadedRun) and run.method_name == name
    assert run.config is not None and [m.name for m in run.config.methods] == ["none", "fromp", "blr"]
    saved = run.result["acc_matrix"][-1]
    np.testing.assert_allclose(_final_row(run), saved, rtol=0, atol=1e-12)


def test_blr_predicts_with_its_posterior_samples(run_dir):
    """``predict_samples`` > 0: the predictive averages sampled networks, so it is not the mean network's
    softmax, and the accuracy stays close to the one the run measured (fresh Monte-Carlo draws)."""
    run = load_run(run_dir, "blr", data=True)
    task = run.stream.tasks[0]
    proba = run.predict_proba(task.x_test, head=task.head)
    assert proba.shape == (task.x_test.shape[0], run.stream.n_outputs)
    torch.testing.assert_close(proba.sum(-1), torch.ones(proba.shape[0]), rtol=0, atol=1e-5)
    with torch.no_grad():
        plain = torch.softmax(run.model(task.x_test, head=task.head), -1)
    assert not torch.allclose(proba, plain, atol=1e-4)
    np.testing.assert_allclose(_final_row(run), run.result["acc_matrix"][-1], atol=0.1)


def test_flat_numpy_inputs_and_head_checks(run_dir):
    run = load_run(run_dir, "none", data=True)
    task = run.stream.tasks[2]
    flat = task.x_test.reshape(task.x_test.shape[0], -1).numpy()
    torch.testing.assert_close(run.predict_proba(flat, head=2), run.predict_proba(task.x_test, head=2))
    with pytest.raises(ValueError, match=r"head: the network has 5 heads"):
        run.predict(flat)
    with pytest.raises(ValueError, match=r"head: allowed 0\.\.4, got 7"):
        run.predict(flat, head=7)
    with pytest.raises(ValueError, match=r"inputs: shape \(3, 5\)"):
        run.predict(np.zeros((3, 5), np.float32), head=0)


def test_default_method_subfolder_and_latest_pointer(run_dir, tmp_path):
    assert load_run(run_dir).method_name == "none"  # the first finished method
    assert load_run(run_dir, prefer_memory=True).method_name == "fromp"
    assert load_run(run_dir / "blr").method_name == "blr"  # a <method>/ subfolder names the method
    (run_dir.parent / "latest").write_text(run_dir.name + "\n")  # runs/latest where links fail
    assert load_run(run_dir.parent / "latest", "fromp").path == run_dir


def test_a_partial_run_loads_its_finished_methods(run_dir, tmp_path):
    """A run stopped during ``blr``: results.json lacks it and its folder has no model.pt yet (maybe a
    checkpoint): ``none`` and ``fromp`` still load, ``blr`` is one clear error."""
    part = tmp_path / "part"
    shutil.copytree(run_dir, part)
    (part / "blr" / "model.pt").unlink()
    (part / "blr" / "method.pt").unlink()
    (part / "blr" / "checkpoint-task2.pt").write_bytes(b"not read")
    payload = json.loads((part / "results.json").read_text())
    payload["results"] = [r for r in payload["results"] if r["method"] != "blr"]
    (part / "results.json").write_text(json.dumps(payload))
    assert saved_methods(part) == ["none", "fromp"]
    assert load_run(part, "fromp").result["method"] == "fromp"
    with pytest.raises(RunNotFoundError, match="'blr' has not finished .*finished: none, fromp"):
        load_run(part, "blr")
    with pytest.raises(ValueError, match="^method: the run holds none, fromp, blr; got 'ewc'"):
        load_run(part, "ewc")
    with pytest.raises(RunNotFoundError, match="no results.json"):
        load_run(tmp_path / "empty")


def _csv_rows(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


def test_cli_predict_writes_the_methods_predictions(run_dir, tmp_path, capsys):
    run = load_run(run_dir, "fromp", data=True)
    task = run.stream.tasks[3]
    np.save(tmp_path / "x.npy", task.x_test[:7].numpy())
    out = tmp_path / "preds.csv"
    rc = main(["predict", str(run_dir), "--inputs", str(tmp_path / "x.npy"), "--method", "fromp", "--head", "3",
               "--out", str(out)])
    assert rc == 0
    rows = _csv_rows(out.read_text())
    want = run.predict_proba(task.x_test[:7], head=3)
    assert [int(r["head_output"]) for r in rows] == want.argmax(-1).tolist()  # task-incremental: head-local
    assert [int(r["label"]) for r in rows] == [(6, 7)[j] for j in want.argmax(-1).tolist()]  # task 3: digits 6, 7
    np.testing.assert_allclose([[float(r["p_0"]), float(r["p_1"])] for r in rows], want.numpy(), rtol=1e-5)
    capsys.readouterr()
    assert main(["predict", str(run_dir), "--inputs", str(tmp_path / "x.npy"), "--head", "3"]) == 0
    assert len(_csv_rows(capsys.readouterr().out)) == 7  # stdout without --out


@pytest.mark.parametrize("args, needle", [
    (["--head", "0"], "--inputs: file not found"),
    (["--inputs", "BAD", "--head", "9"], "head: allowed 0..4, got 9"),
    (["--inputs", "BAD"], "head: the network has 5 heads"),
    (["--inputs", "WRONG", "--head", "0"], "inputs: shape (2, 3)"),
    (["--inputs", "TEXT", "--head", "0"], "is not a .npy array"),
    (["--inputs", "BAD", "--head", "0", "--method", "nosuch"], "--method: the run holds none, fromp, blr"),
    (["--inputs", "BAD", "--head", "0", "--device", "gpu"], "--device: got 'gpu'"),
])
def test_cli_predict_bad_input_is_one_line(run_dir, tmp_path, capsys, args, needle):
    np.save(tmp_path / "ok.npy", np.zeros((2, 64), np.float32))
    np.save(tmp_path / "wrong.npy", np.zeros((2, 3), np.float32))
    (tmp_path / "text.npy").write_text("hello")
    subst = {"BAD": str(tmp_path / "ok.npy"), "WRONG": str(tmp_path / "wrong.npy"), "TEXT": str(tmp_path / "text.npy")}
    args = [subst.get(a, a) for a in args]
    if "--inputs" not in args:
        args += ["--inputs", str(tmp_path / "missing.npy")]
    rc = main(["predict", str(run_dir)] + args)
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("continual-blr: error:") and "\n" not in err and needle in err, err


def test_predict_needs_no_dataset(tmp_path, capsys, monkeypatch):
    """A split-MNIST run (generated MNIST files) predicts after its data root is emptied: ``predict`` and
    ``load_run`` read the stream's description from ``results.json`` (issue 24: ``MNIST not found``). The
    predictions equal those made with the data present; ``data=True`` then says the data is missing."""
    from test_data import _fake_mnist

    data = tmp_path / "data"
    _fake_mnist(data, gz=False, per_class=(8, 4))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"stream: {{name: split_mnist, data_dir: {data}, options: {{download: false}}}}\n"
                   "model: {hidden: [16]}\ntrain: {epochs: 1, batch_size: 16}\nprogress: false\nmethods: [ewc]\n")
    assert main(["run", str(cfg), "--out", str(tmp_path / "run")]) == 0
    x = np.random.default_rng(0).random((5, 784), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    with_data = load_run(tmp_path / "run", data=True).predict_proba(x, head=2)
    shutil.rmtree(data)
    data.mkdir()  # the data root now points at an empty folder
    capsys.readouterr()
    assert main(["predict", str(tmp_path / "run"), "--inputs", str(tmp_path / "x.npy"), "--head", "2"]) == 0
    rows = _csv_rows(capsys.readouterr().out)
    got = torch.tensor([[float(r["p_0"]), float(r["p_1"])] for r in rows])
    torch.testing.assert_close(got, with_data, rtol=1e-5, atol=1e-6)
    run = load_run(tmp_path / "run")
    assert run.stream.meta.get("skeleton") and run.stream.tasks[2].classes == (4, 5)
    with pytest.raises(Exception, match="MNIST"):
        load_run(tmp_path / "run", data=True)
