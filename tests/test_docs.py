"""The documentation site's sources agree with the repository: every page is in the nav, every nav entry
and every API-reference module exists. (The site itself is built by ``mkdocs build --strict`` in CI.)"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _nav_files(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [f for item in node for f in _nav_files(item)]
    if isinstance(node, dict):
        return [f for v in node.values() for f in _nav_files(v)]
    return []


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_files(config["nav"])
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(set(nav)) == pages, "add new docs pages to mkdocs.yml's nav (strict builds fail on omitted pages)"
    assert len(nav) == len(set(nav))


def test_reference_modules_exist():
    text = (ROOT / "docs" / "reference.md").read_text()
    modules = re.findall(r"^::: ([\w.]+)", text, flags=re.M)
    assert modules
    for mod in modules:
        base = ROOT / Path(*mod.split("."))
        assert base.with_suffix(".py").is_file() or (base / "__init__.py").is_file(), mod
