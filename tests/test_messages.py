"""Messages that said something misleading (issue 24, item 10): each case checks the corrected one-liner."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from continual_blr.cli import main
from tiny_runs import TINY as TINY_BASE
from tiny_runs import tiny_run as make_tiny_run

TINY = TINY_BASE + "methods: [none]\n"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return make_tiny_run(tmp_path_factory.mktemp("messages"))


def test_a_config_naming_the_default_scenario_matches_a_run_that_left_it_out(tiny_run):
    """The embedded default leaves ``stream.scenario`` out (the stream's default); its YAML twin names it: the
    same run, not a mismatch. Another scenario still is one."""
    from continual_blr.config import RunConfig, from_dict, yaml_load
    from continual_blr.data import DEFAULT_SCENARIOS
    from continual_blr.saved_run import check_config_matches

    data = yaml_load(TINY)
    data["stream"]["scenario"] = DEFAULT_SCENARIOS["synthetic"]
    check_config_matches(from_dict(RunConfig, data), tiny_run / "run")
    data["stream"]["scenario"] = "class" if DEFAULT_SCENARIOS["synthetic"] != "class" else "task"
    with pytest.raises(ValueError, match="stream.scenario"):
        check_config_matches(from_dict(RunConfig, data), tiny_run / "run")


def test_resume_of_a_copied_finished_run_names_the_copy(tiny_run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_run / "run", copy)
    capsys.readouterr()
    assert main(["run", "--resume", str(copy), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert str(copy / "results.json") in out and str(tiny_run / "run") not in out, out


@pytest.mark.parametrize("args, needle", [
    (["--inputs", "OK"], "--head: the network has 2 heads (one per task); pass --head 0..1"),
    (["--inputs", "/dev/null", "--head", "0"], "--inputs: /dev/null is not a regular file"),
])
def test_predict_names_the_cli_option(tiny_run, tmp_path, capsys, args, needle):
    np.save(tmp_path / "ok.npy", np.zeros((2, 6), np.float32))
    args = [str(tmp_path / "ok.npy") if a == "OK" else a for a in args]
    assert main(["predict", str(tiny_run / "run"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_inspect_offers_other_methods_only_when_there_are_some(tiny_run, tmp_path, capsys):
    assert main(["inspect", str(tiny_run / "run"), "--out", str(tmp_path / "report"), "--no-progress",
                 "--top", "4"]) == 0
    out = capsys.readouterr().out
    assert "inspected none" in out and "--method" not in out, out
    payload = json.loads((tiny_run / "run" / "results.json").read_text())
    assert [m["name"] for m in payload["config"]["methods"]] == ["none"]


def test_no_progress_bars_in_a_log_and_no_folders_left_by_a_failed_download(tmp_path):
    """Issue 24, item 11. With stderr not a terminal (a log file, a pipe) a run writes no progress bars; a download
    attempt that fails removes the folders it created (torchvision makes ``MNIST/raw`` before it tries)."""
    import subprocess
    import sys

    from continual_blr.data.paths import no_litter

    (tmp_path / "c.yaml").write_text(TINY.replace("progress: false\n", ""))  # bars asked for
    r = subprocess.run([sys.executable, "-m", "continual_blr", "run", str(tmp_path / "c.yaml"), "--out",
                        str(tmp_path / "run")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-500:]
    root = tmp_path / "data"
    (tmp_path / "keep").mkdir()
    with pytest.raises(RuntimeError, match="no network"):
        with no_litter(root / "MNIST" / "raw", tmp_path / "keep"):
            (root / "MNIST" / "raw").mkdir(parents=True)
            raise RuntimeError("no network")
    assert not root.exists() and (tmp_path / "keep").is_dir()
    with no_litter(root / "MNIST" / "raw"):  # a success keeps what it made
        (root / "MNIST" / "raw").mkdir(parents=True)
    assert (root / "MNIST" / "raw").is_dir()


def test_silent_cases_now_speak(tiny_run, tmp_path, capsys):
    """Issue 24, item 9, the choices: ``predict`` refuses a 1-D array (one example is ``x[None]``) and inputs far
    outside the range the run was trained on when that range is [0, 1] (0–255 pixels); ``accuracy_matrix``
    refuses metrics without per-experience accuracy instead of returning NaN; ``--ray`` without Ray says that
    the seeds run one after another."""
    from continual_blr.integrations.avalanche import accuracy_matrix
    from continual_blr.run_folder import read_json

    np.save(tmp_path / "one.npy", np.zeros(6, np.float32))
    assert main(["predict", str(tiny_run / "run"), "--inputs", str(tmp_path / "one.npy"), "--head", "0"]) == 2
    assert "1-D array" in capsys.readouterr().err
    lo, hi = read_json(tiny_run / "run" / "results.json")["stream"]["input_range"]
    assert lo < hi  # recorded with the run
    with pytest.raises(ValueError, match="per-experience test accuracy"):
        accuracy_matrix([{"Loss_Stream/eval_phase/test_stream": 0.3}])
    assert accuracy_matrix([{"Top1_Acc_Exp/eval_phase/test_stream/Task000/Exp000": 0.9}]) == [[0.9]]


def test_pixels_against_a_run_trained_on_unit_inputs(tmp_path, capsys):
    torch.set_num_threads(1)
    (tmp_path / "c.yaml").write_text("stream: {name: split_digits}\nmodel: {hidden: [8]}\n"
                                     "train: {epochs: 1, batch_size: 64}\nprogress: false\nmethods: [none]\n")
    assert main(["run", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "run")]) == 0
    np.save(tmp_path / "px.npy", np.full((2, 64), 255, np.float32))
    capsys.readouterr()
    assert main(["predict", str(tmp_path / "run"), "--inputs", str(tmp_path / "px.npy"), "--head", "0"]) == 2
    err = capsys.readouterr().err
    assert "values up to 255" in err and "[0, 1]" in err, err
    np.save(tmp_path / "unit.npy", np.full((2, 64), 0.5, np.float32))
    assert main(["predict", str(tmp_path / "run"), "--inputs", str(tmp_path / "unit.npy"), "--head", "0"]) == 0


def test_ray_missing_is_said(tmp_path, capsys, monkeypatch):
    import continual_blr.sweep_ray as sweep_ray

    monkeypatch.setattr(sweep_ray, "ray_available", lambda: False)
    (tmp_path / "c.yaml").write_text(TINY)
    assert main(["run", str(tmp_path / "c.yaml"), "--seeds", "0", "--ray", "--out", str(tmp_path / "s")]) == 0
    err = capsys.readouterr().err
    assert "ray is not installed; the seeds run one after another" in err, err
