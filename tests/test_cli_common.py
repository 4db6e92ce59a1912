"""The command-line modules share cli_common (no import circle cli <-> cli_saved); library errors name the
Python API's arguments, the CLI's one-line errors the flags."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "continual_blr"


def _imported_units(module: str) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse((PKG / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("continual_blr."):
            out.add(node.module.split(".")[1])
    return out


def test_no_import_circle_between_cli_and_cli_saved():
    assert "cli" not in _imported_units("cli_saved")  # cli registers cli_saved's commands; never the reverse
    assert not {"cli", "cli_saved"} & _imported_units("cli_common")


def test_library_errors_name_arguments_not_flags(tmp_path):
    from continual_blr.inspect.report import write_report
    from continual_blr.runner import load_run_config, set_threads

    with pytest.raises(ValueError) as err:
        set_threads(0)
    assert str(err.value).startswith("threads:")
    with pytest.raises(ValueError) as err:
        load_run_config(tmp_path)
    assert str(err.value).startswith("resume:")
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError) as err:
        write_report(None, tmp_path / "f")  # type: ignore[arg-type]
    assert str(err.value).startswith("out:")


def test_the_cli_names_the_flag(tmp_path, capsys):
    from continual_blr.cli import main

    assert main(["run", "--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("continual-blr: error: --resume:") and "\n" not in err
