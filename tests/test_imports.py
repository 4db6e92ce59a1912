"""The design's dependency direction, checked on the source: no module imports a layer above its own.

Layers, lowest first (``docs/concepts.md``, "Layers"): a module may import its own layer and the ones
below, never one above. A module not listed sits in the top layer. Every ``import`` statement counts, also those inside functions (a lazy import
is still an arrow).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "continual_blr"

LAYERS: list[tuple[str, ...]] = [
    ("types", "mixed_precision", "compiled", "data", "posteriors", "curvature", "models", "distributed"),
    ("regularizers", "optim", "memory", "replay_buffer", "dnn2gp"),
    ("methods",),
    ("loop",),
    ("inspect", "plots"),
    ("config", "runner", "sweep", "saved_run", "integrations", "cli", "cli_saved", "__init__"),
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
TOP = len(LAYERS) - 1  # a module not listed (a new run-side module) sits in the top layer


def _rank(unit: str) -> int:
    return RANK.get(unit, TOP)


def _unit(parts: tuple[str, ...]) -> str:
    """The top-level unit (subpackage or module) of a dotted path inside ``continual_blr``."""
    head = parts[0] if parts else "__init__"
    return head[:-3] if head.endswith(".py") else head


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, unit)`` for every import of a ``continual_blr`` unit in the file at ``path``."""
    rel = path.relative_to(PKG).with_suffix("").parts
    package = rel[:-1] if rel[-1] != "__init__" else rel[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "continual_blr":
                    out.append((node.lineno, _unit(tuple(parts[1:]))))
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] != "continual_blr":
                    continue
                targets = [tuple(parts[1:])] if len(parts) > 1 else [(a.name,) for a in node.names]
            else:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                mod = tuple((node.module or "").split(".")) if node.module else ()
                targets = [base + mod] if (base + mod) else [(a.name,) for a in node.names]
            out.extend((node.lineno, _unit(t)) for t in targets)
    return out


def _arrows_against_the_direction() -> list[str]:
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        own = _unit(path.relative_to(PKG).parts)
        for line, target in _imports(path):
            if _rank(target) > _rank(own):
                bad.append(f"{path.relative_to(PKG.parent)}:{line}: {own} (layer {_rank(own)}) imports "
                           f"{target} (layer {_rank(target)})")
    return bad


def test_no_import_points_up_the_layers():
    assert _arrows_against_the_direction() == []


def test_the_checker_sees_an_upward_arrow(tmp_path):
    """The walk would fail on the arrows issue 16 found (methods → config, inspect → runner)."""
    pkg = tmp_path / "continual_blr"
    (pkg / "methods").mkdir(parents=True)
    (pkg / "inspect").mkdir()
    (pkg / "methods" / "__init__.py").write_text("def f():\n    from ..config import from_dict\n")
    (pkg / "inspect" / "saved_run.py").write_text("from ..runner import build_stream\nfrom ..methods import x\n")
    (pkg / "loop.py").write_text("import continual_blr.methods.base\nfrom continual_blr import runner\n")
    globals()["PKG"], old = pkg, PKG
    try:
        bad = _arrows_against_the_direction()
    finally:
        globals()["PKG"] = old
    assert len(bad) == 3, bad
    assert any("methods (layer 2) imports config" in b for b in bad)
    assert any("inspect (layer 4) imports runner" in b for b in bad)
    assert any("loop (layer 3) imports runner" in b for b in bad)


@pytest.mark.parametrize("unit", ["methods", "inspect", "loop"])
def test_heavy_layers_do_not_pull_in_the_config(unit):
    """Importing a low layer in a fresh interpreter does not load the run configuration or the runner."""
    import subprocess
    import sys

    code = (f"import sys, continual_blr.{unit}; "
            "bad = [m for m in ('continual_blr.config', 'continual_blr.runner', 'continual_blr.cli') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
