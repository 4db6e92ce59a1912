"""``load_run`` without ``data=True`` (issue 42, item 3): the tasks hold empty tensors, and predicting on them is a
one-line error that says to pass ``data=True`` — not an empty answer (``docs/index.md``'s example once printed
``tensor(nan)``). With ``data=True`` the same call predicts.

Planted once (the check in ``LoadedRun._inputs`` removed): ``predict`` returned an empty tensor and the test failed.
"""

import pytest
import torch

from continual_blr import load_run
from tiny_runs import tiny_run


def test_predict_on_the_tasks_of_a_run_loaded_without_data_says_to_pass_data_true(tmp_path):
    root = tiny_run(tmp_path)
    run = load_run(root / "run", method="none")
    task = run.stream.tasks[0]
    for call in (run.predict, run.predict_proba):
        with pytest.raises(ValueError, match=r"pass load_run\(\.\.\., data=True\)") as err:
            call(task.x_test, head=task.head)
        assert "\n" not in str(err.value)
    full = load_run(root / "run", method="none", data=True)
    task = full.stream.tasks[0]
    pred = full.predict(task.x_test, head=task.head)
    assert pred.shape == (task.x_test.shape[0],) and pred.shape[0] > 0
    assert 0 < float((pred == task.y_test).float().mean()) <= 1  # the docs' accuracy is a number, not nan
    torch.testing.assert_close(full.predict_proba(task.x_test, head=task.head).sum(-1),
                               torch.ones(task.x_test.shape[0]))
