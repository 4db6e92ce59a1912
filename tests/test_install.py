"""Install: the library and the CLI import and run without Avalanche (the optional ``[avalanche]`` extra),
and the package says its version."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import continual_blr

BLOCK_AVALANCHE = textwrap.dedent('''
    import importlib.abc, sys

    class _NoAvalanche(importlib.abc.MetaPathFinder):
        """Acts as if avalanche-lib were not installed."""
        def find_spec(self, name, path=None, target=None):
            if name == "avalanche" or name.startswith("avalanche."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NoAvalanche())
    for mod in [m for m in sys.modules if m == "avalanche" or m.startswith("avalanche.")]:
        del sys.modules[mod]
''')


def _python(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-c", BLOCK_AVALANCHE + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env=env)


def test_blocker_really_blocks(tmp_path):
    res = _python("import avalanche\n", tmp_path)
    assert res.returncode != 0 and "No module named 'avalanche'" in res.stderr


def test_library_and_cli_run_without_avalanche(tmp_path):
    code = f'''
        import importlib, pkgutil, sys
        import continual_blr
        skipped = []
        for info in pkgutil.walk_packages(continual_blr.__path__, "continual_blr."):
            if info.name == "continual_blr.integrations.avalanche":
                skipped.append(info.name)
                continue
            importlib.import_module(info.name)
        assert skipped == ["continual_blr.integrations.avalanche"], skipped
        from continual_blr.cli import main
        rc = main(["run", "--method", "none", "--epochs", "1", "--no-progress", "--out", {str(tmp_path / "run")!r}])
        assert rc == 0, rc
        assert not any(m == "avalanche" or m.startswith("avalanche.") for m in sys.modules)
        try:
            import continual_blr.integrations.avalanche
        except ImportError as err:
            print("HINT:", err)
        else:
            raise SystemExit("the plugins imported without Avalanche")
    '''
    res = _python(code, tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert 'pip install "continual_blr[avalanche]"' in res.stdout
    payload = json.loads((tmp_path / "run" / "results.json").read_text())
    assert [r["method"] for r in payload["results"]] == ["none"]


def test_version_is_the_installed_distributions():
    from importlib import metadata

    assert continual_blr.__version__ == metadata.version("continual_blr")
    assert "__version__" in continual_blr.__all__ and "load_run" in dir(continual_blr)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        continual_blr.nope  # noqa: B018


def test_avalanche_is_an_extra_not_a_dependency():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("avalanche") for d in project["dependencies"])
    extras = project["optional-dependencies"]
    assert any(d.startswith("avalanche-lib") for d in extras["avalanche"])
    assert any(d.startswith("avalanche-lib") for d in extras["test"])
