"""Where datasets live on disk, and the error raised when they are not there.

The data root is resolved in this order (first match wins):

1. the explicit argument (``data_dir=...`` in Python, ``--data-dir`` on the command line);
2. the environment variable ``CONTINUAL_BLR_DATA``;
3. a per-user cache folder: ``$XDG_CACHE_HOME/continual_blr/data``, by default
   ``~/.cache/continual_blr/data``.

Nothing here creates folders; only a download (when asked for) writes under the root.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

__all__ = ["DATA_ENV_VAR", "DataNotFoundError", "default_data_dir", "resolve_data_dir", "no_litter"]

DATA_ENV_VAR = "CONTINUAL_BLR_DATA"


class DataNotFoundError(ValueError):
    """A dataset's files are not where they were looked for (and could not be downloaded).

    The message is one line naming the folder that was searched and the files expected there.
    """


def default_data_dir() -> Path:
    """The per-user cache folder used when neither an argument nor ``CONTINUAL_BLR_DATA`` is given.

    Returns:
        ``$XDG_CACHE_HOME/continual_blr/data`` if ``XDG_CACHE_HOME`` is set, else
        ``~/.cache/continual_blr/data``.
    """
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "continual_blr" / "data"


def resolve_data_dir(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The data root to use.

    Args:
        data_dir: an explicit root; wins when given (``~`` is expanded).

    Returns:
        ``data_dir`` if given, else ``$CONTINUAL_BLR_DATA`` if set and non-empty, else
        :func:`default_data_dir`. The folder is not created and need not exist.
    """
    if data_dir is not None and str(data_dir) != "":
        return Path(data_dir).expanduser()
    env = os.environ.get(DATA_ENV_VAR, "")
    if env:
        return Path(env).expanduser()
    return default_data_dir()


@contextlib.contextmanager
def no_litter(*folders: Path) -> Iterator[None]:
    """Run a download attempt that may create ``folders`` (and their missing parents): if it fails, remove
    those that did not exist before and are still empty, deepest first — torchvision makes ``<root>/MNIST/raw``
    before it tries the network, and a failed look-up must leave nothing behind."""
    candidates: list[Path] = []
    for folder in folders:
        p = Path(folder)
        while not p.exists() and p != p.parent and p not in candidates:
            candidates.append(p)
            p = p.parent
    try:
        yield
    except BaseException:
        for d in sorted(candidates, key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                if d.is_dir() and not any(d.iterdir()):
                    d.rmdir()
        raise
