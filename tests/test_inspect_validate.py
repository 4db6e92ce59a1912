"""``inspect --validate``: the leave-one-out estimates checked against retraining (continual_blr/inspect/validate.py).

Oracles:
* the leverage-corrected shift V (I − ΛV)⁻¹ e against J Σ_∖i Jᵀ e with Σ_∖i = (Σ⁻¹ − JᵀΛJ)⁻¹ formed densely in
  float64 (the Woodbury identity the module's docstring states), tolerance EXACT;
* Spearman / Pearson against ``scipy.stats`` (independent implementations, ties included), tolerance EXACT;
* the true deviation against a retraining written out by hand: full-batch Adam on the task without the example, from
  the same warm start, with nothing shared with ``fit_task`` but the network's class (tolerance TRAIN: float32
  training of a few steps in a different order of operations);
* the minibatches of a leave-out retraining against those of the full task: all equal but the one that held i.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from torch import nn

from continual_blr import loop
from continual_blr.cli import main
from continual_blr.data.stream import Task
from continual_blr.inspect.validate import leverage_shift, pearson, pick_examples, spearman

EXACT = dict(rtol=1e-10, atol=1e-12)
TRAIN = dict(rtol=1e-4, atol=1e-6)

CONFIG = """\
stream: {name: synthetic, options: {n_tasks: 2, n_train: 30}}
model: {arch: linear}
train: {epochs: 3, batch_size: 64, lr: 0.05}
seed: 1
methods:
  - {name: none}
"""


def test_leverage_shift_is_the_shift_under_the_posterior_without_the_example():
    g = torch.Generator().manual_seed(0)
    n, k, p = 5, 3, 7
    a = torch.randn(p, p, generator=g, dtype=torch.float64)
    prec = a @ a.T + 3 * torch.eye(p, dtype=torch.float64)  # Σ⁻¹
    sigma = torch.linalg.inv(prec)
    for i in range(n):
        jac = torch.randn(k, p, generator=g, dtype=torch.float64) * 0.5
        probs = torch.softmax(torch.randn(k, generator=g, dtype=torch.float64), -1)
        e = probs - torch.nn.functional.one_hot(torch.tensor(i % k), k).double()
        lam = torch.diag(probs) - torch.outer(probs, probs)
        sigma_wo = torch.linalg.inv(prec - jac.T @ lam @ jac)
        expected = jac @ sigma_wo @ jac.T @ e
        got = leverage_shift(e[None], (jac @ sigma @ jac.T)[None], probs[None])[0]
        torch.testing.assert_close(got, expected, **EXACT)


def test_correlations_equal_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 6, (50,), generator=g).double()  # many ties
    b = a + torch.randn(50, generator=g, dtype=torch.float64)
    b[::7] = 0.0
    assert spearman(a, b) == pytest.approx(stats.spearmanr(a.numpy(), b.numpy()).statistic, rel=1e-10)
    assert pearson(a, b) == pytest.approx(stats.pearsonr(a.numpy(), b.numpy()).statistic, rel=1e-10)


def test_picked_examples_cover_the_whole_score_range():
    score = torch.arange(100.0).flip(0)  # row r has score 99 − r
    rows = pick_examples(score, 10, torch.Generator().manual_seed(0))
    strata = sorted(int(score[r]) // 10 for r in rows)
    assert strata == list(range(10))  # one example from each decile of the score
    again = pick_examples(score, 10, torch.Generator().manual_seed(0))
    assert torch.equal(rows, again)


def test_leaving_out_changes_only_the_batch_that_held_the_example():
    x = torch.arange(23.0)[:, None]
    task = Task(0, x, torch.zeros(23, dtype=torch.long), x[:1], torch.zeros(1, dtype=torch.long), (0, 1))
    full = [b.x.flatten().tolist() for _, b in loop._batches([task], 5, torch.Generator().manual_seed(3))]
    left = [b.x.flatten().tolist() for _, b in
            loop._batches([task], 5, torch.Generator().manual_seed(3), (task, torch.tensor([7])))]
    assert len(full) == len(left)
    changed = [k for k, (f, l) in enumerate(zip(full, left)) if f != l]
    assert len(changed) == 1 and 7.0 in full[changed[0]]
    assert left[changed[0]] == [v for v in full[changed[0]] if v != 7.0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("validate")
    cfg = folder / "tiny.yaml"
    cfg.write_text(CONFIG)
    out = folder / "run"
    assert main(["run", str(cfg), "--out", str(out), "--no-progress", "--threads", "1"]) == 0
    return out


def test_the_true_deviation_is_a_retraining_without_the_example(run):
    """Full batch (batch_size > n_train): fit_task is one Adam step per epoch on the mean loss of the task without i;
    the same retraining written out by hand must give the same prediction of i, and so the same deviation."""
    from continual_blr.saved_run import load_boundary, load_run, validate_run

    loaded = load_run(run, "none", data=True)
    task = loaded.stream.tasks[1]
    v = validate_run(loaded, 6, epochs=3)
    end = load_boundary(loaded, 1)
    assert v.true.max() > 1e-4  # the examples do move: the check below is not 0 == 0

    def by_hand(leave: int | None) -> torch.Tensor:
        model = copy.deepcopy(end.model)
        keep = torch.ones(task.n_train, dtype=torch.bool)
        if leave is not None:
            keep[leave] = False
        opt = torch.optim.Adam(model.parameters(), lr=loaded.train.lr)
        for _ in range(3):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(task.x_train[keep], head=task.head), task.y_train[keep])
            loss.backward()
            opt.step()
        with torch.no_grad():
            return torch.softmax(model(task.x_train, head=task.head).double(), -1)

    ref = by_hand(None)
    for k, r in enumerate(v.rows.tolist()):
        expected = (by_hand(r)[r] - ref[r]).abs().sum()
        torch.testing.assert_close(v.true[k].double(), expected, **TRAIN)


def test_cli_validate_writes_the_numbers_and_refuses_bad_input(run, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["inspect", str(run), "--validate", "4", "--validate-epochs", "2", "--no-progress", "--out",
                 str(out)]) == 0
    printed = capsys.readouterr().out
    assert "validated task 1 (0-based) against 4 retrainings of 2 epochs" in printed
    payload = json.loads((out / "validation.json").read_text())
    assert len(payload["rows"]) == 4 and payload["epochs"] == 2
    assert -1.0 <= payload["summary"]["spearman_sensitivity"] <= 1.0
    assert (out / "validation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "index.html").read_text()
    first_screen = page[: page.index("<h2>")]  # the report's header, above its first section
    rho = payload["summary"]["spearman_sensitivity"]
    assert "checked on this run" in first_screen and f"<b>{rho:.2f}</b>" in first_screen
    assert 'href="validation.png"' in first_screen
    for bad, flag in ((["--validate", "0"], "--validate:"), (["--validate", "2", "--validate-epochs", "0"],
                                                             "--validate-epochs:")):
        assert main(["inspect", str(run), *bad, "--no-progress", "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"continual-blr: {flag}") or flag in err, err
        assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_report_without_validate_says_it_was_not_checked(run, tmp_path):
    out = tmp_path / "report"
    assert main(["inspect", str(run), "--no-progress", "--out", str(out)]) == 0
    page = (out / "index.html").read_text()
    first_screen = page[: page.index("<h2>")]
    assert "not checked on this run" in first_screen and "--validate N" in first_screen
    assert not (out / "validation.json").exists()


def test_cli_validate_without_kept_boundaries_is_one_line(run, tmp_path, capsys):
    old = tmp_path / "old"
    shutil.copytree(run, old)
    shutil.rmtree(old / "none" / "tasks")  # a run written before boundaries were kept
    assert main(["inspect", str(old), "--validate", "2", "--no-progress", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "kept no checkpoint of the boundary" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("end_task", [True, False])
def test_fit_task_leaves_out_the_task_end_only_when_asked(end_task):
    """``fit_task(end_task=False)`` (the retrainings of --validate) trains without the method's task-end update."""
    from continual_blr.methods import build_method
    from continual_blr.methods.base import TrainConfig
    from continual_blr.models import build_model

    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 3, generator=g)
    task = Task(0, x, (x[:, 0] > 0).long(), x[:2], torch.zeros(2, dtype=torch.long), (0, 1))
    model = build_model("mlp", (3,), 2, 1, hidden=(4,), generator=g)
    method = build_method("none", {}, seed=0)
    calls = []
    method.on_task_end = lambda *a, **k: calls.append(1)  # type: ignore[method-assign]
    loop.fit_task(model, task, method, TrainConfig(epochs=1, batch_size=4), seen=[task],
                  generator=torch.Generator().manual_seed(0), progress=False, end_task=end_task)
    assert calls == ([1] if end_task else [])
