"""Task-incremental predictions say the global class (issue 42 item 5): on head 1 of a stream whose task 1 holds
classes 2 and 3, ``predict`` gives head-local outputs 0 / 1 (as the tasks' ``y_test`` are), ``predict_label`` gives
2 / 3, and the CSV of ``continual-blr predict`` carries ``label`` (global), ``head`` and ``head_output``.
Class-incremental runs are unchanged: their outputs are the labels."""

import csv
import io

import numpy as np
import pytest
import torch

from continual_blr.cli import main
from continual_blr.saved_run import load_run
from tiny_runs import TINY


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("labels")
    out = {}
    for scenario in ("task", "class"):
        text = TINY.replace("{name: synthetic,", f"{{name: synthetic, scenario: {scenario},")
        (root / f"{scenario}.yaml").write_text(text + "methods: [none]\n")
        assert main(["run", str(root / f"{scenario}.yaml"), "--out", str(root / scenario)]) == 0
        out[scenario] = root / scenario
    x = load_run(out["task"], data=True).stream.tasks[1].x_test[:9].numpy()
    np.save(root / "x.npy", x)
    return out, root / "x.npy"


def _csv(capsys, argv):
    capsys.readouterr()
    assert main(argv) == 0
    return list(csv.DictReader(io.StringIO(capsys.readouterr().out)))


def test_task_scenario_predictions_carry_the_global_class(runs, capsys):
    (paths, x_path) = runs
    run = load_run(paths["task"])
    assert run.stream.tasks[1].classes == (2, 3)
    assert run.head_classes(1) == [2, 3] and run.head_classes(0) == [0, 1]
    x = np.load(x_path)
    local = run.predict(x, head=1)
    assert set(local.tolist()) <= {0, 1}
    assert run.predict_label(x, head=1).tolist() == [[2, 3][j] for j in local.tolist()]
    rows = _csv(capsys, ["predict", str(paths["task"]), "--inputs", str(x_path), "--head", "1"])
    assert list(rows[0]) == ["index", "label", "head", "head_output", "p_0", "p_1"]
    assert [int(r["head_output"]) for r in rows] == local.tolist()
    assert [int(r["label"]) for r in rows] == [[2, 3][j] for j in local.tolist()]
    assert {r["head"] for r in rows} == {"1"}


def test_class_scenario_predictions_are_unchanged(runs, capsys):
    (paths, x_path) = runs
    run = load_run(paths["class"])
    x = np.load(x_path)
    assert run.head_classes() == [0, 1, 2, 3]
    assert torch.equal(run.predict_label(x), run.predict(x))
    rows = _csv(capsys, ["predict", str(paths["class"]), "--inputs", str(x_path)])
    assert list(rows[0]) == ["index", "pred", "p_0", "p_1", "p_2", "p_3"]
    assert [int(r["pred"]) for r in rows] == run.predict(x).tolist()
