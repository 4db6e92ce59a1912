"""Issue 42 item 13's smaller things: --data-dir for data-free streams, a CSV as --inputs, 'did you mean', --resume
of a finished run, the heatmap's colour bar in %."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiny_runs import TINY, tiny_run

from continual_blr.cli import main

torch.set_num_threads(1)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("continual-blr: error:") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("small")) / "run"


def test_data_dir_need_not_exist_for_a_data_free_stream(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(TINY + "methods: [none]\n")
    assert main(["run", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "r"), "--data-dir", str(tmp_path / "no")]) == 0
    capsys.readouterr()
    assert main(["run", "--method", "none", "--set", "stream.name=split_mnist", "--data-dir", str(tmp_path / "no")]) == 2
    assert "--data-dir: folder not found" in _one_line(capsys)  # a stream that reads files: still refused


def test_a_csv_as_inputs_is_one_line_naming_npy(run, tmp_path, capsys):
    np.savetxt(tmp_path / "x.csv", np.zeros((3, 6)), delimiter=",")
    assert main(["predict", str(run), "--inputs", str(tmp_path / "x.csv")]) == 2
    err = _one_line(capsys)
    assert "--inputs:" in err and "is not a .npy array" in err and "numpy.loadtxt" in err and "pickle" not in err


@pytest.mark.parametrize("argv, suggestion", [
    (["run", "--method", "fromq"], "did you mean 'fromp'?"),
    (["methods", "from-l2"], "did you mean 'fromp-l2'?"),
])
def test_a_misspelt_method_gets_did_you_mean(argv, suggestion, capsys):
    assert main(argv) == 2
    err = _one_line(capsys)
    assert suggestion in err and "allowed:" in err


def test_resume_of_a_finished_run_says_so(run, capsys):
    assert main(["run", "--resume", str(run)]) == 0
    err = capsys.readouterr().err
    assert f"every method of {run} has finished; nothing to run" in err


def test_heatmap_colour_bar_in_percent_like_its_cells(tmp_path, monkeypatch):
    from continual_blr import plots
    from continual_blr.loop import StreamResult

    made = []
    figure = plots._figure
    monkeypatch.setattr(plots, "_figure", lambda *a: made.append(figure(*a)) or made[-1])
    r = StreamResult(method="m", stream="s", scenario="task", seed=0, acc_matrix=[[0.9, float("nan")], [0.8, 0.7]],
                     task_times=[0.0, 0.0], train_loss=[0.0, 0.0], config={}, avg_acc=0.75, forgetting=0.1,
                     bwt=-0.1, avg_acc_per_step=[0.9, 0.75], memory={})
    plots.plot_accuracy_matrices([r], tmp_path / "h.png")
    bar = made[0].axes[-1]  # the colour bar's axes
    assert max(bar.get_ylim()) == pytest.approx(100.0) and "%" in bar.get_ylabel()
