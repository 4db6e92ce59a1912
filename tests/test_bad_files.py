"""Bad files and bad places to write, for ``run``, ``predict`` and ``inspect``: one line on stderr naming the file or
the option, exit 2, no traceback, and nothing written or left behind (issue 24, item 3).

One table: (id, how to damage a copy of a small finished run, the argv, words the line must hold, paths that must
not exist afterwards).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from continual_blr.cli import main
from tiny_runs import tiny_run


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("bad_files")) / "run"


def _unfinished(run: Path, checkpoint: bytes | None) -> None:
    """Make the run look interrupted in its last task (no model.pt), its checkpoint replaced by ``checkpoint``."""
    (run / "none" / "model.pt").unlink()
    if checkpoint is not None:
        (run / "none" / "checkpoint.pt").write_bytes(checkpoint)


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _refit(run: Path) -> None:
    """The run's config asks for another network than its weights (hidden 8 → 16)."""
    payload = json.loads((run / "results.json").read_text())
    payload["config"]["model"]["hidden"] = [16]
    (run / "results.json").write_text(json.dumps(payload))


def _inputs(t: Path, kind: str) -> str:
    if kind == "npz":
        np.savez(t / "x.npz", x=np.zeros((2, 6), np.float32))
        return str(t / "x.npz")
    x = np.zeros((2, 6), np.float32)
    x[0, 0] = np.nan
    np.save(t / "x.npy", x)
    return str(t / "x.npy")


# (id, damage(run), argv(run, tmp), words in the line, paths (relative to tmp) that must not exist afterwards)
CASES = [
    ("resume: empty checkpoint", lambda r: _unfinished(r, b""), lambda r, t: ["run", "--resume", str(r)],
     ["checkpoint.pt", "cannot be read", "0 bytes"], []),
    ("resume: random bytes as checkpoint", lambda r: _unfinished(r, bytes(range(256)) * 8),
     lambda r, t: ["run", "--resume", str(r)], ["checkpoint.pt", "cannot be read"], []),
    ("resume: truncated checkpoint", lambda r: (_truncate(r / "none" / "checkpoint.pt"), _unfinished(r, None)),
     lambda r, t: ["run", "--resume", str(r)], ["checkpoint.pt", "cannot be read"], []),
    ("resume: truncated results.json", lambda r: _truncate(r / "results.json", 0.3),
     lambda r, t: ["run", "--resume", str(r)], ["results.json", "not valid JSON", "line"], []),
    ("run: --out names a file", lambda r: (r.parent / "afile").write_text("x"),
     lambda r, t: ["run", "--epochs", "1", "--out", str(r.parent / "afile")], ["--out", "is a file"], []),
    ("run: --out cannot be written", lambda r: None,
     lambda r, t: ["run", "--epochs", "1", "--out", "/proc/continual-blr-run"], ["--out", "cannot write"], []),
    ("predict: --inputs is a .npz", lambda r: None,
     lambda r, t: ["predict", str(r), "--inputs", _inputs(t, "npz"), "--head", "0"], ["--inputs", ".npz", "numpy.save"],
     []),
    ("predict: NaN inputs", lambda r: None,
     lambda r, t: ["predict", str(r), "--inputs", _inputs(t, "nan"), "--head", "0"], ["--inputs", "NaN", "finite"], []),
    ("predict: --out cannot be written", lambda r: None,
     lambda r, t: ["predict", str(r), "--inputs", _inputs(t, "npz").replace("x.npz", "ok.npy"), "--head", "0",
                   "--out", "/proc/continual-blr/p.csv"], ["--out", "cannot write"], []),
    ("predict: weights that do not fit the config", _refit,
     lambda r, t: ["predict", str(r), "--inputs", _inputs(t, "npz").replace("x.npz", "ok.npy"), "--head", "0"],
     ["model.pt", "do not fit", "size mismatch"], []),
    ("predict: truncated results.json", lambda r: _truncate(r / "results.json", 0.3),
     lambda r, t: ["predict", str(r), "--inputs", _inputs(t, "npz").replace("x.npz", "ok.npy"), "--head", "0"],
     ["results.json", "not valid JSON"], []),
    ("inspect: --out cannot be written", lambda r: None,
     lambda r, t: ["inspect", str(r), "--out", "/proc/continual-blr-report", "--no-progress"], ["--out", "cannot write"],
     []),
    ("inspect: --out names a file", lambda r: (r.parent / "afile").write_text("x"),
     lambda r, t: ["inspect", str(r), "--out", str(r.parent / "afile"), "--no-progress"], ["--out", "is a file"], []),
]


@pytest.mark.parametrize("damage, argv, needles, absent", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_file_is_one_line_and_exit_2(finished_run, tmp_path, capsys, monkeypatch, damage, argv, needles, absent):
    monkeypatch.chdir(tmp_path)  # a run that wrongly started would write under tmp_path/runs
    run = tmp_path / "work" / "run"
    shutil.copytree(finished_run, run)
    np.save(tmp_path / "ok.npy", np.zeros((2, 6), np.float32))
    damage(run)
    args = argv(run, tmp_path)  # writes the inputs a case needs
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc == 2, (rc, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err and err.startswith("continual-blr"), err
    for n in needles:
        assert n in err, err
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert after == before, set(after) ^ set(before)  # nothing written, nothing left behind
    assert not Path("/proc/continual-blr-run").exists() and not Path("/proc/continual-blr-report").exists()
