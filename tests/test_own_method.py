"""A user's own method outside the package reaches every command: ``imports:`` in a config (or ``--import``) runs
it from the CLI, and the run records the import so that ``--resume``, ``predict`` and ``load_run`` in a fresh
process import it again; an installed package's entry point (group ``continual_blr.methods``) registers its
methods; ``continual-blr methods`` lists them and one method's parameters (issue 24, item 4).

Every command runs in a subprocess, so nothing is registered unless the command imports it itself."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from tiny_runs import TINY

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "my_methods.py"


def _cli(*args: str, cwd: Path, env_path: Path | None = None) -> subprocess.CompletedProcess:
    env = None
    if env_path is not None:
        import os

        env = dict(os.environ, PYTHONPATH=f"{env_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-m", "continual_blr", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


def test_a_module_of_your_own_runs_resumes_and_predicts(tmp_path):
    user = tmp_path / "project"
    user.mkdir()
    shutil.copy(EXAMPLE, user / "my_methods.py")
    (user / "c.yaml").write_text(TINY + "imports: [my_methods]\nmethods: [{name: l2-decay, params: {decay: 0.01}}, none]\n")
    elsewhere = tmp_path / "elsewhere"  # later commands run from another folder: the recorded path must do
    elsewhere.mkdir()
    r = _cli("run", str(user / "c.yaml"), "--out", str(tmp_path / "run"), cwd=user)
    assert r.returncode == 0, r.stderr
    payload = json.loads((tmp_path / "run" / "results.json").read_text())
    assert payload["config"]["imports"] == [str((user / "my_methods.py").resolve())]
    assert [res["method"] for res in payload["results"]] == ["l2-decay", "none"]
    # an interrupted run: the second method has not finished; resume in a fresh process from elsewhere
    shutil.rmtree(tmp_path / "run" / "none")
    payload["results"] = payload["results"][:1]
    payload["progress"].pop("none", None)
    (tmp_path / "run" / "results.json").write_text(json.dumps(payload))
    r = _cli("run", "--resume", str(tmp_path / "run"), "--no-progress", cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    np.save(tmp_path / "x.npy", np.zeros((3, 6), np.float32))
    r = _cli("predict", str(tmp_path / "run"), "--inputs", str(tmp_path / "x.npy"), "--method", "l2-decay",
             "--head", "1", cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "index,label,head,head_output,p_0,p_1" and len(r.stdout.splitlines()) == 4
    # without the import the name is unknown: one line naming it
    (user / "d.yaml").write_text(TINY + "methods: [l2-decay]\n")
    r = _cli("run", str(user / "d.yaml"), "--out", str(tmp_path / "run2"), cwd=elsewhere)
    assert r.returncode == 2 and "l2-decay" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # --import on the command line, and a module that fails to import: one line
    r = _cli("run", str(user / "d.yaml"), "--import", str(user / "my_methods.py"), "--out", str(tmp_path / "run3"),
             cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    (user / "broken.py").write_text("raise RuntimeError('boom')\n")
    r = _cli("run", str(user / "d.yaml"), "--import", str(user / "broken.py"), cwd=elsewhere)
    assert r.returncode == 2 and "broken.py" in r.stderr and "boom" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_an_installed_package_registers_through_its_entry_point(tmp_path):
    site = tmp_path / "site"
    (site / "cblr_extra-0.1.dist-info").mkdir(parents=True)
    shutil.copy(EXAMPLE, site / "cblr_extra.py")
    (site / "cblr_extra-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: cblr-extra\nVersion: 0.1\n")
    (site / "cblr_extra-0.1.dist-info" / "entry_points.txt").write_text(
        "[continual_blr.methods]\nl2-decay = cblr_extra\n")
    r = _cli("methods", cwd=tmp_path, env_path=site)
    assert r.returncode == 0 and any(line.startswith("l2-decay ") for line in r.stdout.splitlines()), r.stdout
    r = _cli("methods", "l2-decay", cwd=tmp_path, env_path=site)
    assert r.returncode == 0 and "decay: float = 0.001  c, the weight of c · Σ θ² added to the mean loss" in r.stdout
    (tmp_path / "c.yaml").write_text(TINY + "methods: [l2-decay]\n")
    r = _cli("run", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "run"), cwd=tmp_path, env_path=site)
    assert r.returncode == 0, r.stderr
    r = _cli("methods", "l2-decay", cwd=tmp_path)  # not installed: unknown, one line
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_methods_command_lists_every_method_and_a_methods_parameters(capsys):
    from continual_blr.cli import main
    from continual_blr.methods import METHODS

    assert main(["methods"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert sorted(METHODS) == sorted(names)
    assert main(["methods", "ewc"]) == 0
    out = capsys.readouterr().out
    assert "parameters (EWCParams" in out and "lam:" in out


def test_methods_command_describes_inherited_parameters(capsys):
    """A params dataclass that inherits fields (FROMPReplayParams from FunctionalParams, FRORPParams from
    FROMPParams) shows each inherited field with its base class's description, not an empty one."""
    from continual_blr.cli import main

    for name in ("fromp-replay", "frorp"):
        assert main(["methods", name]) == 0
        lines = {line.split(":")[0].strip(): line for line in capsys.readouterr().out.splitlines()[2:]}
        assert "prior_precision" in lines and "δ in Σ" in lines["prior_precision"], (name, lines)
        assert "τ, weight" in lines["tau"], name
