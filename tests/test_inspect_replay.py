"""`continual-blr inspect` on a replay method: the ER / DER buffer is the memory the report shows."""

from __future__ import annotations

import pytest
import torch

from tiny_runs import tiny_run

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def replay_run(tmp_path_factory):
    root = tiny_run(tmp_path_factory.mktemp("replay"), "[none, {name: er, params: {memory_size: 30}}]")
    return root / "run"


def test_inspect_shows_the_replay_buffer_as_the_memory(replay_run, tmp_path, capsys):
    from continual_blr.cli import main
    from continual_blr.saved_run import inspect_path, load_run

    index, insp = inspect_path(replay_run, out=tmp_path / "rep")
    assert insp.run.method_name == "er"  # the default: the first method that keeps past examples
    assert insp.has_memory and insp.memory_kind == "replay"
    buf = load_run(replay_run, "er", data=True).method.buffer
    assert buf.size == 30
    for s in insp.scores:  # the memorable points are the buffer's examples of the task, found by their inputs
        rows = buf.x[: buf.size][buf.task_id[: buf.size] == s.task_id]
        marked = insp.tasks[insp.scores.index(s)].x_train[s.index[s.memorable]]
        assert len(marked) == len(rows) > 0
        assert sorted(map(tuple, marked.tolist())) == sorted(map(tuple, rows.tolist()))
        assert torch.equal(s.memorable, s.stored_memory)
    text = index.read_text()
    assert "stored no memory" not in text and "replay buffer" in text
    assert "<b>30</b> in all" in text
    assert main(["inspect", str(replay_run), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    assert "inspected er (the first method with a stored memory" in capsys.readouterr().out


@pytest.mark.parametrize("stage", ["scores", "figures"])
def test_ctrl_c_in_inspect_is_one_line_exit_130_and_leaves_no_report(replay_run, tmp_path, capsys, monkeypatch, stage):
    """KeyboardInterrupt while scoring or while drawing: one line on stderr, exit 130, no report folder."""
    from continual_blr.cli import main
    from continual_blr.inspect import figures, report

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    if stage == "scores":
        monkeypatch.setattr(report, "score_examples", interrupt)
    else:
        monkeypatch.setattr(figures, "plot_memory_across_tasks", interrupt)  # after scores.csv and two figures
    out = tmp_path / "new" / "rep"
    assert main(["inspect", str(replay_run), "--out", str(out), "--no-progress"]) == 130
    err = capsys.readouterr().err.strip()
    assert err == "continual-blr: inspect interrupted; no report written"
    assert not out.exists() and list(tmp_path.iterdir()) == []
