"""Which code of ``continual_blr`` a run executed, and whether that code is still the same: the currency of records.

A run record (``records.py``) stores a **fingerprint**: ``{"<module path>::<qualified name>": <hash>}`` for every
function, class body and module body of the package that ran during the run, taken with a profiler hook
(:class:`ExecutedCode`) and hashed by :func:`source_hashes`. A record is current while every entry of its
fingerprint hashes the same in today's sources (:func:`changed_entries` is empty) and its config is unchanged.

What a hash covers. The hash of an entry is the SHA-256 of ``ast.dump`` of its syntax tree (no line numbers; printed as
Python 3.11 prints it on every version, :func:`canonical_dump`),
with docstrings removed: comments, blank lines, docstrings and moved code never change it; any change to what the
code does (a constant, an operator, a default, a decorator) does. Nested functions, lambdas and comprehensions
count as part of the function that holds them. A class body or module body is hashed with the bodies of the
functions it defines replaced by ``pass`` (their signatures, defaults and decorators stay: those run with the
body), so a change inside one method stales only the runs that executed that method. A non-Python source the
package builds at run time (``optim/native_update.c``, the BLR's native update) is an entry of its own,
``<path>::<file>``, whenever the module that builds it ran.

Limits, stated where they bite: the fingerprint knows the package's own code only (torch, numpy and the Python
version are in the record's ``versions``); a branch taken only on a GPU is in the fingerprint of a GPU run alone,
so a fingerprint taken on the CPU for a GPU record (``backfill``) may miss GPU-only functions.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import inspect
import sys
import threading
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

# Non-Python sources read at run time: (module that builds it, the file), relative to the package's parent.
BUILT_SOURCES: dict[str, str] = {"continual_blr/optim/native.py": "continual_blr/optim/native_update.c"}
MODULE = "<module>"


class ExecutedCode:
    """Context manager that collects the code objects of one package that run inside it.

    A ``sys.settrace`` / ``threading.settrace`` hook is called once per Python call (never per line: it returns no
    local tracer) and keeps the frame's code object in a set. On split digits that makes a fully traced run about
    1.45 × as costly in CPU time, so a run is traced where new code can first run, not in every epoch:
    :meth:`epoch_hook` keeps the hook on during the first and the last epoch of every task and everything between
    tasks (task ends, curvature, memory, kernels, evaluation), and off in the middle epochs, which repeat the
    first epoch's steps. What that misses: a function first reached in a middle epoch only (none in this library
    today: every step-count branch, e.g. ``curvature_every``, is reached within an epoch).
    ``benchmarks/perf/fingerprint_cost.py`` measures the cost and checks that the full and the epoch-gated
    fingerprints agree.

    Args:
        package_dir: the folder of the package whose code is collected (the one actually imported).
    """

    def __init__(self, package_dir: str | Path) -> None:
        self.package_dir = str(Path(package_dir).resolve())
        self.codes: set[CodeType] = set()
        self._previous: tuple[Any, Any] | None = None
        self._on = False

    def _hook(self, frame: FrameType, event: str, arg: Any) -> None:
        self.codes.add(frame.f_code)  # settrace's global hook sees only "call" events

    def resume(self) -> None:
        """Trace calls from now on (in this thread and threads started later)."""
        threading.settrace(self._hook)
        sys.settrace(self._hook)
        self._on = True

    def pause(self) -> None:
        """Stop tracing (frames already running were never traced line by line: nothing else to undo)."""
        sys.settrace(self._previous[0] if self._previous else None)
        threading.settrace(self._previous[1] if self._previous else None)
        self._on = False

    def epoch_hook(self, epochs: int):
        """An ``on_epoch(task_index, epoch, loss)`` hook (``run_config(on_epoch=...)``) that traces the first and
        the last of ``epochs`` epochs of each task and the time between tasks, and pauses in between."""

        def hook(task: int, epoch: int, loss: float) -> None:
            following = epoch + 1  # the epoch about to run; == epochs: the task ends next
            if 1 <= following < epochs - 1:
                if self._on:
                    self.pause()
            elif not self._on:
                self.resume()

        return hook

    def __enter__(self) -> "ExecutedCode":
        self._previous = (sys.gettrace(), threading.gettrace())
        self.resume()
        return self

    def __exit__(self, *exc: object) -> None:
        self.pause()

    def entries(self, definitions_only: bool = False) -> set[str]:
        """``"<path>::<qualified name>"`` of every package function, class body or module body that ran, the path
        relative to the package's parent folder (``continual_blr/loop.py``). ``definitions_only``: only module
        and class bodies (code that runs once per process, when a module is imported)."""
        root = Path(self.package_dir).parent
        out = set()
        for code in list(self.codes):  # a snapshot: other threads may still be traced
            if not code.co_filename.startswith(self.package_dir):
                continue
            if definitions_only and code.co_flags & inspect.CO_NEWLOCALS:
                continue  # a function's frame, not a module or class body
            rel = Path(code.co_filename).resolve().relative_to(root).as_posix()
            out.add(f"{rel}::{entry_name(code.co_qualname)}")
        for module, built in BUILT_SOURCES.items():
            if any(e.startswith(module + "::") for e in out):
                out.add(f"{built}::<file>")
        return out

    def fingerprint(self) -> dict[str, str]:
        """The entries that ran, each with the hash of its source today (:func:`source_hashes`)."""
        return source_hashes(self.entries(), Path(self.package_dir).parent)


def entry_name(qualname: str) -> str:
    """The entry a code object belongs to: ``f.<locals>.g`` and ``f.<locals>.<lambda>`` belong to ``f``; a lambda or
    comprehension at module level to ``<module>``."""
    head = qualname.split(".<locals>", 1)[0]
    return MODULE if head.startswith("<") else head


def _strip_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[1:] or [ast.Pass()]
    return body


class _NoDocstrings(ast.NodeTransformer):
    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            node.body = _strip_docstring(node.body)
        return node


class _Outline(ast.NodeTransformer):
    """A class or module body as it runs when defined: function bodies replaced by ``pass``."""

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        node = copy.copy(node)
        node.body = [ast.Pass()]
        return node

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        node = copy.copy(node)  # a class body is an entry of its own; its header (bases, decorators) stays here
        node.body = [ast.Pass()]
        return node


# Fields that later Pythons added to nodes that exist in 3.11, omitted while they hold their empty default, so that
# one source hashes alike under 3.11, 3.12 and 3.13 (3.12: ``type_params`` of functions and classes, PEP 695).
_LATER_FIELDS = frozenset({"type_params"})


def canonical_dump(node: Any, dialect: str = "3.11") -> str:
    """``ast.dump(node, annotate_fields=True, include_attributes=False)`` as Python 3.11 prints it, on any Python.

    ``ast.dump`` is not stable across versions: 3.12 prints ``type_params=[]`` on every function and class, and 3.13
    leaves out empty lists and ``None`` (``show_empty=False``). Records made on the lent GPU machine (Python 3.12)
    must hash like those made here (3.11), so this prints every field of ``node._fields`` except a ``None`` whose
    class default is ``None`` (3.11's own rule) and an empty field of ``_LATER_FIELDS``, and drops the empty string
    constants that 3.12.0-3.12.1 put into nested f-string format specs (3.11 never makes one).

    Args:
        node: a syntax tree (or a list of them, or a field's value).
        dialect: ``"3.11"`` (the canonical form every record made since holds) or ``"3.12"``: what ``ast.dump``
            printed on Python 3.12.2+ (``type_params=[]`` last on every function and class), the form of the
            fingerprints that lent-GPU records held before (:func:`translate_fingerprint` reads them).
    """
    if dialect not in DIALECTS:
        raise ValueError(f"dialect must be one of {DIALECTS}, not {dialect!r}")
    if isinstance(node, ast.AST):
        cls = type(node)
        args = []
        for name in node._fields:
            try:
                value = getattr(node, name)
            except AttributeError:
                continue
            if value is None and getattr(cls, name, ...) is None:
                continue
            if name in _LATER_FIELDS and value in (None, []):
                continue
            if isinstance(node, ast.JoinedStr) and name == "values":  # 3.12.0-1 add Constant('') to nested specs
                value = [v for v in value if not (isinstance(v, ast.Constant) and v.value == "")]
            args.append(f"{name}={canonical_dump(value, dialect)}")
        if dialect == "3.12" and isinstance(node, _TYPE_PARAM_NODES) and "type_params" not in node._fields:
            args.append("type_params=[]")
        return f"{cls.__name__}({', '.join(args)})"
    if isinstance(node, list):
        return f"[{', '.join(canonical_dump(x, dialect) for x in node)}]"
    return repr(node)


DIALECTS = ("3.11", "3.12")
_TYPE_PARAM_NODES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _digest(node: ast.AST, dialect: str = "3.11") -> str:
    return hashlib.sha256(canonical_dump(node, dialect).encode()).hexdigest()[:16]


_MODULE_CACHE: dict[tuple[str, int, int, str, str], dict[str, str]] = {}


def module_hashes(path: Path, rel: str, dialect: str = "3.11") -> dict[str, str]:
    """Every entry of one module (``<module>``, each class body, each function and method) with its hash (cached
    per file, size and modification time)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, rel, dialect)
    if key not in _MODULE_CACHE:
        _MODULE_CACHE[key] = _module_hashes(path, rel, dialect)
    return _MODULE_CACHE[key]


def _module_hashes(path: Path, rel: str, dialect: str = "3.11") -> dict[str, str]:
    tree = _NoDocstrings().visit(ast.parse(path.read_text(), filename=str(path)))
    out: dict[str, str] = {}

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[f"{rel}::{prefix}{node.name}"] = _digest(node, dialect)
            elif isinstance(node, ast.ClassDef):
                outline = copy.copy(node)
                outline.body = [_Outline().visit(copy.deepcopy(n)) for n in node.body]
                out[f"{rel}::{prefix}{node.name}"] = _digest(outline, dialect)
                walk(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.If, ast.Try)):  # definitions under `if TYPE_CHECKING:` / try-except imports
                for block in (getattr(node, "body", []), getattr(node, "orelse", []), getattr(node, "finalbody", []),
                              *[h.body for h in getattr(node, "handlers", [])]):
                    walk(block, prefix)

    walk(tree.body, "")
    outline = copy.copy(tree)
    outline.body = [_Outline().visit(copy.deepcopy(n)) for n in tree.body]
    out[f"{rel}::{MODULE}"] = _digest(outline, dialect)
    return out


def source_hashes(entries: set[str] | list[str], root: Path, dialect: str = "3.11") -> dict[str, str]:
    """The hash of each entry in the sources under ``root`` (the folder holding ``continual_blr/``); an entry whose
    module or definition no longer exists maps to ``"missing"`` (``dialect``: :func:`canonical_dump`)."""
    by_module: dict[str, dict[str, str]] = {}
    out = {}
    for entry in sorted(entries):
        rel, _, name = entry.partition("::")
        path = Path(root) / rel
        if name == "<file>":
            out[entry] = hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else "missing"
            continue
        if rel not in by_module:
            by_module[rel] = module_hashes(path, rel, dialect) if path.is_file() else {}
        out[entry] = by_module[rel].get(entry, "missing")
    return out


def changed_entries(fingerprint: dict[str, str], root: Path,
                    equivalent: dict[str, set[str]] | None = None) -> list[str]:
    """The entries of ``fingerprint`` whose code differs today under ``root``; ``equivalent`` maps an entry to
    old hashes declared to give today's numbers (``records.py``: checked side by side)."""
    now = source_hashes(set(fingerprint), root)
    equivalent = equivalent or {}
    return sorted(e for e, h in fingerprint.items() if now[e] != h and h not in equivalent.get(e, set()))


def record_dialect(record: dict[str, Any]) -> str:
    """The dialect a record's fingerprint was hashed in: ``"3.11"`` when it says so (``fingerprint_format``, every
    record made since :func:`canonical_dump`) or ran on Python 3.11; ``"3.12"`` for an older record made on 3.12 (the
    lent GPU machine)."""
    if record.get("fingerprint_format") == "3.11":
        return "3.11"
    python = str((record.get("versions") or {}).get("python", "3.11"))
    return "3.12" if python.startswith("3.12.") else "3.11"


def translate_fingerprint(fingerprint: dict[str, str], source_root: Path,
                          dialect: str) -> tuple[dict[str, str], list[str]]:
    """A fingerprint hashed in ``dialect`` rewritten in the canonical one, entry by entry, where it can be checked.

    ``source_root`` holds the sources the record ran (a checkout of its commit). An entry is translated only where
    its stored hash equals the ``dialect`` hash of that source: then the canonical hash of the same source replaces
    it. Every other entry keeps its stored hash and is returned in the second list (it stays stale).
    """
    then = source_hashes(set(fingerprint), source_root, dialect)
    canonical = source_hashes(set(fingerprint), source_root)
    out, unverified = {}, []
    for entry, h in fingerprint.items():
        if then[entry] == h != "missing":
            out[entry] = canonical[entry]
        else:
            out[entry] = h
            unverified.append(entry)
    return out, sorted(unverified)
