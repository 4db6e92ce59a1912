"""A run records its own module's path in ``imports``; when the module (or the whole project) moves, ``predict`` and
``load_run`` still load the run's built-in methods, and ``predict`` / ``inspect --import PATH`` (``load_run(...,
imports=[PATH])``) say where the module is now (issue 42 item 7). Commands run in subprocesses, so that the
registry of this process never holds the module's method."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from continual_blr.saved_run import load_run
from tiny_runs import TINY

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "my_methods.py"


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "continual_blr", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_a_moved_module_is_needed_only_by_its_own_method(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(EXAMPLE, project / "my_methods.py")
    (project / "c.yaml").write_text(TINY + "imports: [my_methods]\nmethods: [l2-decay, none]\n")
    r = _cli("run", "c.yaml", "--out", "run", cwd=project)
    assert r.returncode == 0, r.stderr
    moved = tmp_path / "moved"
    shutil.move(project, moved)  # the recorded path project/my_methods.py is gone
    np.save(tmp_path / "x.npy", np.zeros((3, 6), np.float32))
    run = moved / "run"

    # a built-in method needs no import: the Python API and the CLI
    assert load_run(run, "none").predict(np.zeros((3, 6), np.float32), head=0).shape == (3,)
    r = _cli("predict", str(run), "--inputs", "x.npy", "--method", "none", "--head", "0", cwd=tmp_path)
    assert r.returncode == 0, r.stderr

    # the run's own method: one line naming the missing module and --import
    with pytest.raises(ValueError, match=r"my_methods\.py.*'l2-decay'.*--import"):
        load_run(run, "l2-decay")
    r = _cli("predict", str(run), "--inputs", "x.npy", "--method", "l2-decay", "--head", "0", cwd=tmp_path)
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "my_methods.py" in err and "--import" in err, err

    # --import names the module's new place (relative to the working directory)
    r = _cli("predict", str(run), "--inputs", "x.npy", "--method", "l2-decay", "--head", "0",
             "--import", "moved/my_methods.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 4
    r = _cli("inspect", str(run), "--method", "l2-decay", "--import", str(moved / "my_methods.py"), "--top", "2",
             "--out", str(tmp_path / "report"), "--no-progress", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "report" / "index.html").is_file()


def test_a_labelled_entry_loads_and_predicts(tmp_path, capsys):
    """A method listed twice gets the name ``l2#2`` (issue 42 item 1); ``load_run`` and ``predict`` look its
    method up by the part before ``#`` (they refused it as 'not registered')."""
    import torch

    from continual_blr.cli import main

    torch.set_num_threads(1)
    (tmp_path / "c.yaml").write_text(TINY + "methods: [l2, {name: l2, params: {lam: 3}}]\n")
    assert main(["run", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "run")]) == 0
    run = load_run(tmp_path / "run", "l2#2")
    assert run.method.name == "l2#2" and run.method.params.lam == 3
    np.save(tmp_path / "x.npy", np.zeros((3, 6), np.float32))
    capsys.readouterr()
    assert main(["predict", str(tmp_path / "run"), "--inputs", str(tmp_path / "x.npy"), "--method", "l2#2",
                 "--head", "0"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 4
