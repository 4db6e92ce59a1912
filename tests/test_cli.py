"""The command line: the default run and one-line errors."""

import json
import struct
import zlib

import pytest

from continual_blr.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _valid_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    # the first chunk is IHDR with a correct CRC
    length = struct.unpack(">I", data[8:12])[0]
    chunk = data[12 : 16 + length]
    assert chunk[:4] == b"IHDR"
    assert struct.unpack(">I", data[16 + length : 20 + length])[0] == zlib.crc32(chunk)


def test_default_run_writes_results_and_heatmap(tmp_path, capsys):
    # The embedded default (split-digits, blr + fromp + none), shortened to 1 epoch for the test suite.
    rc = main(["run", "--out", str(tmp_path), "--epochs", "1", "--no-progress"])
    assert rc == 0
    payload = json.loads((tmp_path / "results.json").read_text())
    assert [r["method"] for r in payload["results"]] == ["blr", "fromp", "none"]
    assert all(len(r["acc_matrix"]) == 5 for r in payload["results"])
    _valid_png(tmp_path / "accuracy_matrix.png")
    out = capsys.readouterr().out
    assert "split_digits" in out and "avg" in out


def _one_line_error(capsys, argv, *needles):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err


TINY = ("stream: {name: synthetic, options: {n_tasks: 2, n_train: 40}}\nmodel: {hidden: [8]}\n"
        "train: {epochs: 1, batch_size: 20}\nmethods: [none]\n")


def _yaml(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _existing_run(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "results.json").write_text("{}")
    return str(tmp_path / "old")


# Every bad input of the run command: (id, argv builder given tmp_path, words the one line must hold).
BAD_INPUT = [
    ("unknown --method", lambda t: ["run", "--method", "nope"], ["nope", "blr", "none"]),
    ("unknown config key", lambda t: ["run", _yaml(t, "train:\n  epoch: 3\n")], ["epoch", "epochs"]),
    ("wrong type", lambda t: ["run", _yaml(t, "train:\n  epochs: ten\n")], ["train.epochs", "int"]),
    ("missing config file", lambda t: ["run", str(t / "absent.yaml")], ["absent.yaml"]),
    ("empty config file", lambda t: ["run", _yaml(t, "")], ["config file", "c.yaml", "is empty"]),
    ("comments-only config file", lambda t: ["run", _yaml(t, "# nothing\n")], ["is empty"]),
    ("invalid YAML", lambda t: ["run", _yaml(t, "train: [unclosed\n")], ["YAML"]),
    ("top level not a mapping", lambda t: ["run", _yaml(t, "- a\n")], ["mapping"]),
    ("missing data folder", lambda t: ["run", "--data-dir", str(t / "nodata"), "--set", "stream.name=split_mnist"],
     ["nodata"]),  # a stream that reads files (a data-free one ignores --data-dir)
    ("missing dataset files", lambda t: ["run", _yaml(t, f"stream:\n  name: split_mnist\n  data_dir: {t}\n"
                                                        "  options: {download: false}\n")], [None]),
    ("--device gpu", lambda t: ["run", "--device", "gpu"], ["--device", "'gpu'", "cpu, cuda, cuda:N"]),
    ("device gpu in the config", lambda t: ["run", _yaml(t, "device: gpu\n")], ["device", "cpu, cuda, cuda:N"]),
    ("--seed -1", lambda t: ["run", "--seed", "-1"], ["--seed", "-1", ">= 0"]),
    ("seed -1 in the config", lambda t: ["run", _yaml(t, "seed: -1\n")], ["seed", ">= 0"]),
    ("method parameter", lambda t: ["run", _yaml(t, "stream: {name: synthetic}\n"
                                                    "methods: [{name: none}, {name: blr, params: {lrr: 1}}]\n")],
     ["methods[1] (blr)", "lrr", "allowed", "lr"]),
    ("method without parameters given some",
     lambda t: ["run", _yaml(t, "stream: {name: synthetic}\nmethods: [{name: none, params: {a: 1}}]\n")],
     ["methods[0] (none)"]),
    ("unknown method in the config", lambda t: ["run", _yaml(t, "methods: [blr, nope]\n")], ["methods[1]", "nope"]),
    ("--threads 0", lambda t: ["run", "--threads", "0"], ["--threads", ">= 1"]),
    ("--ray without --seeds", lambda t: ["run", "--ray"], ["--ray", "--seeds"]),
    ("--threads not a number", lambda t: ["run", "--threads", "two"], ["--threads", "two"]),
    ("--epochs 0", lambda t: ["run", "--epochs", "0"], ["--epochs", ">= 1"]),
    ("--validation 1.5", lambda t: ["run", _yaml(t, TINY), "--validation", "1.5"], ["validation", "[0, 1)"]),
    ("--resume on a folder without a run", lambda t: ["run", "--resume", str(t)], ["--resume", "no run"]),
    ("--resume on a missing folder", lambda t: ["run", "--resume", str(t / "nothing")], ["--resume", "no run"]),
    ("--resume with a config change", lambda t: ["run", "--resume", _existing_run(t), "--method", "blr"],
     ["--resume", "--method"]),
    ("--out on an existing run", lambda t: ["run", _yaml(t, TINY), "--out", _existing_run(t)],
     ["--out", "already holds a run", "--overwrite", "--resume"]),
    ("--overwrite without --out", lambda t: ["run", "--overwrite"], ["--overwrite", "--out"]),
    ("--seeds with a duplicate", lambda t: ["run", "--seeds", "0", "1", "0"], ["--seeds", "0", "twice"]),
    ("--seeds with a negative", lambda t: ["run", "--seeds", "0", "-2"], ["--seeds", "-2", ">= 0"]),
    ("--seed and --seeds", lambda t: ["run", "--seed", "1", "--seeds", "0", "1"], ["--seed", "--seeds"]),
    ("--log-loo with --seeds", lambda t: ["run", "--log-loo", "--seeds", "0", "1"], ["--log-loo", "--seeds"]),
    ("--checkpoint-every -1", lambda t: ["run", "--checkpoint-every", "-1"], ["--checkpoint-every", "-1", ">= 0"]),
    ("--checkpoint-every nan", lambda t: ["run", "--checkpoint-every", "nan"], ["--checkpoint-every", "nan"]),
    ("--checkpoint-every with --seeds", lambda t: ["run", "--checkpoint-every", "5", "--seeds", "0", "1"],
     ["--checkpoint-every", "--seeds"]),
    ("no subcommand", lambda t: [], ["command"]),
]


@pytest.mark.parametrize("build, needles", [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2(build, needles, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a run that wrongly started would write under tmp_path/runs
    argv = build(tmp_path)
    rc = main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert rc == 2, (rc, err)
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err and err.startswith("continual-blr"), err
    for n in needles:
        assert n is None or n in err, err
    assert not (tmp_path / "runs").exists()  # nothing was run


def test_embedded_default_matches_its_yaml_copies():
    """The embedded default (code, so that an installed package needs no config files) and the YAML files
    that document it must not drift apart: default.yaml's methods, and blr.yaml / fromp.yaml's params."""
    from pathlib import Path

    import yaml

    from continual_blr.config import DEFAULT_CONFIG, SPLIT_DIGITS_BLR, SPLIT_DIGITS_FROMP, RunConfig, from_dict

    folder = Path(__file__).resolve().parent.parent / "configs" / "split_digits"
    load = lambda name: from_dict(RunConfig, yaml.safe_load((folder / name).read_text()))  # noqa: E731
    default = load("default.yaml")
    assert [(m.name, m.params) for m in default.methods] == [(m.name, m.params) for m in DEFAULT_CONFIG.methods]
    assert (default.model, default.train) == (DEFAULT_CONFIG.model, DEFAULT_CONFIG.train)
    assert default.stream.name == DEFAULT_CONFIG.stream.name
    assert default.out is None and DEFAULT_CONFIG.out is None  # both write a new run folder
    assert default.stream.scenario == (DEFAULT_CONFIG.stream.scenario or "task")  # split digits' default scenario
    assert load("blr.yaml").methods[0].params == SPLIT_DIGITS_BLR
    assert load("fromp.yaml").methods[0].params == SPLIT_DIGITS_FROMP


def test_validation_flag_evaluates_on_held_out_training_data(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text("stream: {name: synthetic, options: {n_tasks: 2, n_train: 40}}\nmodel: {hidden: [8]}\n"
                 "train: {epochs: 1, batch_size: 20}\nmethods: [none]\n")
    assert main(["run", str(p), "--validation", "0.25", "--out", str(tmp_path / "v"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "synthetic[validation 0.25]" in out and "final validation" in out and "final test" not in out
    payload = json.loads((tmp_path / "v" / "results.json").read_text())
    assert payload["config"]["stream"]["validation"] == 0.25
    assert payload["results"][0]["stream"] == "synthetic[validation 0.25]"
    assert main(["run", str(p), "--out", str(tmp_path / "t"), "--no-progress"]) == 0
    assert "final test" in capsys.readouterr().out
    _one_line_error(capsys, ["run", str(p), "--validation", "1.5"], "validation", "[0, 1)")


def test_yaml_floats_without_a_dot_are_numbers(tmp_path):
    """``lr: 1e-3`` is a float (YAML 1.2), not the string PyYAML's YAML 1.1 rules make of it (a newcomer's config
    was refused with ``train.lr must be float, got '1e-3'``); integers stay integers, strings stay strings."""
    from continual_blr.config import yaml_load

    assert yaml_load("a: 1e-3\nb: -2E+4\nc: 10\nd: 1.5\ne: abc\nf: 1_000\n") == \
        {"a": 0.001, "b": -20000.0, "c": 10, "d": 1.5, "e": "abc", "f": 1000}
    p = tmp_path / "c.yaml"
    p.write_text("stream: {name: synthetic, options: {n_tasks: 2, n_train: 40}}\nmodel: {hidden: [8]}\n"
                 "train: {epochs: 1, batch_size: 20, lr: 1e-3}\nmethods: [none]\n")
    assert main(["run", str(p), "--out", str(tmp_path / "r"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "r" / "results.json").read_text())["config"]["train"]["lr"] == 0.001


def test_scenario_flag_overrides_the_config_and_refuses_what_the_stream_lacks(tmp_path, capsys):
    """``--scenario class`` turns a task-incremental config into one head over all classes; a scenario the
    stream does not offer, or no scenario at all, is a one-line error naming the allowed values."""
    p = tmp_path / "c.yaml"
    p.write_text("stream: {name: synthetic, scenario: task, options: {n_tasks: 2, n_train: 40}}\nmodel: {hidden: [8]}\n"
                 "train: {epochs: 1, batch_size: 20}\nmethods: [none]\n")
    assert main(["run", str(p), "--scenario", "class", "--out", str(tmp_path / "c"), "--no-progress"]) == 0
    payload = json.loads((tmp_path / "c" / "results.json").read_text())
    assert payload["config"]["stream"]["scenario"] == "class"
    assert payload["results"][0]["scenario"] == "class"
    assert main(["run", str(p), "--out", str(tmp_path / "t"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "t" / "results.json").read_text())["results"][0]["scenario"] == "task"
    capsys.readouterr()
    _one_line_error(capsys, ["run", str(p), "--scenario", "bogus"], "--scenario", "task, class, domain")
    _one_line_error(capsys, ["run", "--scenario", "domain", "--method", "none"], "scenario 'domain'", "task, class")
