"""The run's cost columns: each method's ``time s`` measures that method alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tiny_runs import TINY


def test_first_method_is_not_charged_the_process_start_up(tmp_path):
    """In a fresh process (torch.optim's first optimiser imports torch._dynamo, ~2 s), the first task of the first
    method takes about as long as the same work later; before the fix it carried the start-up."""
    cfg = TINY + "methods: [none, {name: l2}]\n"
    (tmp_path / "c.yaml").write_text(cfg)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "continual_blr", "run", str(tmp_path / "c.yaml"), "--out",
                           str(tmp_path / "run"), "--threads", "1"], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "run" / "results.json").read_text())["results"]
    first, rest = results[0]["task_times"][0], results[0]["task_times"][1:] + results[1]["task_times"]
    assert first <= 0.3 + 5 * max(rest), (first, rest)


def test_heatmap_drawn_once_at_the_end_and_on_resume(tmp_path, monkeypatch, capsys):
    """One heatmap per run (not one per task of every method), and a resumed run draws it when it ends."""
    import torch

    from continual_blr import loop, plots
    from continual_blr.cli import main

    torch.set_num_threads(1)
    drawn = []
    original = plots.plot_accuracy_matrices
    monkeypatch.setattr(plots, "plot_accuracy_matrices", lambda results, path: drawn.append(path) or
                        original(results, path))
    (tmp_path / "c.yaml").write_text(TINY + "methods: [none, l2]\n")
    assert main(["run", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "a")]) == 0
    assert len(drawn) == 1 and (tmp_path / "a" / "accuracy_matrix.png").is_file()

    drawn.clear()
    fit, calls = loop.fit_task, []

    def stop_at_third(*args, **kwargs):  # l2's first task: none has finished
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return fit(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(loop, "fit_task", stop_at_third)
        assert main(["run", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "b")]) == 130
    assert drawn == [] and not (tmp_path / "b" / "accuracy_matrix.png").exists()
    assert main(["run", "--resume", str(tmp_path / "b")]) == 0
    assert len(drawn) == 1 and (tmp_path / "b" / "accuracy_matrix.png").is_file()
    capsys.readouterr()


def test_results_md_names_stream_seed_and_a_quick_run(tmp_path, capsys):
    """results.md says what it is: stream, scenario, seed, what was evaluated, and QUICK for a quick run."""
    import torch

    from continual_blr.cli import main

    torch.set_num_threads(1)
    (tmp_path / "c.yaml").write_text(TINY + "methods: [none]\nseed: 3\n")
    assert main(["run", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "q"), "--quick"]) == 0
    text = (tmp_path / "q" / "results.md").read_text()
    head = text.splitlines()[0]
    assert head.startswith("synthetic (task-incremental), seed 3") and "QUICK" in head, head
    assert "final test accuracy (%)" in text
    assert main(["run", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "f")]) == 0
    assert "QUICK" not in (tmp_path / "f" / "results.md").read_text()
    printed = capsys.readouterr().out
    assert "synthetic (task-incremental), seed 3 [QUICK MODE: epochs / 5]" in printed  # the printed table: unchanged
