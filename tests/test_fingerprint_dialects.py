"""Fingerprints hash alike on every Python (benchmarks/fingerprint.py: canonical_dump, translate_fingerprint).

Records made on the lent GPU machine (Python 3.12) held hashes of 3.12's ``ast.dump``, which prints
``type_params=[]`` on every function and class: all of them read as stale here (3.11). The oracles below are
``ast.dump`` itself, printed once by Python 3.11.7 and 3.12.1 for ``SRC`` (no nested format spec, where 3.12.1
differs from later 3.12 releases). Planted: the ``type_params`` skip removed fails
``test_a_312_node_hashes_like_its_311_twin``; the 3.12 dialect's ``type_params=[]`` removed fails
``test_the_312_dialect_is_312s_ast_dump``; the translation's check removed fails
``test_translation_rewrites_only_entries_it_checks``."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import fingerprint  # noqa: E402

SRC = '''
@dec(1)
def f(x: int = 1, *a, k=None) -> int:
    class C(Base, metaclass=M):
        y = 2
    return f"{x!r:>8}" + g(x, k=k)
'''
# ast.dump(tree.body[0], annotate_fields=True, include_attributes=False) under Python 3.11.7 and 3.12.1:
DUMP_311 = ("FunctionDef(name='f', args=arguments(posonlyargs=[], args=[arg(arg='x', annotation=Name(id='int', ctx=Load()))], vararg=arg(arg='a'), kwonlyargs=[arg(arg='k')], kw_defaults=[Constant(value=None)], defaults=[Constant(value=1)]), body=[ClassDef(name='C', bases=[Name(id='Base', ctx=Load())], keywords=[keyword(arg='metaclass', value=Name(id='M', ctx=Load()))], body=[Assign(targets=[Name(id='y', ctx=Store())], value=Constant(value=2))], decorator_list=[]), Return(value=BinOp(left=JoinedStr(values=[FormattedValue(value=Name(id='x', ctx=Load()), conversion=114, format_spec=JoinedStr(values=[Constant(value='>8')]))]), op=Add(), right=Call(func=Name(id='g', ctx=Load()), args=[Name(id='x', ctx=Load())], keywords=[keyword(arg='k', value=Name(id='k', ctx=Load()))])))], decorator_list=[Call(func=Name(id='dec', ctx=Load()), args=[Constant(value=1)], keywords=[])], returns=Name(id='int', ctx=Load()))")
DUMP_312 = ("FunctionDef(name='f', args=arguments(posonlyargs=[], args=[arg(arg='x', annotation=Name(id='int', ctx=Load()))], vararg=arg(arg='a'), kwonlyargs=[arg(arg='k')], kw_defaults=[Constant(value=None)], defaults=[Constant(value=1)]), body=[ClassDef(name='C', bases=[Name(id='Base', ctx=Load())], keywords=[keyword(arg='metaclass', value=Name(id='M', ctx=Load()))], body=[Assign(targets=[Name(id='y', ctx=Store())], value=Constant(value=2))], decorator_list=[], type_params=[]), Return(value=BinOp(left=JoinedStr(values=[FormattedValue(value=Name(id='x', ctx=Load()), conversion=114, format_spec=JoinedStr(values=[Constant(value='>8')]))]), op=Add(), right=Call(func=Name(id='g', ctx=Load()), args=[Name(id='x', ctx=Load())], keywords=[keyword(arg='k', value=Name(id='k', ctx=Load()))])))], decorator_list=[Call(func=Name(id='dec', ctx=Load()), args=[Constant(value=1)], keywords=[])], returns=Name(id='int', ctx=Load()), type_params=[])")


def _node() -> ast.AST:
    return ast.parse(SRC).body[0]


def test_the_canonical_form_is_311s_ast_dump():
    assert fingerprint.canonical_dump(_node()) == DUMP_311


def test_the_312_dialect_is_312s_ast_dump():
    assert fingerprint.canonical_dump(_node(), "3.12") == DUMP_312


def test_an_unknown_dialect_is_refused():
    with pytest.raises(ValueError, match="dialect must be one of"):
        fingerprint.canonical_dump(_node(), "3.14")


def test_a_312_node_hashes_like_its_311_twin():
    """A node built as 3.12 builds it (``type_params`` among its fields) prints as 3.11's."""
    twin = type("FunctionDef", (ast.AST,), {"_fields": ast.FunctionDef._fields + ("type_params",),
                                            "returns": None, "type_comment": None})  # 3.12's optional fields
    node = _node()
    kwargs = {name: getattr(node, name) for name in ast.FunctionDef._fields}
    fake = twin(**kwargs, type_params=[])
    assert fingerprint.canonical_dump(fake) == fingerprint.canonical_dump(node) == DUMP_311


def test_on_this_python_the_package_hashes_as_ast_dump_prints_it():
    if sys.version_info[:2] != (3, 11):
        pytest.skip("the canonical form is 3.11's ast.dump; another Python prints it otherwise")
    for path in sorted((ROOT / "continual_blr").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                assert fingerprint.canonical_dump(node) == ast.dump(node, annotate_fields=True,
                                                                    include_attributes=False), path


def test_translation_rewrites_only_entries_it_checks(tmp_path):
    pkg = tmp_path / "continual_blr"
    pkg.mkdir()
    (pkg / "m.py").write_text(SRC + "\n\ndef h():\n    return 3\n")
    old = fingerprint.source_hashes({"continual_blr/m.py::f", "continual_blr/m.py::h"}, tmp_path, "3.12")
    canonical = fingerprint.source_hashes(set(old), tmp_path)
    assert old["continual_blr/m.py::f"] != canonical["continual_blr/m.py::f"]
    stored = dict(old, **{"continual_blr/m.py::h": "0123456789abcdef"})  # h: a hash that does not check
    new, unverified = fingerprint.translate_fingerprint(stored, tmp_path, "3.12")
    assert new["continual_blr/m.py::f"] == canonical["continual_blr/m.py::f"]
    assert new["continual_blr/m.py::h"] == "0123456789abcdef" and unverified == ["continual_blr/m.py::h"]


def test_record_dialect():
    assert fingerprint.record_dialect({"versions": {"python": "3.12.3"}}) == "3.12"
    assert fingerprint.record_dialect({"versions": {"python": "3.12.3"}, "fingerprint_format": "3.11"}) == "3.11"
    assert fingerprint.record_dialect({"versions": {"python": "3.11.7"}}) == "3.11"


def _import_records_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("import_records", ROOT / "benchmarks" / "device" / "import_records.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_import_records_translates_a_312_record_and_refuses_a_dirty_one(tmp_path):
    """benchmarks/device/import_records.py: a job folder as gpu_runs.sh leaves it. The 3.12 hashes are taken from
    the sources of HEAD (``git archive``), the commit the record names, so the check has something to pass."""
    import json
    import subprocess

    ir = _import_records_module()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    commit = head.stdout.strip()
    src = ir.checkout(commit, tmp_path / "src")
    entry = "continual_blr/types.py::params_of"
    old = fingerprint.source_hashes({entry}, src, "3.12")
    job = tmp_path / "in" / "split_x-none-0" / "split_x" / "task" / "full_validation0.1"
    job.mkdir(parents=True)
    base = {"avg_acc": 0.5, "versions": {"python": "3.12.3"}, "fingerprint": old}
    (job / "none_seed0.json").write_text(json.dumps(base | {"commit": commit, "dirty": False}))
    (job / "ewc_seed0.json").write_text(json.dumps(base | {"commit": commit, "dirty": True}))
    (job.parents[2] / "results").mkdir()
    (job.parents[2] / "results" / "table_seed0.json").write_text("{}")  # a table of the job's own: left out
    lines = ir.import_records(tmp_path / "in", tmp_path / "records")
    assert any("ewc_seed0.json: refused" in line for line in lines)
    out = json.loads((tmp_path / "records" / "split_x" / "task" / "full_validation0.1" / "none_seed0.json").read_text())
    assert out["fingerprint"] == fingerprint.source_hashes({entry}, src)
    assert out["fingerprint"] != old and out["fingerprint_format"] == "3.11"
    assert out["fingerprint_translated"] == {"from": "3.12", "commit": commit, "unverified": []}
    assert not (tmp_path / "records" / "split_x" / "task" / "full_validation0.1" / "ewc_seed0.json").exists()
    assert not list((tmp_path / "records").rglob("table_seed0.json"))

    # importing again: the record already there is an earlier evaluation, kept in superseded/, never overwritten;
    # a second job writing the same target in one import is refused
    twin = tmp_path / "in" / "split_x-none-0b" / "split_x" / "task" / "full_validation0.1"
    twin.mkdir(parents=True)
    (twin / "none_seed0.json").write_text(json.dumps(base | {"commit": commit, "dirty": False, "avg_acc": 0.6}))
    lines = ir.import_records(tmp_path / "in", tmp_path / "records")
    assert sum("refused, a record for" in line for line in lines) == 1
    kept = list((tmp_path / "records").rglob("superseded/none_seed0@*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["avg_acc"] == 0.5
