"""``constraints.txt`` pins every package that ``pyproject.toml`` asks for, in the library and in every extra, at a
version the requirement allows; and in the environment the tests run in, every such package is the pinned version
(the README installs with ``pip install -c constraints.txt``)."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")
from packaging.requirements import Requirement  # noqa: E402 (pytest's own dependency, pinned in constraints.txt)

ROOT = Path(__file__).resolve().parents[1]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not a pin (name==version)"
            assert _norm(name) not in pins, f"constraints.txt: {name} is pinned twice"
            pins[_norm(name)] = version
    return pins


def _requirements() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"dependencies": project["dependencies"]} | project.get("optional-dependencies", {})
    return {group: [Requirement(r) for r in reqs] for group, reqs in groups.items()}


def test_every_requirement_is_pinned_at_an_allowed_version():
    pins = _pins()
    for group, reqs in _requirements().items():
        for req in reqs:
            name = _norm(req.name)
            assert name in pins, f"pyproject {group}: {req.name} has no pin in constraints.txt"
            assert req.specifier.contains(pins[name], prereleases=True), \
                f"pyproject {group}: {req} does not allow the pinned {pins[name]}"


def test_the_test_environment_has_the_pinned_versions():
    pins, groups = _pins(), _requirements()
    for req in groups["dependencies"] + groups["test"]:
        assert metadata.version(req.name) == pins[_norm(req.name)], req.name
