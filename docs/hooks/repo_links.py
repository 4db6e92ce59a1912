"""MkDocs hook: links from a docs page to repository files outside ``docs/`` become plain references.

Pages such as ``benchmarks.md`` link to result files under ``benchmarks/results/``; those files live in
the repository, not on the site, so a link to them cannot resolve (``mkdocs build --strict`` would
fail). Each such Markdown link ``[text](../path)`` is rewritten to ``text (`path` in the repository)``.

Also: math indices written like ``R[i][j]`` in docstrings are read by mkdocs-autorefs as reference
links to an object called ``j``; warnings about unresolvable single-letter targets are dropped
(every other autorefs warning still fails the strict build).
"""

from __future__ import annotations

import logging
import re

_OUTSIDE = re.compile(r"\[([^\]]+)\]\(\.\./([^)#\s]+)(#[^)\s]*)?\)")
_INDEX_TARGET = re.compile(r"Could not find cross-reference target '[a-z]'")


class _DropIndexRefs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _INDEX_TARGET.search(record.getMessage())


def on_config(config, **kwargs):
    for name in ("mkdocs.plugins.mkdocs_autorefs._internal.plugin", "mkdocs.plugins.mkdocs_autorefs"):
        logging.getLogger(name).addFilter(_DropIndexRefs())
    return config


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    def repl(m: re.Match) -> str:
        text, path = m.group(1), m.group(2)
        if text.strip("`") == path:
            return f"`{path}` (in the repository)"
        return f"{text} (`{path}` in the repository)"

    return _OUTSIDE.sub(repl, markdown)
