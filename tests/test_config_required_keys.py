"""A config file must say what it runs: without ``stream:`` or ``methods:`` it is refused in one line (exit 2)
naming the missing key, instead of silently running the embedded default's split digits or blr/fromp/none
(issue 42 item 4). ``continual-blr run`` with no config at all still runs the embedded default
(``tests/test_cli.py::test_default_run_writes_results_and_heatmap``)."""

import json

import pytest

from continual_blr.cli import main

STREAM = "stream: {name: synthetic, options: {n_tasks: 2, n_train: 40}}\n"
REST = "model: {hidden: [8]}\ntrain: {epochs: 1, batch_size: 20}\n"


@pytest.mark.parametrize("text, key", [(REST + "methods: [none]\n", "stream"), (STREAM + REST, "methods"),
                                       ("train: {epochs: 1}\n", "stream")],
                         ids=["no stream", "no methods", "neither"])
def test_config_without_stream_or_methods_is_one_line(text, key, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a run that wrongly started would write under tmp_path/runs
    (tmp_path / "c.yaml").write_text(text)
    rc = main(["run", "c.yaml", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"no '{key}:' key" in err and "c.yaml" in err, err
    assert not (tmp_path / "runs").exists()


def test_method_flag_stands_in_for_methods_key(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(STREAM + REST)
    assert main(["run", str(tmp_path / "c.yaml"), "--method", "none", "--out", str(tmp_path / "r"),
                 "--no-progress"]) == 0
    payload = json.loads((tmp_path / "r" / "results.json").read_text())
    assert [r["method"] for r in payload["results"]] == ["none"]
    assert payload["config"]["stream"]["name"] == "synthetic"


def test_missing_dataset_files_with_both_keys_is_one_line(tmp_path, monkeypatch, capsys):
    """test_cli's "missing dataset files" case now stops at its missing ``methods:``; this one reaches the data."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(f"stream:\n  name: split_mnist\n  data_dir: {tmp_path}\n"
                                     "  options: {download: false}\nmethods: [none]\n")
    rc = main(["run", "c.yaml", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "methods:" not in err and "mnist" in err.lower(), err


def test_unknown_stream_option_is_one_line_naming_it_and_the_allowed(tmp_path, monkeypatch, capsys):
    """A stream option its builder does not take was Python's own message (``split_cifar10() got an unexpected
    keyword argument 'n_tasks'``), raised only when the data was built; now the config is refused first."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("stream: {name: synthetic, options: {n_tasks: 2, n_trian: 40}}\n" + REST
                                     + "methods: [none]\n")
    rc = main(["run", "c.yaml", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "stream.options" in err and "'n_trian'" in err and "synthetic" in err, err
    assert "n_train" in err and "n_tasks" in err, err  # the allowed options are listed
    assert "seed" not in err.split("allowed:")[1], err  # make_stream sets seed itself
    assert not (tmp_path / "runs").exists()


def test_every_stream_option_of_the_shipped_configs_is_accepted():
    """The check refuses no option that a committed config uses (they all ran)."""
    from pathlib import Path

    from continual_blr.config import RunConfig, from_dict, yaml_load

    configs = sorted((Path(__file__).resolve().parent.parent / "configs").rglob("*.yaml"))
    assert configs
    for path in configs:
        from_dict(RunConfig, yaml_load(path.read_text()) or {})
