"""Methods from outside the package: a user's own module, or an installed package's entry point.

A method is a :class:`~continual_blr.methods.base.Method` subclass and its params dataclass, added to the registry
with :func:`~continual_blr.methods.register`. Code outside this package reaches the registry in two ways:

* **a module of your own**, named in a run config's ``imports: [my_methods]`` (a module name importable from
  the config file's folder or ``sys.path``, or a path to a ``.py`` file) or with ``continual-blr run --import
  my_methods``. The run records the imports in its ``results.json``, so ``--resume``, ``predict``, ``inspect``
  and :func:`~continual_blr.load_run` import them again;
* **an installed package** declaring an entry point in the group ``continual_blr.methods``
  (``[project.entry-points."continual_blr.methods"] my-method = "my_package.methods"``): the module named
  is imported (and registers its methods) the first time the registry is asked for a name it does not hold,
  or for the list of all methods.

``docs/own_method.md`` walks through both.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

__all__ = ["ENTRY_POINT_GROUP", "import_modules", "load_entry_points"]

ENTRY_POINT_GROUP = "continual_blr.methods"
_ENTRY_POINTS_LOADED = False


def import_modules(names: list[str], base: str | Path | None = None) -> None:
    """Import each module of ``names`` (its import registers its methods): a dotted module name, looked up
    first in ``base`` (the config file's folder) and then on ``sys.path``, or a path to a ``.py`` file
    (relative paths against ``base``, else the working directory). A module already imported is not
    imported again.

    Raises:
        ValueError: one line naming the module and why it could not be imported.
    """
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"imports: got {name!r}; allowed: a module name or a path to a .py file")
        try:
            if name.endswith(".py"):
                _import_file(Path(name) if Path(name).is_absolute() or base is None else Path(base) / name)
            else:
                _import_name(name, base)
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001 - any error raised while a user's module runs
            first = str(err).splitlines()[0] if str(err) else ""
            raise ValueError(f"imports: cannot import {name!r} ({type(err).__name__}: {first})") from None


def _import_file(path: Path) -> None:
    path = path.resolve()
    if not path.is_file():
        raise ValueError(f"imports: file not found: {path}")
    module_name = f"continual_blr_user_{path.stem}_{abs(hash(str(path))) % 10**8}"
    if module_name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise


def _import_name(name: str, base: str | Path | None) -> None:
    if name in sys.modules:
        return
    added = base is not None and str(Path(base).resolve()) not in sys.path
    if added:
        sys.path.insert(0, str(Path(base).resolve()))
    try:
        importlib.import_module(name)
    finally:
        if added:
            sys.path.remove(str(Path(base).resolve()))


def load_entry_points() -> None:
    """Import every module declared in the entry-point group ``continual_blr.methods`` (once per process).
    A package whose module fails to import is skipped with a warning naming it."""
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    from importlib import metadata

    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as err:  # noqa: BLE001 - an installed package's bug must not stop the registry
            import warnings

            warnings.warn(f"continual_blr.methods entry point {ep.name!r} ({ep.value}) failed to load: "
                          f"{type(err).__name__}: {err}", stacklevel=2)
