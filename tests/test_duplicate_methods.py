"""A method listed twice in one run (issue 42, item 1): distinct parameters are distinct runs with distinct names
(``fromp``, ``fromp#2``); an exact repeat is a one-line error, never a copy of the first row.

Planted once (``RunConfig.__post_init__`` without :func:`~continual_blr.config.label_methods`): the run with two
``none`` entries of different epochs wrote one row twice (the second skipped as finished), and ``--method none
--method none`` ran and exited 0.
"""

import json

import pytest
import torch

from continual_blr.cli import main
from continual_blr.config import RunConfig, from_dict
from continual_blr.methods import build_method
from continual_blr.types import ConfigError

TINY = ("stream: {name: synthetic, options: {n_tasks: 2, n_train: 40, n_features: 6}}\nmodel: {hidden: [8]}\n"
        "train: {epochs: 1, batch_size: 20}\nprogress: false\n")


def test_a_method_listed_again_with_other_params_gets_its_own_name():
    cfg = from_dict(RunConfig, {"methods": [{"name": "fromp", "params": {"tau": 0.1}}, "none",
                                            {"name": "fromp", "params": {"tau": 100.0}},
                                            {"name": "fromp", "params": {"tau": 1.0}}]})
    assert [m.name for m in cfg.methods] == ["fromp", "none", "fromp#2", "fromp#3"]
    method = build_method(cfg.methods[2].name, cfg.methods[2].params)
    assert method.name == "fromp#2" and method.params.tau == 100.0
    assert type(method) is type(build_method("fromp"))


def test_a_label_may_be_given_and_is_checked():
    cfg = from_dict(RunConfig, {"methods": [{"name": "fromp#tau100", "params": {"tau": 100.0}}, "fromp"]})
    assert [m.name for m in cfg.methods] == ["fromp#tau100", "fromp"]
    with pytest.raises(ConfigError, match=r"methods\[0\].name: got 'fromp#a b'") as err:
        from_dict(RunConfig, {"methods": [{"name": "fromp#a b"}]})
    assert "\n" not in str(err.value)


def test_an_exact_repeat_is_a_one_line_error_naming_both_entries():
    with pytest.raises(ConfigError, match=r"methods\[2\] repeats methods\[0\] \('none' with the same params") as err:
        from_dict(RunConfig, {"methods": ["none", "blr", "none"]})
    assert "\n" not in str(err.value)


def test_cli_method_given_twice_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(TINY + "methods: [none]\n")
    rc = main(["run", str(tmp_path / "c.yaml"), "--method", "none", "--method", "none", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "--method[1] repeats --method[0]" in err
    assert not (tmp_path / "r").exists()


def test_two_entries_of_one_method_give_two_results(tmp_path):
    """Two ``none`` entries, 1 and 3 epochs: two rows with their own names, folders and numbers."""
    torch.set_num_threads(1)
    (tmp_path / "c.yaml").write_text(TINY + "methods: [{name: none}, {name: none, train: {epochs: 3}}]\n")
    assert main(["run", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "run")]) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())["results"]
    assert [r["method"] for r in results] == ["none", "none#2"]
    assert results[0]["acc_matrix"] != results[1]["acc_matrix"]
    assert (tmp_path / "run" / "none" / "model.pt").is_file() and (tmp_path / "run" / "none#2" / "model.pt").is_file()
    # a resume of the finished run keeps both rows
    assert main(["run", "--resume", str(tmp_path / "run")]) == 0
    again = json.loads((tmp_path / "run" / "results.json").read_text())["results"]
    assert [r["acc_matrix"] for r in again] == [r["acc_matrix"] for r in results]
