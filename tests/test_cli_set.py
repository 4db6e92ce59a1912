"""``continual-blr run --set KEY=VALUE`` (issue 42 item 6): method parameters (``fromp.tau=1``; a bare ``tau=1`` when
the run has one method; ``fromp.train.epochs=2``) and config keys (``train.epochs=2``) from the command line. Values
are read as YAML, checked as a config file's are (one line naming the bad key and the allowed ones, exit 2) and
recorded in the run's config."""

import json

import pytest

from continual_blr.cli import main
from tiny_runs import TINY


def _cfg(tmp_path, methods="[l2]"):
    (tmp_path / "c.yaml").write_text(TINY + f"methods: {methods}\n")
    return str(tmp_path / "c.yaml")


def _config_of(run):
    return json.loads((run / "results.json").read_text())["config"]


def test_set_records_method_params_and_config_keys(tmp_path):
    assert main(["run", _cfg(tmp_path, "[l2, none]"), "--set", "l2.lam=1e-2", "--set", "train.epochs=2",
                 "--set", "l2.train.batch_size=10", "--out", str(tmp_path / "r")]) == 0
    cfg = _config_of(tmp_path / "r")
    assert cfg["methods"][0]["params"] == {"lam": 0.01} and cfg["methods"][0]["train"] == {"batch_size": 10}
    assert cfg["train"]["epochs"] == 2 and cfg["methods"][1]["params"] == {}


def test_method_flag_with_a_bare_parameter(tmp_path):
    """The issue's example, ``run --method fromp --set tau=1``, on the tiny stream: τ 1 is what the run records."""
    assert main(["run", _cfg(tmp_path), "--method", "fromp", "--set", "tau=1", "--set", "fromp.n_points=4",
                 "--out", str(tmp_path / "r")]) == 0
    cfg = _config_of(tmp_path / "r")
    assert [m["name"] for m in cfg["methods"]] == ["fromp"]
    assert cfg["methods"][0]["params"]["tau"] == 1 and cfg["methods"][0]["params"]["n_points"] == 4


BAD = [
    ("misspelt parameter", ["--set", "l2.lamb=1"], ["--set l2.lamb=1", "'lamb'", "allowed: lam"]),
    ("wrong type", ["--set", "l2.lam=strong"], ["--set l2.lam=strong", "lam", "float", "'strong'"]),
    ("method not in the run", ["--set", "ewc.lam=1"], ["'ewc'", "l2", "train", "stream"]),
    ("bare key, several methods", ["--method", "l2", "--method", "none", "--set", "lam=1"],
     ["--set lam=1", "unknown key 'lam'", "METHOD.PARAM", "l2, none"]),
    ("misspelt config key", ["--set", "train.epoch=2"], ["train", "'epoch'", "epochs"]),
    ("config key of the wrong type", ["--set", "train.epochs=two"], ["train.epochs", "int", "'two'"]),
    ("no '='", ["--set", "l2.lam"], ["--set", "KEY=VALUE", "fromp.tau=1"]),
    ("not YAML", ["--set", "l2.lam=[1"], ["--set l2.lam", "YAML"]),
    ("too deep", ["--set", "l2.a.b=1"], ["--set l2.a.b=1", "l2.PARAM=VALUE"]),
    ("method without parameters", ["--method", "none", "--set", "none.a=1"], ["--set none.a=1", "no params"]),
]


@pytest.mark.parametrize("extra, needles", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_set_is_one_line_and_exit_2(extra, needles, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = main(["run", _cfg(tmp_path)] + extra)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err and err.startswith("continual-blr"), err
    for n in needles:
        assert n in err, err
    assert not (tmp_path / "runs").exists()


def test_resume_refuses_set(tmp_path, capsys):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "results.json").write_text("{}")
    assert main(["run", "--resume", str(tmp_path / "old"), "--set", "train.epochs=2"]) == 2
    assert "drop --set" in capsys.readouterr().err


def test_set_reaches_a_labelled_method_whose_label_holds_a_dot(tmp_path):
    assert main(["run", _cfg(tmp_path, "[l2, 'l2#lam0.5']"), "--set", "l2#lam0.5.lam=0.5",
                 "--out", str(tmp_path / "r")]) == 0
    methods = _config_of(tmp_path / "r")["methods"]
    assert [(m["name"], m["params"]) for m in methods] == [("l2", {}), ("l2#lam0.5", {"lam": 0.5})]
