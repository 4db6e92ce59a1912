"""The benchmark configs and ``benchmarks/reproduce.py``: every config is valid, the report is
complete and honest (quick mode labelled, references beside ours), and reruns are resumable."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
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
    for name, params in (("none", None), ("fromp", {"n_points": 4})):
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
    assert "±" in cells[1] and cells[2] == "2 (0,1)" and cells[3] == "task" and cells[4] == "4"
    assert "python benchmarks/reproduce.py tiny" in report
    assert "QUICK" not in report
    assert "**fromp** (seed 0)" in report  # accuracy matrices
    stored = json.loads((tmp_path / "runs" / "tiny" / "task" / "full" / "fromp_seed1.json").read_text())
    assert stored["seed"] == 1 and len(stored["acc_matrix"]) == 2 and stored["wall_s"] > 0


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
    with pytest.raises(SystemExit, match="available for tiny: fromp, none"):
        reproduce.main(_args(tmp_path, "--methods", "ewc", "--seeds", "0"))


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
