"""Run-record currency from the code a run executed (benchmarks/records.py, fingerprint.py, side_by_side.py).

Each test plants one change in a copy of the library and checks the verdict; each planted change was also watched
to flip the verdict it targets (see the commit message). The side-by-side tests run the probe in subprocesses on two
library copies on this machine (about 4 s per probe)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))
import fingerprint  # noqa: E402
import records as run_records  # noqa: E402

CONFIG = """stream: {name: split_digits, scenario: task}
model: {arch: mlp, hidden: [16]}
train: {epochs: 2, batch_size: 64, lr: 0.01}
methods:
  - name: %s
    params: %s
"""
METHODS = {"ewc": "{lam: 10.0}", "none": "{}"}
EWC_LAM = "scale=p.lam, divide_by_n=False"  # the line of methods/ewc.py that hands λ to the Gaussian prior
PROBE = ["--train", "96", "--test", "64", "--epochs", "2"]


def _side_by_side():
    spec = importlib.util.spec_from_file_location("side_by_side", BENCH / "side_by_side.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _library_copy(dest: Path) -> Path:
    shutil.copytree(ROOT / "continual_blr", dest / "continual_blr",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (dest / "configs" / "t").mkdir(parents=True)
    for name, params in METHODS.items():
        (dest / "configs" / "t" / f"{name}.yaml").write_text(CONFIG % (name, params))
    return dest


def _edit(root: Path, rel: str, old: str, new: str) -> None:
    path = root / rel
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} not found once in {rel}"
    path.write_text(text.replace(old, new))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A library copy and one record per method, fingerprinted from a real (tiny) run of that method."""
    import continual_blr
    from continual_blr.config import RunConfig, from_dict, yaml_load
    from continual_blr.runner import run_config

    root = _library_copy(tmp_path_factory.mktemp("old"))
    recs = {}
    for name in METHODS:
        file = f"configs/t/{name}.yaml"
        cfg = from_dict(RunConfig, yaml_load((root / file).read_text()))
        cfg.progress = False
        with fingerprint.ExecutedCode(Path(continual_blr.__file__).parent) as ex:
            result = run_config(cfg, save=False, on_epoch=ex.epoch_hook(cfg.train.epochs))[0]
        recs[name] = result.to_dict() | {"config": dataclasses.asdict(cfg), "config_file": file, "method_name": name,
                                         "fingerprint": fingerprint.source_hashes(ex.entries(), root)}
    return root, recs


def _current(rec, root):
    return run_records.currency(rec, None, Path("/nonexistent"), root)


def test_fingerprint_names_the_code_each_method_ran(made):
    root, recs = made
    assert any("methods/ewc.py::EWCMethod.__init__" in e for e in recs["ewc"]["fingerprint"])
    assert not any("methods/ewc.py" in e for e in recs["none"]["fingerprint"])
    assert all(h != "missing" for r in recs.values() for h in r["fingerprint"].values())
    assert all(_current(r, root) == (True, "") for r in recs.values())


def test_comments_docstrings_and_unexecuted_code_stale_nothing(made, tmp_path):
    _, recs = made
    root = _library_copy(tmp_path)
    _edit(root, "continual_blr/methods/ewc.py", "class EWCMethod(Method):",
          "# a comment that changes no number\nclass EWCMethod(Method):")
    _edit(root, "continual_blr/methods/ewc.py", '"""EWC: Adam on the mean loss', '"""EWC (reworded): Adam on the mean loss')
    # a function no run executes: its body changes
    _edit(root, "continual_blr/plots.py", "def plot_average_accuracy(", "def _never_called():\n    return 1\n\n\ndef plot_average_accuracy(")
    assert not any("plots.py" in e for r in recs.values() for e in r["fingerprint"])
    for rec in recs.values():
        assert _current(rec, root) == (True, "")


def test_a_two_to_the_minus_twenty_change_to_ewc_lambda_stales_only_ewc(made, tmp_path):
    _, recs = made
    root = _library_copy(tmp_path)
    _edit(root, "continual_blr/methods/ewc.py", EWC_LAM, "scale=p.lam * (1 + 2 ** -20), divide_by_n=False")
    ok, why = _current(recs["ewc"], root)
    assert not ok and "methods/ewc.py::EWCMethod.__init__" in why
    assert _current(recs["none"], root) == (True, "")


def test_a_config_change_stales_that_configs_rows(made, tmp_path):
    _, recs = made
    root = _library_copy(tmp_path)
    _edit(root, "configs/t/ewc.yaml", "epochs: 2", "epochs: 1")
    ok, why = _current(recs["ewc"], root)
    assert not ok and why == "config changed: train.epochs"
    assert _current(recs["none"], root) == (True, "")


def test_a_field_the_library_added_since_is_no_config_change(made):
    root, recs = made
    rec = json.loads(json.dumps(recs["none"]))
    del rec["config"]["train"]["grad_clip"]  # as if the record predates the field: the file does not set it
    assert run_records.config_changes(rec, root) == []


def test_a_compiled_run_compares_as_its_config(made):
    """``train.compile`` says how the steps ran (reproduce.py --compile), like the device: not a config change;
    planted (the field compared): this fails. Any other train field still is one."""
    root, recs = made
    rec = json.loads(json.dumps(recs["none"]))
    rec["config"]["train"]["compile"] = "reduce-overhead"
    assert run_records.config_changes(rec, root) == []
    rec["config"]["train"]["lr"] = 0.5
    assert run_records.config_changes(rec, root) == ["train.lr"]


def _record_file(records_dir: Path, rec: dict) -> Path:
    path = records_dir / "t" / "task" / "full" / f"{rec['method_name']}_seed0.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec))
    return path


@pytest.mark.parametrize("planted", [False, True])
def test_side_by_side_carries_a_refactor_over_and_refuses_a_numerical_change(made, tmp_path, planted):
    """Moving EWC's λ into a helper is declared equivalent (old and new libraries probed here, two kernel paths);
    the same move with λ·(1 + 2⁻²⁰) is refused."""
    old_root, recs = made
    new_root = _library_copy(tmp_path / "new")
    factor = " * (1 + 2 ** -20)" if planted else ""
    _edit(new_root, "continual_blr/methods/ewc.py", EWC_LAM, "scale=_strength(p), divide_by_n=False")
    _edit(new_root, "continual_blr/methods/ewc.py", "class EWCMethod(Method):",
          f"def _strength(p):\n    return p.lam{factor}\n\n\nclass EWCMethod(Method):")
    records_dir = tmp_path / "records"
    path = _record_file(records_dir, recs["ewc"])
    sbs = _side_by_side()
    verdict = sbs.check_row(records_dir, "t/task/full", "ewc", [path], tmp_path, new_root=new_root,
                            old_root=old_root, extra=PROBE)
    rec = json.loads(path.read_text())
    if planted:
        assert verdict.startswith("stale (probe numbers differ)"), verdict
        assert not (records_dir / run_records.EQUIVALENT_CODE).exists()
        assert not run_records.currency(rec, "t/task/full", records_dir, new_root)[0]
    else:
        assert verdict.startswith("carried over"), verdict
        assert run_records.currency(rec, "t/task/full", records_dir, new_root) == (True, "")
        assert "continual_blr/methods/ewc.py::_strength" in rec["fingerprint"]  # moved code now counts


def test_side_by_side_refuses_when_the_probe_does_not_reach_the_changed_code(made, tmp_path):
    """A record whose run executed a function the probe never reaches: a change there cannot be checked by the
    probe, so the row stays stale even though the probes agree."""
    old_root, recs = made
    rec = json.loads(json.dumps(recs["none"]))
    entry = "continual_blr/plots.py::plot_average_accuracy"
    rec["fingerprint"][entry] = fingerprint.source_hashes({entry}, old_root)[entry]
    new_root = _library_copy(tmp_path / "new")
    _edit(new_root, "continual_blr/plots.py", 'ax.set_xlabel("tasks trained")', 'ax.set_xlabel("tasks trained so far")')
    records_dir = tmp_path / "records"
    path = _record_file(records_dir, rec)
    verdict = _side_by_side().check_row(records_dir, "t/task/full", "none", [path], tmp_path, new_root=new_root,
                                        old_root=old_root, extra=PROBE)
    assert verdict == f"stale (the probe does not execute {entry}): rerun the row"


@pytest.mark.parametrize("device", ["AMD EPYC 7B13", "NVIDIA H200"])
def test_a_precision_policy_change_stales_a_gpu_record_without_a_probe(made, tmp_path, device):
    """A change to the precision policy (here: TF32 switched off inside full_precision) leaves every CPU number
    bit-identical, so a CPU probe would carry a GPU record over; a GPU record is refused, a CPU one is probed."""
    old_root, recs = made
    rec = json.loads(json.dumps(recs["ewc"])) | {"device": device}
    assert "continual_blr/mixed_precision.py::full_precision" in rec["fingerprint"]
    new_root = _library_copy(tmp_path / "new")
    _edit(new_root, "continual_blr/mixed_precision.py", "        if not autocast_active()",
          "        if not autocast_active() and 1 + 1 == 2")
    records_dir = tmp_path / "records"
    path = _record_file(records_dir, rec)
    verdict = _side_by_side().check_row(records_dir, "t/task/full", "ewc", [path], tmp_path, new_root=new_root,
                                        old_root=old_root, extra=PROBE)
    if device.startswith("NVIDIA"):
        assert verdict.startswith("stale: made on a GPU and continual_blr/mixed_precision.py::full_precision"), verdict
    else:
        assert verdict.startswith("carried over"), verdict


def test_the_epoch_gated_trace_sees_what_a_full_trace_sees(tmp_path):
    """fingerprint.ExecutedCode.epoch_hook's claim: tracing the first and last epoch of each task (and between tasks)
    collects the same entries as tracing every epoch (4 epochs per task here, so two middle epochs go untraced).
    Planted once: a hook that pauses after the first epoch and never resumes misses the task-end code and fails."""
    import continual_blr
    from continual_blr.config import RunConfig, from_dict, yaml_load
    from continual_blr.runner import run_config

    got = {}
    for gated in (False, True):
        cfg = from_dict(RunConfig, yaml_load((CONFIG % ("ewc", "{lam: 10.0}")).replace("epochs: 2", "epochs: 4")))
        cfg.progress = False
        with fingerprint.ExecutedCode(Path(continual_blr.__file__).parent) as ex:
            run_config(cfg, save=False, on_epoch=ex.epoch_hook(4) if gated else None)
        got[gated] = ex.entries()
    assert got[True] == got[False] and len(got[True]) > 50


def test_side_by_side_refuses_a_missing_dataset_before_any_probe(made, tmp_path, monkeypatch):
    """A stale split-MNIST row with no MNIST under the data root: ``main`` stops in one line naming the record and
    ``--data-dir`` before the first probe (which used to end a carry-over minutes in, with a traceback); a
    split-digits row (embedded data) passes the same check."""
    _, recs = made
    empty = tmp_path / "no_data"
    empty.mkdir()
    rec = json.loads(json.dumps(recs["none"]))
    rec["config"]["stream"] |= {"name": "split_mnist", "data_dir": str(empty), "options": {"download": False}}
    records_dir = tmp_path / "records"
    path = _record_file(records_dir, rec)
    sbs = _side_by_side()
    sbs.check_data([_record_file(tmp_path / "digits", recs["ewc"])], None)  # embedded data: no exit
    monkeypatch.setattr(sbs, "stale_row", lambda *a, **k: ("", rec, ["continual_blr/loop.py::x"], tmp_path))

    def probed(*a, **k):
        raise AssertionError("a probe ran before the data check")

    monkeypatch.setattr(sbs, "compare", probed)
    monkeypatch.delenv("CONTINUAL_BLR_DATA", raising=False)
    with pytest.raises(SystemExit) as err:
        sbs.main(["--records-dir", str(records_dir), "--worktrees", str(tmp_path / "wt")])
    msg = str(err.value)
    assert "\n" not in msg and path.name in msg and "split_mnist" in msg and "--data-dir" in msg, msg
    assert str(empty) in msg, msg
