"""Griffe extension for the API reference: Sphinx roles in docstrings become working cross-references.

The docstrings use reStructuredText roles (``:class:`~continual_blr.config.RunConfig```, ``:func:`load_run```,
``:mod:`continual_blr.optim.blr```), which mkdocstrings' Google-style parser shows as raw text. This extension
rewrites each role, once the package is loaded, into mkdocs-autorefs' Markdown ``[title][identifier]`` when the
target is an object the reference renders (public, documented, in a module named by a ``::: module`` line of
``docs/reference/*.md``), resolving
relative names against the docstring's module and aliases to their canonical path; any other target becomes
plain code (a role that names a private helper or another library), so the strict build never meets an
unresolvable link. ``~`` keeps only the last component as the title, as in Sphinx.
"""

from __future__ import annotations

import re
from pathlib import Path

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|obj|exc|const):`(~?)([^`<>]+?)`")


def _public(path: str) -> bool:
    return not any(part.startswith("_") for part in path.split("."))


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles in every docstring of the package (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        objects: dict[str, griffe.Object] = {}

        def walk(obj: griffe.Object) -> None:
            objects[obj.path] = obj
            for member in obj.members.values():
                if member.is_alias:
                    continue
                walk(member)

        walk(pkg)
        pages = {m.group(1) for page in Path("docs/reference").glob("*.md")
                 for m in re.finditer(r"^::: (\S+)", page.read_text(), re.M)}

        def on_a_page(obj: griffe.Object) -> bool:
            module = obj if obj.is_module else obj.module
            return module.path in pages

        rendered = {p for p, o in objects.items()
                    if _public(p) and on_a_page(o) and (o.is_module or o.docstring is not None)}

        def resolve(target: str, where: griffe.Object) -> str | None:
            target = target.strip().rstrip("()")
            module = where if where.is_module else where.module
            candidates = [target]
            if not target.startswith("continual_blr"):
                mod: griffe.Object | None = module
                while mod is not None:
                    candidates.append(f"{mod.path}.{target.lstrip('.')}")
                    mod = mod.parent
                if where.is_class or (where.parent is not None and where.parent.is_class):
                    cls = where if where.is_class else where.parent
                    candidates.append(f"{cls.path}.{target}")
            for cand in candidates:
                obj = objects.get(cand)
                if obj is None:  # an alias re-exported by a package: its canonical path
                    parent_path, _, name = cand.rpartition(".")
                    parent = objects.get(parent_path)
                    member = parent.members.get(name) if parent is not None else None
                    if member is not None and member.is_alias:
                        cand = member.target_path
                        obj = objects.get(cand)
                if obj is not None and cand in rendered:
                    return cand
            return None

        def rewrite(obj: griffe.Object) -> None:
            if obj.docstring is not None:
                def repl(m: re.Match) -> str:
                    tilde, target = m.group(1), m.group(2)
                    title = target.strip().split(".")[-1] if tilde else target.strip()
                    ident = resolve(target, obj)
                    return f"[`{title}`][{ident}]" if ident else f"`{title}`"

                obj.docstring.value = _ROLE.sub(repl, obj.docstring.value)
            for member in obj.members.values():
                if not member.is_alias:
                    rewrite(member)

        rewrite(pkg)
