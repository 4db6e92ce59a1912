"""Multi-seed runs (``continual_blr.sweep``, ``continual-blr run --seeds``): per-seed run folders, the
mean ± std table, skipping finished seeds, pluggable executors."""

from __future__ import annotations

import json
import statistics

import pytest

from continual_blr.cli import main
from continual_blr.config import RunConfig, from_dict
from continual_blr.loop import StreamResult
from continual_blr.sweep import format_mean_std, mean_std, run_seeds, summarize

TINY = {"stream": {"name": "synthetic", "options": {"n_tasks": 2, "n_train": 40}}, "model": {"hidden": [8]},
        "train": {"epochs": 1, "batch_size": 20}, "methods": ["none", "l2"], "progress": False}


def _result(method: str, seed: int, avg: float, forgetting: float = 0.0) -> StreamResult:
    return StreamResult(method=method, stream="s", scenario="task", seed=seed, acc_matrix=[[avg]], avg_acc=avg,
                        avg_acc_per_step=[avg], forgetting=forgetting, bwt=-forgetting, task_times=[1.0],
                        train_loss=[0.0])


def test_mean_std_is_the_sample_std():
    assert mean_std([1.0, 2.0, 4.0]) == (statistics.fmean([1, 2, 4]), statistics.stdev([1, 2, 4]))
    assert mean_std([3.0]) == (3.0, 0.0)
    assert format_mean_std([0.9, 0.8]) == "85.00 ± 7.07"  # 100·mean, 100·sqrt(((0.05)² · 2) / 1)


def test_summarize_by_method():
    table = summarize([[_result("a", 0, 0.9), _result("b", 0, 0.5, 0.1)],
                       [_result("a", 1, 0.8), _result("b", 1, 0.7, 0.3)]], title="t")
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| a") or line.startswith("| b")}
    assert "| 2 | 85.00 ± 7.07 |" in rows["a"]
    assert "| 2 | 60.00 ± 14.14 | 20.00 ± 14.14 | -20.00 ± 14.14 |" in rows["b"]


def test_run_seeds_writes_each_seed_and_skips_finished_ones(tmp_path):
    cfg = from_dict(RunConfig, TINY)
    calls = []

    def recording(jobs, run):
        calls.append([(j.seed, j.resume) for j in jobs])
        return [run(j) for j in jobs]

    first = run_seeds(cfg, [0, 1], tmp_path / "sw", executor=recording)
    assert calls == [[(0, False), (1, False)]]
    for s in (0, 1):
        payload = json.loads((tmp_path / "sw" / f"seed-{s}" / "results.json").read_text())
        assert payload["config"]["seed"] == s and all(p["complete"] for p in payload["progress"].values())
    assert [r.seed for per in first for r in per] == [0, 0, 1, 1]
    summary = (tmp_path / "sw" / "summary.md").read_text()
    m, s = mean_std([100 * per[0].avg_acc for per in first])
    assert f"| none | 2 | {m:.2f} ± {s:.2f} |" in summary
    # again with one more seed: the finished seeds are reloaded (resume, nothing retrained), the new one runs
    again = run_seeds(cfg, [0, 1, 2], tmp_path / "sw", executor=recording)
    assert calls[1] == [(0, True), (1, True), (2, False)]
    assert [r.to_dict() for r in again[0]] == [r.to_dict() for r in first[0]]
    # another config in the same folder is refused
    other = from_dict(RunConfig, TINY | {"train": {"epochs": 2, "batch_size": 20}})
    with pytest.raises(ValueError, match="another config"):
        run_seeds(other, [0], tmp_path / "sw")


def test_cli_seeds_prints_and_writes_the_summary(tmp_path, capsys):
    import yaml

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({k: v for k, v in TINY.items() if k != "progress"}))
    out = tmp_path / "sw"
    assert main(["run", str(cfg), "--seeds", "0", "1", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    summary = (out / "summary.md").read_text()
    assert "| none | 2 |" in printed and "| l2 | 2 |" in printed and summary.strip() in printed
    assert sorted(p.name for p in out.iterdir()) == ["seed-0", "seed-1", "summary.md", "sweep.json"]
    # a folder of seeds resumes as one run folder does
    assert main(["run", "--resume", str(out), "--no-progress"]) == 0
    assert (out / "summary.md").read_text() == summary


def test_interrupted_sweep_resumes_to_the_same_summary(tmp_path, monkeypatch, capsys):
    import yaml

    import continual_blr.loop as loop

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({k: v for k, v in TINY.items() if k != "progress"}))
    ref, out = tmp_path / "ref", tmp_path / "sw"
    assert main(["run", str(cfg), "--seeds", "0", "1", "--out", str(ref), "--no-progress"]) == 0
    original, count = loop.fit_task, {"n": 0}

    def stop_in_seed_1(*args, **kwargs):  # seed 0 trains 2 methods × 2 tasks; stop seed 1's 2nd task
        count["n"] += 1
        if count["n"] == 6:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(loop, "fit_task", stop_in_seed_1)
        assert main(["run", str(cfg), "--seeds", "0", "1", "--out", str(out), "--no-progress"]) == 130
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"continual-blr run --resume {out}" in err and "seed 1" in err, err
    assert main(["run", "--resume", str(out), "--no-progress"]) == 0
    strip_time = lambda text: [line.rsplit("|", 2)[0] for line in text.splitlines()]  # noqa: E731 - wall time differs
    assert strip_time((out / "summary.md").read_text()) == strip_time((ref / "summary.md").read_text())
