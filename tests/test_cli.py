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


def test_unknown_method(capsys):
    _one_line_error(capsys, ["run", "--method", "nope"], "nope", "blr", "none")


def test_unknown_config_key(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  epoch: 3\n")
    _one_line_error(capsys, ["run", str(p)], "epoch", "epochs")


def test_wrong_type(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  epochs: ten\n")
    _one_line_error(capsys, ["run", str(p)], "train.epochs", "int")


def test_missing_config_file(tmp_path, capsys):
    _one_line_error(capsys, ["run", str(tmp_path / "absent.yaml")], "absent.yaml")


def test_missing_data_folder(tmp_path, capsys):
    _one_line_error(capsys, ["run", "--data-dir", str(tmp_path / "nodata")], "nodata")


def test_missing_dataset_files(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text(f"stream:\n  name: split_mnist\n  data_dir: {tmp_path}\n  options: {{download: false}}\n")
    _one_line_error(capsys, ["run", str(p)], str(tmp_path))


def test_invalid_yaml(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text("train: [unclosed\n")
    _one_line_error(capsys, ["run", str(p)], "YAML")


def test_cuda_unavailable_is_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    _one_line_error(capsys, ["run", "--device", "cuda", "--epochs", "1"], "cuda")


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
