"""A tiny finished run for the command-line tests that need one (bad files, messages, own methods)."""

from __future__ import annotations

from pathlib import Path

import torch

# two synthetic tasks of 40 examples, 6 features, an 8-unit MLP, one epoch: a run in about a second
TINY = ("stream: {name: synthetic, options: {n_tasks: 2, n_train: 40, n_features: 6}}\nmodel: {hidden: [8]}\n"
        "train: {epochs: 1, batch_size: 20}\nprogress: false\n")


def tiny_run(root: Path, methods: str = "[none]") -> Path:
    """Run ``TINY`` with ``methods`` into ``root/run`` (its config is ``root/c.yaml``); returns ``root``."""
    from continual_blr.cli import main

    torch.set_num_threads(1)
    (root / "c.yaml").write_text(TINY + f"methods: {methods}\n")
    assert main(["run", str(root / "c.yaml"), "--out", str(root / "run")]) == 0
    return root
