"""The benchmark configs and ``benchmarks/reproduce.py``: every config is valid, the report is
complete and honest (quick mode labelled, references beside ours), and reruns are resumable."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from continual_blr.config import RunConfig, from_dict
from continual_blr.data import STREAMS
from continual_blr.methods import METHODS, build_method

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*/*.yaml"))


def _load_reproduce():
    spec = importlib.util.spec_from_file_location("reproduce", ROOT / "benchmarks" / "reproduce.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_config_parses_and_names_registered_things(path):
    cfg = from_dict(RunConfig, yaml.safe_load(path.read_text()) or {})
    assert cfg.stream.name in STREAMS
    assert cfg.stream.data_dir is None, "data paths belong on the command line, not in configs"
    for mc in cfg.methods:
        assert mc.name in METHODS
        build_method(mc.name, mc.params)  # params validated against the method's dataclass


@pytest.mark.parametrize("benchmark", ["split_mnist", "permuted_mnist", "split_cifar"])
def test_benchmark_config_folders_share_one_protocol(benchmark):
    """Per benchmark, every method's config uses the same stream, network and (unclipped) schedule."""
    cfgs = [from_dict(RunConfig, yaml.safe_load(p.read_text())) for p in (ROOT / "configs" / benchmark).glob("*.yaml")]
    assert {c.stream.name for c in cfgs} == {benchmark}
    assert len({(c.model.arch, tuple(c.model.hidden)) for c in cfgs}) == 1
    assert len({(c.train.epochs, c.train.batch_size) for c in cfgs}) == 1


@pytest.mark.parametrize("benchmark, tau, n_points, delta, eps, clip", [
    ("split_mnist", 10.0, 40, 1e-3, 1e-6, 1.0),  # clips: tau × the reference's (it clips grad / tau)
    ("permuted_mnist", 0.5, 200, 1e-5, 1e-5, 0.005),
    ("split_cifar", 10.0, 200, 1e-4, 1e-6, 1000.0),
])
def test_fromp_configs_carry_the_papers_hyperparameters(benchmark, tau, n_points, delta, eps, clip):
    for name in ("fromp", "frorp", "fromp-l2"):
        cfg = from_dict(RunConfig, yaml.safe_load((ROOT / "configs" / benchmark / f"{name}.yaml").read_text()))
        method = build_method(cfg.methods[0].name, cfg.methods[0].params)
        p = method.params
        assert (p.tau, p.n_points, p.prior_precision, p.jitter) == (tau, n_points, delta, eps)
        assert cfg.train.grad_clip == clip


def _tiny_configs(root: Path) -> Path:
    folder = root / "configs" / "tiny"
    folder.mkdir(parents=True)
    base = {"stream": {"name": "synthetic", "scenario": "task", "options": {"n_tasks": 2, "n_train": 40, "n_test": 20}},
            "model": {"arch": "mlp", "hidden": [8]}, "train": {"epochs": 5, "batch_size": 20, "lr": 0.01}}
    for name, params in (("none", None), ("fromp", {"n_points": 4}), ("ewc", {"lam": 1.0})):
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(base | {"methods": [{"name": name, **({"params": params} if params else {})}]}))
    return root / "configs"


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return ["tiny", "--configs-dir", str(tmp_path / "configs"), "--runs-dir", str(tmp_path / "runs"),
            "--results-dir", str(tmp_path / "results"), *extra]


def test_reproduce_report_on_a_tiny_synthetic_run(tmp_path, capsys):
    reproduce = _load_reproduce()
    _tiny_configs(tmp_path)
    assert reproduce.main(_args(tmp_path, "--methods", "fromp", "none", "--seeds", "0", "1")) == 0
    report = (tmp_path / "results" / "tiny.md").read_text()
    assert (tmp_path / "results" / "tiny_curves.png").stat().st_size > 0
    rows = [line for line in report.splitlines() if line.startswith("| fromp ") or line.startswith("| none ")]
    assert len(rows) == 2 and rows[0].startswith("| fromp ")  # canonical order: fromp before none
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    # fromp keeps n_points = 4 per task over 2 tasks: 8 stored examples (results.json's memory stats)
    assert "±" in cells[1] and cells[2] == "2 (0,1)" and cells[3] == "task" and cells[4].startswith("8 ex. in all, ")
    assert "python benchmarks/reproduce.py tiny" in report
    assert "QUICK" not in report
    assert "**fromp** (seed 0)" in report  # accuracy matrices
    stored = json.loads((tmp_path / "runs" / "tiny" / "task" / "full" / "fromp_seed1.json").read_text())
    assert stored["seed"] == 1 and len(stored["acc_matrix"]) == 2 and stored["wall_s"] > 0


def test_deterministic_flag_turns_on_deterministic_kernels_and_is_named_in_the_record(tmp_path):
    """``--deterministic`` (for GPU runs, which are not bit-reproducible otherwise) switches PyTorch's deterministic
    algorithms on in warn-only mode, sets the cuBLAS workspace it needs, and the record's command names it; on the
    CPU the run's numbers equal a run without it."""
    reproduce = _load_reproduce()
    _tiny_configs(tmp_path)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    try:
        reproduce.main(_args(tmp_path, "--methods", "none", "--seeds", "0", "--runs-dir", str(tmp_path / "plain")))
        assert not torch.are_deterministic_algorithms_enabled()
        reproduce.main(_args(tmp_path, "--methods", "none", "--seeds", "0", "--deterministic"))
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()  # a missing kernel never stops a GPU run
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        if before[2] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = before[2]
    rec = json.loads((tmp_path / "runs" / "tiny" / "task" / "full" / "none_seed0.json").read_text())
    plain = json.loads((tmp_path / "plain" / "tiny" / "task" / "full" / "none_seed0.json").read_text())
    assert "--deterministic" in rec["command"] and "--deterministic" not in plain["command"]
    assert rec["acc_matrix"] == plain["acc_matrix"]


def test_reproduce_is_resumable_and_merges_runs_and_keeps_notes(tmp_path, monkeypatch):
    reproduce = _load_reproduce()
    _tiny_configs(tmp_path)
    reproduce.main(_args(tmp_path, "--methods", "none", "--seeds", "0"))
    out = tmp_path / "results" / "tiny.md"
    out.write_text(out.read_text() + "Closing note: kept across rewrites.\n")

    import continual_blr.runner as runner

    def boom(*a, **k):
        raise AssertionError("a finished run was rerun")

    monkeypatch.setattr(runner, "run_config", boom)
    reproduce.main(_args(tmp_path, "--methods", "none", "--seeds", "0"))  # skipped: already stored
    monkeypatch.undo()
    reproduce.main(_args(tmp_path, "--methods", "fromp", "--seeds", "0"))  # a second command, other method
    report = out.read_text()
    assert "| none " in report and "| fromp " in report  # both commands' runs in one table
    assert report.count("python benchmarks/reproduce.py tiny") == 2
    assert report.rstrip().endswith("Closing note: kept across rewrites.")


def test_records_hold_provenance_and_a_stale_record_is_rerun(tmp_path, monkeypatch):
    """A record names its commit, dirty flag, library hash, versions, device, resolved parameters, timestamps and
    the code it executed; a record whose executed code changed (or, without a fingerprint, whose library hash is not
    the current one) is run again and the replaced one kept under superseded/; a current one is reused."""
    reproduce = _load_reproduce()
    _tiny_configs(tmp_path)
    reproduce.main(_args(tmp_path, "--methods", "ewc", "--seeds", "0"))
    path = tmp_path / "runs" / "tiny" / "task" / "full" / "ewc_seed0.json"
    rec = json.loads(path.read_text())
    assert rec["library_hash"] == reproduce.run_records.library_hash() and len(rec["library_hash"]) == 16
    assert rec["versions"]["torch"] == torch.__version__ and rec["device"]
    assert rec["resolved_params"]["lam"] == 1.0 and "mode" in rec["resolved_params"]  # defaults filled in
    assert "commit" in rec and "dirty" in rec
    import continual_blr.runner as runner

    calls = []
    real = runner.run_config
    monkeypatch.setattr(runner, "run_config", lambda *a, **k: calls.append(1) or real(*a, **k))
    reproduce.main(_args(tmp_path, "--methods", "ewc", "--seeds", "0"))
    assert calls == []  # current: reused
    assert rec["fingerprint"] and rec["started"] <= rec["ended"] and "cpu_flags" in rec["device_info"]
    entry = next(e for e in rec["fingerprint"] if "methods/ewc.py" in e)
    path.write_text(json.dumps(rec | {"fingerprint": rec["fingerprint"] | {entry: "0" * 16}}))
    reproduce.main(_args(tmp_path, "--methods", "ewc", "--seeds", "0"))
    assert calls == [1]  # code it executed changed: stale, rerun
    assert len(list(path.parent.glob("superseded/ewc_seed0@*.json"))) == 1  # the replaced evaluation is kept
    rec = json.loads(path.read_text())
    legacy = {k: v for k, v in rec.items() if k != "fingerprint"} | {"library_hash": "0" * 16}
    path.write_text(json.dumps(legacy))  # a record without a fingerprint: the library-hash rule
    reproduce.main(_args(tmp_path, "--methods", "ewc", "--seeds", "0"))
    assert calls == [1, 1]


def test_a_resumable_run_writes_its_cpu_time_while_it_runs(tmp_path, monkeypatch):
    """The attempts file is rewritten every ``HEARTBEAT_S`` while the run goes on (so a killed process loses at
    most that much of its count), not only at the end: with a 0.05 s heartbeat, a run that has spent 0.4 s of CPU
    shows at least 0.3 s in the file before it returns, and its attempt is not yet marked ended."""
    import dataclasses
    import time

    import continual_blr.runner as runner

    reproduce = _load_reproduce()
    monkeypatch.setattr(reproduce, "HEARTBEAT_S", 0.05)
    work = tmp_path / "work" / "run"
    seen = []

    def busy_run(cfg, save=True, resume=False, **kw):
        c0 = time.process_time()
        while time.process_time() - c0 < 0.4:
            pass
        deadline = time.perf_counter() + 10.0
        while time.perf_counter() < deadline:  # at most one heartbeat late, however slow the machine
            attempt = json.loads(work.with_name("run.attempts.json").read_text())["attempts"][-1]
            if attempt["cpu_s"] >= 0.3:
                break
            time.sleep(0.01)
        seen.append(attempt)
        return ({"acc_matrix": []},)

    @dataclasses.dataclass
    class Cfg:
        out: str | None = None

    monkeypatch.setattr(runner, "run_config", busy_run)
    reproduce.run_resumable(Cfg(), work)
    assert seen[0]["cpu_s"] >= 0.3 and seen[0]["ended"] is None, seen
    final = json.loads(work.with_name("run.attempts.json").read_text())["attempts"]
    assert len(final) == 1 and final[0]["ended"] == "finished" and final[0]["cpu_s"] >= 0.4


def test_a_run_in_a_work_dir_continues_after_an_interruption_bit_identically(tmp_path, monkeypatch):
    """``--work-dir``: a run stopped after its first task (Ctrl-C / SIGTERM) returns 130 and writes no record;
    the same command continues it from the checkpoint, and the record equals an uninterrupted run's, with both
    processes' times counted; a work folder begun on another library is refused in one line."""
    reproduce = _load_reproduce()
    plain, resumable = tmp_path / "plain", tmp_path / "resumable"
    _tiny_configs(plain)
    _tiny_configs(resumable)
    assert reproduce.main(_args(plain, "--methods", "ewc", "--seeds", "0")) == 0
    expected = json.loads((plain / "runs" / "tiny" / "task" / "full" / "ewc_seed0.json").read_text())

    import continual_blr.runner as runner

    real = runner.run_stream

    def stop_after_task_1(*a, on_task_end=None, **k):
        def hook(progress, *rest):
            on_task_end(progress, *rest)
            if progress.next_task == 1:
                raise KeyboardInterrupt
        return real(*a, on_task_end=hook, **k)

    work = tmp_path / "work"
    args = _args(resumable, "--methods", "ewc", "--seeds", "0", "--work-dir", str(work))
    monkeypatch.setattr(runner, "run_stream", stop_after_task_1)
    assert reproduce.main(args) == 130
    monkeypatch.undo()
    record_path = resumable / "runs" / "tiny" / "task" / "full" / "ewc_seed0.json"
    attempts_path = work / "tiny" / "task" / "full" / "ewc_seed0.attempts.json"
    assert not record_path.exists()
    first = json.loads(attempts_path.read_text())["attempts"]
    assert [a["ended"] for a in first] == ["interrupted"] and first[0]["cpu_s"] > 0

    trained = []

    def count(*a, on_task_end=None, **k):
        def hook(progress, *rest):
            trained.append(progress.next_task)
            on_task_end(progress, *rest)
        return real(*a, on_task_end=hook, **k)

    monkeypatch.setattr(runner, "run_stream", count)
    assert reproduce.main(args) == 0
    monkeypatch.undo()
    assert trained == [2]  # the second process trained task 2 only
    got = json.loads(record_path.read_text())
    assert got["acc_matrix"] == expected["acc_matrix"] and got["train_loss"] == expected["train_loss"]
    assert [(a["resumed"], a["ended"]) for a in got["attempts"]] == [(False, "interrupted"), (True, "finished")]
    assert got["cpu_s"] == pytest.approx(sum(a["cpu_s"] for a in got["attempts"]))
    assert got["config"]["out"] is None

    meta = json.loads(attempts_path.read_text())
    attempts_path.write_text(json.dumps(meta | {"library_hash": "0" * 16}))
    record_path.unlink()
    with pytest.raises(SystemExit) as err:
        reproduce.main(args)
    assert "begun on library 0000000000000000" in str(err.value) and "--force" in str(err.value)
    assert "\n" not in str(err.value)


def test_provenance_takes_the_sent_commit_over_a_copied_git(monkeypatch):
    """On a machine that received a copy of the tree (a GPU machine), CONTINUAL_BLR_COMMIT / _DIRTY name the commit
    that was sent; they win over whatever ``.git`` came along, and the record says where the commit came from."""
    reproduce = _load_reproduce()
    rr = reproduce.run_records
    monkeypatch.delenv("CONTINUAL_BLR_COMMIT", raising=False)
    assert rr.provenance()["commit_source"] in ("git", None)
    monkeypatch.setenv("CONTINUAL_BLR_COMMIT", "a" * 40)
    monkeypatch.setenv("CONTINUAL_BLR_DIRTY", "0")
    prov = rr.provenance()
    assert (prov["commit"], prov["dirty"], prov["commit_source"]) == ("a" * 40, False, "env")
    monkeypatch.setenv("CONTINUAL_BLR_DIRTY", "1")
    assert rr.provenance()["dirty"] is True
    monkeypatch.setattr(rr, "_git", lambda *a: None)  # no git at all
    monkeypatch.setenv("CONTINUAL_BLR_DIRTY", "maybe")
    prov = rr.provenance()
    assert (prov["commit"], prov["dirty"]) == ("a" * 40, None)


def test_tables_are_generated_from_records_alone_and_checked(tmp_path):
    """tables.py rebuilds a table from its records; --check passes on it and fails once a row is edited by hand."""
    reproduce = _load_reproduce()
    _tiny_configs(tmp_path)
    reproduce.main(_args(tmp_path, "--methods", "none", "--seeds", "0", "1"))
    spec = importlib.util.spec_from_file_location("tables", ROOT / "benchmarks" / "tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    argv = ["--records-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "results")]
    assert tables.main(argv) == 0
    assert tables.main([*argv, "--check"]) == 0
    out = tmp_path / "results" / "tiny.md"
    out.write_text(out.read_text().replace("| none |", "| none (tuned) |", 1))
    assert tables.main([*argv, "--check"]) == 1


def test_tables_find_nested_benchmarks_and_name_their_reports_flat(tmp_path):
    """A benchmark with a slash (``split_cifar10/resnet18``) has its records one folder deeper; tables.py finds
    them (and not the search records), and its report is ``split_cifar10_resnet18.md``, not a subfolder."""
    spec = importlib.util.spec_from_file_location("tables", ROOT / "benchmarks" / "tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    for folder in ("a/b/task/full", "c/class/quick_validation0.1", "search/c/task/full", "d/task/notamode"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "none_seed0.json").write_text("{}")
    (tmp_path / "e/task/full").mkdir(parents=True)  # no record in it
    assert sorted(tables.tables(tmp_path)) == [("a/b", "task", False, 0.0), ("c", "class", True, 0.1)]
    reproduce = _load_reproduce()
    assert reproduce.report_path(tmp_path, "a/b", "task", False) == tmp_path / "a_b.md"


def test_committed_tables_equal_what_their_records_generate():
    """CI's check: every table under benchmarks/results/ that has records under benchmarks/records/ is exactly
    what those records generate (above its notes line)."""
    spec = importlib.util.spec_from_file_location("tables", ROOT / "benchmarks" / "tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    assert tables.main(["--check"]) == 0


def test_quick_mode_is_labelled_and_stored_apart(tmp_path):
    reproduce = _load_reproduce()
    _tiny_configs(tmp_path)
    reproduce.main(_args(tmp_path, "--methods", "none", "--seeds", "0", "--quick"))
    assert not (tmp_path / "results" / "tiny.md").exists()
    report = (tmp_path / "results" / "tiny_quick.md").read_text()
    assert "QUICK MODE" in report.splitlines()[0]
    stored = json.loads((tmp_path / "runs" / "tiny" / "task" / "quick" / "none_seed0.json").read_text())
    assert stored["quick"] is True


def test_reference_gap_is_flagged():
    reproduce = _load_reproduce()
    assert reproduce._verdict(99.4, 0.1, 99.3).endswith("(meets)")
    assert reproduce._verdict(99.25, 0.1, 99.3).endswith("(within 1 std)")
    assert reproduce._verdict(98.0, 0.1, 99.3).endswith("(**short**)")


def test_missing_config_lists_the_available_ones(tmp_path):
    reproduce = _load_reproduce()
    _tiny_configs(tmp_path)
    with pytest.raises(SystemExit, match="available for tiny: ewc, fromp, none"):
        reproduce.main(_args(tmp_path, "--methods", "l2", "--seeds", "0"))


def test_split_digits_rows_name_existing_configs_per_scenario():
    """Every row's YAML exists; a row tuned per scenario runs its class config (scenario: class) there."""
    spec = importlib.util.spec_from_file_location("split_digits_bench", ROOT / "benchmarks" / "split_digits.py")
    sd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sd)
    folder = ROOT / "configs" / "split_digits"
    per_scenario = [r for r in sd.ROWS if r.class_config]
    assert per_scenario, "expected rows tuned per scenario (laplace, blr)"
    for row in sd.ROWS:
        for scen in row.scenarios:
            assert (folder / f"{row.config_for(scen)}.yaml").is_file()
    for row in per_scenario:
        assert row.config_for("task") == row.config and row.config_for("class") == row.class_config
        cfg = from_dict(RunConfig, yaml.safe_load((folder / f"{row.class_config}.yaml").read_text()))
        assert cfg.stream.scenario == "class"
        assert sd.method_config(row, "class").params != sd.method_config(row, "task").params


# ----------------------------------------------------------------------------- validation runs and searches


def _script_path(name: str) -> Path:
    """A benchmarks script by name: the suite at the top of benchmarks/, perf/ and diagnose/ apart."""
    for folder in ("", "perf", "diagnose"):
        path = ROOT / "benchmarks" / folder / f"{name}.py"
        if path.is_file():
            return path
    raise FileNotFoundError(name)


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", _script_path(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reproduce_validation_runs_are_stored_and_reported_apart(tmp_path):
    reproduce = _load_reproduce()
    _tiny_configs(tmp_path)
    reproduce.main(_args(tmp_path, "--methods", "none", "--seeds", "0", "--validation", "0.25"))
    assert not (tmp_path / "results" / "tiny.md").exists()
    report = (tmp_path / "results" / "tiny_validation.md").read_text()
    assert "VALIDATION" in report.splitlines()[0] and "not test" in report.splitlines()[0]
    stored = json.loads((tmp_path / "runs" / "tiny" / "task" / "full_validation0.25" / "none_seed0.json").read_text())
    assert stored["validation"] == 0.25 and stored["stream"] == "synthetic[validation 0.25]"
    with pytest.raises(SystemExit):
        reproduce.main(_args(tmp_path, "--methods", "none", "--seeds", "0", "--validation", "1"))


def test_reproduce_reruns_a_stored_run_whose_config_changed(tmp_path):
    reproduce = _load_reproduce()
    configs = _tiny_configs(tmp_path)
    reproduce.main(_args(tmp_path, "--methods", "ewc", "--seeds", "0"))
    path = tmp_path / "runs" / "tiny" / "task" / "full" / "ewc_seed0.json"
    assert json.loads(path.read_text())["config"]["method"]["params"] == {"lam": 1.0}
    cfg = yaml.safe_load((configs / "tiny" / "ewc.yaml").read_text())
    cfg["methods"][0]["params"]["lam"] = 50.0
    (configs / "tiny" / "ewc.yaml").write_text(yaml.safe_dump(cfg))
    reproduce.main(_args(tmp_path, "--methods", "ewc", "--seeds", "0"))
    assert json.loads(path.read_text())["config"]["method"]["params"] == {"lam": 50.0}


def _search_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["tiny", "ewc", "--configs-dir", str(tmp_path / "configs"), "--runs-dir", str(tmp_path / "runs"),
            "--results-dir", str(tmp_path / "results"), *extra]


def test_search_scores_on_validation_chooses_the_best_mean_and_resumes(tmp_path, monkeypatch):
    search = _load_script("search")
    _tiny_configs(tmp_path)
    argv = _search_args(tmp_path, "--grid", "lam=0,1000", "--seeds", "0", "1", "--validation", "0.25",
                        "--then-test", "2")
    assert search.main(argv) == 0
    out = tmp_path / "results" / "search_tiny_ewc.md"
    report = out.read_text()
    assert "VALIDATION 0.25" in report.splitlines()[0] and "python benchmarks/search.py tiny ewc" in report
    runs = tmp_path / "runs" / "tiny" / "ewc" / "task"
    val = {lam: [json.loads((runs / "full_validation0.25" / f"lam={lam}_seed{s}.json").read_text()) for s in (0, 1)]
           for lam in ("0", "1000")}
    for lam, recs in val.items():
        assert all(r["stream"] == "synthetic[validation 0.25]" and r["validation"] == 0.25 for r in recs)
        assert [r["params"]["lam"] for r in recs] == [float(lam)] * 2
    means = {lam: sum(r["avg_acc"] for r in recs) / 2 for lam, recs in val.items()}
    best = max(means, key=lambda k: (means[k], k == "0"))  # ties: the first grid point
    assert f"**Choice: lam={best}**" in report
    assert f"| **lam={best}** |" in report and f"{100 * means[best]:.2f} ±" in report
    test = json.loads((runs / "full_test" / f"lam={best}_seed2.json").read_text())
    assert test["stream"] == "synthetic" and test["validation"] == 0.0 and test["seed"] == 2
    assert f"{100 * test['avg_acc']:.2f} ± 0.00 | 1 (2)" in report

    import continual_blr.runner as runner

    def boom(*a, **k):
        raise AssertionError("a finished run was rerun")

    monkeypatch.setattr(runner, "run_config", boom)
    assert search.main(argv) == 0  # every run is stored: nothing reruns
    with pytest.raises(AssertionError, match="rerun"):  # another validation fraction is another run
        search.main(_search_args(tmp_path, "--grid", "lam=0", "--seeds", "0", "--validation", "0.5"))


def test_search_grid_over_a_train_setting(tmp_path):
    """``train.epochs=1,3`` varies the method's train budget, not its params: each run records the epochs it was
    trained for and the method's params without the key; an unknown train field is refused."""
    search = _load_script("search")
    _tiny_configs(tmp_path)
    assert search.main(_search_args(tmp_path, "--grid", "train.epochs=1,3", "--seeds", "0")) == 0
    runs = tmp_path / "runs" / "tiny" / "ewc" / "task" / "full_validation0.1"
    for epochs in (1, 3):
        rec = json.loads((runs / f"train.epochs={epochs}_seed0.json").read_text())
        assert rec["config"]["train_used"]["epochs"] == epochs
        assert rec["config"]["method"]["params"] == {"lam": 1.0}
    with pytest.raises(SystemExit, match="no param 'train.epoch'"):
        search.main(_search_args(tmp_path, "--grid", "train.epoch=1"))


def test_search_rejects_bad_grids_and_test_scoring(tmp_path):
    search = _load_script("search")
    _tiny_configs(tmp_path)
    with pytest.raises(SystemExit, match="no param 'lamda'.*allowed: lam"):
        search.main(_search_args(tmp_path, "--grid", "lamda=1,2"))
    with pytest.raises(SystemExit, match="lam: not a number"):
        search.main(_search_args(tmp_path, "--grid", "lam=1,big"))
    with pytest.raises(SystemExit, match="KEY=V1,V2"):
        search.main(_search_args(tmp_path, "--grid", "lam"))
    with pytest.raises(SystemExit):  # validation 0 would score on the test set
        search.main(_search_args(tmp_path, "--grid", "lam=1", "--validation", "0"))
    assert search.grid_points({"a": [1, 2], "b": ["x", "y"]}) == [
        {"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}, {"a": 2, "b": "y"}]
    assert search.choose([[0.5, 0.7], [0.6, 0.6], [0.1, 0.2]]) == 0  # equal means: the first
    assert search.report_path(Path("r"), "split_digits", "laplace_class", "class", False).name == \
        "search_split_digits_laplace_class.md"
    assert search.report_path(Path("r"), "split_digits", "ewc", "class", False).name == "search_split_digits_ewc_class.md"


def test_lam_equivalent_maps_temperatures_to_ewc_lambda():
    strength = _load_script("strength")
    assert strength.lam_equivalent("ewc", {"lam": 300.0}) == 300.0
    assert strength.lam_equivalent("ewc", {}) == 1000.0  # EWC's default
    assert strength.lam_equivalent("laplace", {"temperature": 0.04}) == pytest.approx(25.0)
    assert strength.lam_equivalent("blr", {"temperature": 0.5}) == pytest.approx(2.0)
    assert strength.lam_equivalent("ivon", {"temperature": 0.1}) == pytest.approx(10.0)
    assert strength.lam_equivalent("vcl") == 1.0 and strength.lam_equivalent("none") == 0.0
    assert strength.lam_equivalent("l2", {"lam": 3.0}) is None and strength.lam_equivalent("fromp") is None
    assert [strength.format_lam(v) for v in (None, 1e4, 33.333, 0.1, 1e-4)] == ["-", "10000", "33.3", "0.1", "0.0001"]


def test_split_digits_validation_runs_are_stored_apart(tmp_path):
    sd = _load_script("split_digits")
    row = sd.Row("none", "none")
    rec = sd.run_one(row, "task", 0, tmp_path, validation=0.1)
    assert rec["stream"] == "split_digits[validation 0.1]" and rec["validation"] == 0.1
    assert (tmp_path / "split_digits" / "task" / "table_validation0.1" / "none_seed0.json").is_file()
    assert not (tmp_path / "split_digits" / "task" / "table").exists()
    out = sd.table_from_records(tmp_path, tmp_path / "results", validation=0.1)
    assert out.name == "split_digits_validation.md" and "VALIDATION" in out.read_text().splitlines()[0]
    assert sd.table_from_records(tmp_path, tmp_path / "results") is None  # no test records: no test table


def test_split_digits_records_are_reused_while_current_and_superseded_runs_stay_listed(tmp_path, monkeypatch):
    """A stored record is reused while current; a rerun on another library moves the old record to superseded/,
    and the table, generated from the records alone, lists it and names both library versions."""
    sd = _load_script("split_digits")
    row = sd.Row("none", "none")
    first = sd.run_one(row, "task", 0, tmp_path)
    path = tmp_path / "split_digits" / "task" / "table" / "none_seed0.json"
    assert first["library_hash"] and "commit" in first and first["resolved_params"] is None
    assert sd.run_one(row, "task", 0, tmp_path)["wall_s"] == first["wall_s"]  # reused, not rerun
    monkeypatch.setattr(sd.run_records, "currency", lambda rec, *a, **k: (False, "changed"))  # the library changed
    second = sd.run_one(row, "task", 0, tmp_path)
    assert second["wall_s"] != first["wall_s"]
    old = list((path.parent / "superseded").glob("none_seed0__*.json"))
    assert len(old) == 1 and json.loads(old[0].read_text())["wall_s"] == first["wall_s"]
    text = sd.table_from_records(tmp_path, tmp_path / "results").read_text()
    assert "- **none** (task): seed 0" in text
    assert text == sd.table_from_records(tmp_path, tmp_path / "again").read_text()  # records alone decide


def test_reproduce_keeps_rows_whose_runs_are_not_stored_here(tmp_path):
    """With --keep (a runs folder that is not the committed records) a rewrite keeps the rows whose runs are not
    stored there, marked as kept; by default a table holds the stored records only."""
    import shutil

    reproduce = _load_reproduce()
    _tiny_configs(tmp_path)
    reproduce.main(_args(tmp_path, "--methods", "none", "--seeds", "0", "--data-dir", str(tmp_path / "data")))
    out = tmp_path / "results" / "tiny.md"
    first = out.read_text()
    none_row = next(line for line in first.splitlines() if line.startswith("| none |"))
    assert "$CONTINUAL_BLR_DATA" in first and str(tmp_path / "data") not in first  # no machine paths
    out.write_text(out.read_text().replace("--data-dir $CONTINUAL_BLR_DATA", "--data-dir /old/machine/data"))
    shutil.rmtree(tmp_path / "runs")  # another machine: nothing stored
    reproduce.main(_args(tmp_path, "--methods", "fromp", "--seeds", "0", "--keep"))
    report = out.read_text()
    assert none_row in report.splitlines() and "| fromp " in report
    assert "Rows kept from the previous version of this report" in report and ": none." in report
    assert report.count("**none** (seed 0)") == 1 and report.count("**fromp** (seed 0)") == 1
    assert "--methods none" in report and "/old/machine" not in report  # the kept row's command, no machine path
    reproduce.main(_args(tmp_path, "--methods", "fromp", "--seeds", "0"))
    assert "| none |" not in out.read_text()


def _as_legacy(runs: Path) -> None:
    """Strip the fingerprints from the records under ``runs``: records made before fingerprints existed, which
    check_equivalence.py (the library-hash rule) is for."""
    for p in runs.rglob("*_seed*.json"):
        rec = json.loads(p.read_text())
        rec.pop("fingerprint", None)
        p.write_text(json.dumps(rec))


def _load_check_equivalence():
    spec = importlib.util.spec_from_file_location("check_equivalence", ROOT / "benchmarks" / "check_equivalence.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checked_equivalence_keeps_records_current_only_when_every_rerun_is_bitwise_equal(tmp_path, monkeypatch,
                                                                                           capsys):
    """After a library change, check_equivalence reruns the lowest seed of every row on the new library; equal
    accuracy matrices declare the old library's records of that folder current (reproduce then reuses them, a
    folder not checked stays stale); a rerun that differs by one bit declares nothing and the records are rerun."""
    reproduce = _load_reproduce()
    check = _load_check_equivalence()
    rr = check.run_records
    _tiny_configs(tmp_path)
    runs = tmp_path / "runs"
    reproduce.main(_args(tmp_path, "--methods", "none", "ewc", "--seeds", "0", "1"))
    _as_legacy(tmp_path / "runs")
    old = json.loads((runs / "tiny/task/full/ewc_seed1.json").read_text())["library_hash"]
    folder = "tiny/task/full"
    rec = json.loads((runs / folder / "ewc_seed1.json").read_text())
    for mod in (rr, reproduce.run_records):  # the library "changed": its hash is now another one
        monkeypatch.setattr(mod, "library_hash", lambda root=None: "f" * 16)
        monkeypatch.setattr(mod, "_PROCESS_HASH", {})
    assert not rr.is_current(rec, folder=folder, records_dir=runs)
    args = ["--records-dir", str(runs), "--configs-dir", str(tmp_path / "configs")]
    import continual_blr.runner as runner

    real = runner.run_config

    def perturbed(*a, **k):  # the "new library" moves one entry of the accuracy matrix by one ulp
        results = real(*a, **k)
        results[0].acc_matrix[-1][-1] = float(np.nextafter(results[0].acc_matrix[-1][-1], 2.0))
        return results

    monkeypatch.setattr(runner, "run_config", perturbed)
    check.main([folder, *args])
    assert "DIFFERENT" in capsys.readouterr().out and not (runs / rr.EQUIVALENCES).exists()

    def ewc_moved(cfg, *a, **k):  # only the ewc row changes under the "new library"
        return (perturbed if cfg.methods[0].name == "ewc" else real)(cfg, *a, **k)

    monkeypatch.setattr(runner, "run_config", ewc_moved)
    check.main([folder, *args])
    out = capsys.readouterr().out
    assert "ewc seed 0: DIFFERENT" in out and "none seed 0: same" in out
    decl = rr.declarations(runs)
    assert [(d["from"], d["to"], d["folders"], d["methods"]) for d in decl] == [(old, "f" * 16, [folder],
                                                                                {folder: ["none"]})]
    assert not rr.is_current(rec, folder=folder, records_dir=runs)  # ewc: not declared
    none1 = json.loads((runs / folder / "none_seed1.json").read_text())
    assert rr.is_current(none1, folder=folder, records_dir=runs)  # none seed 1 was not rerun, yet is current
    monkeypatch.setattr(runner, "run_config", real)
    check.main([folder, *args])  # the ewc row, now equal, is declared; none is not checked again
    out = capsys.readouterr().out
    assert "ewc seed 0: same" in out and "none seed 0" not in out
    decl = rr.declarations(runs)
    assert sorted(decl[1]["checked"][folder]) == ["ewc_seed0"]
    assert rr.is_current(rec, folder=folder, records_dir=runs)  # seed 1 was not rerun, yet is current
    assert not rr.is_current(rec, folder="tiny/class/full", records_dir=runs)  # only the checked folder
    calls = []
    monkeypatch.setattr(runner, "run_config", lambda *a, **k: calls.append(1) or real(*a, **k))
    reproduce.main(_args(tmp_path, "--methods", "none", "ewc", "--seeds", "0", "1"))
    _as_legacy(tmp_path / "runs")
    assert calls == []  # every record reused


def test_a_parameter_added_since_a_record_counts_as_the_same_only_at_its_default():
    """check_equivalence.same_params: a record made before a parameter existed matches a rerun that has it at its
    default (BLRParams.noise 'gaussian'); not at another value, not when an old value changed, not for a key no
    params class has."""
    same = _load_check_equivalence().same_params
    old = {"lr": 0.03, "rho": 0.05}
    assert same(dict(old), dict(old), "blr") == (True, [])
    assert same({**old, "noise": "gaussian", "noise_refresh": 64}, old, "blr") == (True, ["noise", "noise_refresh"])
    assert same({**old, "noise": "pooled", "noise_refresh": 64}, old, "blr") == (False, [])
    assert same({**old, "lr": 0.1, "noise": "gaussian"}, old, "blr") == (False, [])
    assert same({**old, "no_such_field": 1}, old, "blr") == (False, [])
    assert same(None, old, "blr") == (False, [])


def test_equivalence_declarations_chain_within_their_folder(tmp_path):
    """A → B and B → C declared for one folder make A's and B's records of that folder current under C; a chain
    broken by a declaration for another folder does not."""
    rr = _load_reproduce().run_records
    decls = [{"from": "a", "to": "b", "folders": ["x/task/full"]}, {"from": "b", "to": "c", "folders": ["x/task/full"]},
             {"from": "z", "to": "a", "folders": ["y/task/full"]}]
    (tmp_path / rr.EQUIVALENCES).write_text(json.dumps({"declarations": decls}))
    assert rr.equivalent_hashes("c", "x/task/full", tmp_path) == {"a", "b", "c"}
    assert rr.equivalent_hashes("c", "y/task/full", tmp_path) == {"c"}
    assert rr.is_current({"library_hash": "a"}, "c", "x/task/full", tmp_path)
    assert not rr.is_current({"library_hash": "z"}, "c", "x/task/full", tmp_path)
    assert not rr.is_current({"library_hash": "a"}, "c", None, tmp_path)  # no folder: the strict rule


def test_perf_blr_routes_score_on_the_validation_split_and_name_bad_routes(monkeypatch, tmp_path, capsys):
    """perf_blr_routes.py chooses among routes by accuracy, so every row must run on the validation stream (never
    the test set), with the route's params laid over its config's; the report shows the data folder as
    $CONTINUAL_BLR_DATA; a malformed route is a one-line error."""
    routes = _load_script("perf_blr_routes")
    seen = {}

    def fake_runs(cfgs):
        seen.update(cfgs)
        return {label: (2.0 if label == "none" else 3.0, 1.0, 90.0) for label, _ in cfgs}

    monkeypatch.setattr(routes, "timed_runs", fake_runs)
    data = str(tmp_path / "my_data")
    assert routes.main(["--route", "none=none", "--route", 'k=blr:{"curvature_every": 4}', "--no-write",
                        "--data-dir", data]) == 0
    printed = capsys.readouterr().out
    assert "--data-dir $CONTINUAL_BLR_DATA" in printed and data not in printed
    assert all(cfg.stream.validation == 0.1 for cfg in seen.values())
    assert seen["k"].methods[0].params["curvature_every"] == 4
    assert seen["k"].methods[0].params["clip_radius"] == 0.03  # blr.yaml's own params kept
    with pytest.raises(SystemExit, match="not JSON"):
        routes.parse_route("k=blr:{bad")
    with pytest.raises(SystemExit, match="LABEL=CONFIG"):
        routes.parse_route("blr")


def test_perf_blr_end_to_end_reports_the_median_of_paired_ratios_over_rounds(monkeypatch):
    """perf_blr --end-to-end --repeats R: each row's ratio is the median over rounds of (row CPU / that round's none
    CPU), not a ratio of medians; min-max shown; --configs keeps rows (none always), a bad name is one line."""
    perf = _load_script("perf_blr")
    cpu = iter([{"none": 10.0, "blr_price": 14.0}, {"none": 20.0, "blr_price": 24.0}, {"none": 10.0, "blr_price": 16.0}])

    def fake(cfgs):
        r = next(cpu)
        labels = [label for label, _ in cfgs]
        assert labels[:2] == ["none", "blr_price"] and all(lb.startswith(("none", "blr_price")) for lb in labels)
        return {lb: (r.get(lb, 1.0), r.get(lb, 1.0), 99.0) for lb in labels}

    monkeypatch.setattr(perf, "timed_runs", fake)
    text = perf.end_to_end(None, True, "split_mnist", repeats=3, configs=("none", "blr_price"))
    row = next(line for line in text.splitlines() if line.startswith("| blr_price |"))
    # ratios 1.4, 1.2, 1.6 -> median 1.40 (the ratio of median CPUs would be 16 / 10 = 1.60)
    assert "| 16.0 | 1.40 | 1.20-1.60 |" in row, row
    assert "--repeats 3 --configs none blr_price" in text and "| ivon |" not in text
    with pytest.raises(ValueError, match=r"--configs: got 'adam'; allowed: none, blr, blr_price, ivon"):
        perf.end_to_end(None, True, "split_mnist", configs=("none", "adam"))


def test_the_library_hash_covers_the_native_c_source(tmp_path):
    """A record is current only while the code it ran on is: the hash moves with a ``.py`` file and with the native
    update's C source (``continual_blr/optim/native_update.c``), not with a compiled cache file."""
    rr = _load_reproduce().run_records
    pkg = tmp_path / "continual_blr" / "optim"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "k.c").write_text("int f(void) { return 1; }\n")
    first = rr.library_hash(tmp_path)
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert rr.library_hash(tmp_path) == first
    (pkg / "k.c").write_text("int f(void) { return 2; }\n")
    assert rr.library_hash(tmp_path) != first
    assert rr.library_hash() != rr.library_hash(tmp_path)


def test_two_searches_varying_the_same_key_on_other_bases_keep_both_records(tmp_path):
    """A point's record is named by the varied keys; a second search that varies the same key on another base (here
    the config's train budget edited between the two) stores its run beside the first one's instead of over it, and
    both searches' runs are reused when they are run again."""
    search = _load_script("search")
    configs = _tiny_configs(tmp_path)
    argv = _search_args(tmp_path, "--grid", "lam=0", "--seeds", "0", "--validation", "0.25")
    assert search.main(argv) == 0
    folder = tmp_path / "runs" / "tiny" / "ewc" / "task" / "full_validation0.25"
    plain = json.loads((folder / "lam=0_seed0.json").read_text())
    config = configs / "tiny" / "ewc.yaml"
    first_base, other_base = config.read_text(), config.read_text().replace("epochs: 5", "epochs: 2")
    config.write_text(other_base)
    assert search.main(argv) == 0
    assert json.loads((folder / "lam=0_seed0.json").read_text()) == plain  # not overwritten
    (other,) = [p for p in folder.glob("lam=0_*_seed0.json")]
    assert json.loads(other.read_text())["key"]["train"]["epochs"] == 2
    import continual_blr.runner as runner

    def boom(*a, **k):
        raise AssertionError("a finished run was rerun")

    runner_run = runner.run_config
    runner.run_config = boom
    try:
        for base in (first_base, other_base):
            config.write_text(base)
            assert search.main(argv) == 0
    finally:
        runner.run_config = runner_run


def _records_on_a_changed_library(tmp_path, monkeypatch, *methods: str):
    """Records of ``methods`` (seed 0, one thread) on the tiny configs, then a library "change" (its hash is now
    another one): (reproduce, check_equivalence, run_records, records dir)."""
    reproduce = _load_reproduce()
    check = _load_check_equivalence()
    rr = check.run_records
    _tiny_configs(tmp_path)
    runs = tmp_path / "runs"
    reproduce.main(_args(tmp_path, "--methods", *methods, "--seeds", "0", "--threads", "1"))
    _as_legacy(tmp_path / "runs")
    for mod in (rr, reproduce.run_records):
        monkeypatch.setattr(mod, "library_hash", lambda root=None: "f" * 16)
        monkeypatch.setattr(mod, "_PROCESS_HASH", {})
    return reproduce, check, rr, runs


def test_check_equivalence_reruns_at_the_records_thread_count(tmp_path, monkeypatch, capsys):
    """Matrix products round differently with another number of threads, so a rerun is compared at the record's own
    torch thread count (``threads`` in the record) unless ``--threads`` says otherwise."""
    import torch

    reproduce, check, rr, runs = _records_on_a_changed_library(tmp_path, monkeypatch, "none")
    assert json.loads((runs / "tiny/task/full/none_seed0.json").read_text())["threads"] == 1
    seen = []
    real = check.reproduce.run_one

    def spy(*a, **k):
        seen.append(torch.get_num_threads())
        return real(*a, **k)

    monkeypatch.setattr(check.reproduce, "run_one", spy)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        check.main(["tiny/task/full", "--records-dir", str(runs), "--configs-dir", str(tmp_path / "configs")])
        assert seen == [1] and "same" in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)


def test_an_interrupted_equivalence_check_keeps_the_rows_it_verified(tmp_path, monkeypatch):
    """Each verified row is declared as soon as its rerun matched: a check stopped during the next row's rerun keeps
    the first row current; ``--methods`` checks only the rows named."""
    reproduce, check, rr, runs = _records_on_a_changed_library(tmp_path, monkeypatch, "none", "ewc")
    real = check.reproduce.run_one

    def stop_at_none(benchmark, method, *a, **k):  # rows run in name order: ewc, then none
        if method == "none":
            raise KeyboardInterrupt
        return real(benchmark, method, *a, **k)

    monkeypatch.setattr(check.reproduce, "run_one", stop_at_none)
    args = ["tiny/task/full", "--records-dir", str(runs), "--configs-dir", str(tmp_path / "configs")]
    with pytest.raises(KeyboardInterrupt):
        check.main(args)
    folder = "tiny/task/full"
    ewc, none = (json.loads((runs / folder / f"{m}_seed0.json").read_text()) for m in ("ewc", "none"))
    assert rr.is_current(ewc, folder=folder, records_dir=runs)
    assert not rr.is_current(none, folder=folder, records_dir=runs)
    monkeypatch.setattr(check.reproduce, "run_one", real)
    check.main(args + ["--methods", "none"])
    assert rr.is_current(none, folder=folder, records_dir=runs)
    assert len(rr.declarations(runs)) == 2


def _diagnosis(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "diagnose" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tf32_emulation_rounds_to_eleven_significant_bits():
    """``diagnose_fromp_tf32.round_tf32`` against exact binary cases (round half to even at 2⁻¹¹ relative) and a
    float64 bound on random values; its emulated convolution moves a conv net's output, by at most ~2⁻¹⁰."""
    tf32 = _diagnosis("diagnose_fromp_tf32")
    r = tf32.round_tf32
    x = torch.tensor([1.0, 1 + 2.0 ** -10, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, -(1 + 2.0 ** -12), 0.0, 3.0 * 2 ** -20],
                     dtype=torch.float64)
    want = torch.tensor([1.0, 1 + 2.0 ** -10, 1.0, 1 + 2 * 2.0 ** -10, -1.0, 0.0, 3.0 * 2 ** -20], dtype=torch.float64)
    assert torch.equal(r(x), want)
    y = torch.randn(10_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 1e3
    assert float(((r(y) - y).abs() / y.abs()).max()) <= 2.0 ** -11
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Conv2d(16, 4, 3)).double()
    z = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = net(z), tf32.emulate_tf32(net)(z)
    rel = float((got - ref).norm() / ref.norm())
    assert 0 < rel < 2.0 ** -9
    assert torch.equal(net(z), ref)  # the original is untouched
    assert [n for n, _ in tf32.emulate_tf32(net).named_parameters()] == [n for n, _ in net.named_parameters()]


def test_fromp_divergence_diagnosis_traces_penalty_kernels_and_validation_accuracy(tmp_path):
    """``benchmarks/diagnose/diagnose_fromp_divergence.py`` on a tiny synthetic FROMP run: one trace row per epoch with the
    penalty (zero on task 1, which has no past; positive on task 2) and pre-clip gradient norms, the kernels of the
    stored task at task 2's start (eigenvalues at least the jitter), and validation accuracies per task end."""
    diagnose = _diagnosis("diagnose_fromp_divergence")
    config = tmp_path / "fromp.yaml"
    config.write_text(yaml.safe_dump({
        "stream": {"name": "synthetic", "scenario": "task", "options": {"n_tasks": 2, "n_train": 60, "n_test": 20}},
        "model": {"arch": "mlp", "hidden": [8]}, "train": {"epochs": 3, "batch_size": 20, "lr": 0.01, "grad_clip": 1.0},
        "methods": [{"name": "fromp", "params": {"n_points": 4, "tau": 10.0}}]}))
    from continual_blr.regularizers.functional import FunctionalRegularizer

    clip, hooked = torch.nn.utils.clip_grad_norm_, (FunctionalRegularizer.penalty, FunctionalRegularizer.rebuild)
    assert diagnose.main(["--data-dir", str(tmp_path), "--config", str(config), "--tasks", "2", "--precision", "fp32",
                          "--validation", "0.2", "--out", str(tmp_path / "out")]) == 0
    assert torch.nn.utils.clip_grad_norm_ is clip  # the hooks are undone
    assert (FunctionalRegularizer.penalty, FunctionalRegularizer.rebuild) == hooked
    rows = [json.loads(line) for line in (tmp_path / "out" / "trace.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    assert [(r["task"], r["epoch"]) for r in epochs] == [(t, e) for t in (1, 2) for e in (1, 2, 3)]
    assert all(r["steps"] == 3 and r["norm_max"] > 0 for r in epochs)  # 48 of 60 images train, batches of 20
    assert all(r["pen_max"] == 0 for r in epochs[:3]) and all(r["pen_max"] > 0 for r in epochs[3:])
    assert any(r["clipped"] > 0 for r in epochs)  # clip 1.0 binds on this tiny net
    (kernels,) = [r for r in rows if r["kind"] == "kernels"]
    (entry,) = kernels["entries"]
    assert kernels["task"] == 2 and entry["points"] == 4
    assert entry["eig_min"] >= entry["jitter"] * (1 - 1e-5) and entry["eig_max"] >= entry["eig_min"]
    ends = [r for r in rows if r["kind"] == "task_end"]
    assert [len(r["val_acc"]) for r in ends] == [1, 2] and all(0 <= a <= 1 for r in ends for a in r["val_acc"])


def test_gpu_runs_gives_each_job_its_split_and_folder(tmp_path):
    """``benchmarks/device/gpu_runs.sh`` with a stand-in ``python3`` that logs its arguments: a job's fourth field
    picks its split (``0.1``: validation; ``test``: the test set whatever ``VALIDATION`` says; none: ``VALIDATION``),
    and a validation and a test job of one seed get different run and records folders."""
    import subprocess

    bindir, log = tmp_path / "bin", tmp_path / "calls.txt"
    bindir.mkdir()
    (bindir / "python3").write_text(f'#!/bin/sh\necho "$@" >> "{log}"\n')
    (bindir / "python3").chmod(0o755)
    (tmp_path / "out").mkdir()
    env = os.environ | {"PATH": f"{bindir}:{os.environ['PATH']}", "SCRATCH": str(tmp_path / "s"),
                        "OUT": str(tmp_path / "out"), "VALIDATION": "0.2", "POLL": "0.2",
                        "JOBS": "a/b:m:1:0.1 a/b:m:1:test a/b:m:3"}
    subprocess.run(["bash", str(ROOT / "benchmarks" / "device" / "gpu_runs.sh")], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=120)
    calls = sorted(line for line in log.read_text().splitlines() if "reproduce.py" in line)
    assert len(calls) == 3
    val1 = [c for c in calls if "--seeds 1" in c and "--validation" in c]
    test1 = [c for c in calls if "--seeds 1" in c and "--validation" not in c]
    (seed3,) = [c for c in calls if "--seeds 3" in c]
    assert len(val1) == 1 and len(test1) == 1
    assert "--validation 0.1" in val1[0] and "a_b-m-1-val0.1" in val1[0]
    assert "a_b-m-1 " in test1[0] + " " and "val" not in test1[0].split("--runs-dir")[1]
    assert "--validation 0.2" in seed3


def test_a_run_is_dirty_for_changed_code_or_configs_but_not_for_the_records_and_tables_runs_write(tmp_path):
    """``records.DIRTY_STATUS`` in a throwaway git repository: a changed record or table under ``benchmarks/records``
    or ``benchmarks/results`` leaves the checkout clean (the second run of one ``reproduce.py`` call after the first
    wrote its records was marked dirty before); a changed library file, config or benchmark script makes it dirty.
    Planted once: the two exclusions left out, the first assertion failed."""
    import subprocess

    rr = _load_reproduce().run_records
    files = {"continual_blr/a.py": "x = 1\n", "configs/b.yaml": "a: 1\n", "benchmarks/c.py": "y = 1\n",
             "benchmarks/records/d_seed0.json": "{}\n", "benchmarks/results/tables/e.md": "old\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "start")
    (tmp_path / "benchmarks/records/d_seed0.json").write_text('{"new": 1}\n')
    (tmp_path / "benchmarks/results/tables/e.md").write_text("new\n")
    assert git(*rr.DIRTY_STATUS) == ""
    for name in ("continual_blr/a.py", "configs/b.yaml", "benchmarks/c.py"):
        (tmp_path / name).write_text("changed\n")
        assert name in git(*rr.DIRTY_STATUS)
        git("checkout", "-q", "--", name)


def test_run_log_summary_reports_each_tasks_worst_epoch_and_the_divergence_bar(tmp_path, capsys):
    """``benchmarks/diagnose/run_log_summary.py`` on a hand-written log: per task the epoch with the largest mean
    train loss and its penalty, the largest single-step penalty, the smallest kernel diagonal and the accuracies
    after the task; a run whose worst epoch is 12.5 is reported above the bar of 10, one at 3.0 not."""
    summary = _diagnosis("run_log_summary")
    run = tmp_path / "fromp"
    run.mkdir()
    head = "task,epoch,train_loss,data_loss,penalty,data_loss_max,penalty_max,kernel_dropped,kernel_min_diag\n"
    (run / "train_log.csv").write_text(head + "0,1,0.5,0.5,0.0,0.7,0.0,0.0,nan\n0,2,0.2,0.2,0.0,0.3,0.0,0.0,nan\n"
                                       "1,1,1.0,0.4,0.6,0.9,4.0,0.0,2.5e-5\n1,2,12.5,0.3,12.2,0.4,90.0,1.0,2.5e-5\n")
    (run / "accuracy.csv").write_text("after_task,task,accuracy\n0,0,0.9\n1,0,0.85\n1,1,0.8\n")
    text = summary.summarise(run)
    assert "| 1 | 2 | 0.500 (1) | 0.0000 | 0.000 |  | 90.00 |" in text
    assert "| 2 | 2 | 12.500 (2) | 12.2000 | 90.000 | 2.50e-05 | 85.00 / 80.00 |" in text
    assert "12.500 (above the bar of 10)" in text
    assert "not above the bar of 20" in summary.summarise(run, bar=20.0)
    assert summary.main([str(tmp_path)]) == 2 and "no train_log.csv" in capsys.readouterr().err


def _two_task_run(tmp_path, methods: str):
    """A tiny two-task run of ``methods`` (a YAML list) into ``tmp_path / "run"``: task 2 trained long enough, with
    FROMP's τ small enough, to move task 1's outputs."""
    from continual_blr.cli import main as cli

    torch.set_num_threads(1)
    (tmp_path / "c.yaml").write_text(
        "stream: {name: synthetic, options: {n_tasks: 2, n_train: 40, n_features: 6}}\nmodel: {hidden: [8]}\n"
        f"train: {{epochs: 30, batch_size: 20, lr: 0.05}}\nprogress: false\nmethods: {methods}\n")
    assert cli(["run", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "run")]) == 0
    return tmp_path / "run"


def _memorable_fit_oracle(run, method: str, points_method: str) -> tuple[float, float]:
    """The RMS change of the centred logits of task 1 between the ends of tasks 1 and 2 of ``method``'s networks,
    and their accuracy after task 2, at ``points_method``'s memorable points of task 1, through the library's own
    loaders (``load_run``, ``load_boundary``)."""
    from continual_blr.saved_run import load_boundary, load_run

    points = load_run(run, method=points_method)
    entry = next(e for e in points.method.regularizer.memory if e.task_id == points.stream.tasks[0].task_id)
    end = load_run(run, method=method)
    first = load_boundary(end, 0)
    with torch.no_grad():
        f1, f0 = end.model(entry.x, head=entry.head), first.model(entry.x, head=entry.head)
    c = lambda f: f - f.mean(-1, keepdim=True)  # noqa: E731
    return (float((c(f1) - c(f0)).pow(2).sum(-1).mean().sqrt()),
            100.0 * float((f1.argmax(-1) == entry.y).float().mean()))


def _row_cells(table: str) -> list[str]:
    rows = [r for r in table.splitlines() if r.startswith("| 2 | 1 |")]
    assert len(rows) == 1 and len([r for r in table.splitlines() if r.startswith("| ")]) == 2
    return [s.strip() for s in rows[0].strip("|").split("|")]


def test_fromp_memorable_fit_compares_each_past_task_with_its_own_end(tmp_path):
    """``benchmarks/diagnose/fromp_memorable_fit.py`` on a tiny two-task FROMP run: one row (after task 2, task 1)
    whose memorable-point RMS change of the centred logits and accuracies equal those computed through the library's
    own loaders (``load_run`` for the network after task 2, ``load_boundary`` for it after task 1), to the table's two
    decimals; a folder without boundary checkpoints is a one-line error."""
    fit = _diagnosis("fromp_memorable_fit")
    run = _two_task_run(tmp_path, "[{name: fromp, params: {n_points: 4, tau: 0.01}}]")
    cells = _row_cells(fit.summarise(run / "fromp", None))
    rms, acc = _memorable_fit_oracle(run, "fromp", "fromp")
    assert rms > 0.05, "the run did not move task 1's outputs: the comparison would prove nothing"
    assert cells[2] == f"{rms:.2f}" and cells[4] == f"{acc:.1f}"
    assert fit.main([str(tmp_path)]) == 2


def test_fromp_memorable_fit_reads_another_runs_points_for_a_run_without_any(tmp_path):
    """``fromp_memorable_fit.py --points-from``: a ``none`` run of the same stream, compared at the FROMP run's
    memorable points of task 1, gives the RMS change and accuracy computed through the library's loaders on the
    ``none`` networks at those points; without ``--points-from`` the ``none`` run is a one-line error."""
    fit = _diagnosis("fromp_memorable_fit")
    run = _two_task_run(tmp_path, "[{name: fromp, params: {n_points: 4, tau: 0.01}}, {name: none}]")
    with pytest.raises(SystemExit, match="--points-from"):
        fit.summarise(run / "none", None)
    cells = _row_cells(fit.summarise(run / "none", None, points_from=run / "fromp"))
    rms, acc = _memorable_fit_oracle(run, "none", "fromp")
    (tmp_path / "seed1").mkdir()
    other = _two_task_run(tmp_path / "seed1", "[{name: fromp, params: {n_points: 4, tau: 0.01}}]\nseed: 1")
    with pytest.raises(SystemExit, match="another stream or seed"):
        fit.summarise(run / "none", None, points_from=other / "fromp")
    assert rms > 0.05, "the none run did not move task 1's outputs: the comparison would prove nothing"
    assert cells[2] == f"{rms:.2f}" and cells[4] == f"{acc:.1f}"


def test_fromp_step_trace_replays_a_task_bit_for_bit_and_reads_adams_state(tmp_path):
    """``benchmarks/diagnose/fromp_step_trace.py`` on a tiny three-task FROMP run: replaying task 3 from task 2's
    boundary checkpoint gives the original run's epoch-mean training loss bit for bit (the oracle is the run's own
    ``train_log.csv``, written by the original run); the traced steps' data loss + penalty, weighted by the
    minibatch sizes, give that epoch mean to float round-off; every step's ‖Δθ‖₂ (measured on the parameters) is
    the learning rate times the normalised step ‖m̂ / (√v̂ + ε)‖₂ read from Adam's state (no weight decay); and a
    first task, which has no boundary before it, is a one-line error."""
    import csv
    import json
    from continual_blr.cli import main as cli

    trace = _diagnosis("fromp_step_trace")
    torch.set_num_threads(1)
    (tmp_path / "c.yaml").write_text(
        "stream: {name: synthetic, options: {n_tasks: 3, n_train: 50, n_features: 6}}\nmodel: {hidden: [8]}\n"
        "train: {epochs: 3, batch_size: 20, lr: 0.01}\nprogress: false\n"
        "methods: [{name: fromp, params: {n_points: 5, tau: 1.0}}]\n")
    assert cli(["run", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "run"), "--seed", "3"]) == 0
    out = tmp_path / "trace.jsonl"
    text = trace.trace(tmp_path / "run", 2, 2, out, None)
    assert "bit for bit: 1 of 1 finished epochs" in text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6  # 50 examples in batches of 20: 3 steps an epoch (the loop keeps the last part of 10)
    with (tmp_path / "run" / "fromp" / "train_log.csv").open() as f:
        logged = {(int(r["task"]), int(r["epoch"])): float(r["train_loss"]) for r in csv.DictReader(f)}
    sizes = [20, 20, 10]
    first = sum(n * (r["data_loss"] + r["penalty"]) for n, r in zip(sizes, rows[:3])) / 50
    assert first == pytest.approx(logged[(2, 1)], rel=1e-6, abs=1e-7)
    assert any(r["penalty"] > 0 for r in rows), "no penalty on task 3: the trace would not show FROMP's part"
    for r in rows:
        assert r["update_norm"] == pytest.approx(0.01 * r["normalised_step_norm"], rel=1e-4)
    with pytest.raises(SystemExit, match="--task 0"):
        trace.trace(tmp_path / "run", 0, 1, out, None)
    (tmp_path / "n.yaml").write_text((tmp_path / "c.yaml").read_text().replace(
        "methods: [{name: fromp, params: {n_points: 5, tau: 1.0}}]", "methods: [{name: none}]"))
    assert cli(["run", str(tmp_path / "n.yaml"), "--out", str(tmp_path / "none")]) == 0
    with pytest.raises(SystemExit, match="ran 'none'"):
        trace.trace(tmp_path / "none", 2, 1, out, None)


def test_fromp_step_trace_power_iteration_finds_the_preconditioned_sharpness():
    """``fromp_step_trace._power_iteration`` on a quadratic ½ xᵀ A x with a known spectrum: the largest eigenvalue of
    S A S (S diagonal, the Adam-style preconditioning) against ``torch.linalg.eigvalsh`` in float64, to 1e-3 relative
    (a planted bug, S applied once instead of on both sides, moves it by far more)."""
    trace = _diagnosis("fromp_step_trace")
    g = torch.Generator().manual_seed(1)
    q = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))[0]
    a = q @ torch.diag(torch.tensor([9.0, 2.0, 1.0, 0.5, 0.2, 0.1], dtype=torch.float64)) @ q.T
    s = torch.tensor([0.5, 2.0, 1.0, 3.0, 0.7, 1.5], dtype=torch.float64)
    x = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    x.data.normal_(generator=g)
    got = trace._power_iteration(lambda: 0.5 * x @ a @ x, [x], [s], iters=200)
    want = float(torch.linalg.eigvalsh(torch.diag(s) @ a @ torch.diag(s)).max())
    assert got == pytest.approx(want, rel=1e-3)
