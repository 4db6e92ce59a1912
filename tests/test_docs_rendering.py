"""The API reference renders the docstrings as meant: no raw reST (``.. math::``, a literal-block ``::``, a simple
table of ``====`` rules) in the sources, and, where mkdocs is installed, no raw markup and no formula turned
into italics (``θ*``, ``_{..}``) in the built site."""

from __future__ import annotations

import ast
import html
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _docstrings():
    for path in sorted((ROOT / "continual_blr").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    yield f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}", doc


def test_no_rest_only_markup_in_docstrings():
    bad = []
    for where, doc in _docstrings():
        for line in doc.splitlines():
            if ".. math::" in line or re.search(r"\S::\s*$", line) or re.fullmatch(r"\s*=+(\s+=+)+\s*", line):
                bad.append(f"{where}: {line.strip()[:80]}")
    assert bad == [], "reST markup mkdocstrings shows raw (use Markdown: a code block, a pipe table):\n" + "\n".join(bad)


def _page_text(page: Path) -> tuple[str, str]:
    body = page.read_text(encoding="utf-8")
    m = re.search(r"<article[^>]*>(.*)</article>", body, re.S)
    body = re.sub(r"<pre.*?</pre>", "", m.group(1) if m else body, flags=re.S)
    body = re.sub(r"<code.*?</code>", "", body, flags=re.S)
    return body, html.unescape(re.sub(r"<[^>]+>", "", body))


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs not installed (the [docs] extra)")
def test_built_site_shows_no_raw_markup_and_no_formula_in_italics(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    bad = []
    for page in sorted((tmp_path / "site").rglob("*.html")):
        body, text = _page_text(page)
        for pattern in (r"\.\. math::", r":(?:mod|class|func|meth|attr|data):`", r"``", r"(?<![:\w])::(?!\w)"):
            bad += [f"{page.relative_to(tmp_path)}: {m.group(0)!r}" for m in re.finditer(pattern, text)]
        for m in re.finditer(r"<em>(.*?)</em>", body, re.S):  # emphasis is words; a formula there lost a * or _
            if re.search(r"[_{}=θΣ∇()]", html.unescape(m.group(1))):
                bad.append(f"{page.relative_to(tmp_path)}: <em>{m.group(1)[:60]}")
    assert bad == [], "\n".join(bad)
