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


def _reference_modules() -> list[str]:
    return [m for page in sorted((ROOT / "docs" / "reference").glob("*.md"))
            for m in re.findall(r"^::: ([\w.]+)", page.read_text(), flags=re.M)]


def test_reference_modules_exist():
    modules = _reference_modules()
    assert modules
    for mod in modules:
        base = ROOT / Path(*mod.split("."))
        assert base.with_suffix(".py").is_file() or (base / "__init__.py").is_file(), mod


def test_every_public_module_is_in_the_reference_and_every_method_params_dataclass_with_it():
    """The API reference is split per area (docs/reference/): every public module of the package (packages'
    ``__init__`` aside, their content is their modules') has a ``::: module`` line on one page, once; so every
    method's params dataclass is rendered (they live in the method modules)."""
    modules = _reference_modules()
    assert len(modules) == len(set(modules))
    public = []
    for p in sorted((ROOT / "continual_blr").rglob("*.py")):
        rel = p.relative_to(ROOT).with_suffix("")
        if any(part.startswith("_") for part in rel.parts) or p.name == "__main__.py":
            continue
        public.append(".".join(rel.parts))
    public += ["continual_blr.methods"]  # the registry's functions live in the package itself
    missing = sorted(set(public) - set(modules) - {"continual_blr.cli", "continual_blr.cli_saved", "continual_blr.cli_common",
                                                   "continual_blr.cli_catalog"})  # the command line: docs/runs.md
    assert not missing, f"add these modules to a page of docs/reference/: {missing}"
