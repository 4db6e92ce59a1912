"""The run's cost columns: each method's ``time s`` measures that method alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tiny_runs import TINY


def test_first_method_is_not_charged_the_process_start_up(tmp_path):
    """In a fresh process (torch.optim's first optimiser imports torch._dynamo, ~2 s), the first task of the first
    method takes about as long as the same work later; before the fix it carried the start-up."""
    cfg = TINY + "methods: [none, {name: l2}]\n"
    (tmp_path / "c.yaml").write_text(cfg)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "continual_blr", "run", str(tmp_path / "c.yaml"), "--out",
                           str(tmp_path / "run"), "--threads", "1"], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "run" / "results.json").read_text())["results"]
    first, rest = results[0]["task_times"][0], results[0]["task_times"][1:] + results[1]["task_times"]
    assert first <= 0.3 + 5 * max(rest), (first, rest)
