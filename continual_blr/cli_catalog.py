"""What ``continual-blr --help`` and ``continual-blr methods [NAME]`` print: the registered methods with a
one-line description each, a method's parameters, and the stream names.

Importing the method classes imports torch (about 1.5 s), which is most of what those commands cost. So for the
built-in methods the catalogue is read from the package's own source with :mod:`ast`: the ``METHODS`` and
``DESCRIPTIONS`` tables of ``methods/__init__.py``, each class's docstring, each params dataclass's fields
(annotation, default, the ``Attributes:`` entry of its docstring, inherited fields included) and the stream table
of ``data/registry.py``. :func:`imported` builds the same catalogue from the imported registry; the CLI uses it
when methods come from ``--import`` modules or installed entry points, or when the source holds something the
static reading does not handle (:class:`Unsupported`). ``tests/test_cli_catalog.py`` checks that the two agree
for every built-in method.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["Unsupported", "Field", "Method", "static_methods", "static_streams", "imported", "attribute_docs",
           "entry_points_declared", "plain"]

_PKG = Path(__file__).resolve().parent
_REQUIRED = "(required)"


class Unsupported(Exception):
    """The source holds something the static reading does not handle: import the registry instead."""


class Field(NamedTuple):
    """One parameter of a method: name, annotation as written, default (``"(required)"`` if none), description."""

    name: str
    kind: str
    default: Any
    doc: str


class Method(NamedTuple):
    """A method as ``continual-blr methods`` shows it."""

    description: str
    params: str | None  # the params dataclass's name (None: the method takes no parameters)
    fields: tuple[Field, ...]


def attribute_docs(doc: str) -> dict[str, str]:
    """The first sentence of each entry of a Google-style ``Attributes:`` section."""
    out: dict[str, str] = {}
    inside, current = False, None
    for line in inspect.cleandoc(doc).splitlines():
        stripped = line.strip()
        if stripped == "Attributes:":
            inside = True
            continue
        if not inside:
            continue
        if stripped and not line.startswith(" "):
            break  # the next section
        if stripped and not line.startswith(" " * 8) and ":" in stripped:
            name, _, text = stripped.partition(":")
            if " " in name:
                break
            current = name
            out[current] = text.strip()
        elif stripped and current is not None and not out[current].endswith("."):
            out[current] += " " + stripped
    return {k: v.split(". ")[0].rstrip(".") + "." if v else "" for k, v in out.items()}


def plain(text: str) -> str:
    """Docstring markup as a terminal shows it: ````x```` and ``:mod:`x``` as x, no "(module docstring)"."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text).replace("``", "")
    return text.replace(" (module docstring)", "")


def _first_line(doc: str | None) -> str:
    lines = (doc or "").strip().splitlines()
    return lines[0] if lines else ""


def _kind(annotation: Any) -> str:
    """An annotation as written (``from __future__ import annotations`` keeps it a string), normalised by ast."""
    if isinstance(annotation, str):
        try:
            return ast.unparse(ast.parse(annotation, mode="eval"))
        except SyntaxError:
            return annotation
    return getattr(annotation, "__name__", str(annotation)).replace("typing.", "")


# ------------------------------------------------------------------------------------ from the source


@functools.cache
def _tree(rel: str) -> ast.Module:
    path = _PKG / rel
    if not path.is_file():
        raise Unsupported(rel)
    return ast.parse(path.read_text(encoding="utf-8"))


@functools.cache
def _imports(rel: str) -> dict[str, tuple[str, str]]:
    """The names a module imports from this package: name -> (module file, name there)."""
    out = {}
    here = Path(rel).parent
    for node in _tree(rel).body:
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            base = here
            for _ in range(node.level - 1):
                base = base.parent
            parts = (node.module or "").split(".") if node.module else []
            target = base.joinpath(*parts)
            file = str(target / "__init__.py") if (_PKG / target).is_dir() else str(target) + ".py"
            for alias in node.names:
                out[alias.asname or alias.name] = (file, alias.name)
    return out


def _top_level(rel: str, name: str) -> ast.AST | None:
    for node in _tree(rel).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node.value
    return None


def _class(rel: str, name: str) -> tuple[str, ast.ClassDef]:
    """The class ``name`` as seen from module ``rel`` (defined there or imported into it)."""
    node = _top_level(rel, name)
    if isinstance(node, ast.ClassDef):
        return rel, node
    if name in _imports(rel):
        return _class(*_imports(rel)[name])
    raise Unsupported(f"{rel}: class {name}")


def _dict(rel: str, name: str) -> ast.Dict:
    node = _top_level(rel, name)
    if not isinstance(node, ast.Dict):
        raise Unsupported(f"{rel}: {name} is not a dict literal")
    return node


def _literal(node: ast.AST) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise Unsupported(ast.unparse(node)) from None


def _default(node: ast.AST | None) -> Any:
    if node is None:
        return _REQUIRED
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "field":
        kw = {k.arg: k.value for k in node.keywords}
        if "default" in kw:
            return _literal(kw["default"])
        factory = kw.get("default_factory")
        if isinstance(factory, ast.Name) and factory.id in ("list", "dict", "tuple", "set"):
            return {"list": list, "dict": dict, "tuple": tuple, "set": set}[factory.id]()
        if isinstance(factory, ast.Lambda) and not factory.args.args:
            return _literal(factory.body)
        raise Unsupported(ast.unparse(node))
    return _literal(node)


def _chain(rel: str, cls: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
    """The class and its bases from this package, the class first (single inheritance only)."""
    chain = [(rel, cls)]
    while True:
        r, c = chain[-1]
        bases = [b for b in c.bases if not (isinstance(b, ast.Name) and b.id == "object")]
        if not bases:
            return chain
        if len(bases) > 1 or not isinstance(bases[0], ast.Name):
            raise Unsupported(f"{c.name}: bases")
        chain.append(_class(r, bases[0].id))


def _fields(rel: str, cls: ast.ClassDef) -> tuple[Field, ...]:
    chain = _chain(rel, cls)
    if not all(any(ast.unparse(d) in ("dataclass", "dataclasses.dataclass") for d in c.decorator_list)
               for _, c in chain):
        raise Unsupported(f"{cls.name}: not a chain of plain @dataclass classes")
    order: dict[str, tuple[str, Any]] = {}
    docs: dict[str, str] = {}
    for _, c in reversed(chain):  # base first: dataclass field order; a subclass's default replaces its base's
        docs |= attribute_docs(ast.get_docstring(c) or "")
        for node in c.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                kind = ast.unparse(node.annotation)
                if kind.startswith(("ClassVar", "typing.ClassVar", "InitVar")):
                    continue
                order[node.target.id] = (kind, _default(node.value))
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in order for t in node.targets):
                raise Unsupported(f"{c.name}: a field redefined without annotation")
    return tuple(Field(name, kind, default, docs.get(name, "")) for name, (kind, default) in order.items())


@functools.cache
def static_methods() -> dict[str, Method]:
    """The built-in methods, read from the source (no torch import).

    Raises:
        Unsupported: the source holds something this reading does not handle.
    """
    rel = "methods/__init__.py"
    descriptions = {_literal(k): _literal(v) for k, v in zip(_dict(rel, "DESCRIPTIONS").keys,
                                                             _dict(rel, "DESCRIPTIONS").values)}
    out = {}
    table = _dict(rel, "METHODS")
    for key, value in zip(table.keys, table.values):
        name = _literal(key)
        if not isinstance(value, ast.Tuple) or len(value.elts) != 2 or not isinstance(value.elts[0], ast.Name):
            raise Unsupported(f"METHODS[{name!r}]")
        crel, cls = _class(rel, value.elts[0].id)
        description = descriptions.get(name) or _first_line(ast.get_docstring(cls))
        params = value.elts[1]
        if isinstance(params, ast.Constant) and params.value is None:
            out[name] = Method(description, None, ())
        elif isinstance(params, ast.Name):
            prel, pcls = _class(rel, params.id)
            out[name] = Method(description, pcls.name, _fields(prel, pcls))
        else:
            raise Unsupported(f"METHODS[{name!r}]")
    return out


@functools.cache
def static_streams() -> tuple[str, ...]:
    """The stream names of ``data/registry.py``, read from the source (no torch import)."""
    return tuple(_literal(k) for k in _dict("data/registry.py", "_BUILDERS").keys)


# --------------------------------------------------------------------------------------- imported


def imported(registry: dict[str, tuple[type, type | None]], descriptions: dict[str, str]) -> dict[str, Method]:
    """The same catalogue from the imported registry (``methods.available_methods()`` and ``DESCRIPTIONS``)."""
    out = {}
    for name, (cls, params_cls) in registry.items():
        description = descriptions.get(name) or _first_line(cls.__doc__)
        if params_cls is None:
            out[name] = Method(description, None, ())
            continue
        docs: dict[str, str] = {}
        for klass in reversed(params_cls.__mro__):  # inherited fields keep their base class's description
            docs |= attribute_docs(klass.__doc__ or "") if dataclasses.is_dataclass(klass) else {}
        fields = []
        for f in dataclasses.fields(params_cls):
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else _REQUIRED)
            fields.append(Field(f.name, _kind(f.type), default, docs.get(f.name, "")))
        out[name] = Method(description, params_cls.__name__, tuple(fields))
    return out


def entry_points_declared() -> bool:
    """Whether an installed package declares methods (entry-point group ``continual_blr.methods``)."""
    from importlib import metadata

    return bool(list(metadata.entry_points(group="continual_blr.methods")))
