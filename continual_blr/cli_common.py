"""What the command-line modules share (``cli`` for ``run`` and ``methods``, ``cli_saved`` for ``inspect`` and
``predict``): the one-line error, the exit statuses, reading a YAML config file, torch threads for a block, and the
translation of a library error's parameter name into its command-line flag. Both import this module and neither
imports the other's internals, so there is no import circle between them.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Iterator

__all__ = ["EXIT_USAGE", "EXIT_INTERRUPTED", "fail", "read_yaml", "threads", "as_flag"]

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def fail(msg: str) -> int:
    """Print ``continual-blr: error: MSG`` on stderr; returns the usage exit status (2)."""
    print(f"continual-blr: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def as_flag(msg: str, flags: dict[str, str]) -> str:
    """A library error ``"task: ..."`` as the command line's ``"--task: ..."``: the Python API names its
    arguments, the CLI its flags (``flags`` maps an argument to its flag)."""
    name, sep, rest = msg.partition(":")
    return f"{flags[name]}:{rest}" if sep and name in flags else msg


def read_yaml(path: str) -> dict[str, Any]:
    """The mapping at the top of the YAML file ``path``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not valid YAML, empty, or not a mapping (one line naming the file).
    """
    import yaml

    from .config import yaml_load

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        data = yaml_load(p.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ValueError(f"config file {path} is not valid YAML{where}") from None
    if data is None:
        raise ValueError(f"config file {path} is empty; give at least one setting (e.g. methods: [blr]) "
                         "or run without a config for the embedded default")
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping at the top level")
    return data


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    """``torch.set_num_threads(n)`` (and the inter-op pool where torch still allows it) for the block."""
    if n is None:
        yield
        return
    import torch

    from .runner import set_threads

    old = set_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
