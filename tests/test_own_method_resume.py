"""A method of your own that carries state across tasks (issue 42, item 2): without ``state_dict`` /
``load_state_dict`` its resume is refused in one line naming the attribute (a resumed run would silently lose the
state and diverge); with them, an interrupted and resumed run equals the uninterrupted one.

Planted once (the refusal in ``runner.run_config`` removed): the resume of ``AnchorMethod`` ran and exited 0, a run
whose task-3 training had lost the anchor it needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

import continual_blr.loop as loop
from continual_blr.cli import main
from continual_blr.methods import METHODS, Method

TINY = ("stream: {name: synthetic, options: {n_tasks: 3, n_train: 40, n_features: 6}}\nmodel: {hidden: [8]}\n"
        "train: {epochs: 1, batch_size: 20}\nprogress: false\n")


@dataclass
class AnchorParams:
    """Attributes:
        strength: c of c · ‖θ − θ_prev‖² (θ_prev: the weights at the end of the previous task)."""

    strength: float = 50.0


class AnchorMethod(Method):
    """Adam on the mean loss + c‖θ − θ_prev‖², θ_prev kept in ``self.anchor`` (state across tasks)."""

    def __init__(self, params=None, seed=0):
        super().__init__(seed)
        self.params = params or AnchorParams()
        self.anchor: dict[str, torch.Tensor] | None = None

    def loss(self, model, batch, task):
        loss = super().loss(model, batch, task)
        if self.anchor is not None:
            loss = loss + self.params.strength * sum(((p - self.anchor[k]) ** 2).sum()
                                                     for k, p in model.named_parameters())
        return loss

    def on_task_end(self, model, task, optimizer=None):
        super().on_task_end(model, task, optimizer)
        self.anchor = {k: p.detach().clone() for k, p in model.named_parameters()}


class SavedAnchorMethod(AnchorMethod):
    """The same, with its carried state in ``state_dict`` (``docs/own_method.md``)."""

    def state_dict(self):
        return super().state_dict() | {"anchor": self.anchor}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.anchor = state["anchor"]


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(METHODS, "anchor", (AnchorMethod, AnchorParams))
    monkeypatch.setitem(METHODS, "saved-anchor", (SavedAnchorMethod, AnchorParams))
    torch.set_num_threads(1)


def _interrupt_at_step(monkeypatch, calls: int) -> None:
    original, count = loop.train_step, {"n": 0}

    def wrapped(*args, **kwargs):
        count["n"] += 1
        if count["n"] == calls:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", wrapped)


def _acc(folder):
    return json.loads((folder / "results.json").read_text())["results"][0]["acc_matrix"]


def _interrupted(tmp_path, monkeypatch, method: str):
    (tmp_path / "c.yaml").write_text(TINY + f"methods: [{method}]\n")
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        _interrupt_at_step(patch, 2 * 2 + 1)  # 2 steps a task: the 1st step of task 3, after 2 checkpoints
        with pytest.warns(RuntimeWarning, match="anchor") if method == "anchor" else _no_warning():
            assert main(["run", str(tmp_path / "c.yaml"), "--out", str(out)]) == 130
    return out


class _no_warning:
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("error", RuntimeWarning)

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


def test_resume_of_a_method_with_unsaved_state_is_refused_in_one_line(registered, tmp_path, monkeypatch, capsys):
    out = _interrupted(tmp_path, monkeypatch, "anchor")
    capsys.readouterr()
    before = (out / "results.json").read_text()
    assert main(["run", "--resume", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "method 'anchor' carries state its state_dict does not save (anchor)" in err
    assert "docs/own_method.md" in err
    assert (out / "results.json").read_text() == before  # nothing was written


def test_a_method_that_saves_its_state_resumes_exactly(registered, tmp_path, monkeypatch):
    (tmp_path / "ref").mkdir()
    (tmp_path / "ref" / "c.yaml").write_text(TINY + "methods: [saved-anchor]\n")
    assert main(["run", str(tmp_path / "ref" / "c.yaml"), "--out", str(tmp_path / "ref" / "run")]) == 0
    out = _interrupted(tmp_path, monkeypatch, "saved-anchor")
    assert main(["run", "--resume", str(out)]) == 0
    assert _acc(out) == _acc(tmp_path / "ref" / "run")


def test_task_boundaries_of_a_method_with_unsaved_state_are_refused(registered, tmp_path, capsys):
    """Rebuilding a boundary of ``AnchorMethod`` (its anchor not in its state_dict) would give a method without the
    anchor the run trained with: ``inspect --validate`` refuses in one line, a plain report skips the forgetting
    analysis with that line as its note."""
    from continual_blr.saved_run import UnsavedStateError, load_boundary, load_run

    (tmp_path / "c.yaml").write_text(TINY + "methods: [anchor]\n")
    out = tmp_path / "run"
    with pytest.warns(RuntimeWarning, match="cannot be resumed"):
        assert main(["run", str(tmp_path / "c.yaml"), "--out", str(out)]) == 0
    run = load_run(out, "anchor", data=True)
    with pytest.raises(UnsavedStateError, match=r"carries state its state_dict does not save \(anchor\)"):
        load_boundary(run, 0)
    capsys.readouterr()
    assert main(["inspect", str(out), "--validate", "2", "--no-progress", "--out", str(tmp_path / "v")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not save (anchor)" in err, err
    assert main(["inspect", str(out), "--no-progress", "--out", str(tmp_path / "r")]) == 0
    assert "does not save (anchor)" in (tmp_path / "r" / "index.html").read_text()
