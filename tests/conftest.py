"""Shared fixtures and named tolerances for the test suite."""

import os

import pytest
import torch

# Under pytest-xdist (`-n N`) each worker gets an equal share of the cores, so that N workers do not each start
# one torch thread per core and oversubscribe the machine (set once per worker process, before any test runs).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# Named tolerance tiers (see STYLE.md): exact float64 maths, and Monte-Carlo estimates.
EXACT = dict(rtol=1e-8, atol=1e-10)
EXACT32 = dict(rtol=1e-4, atol=1e-6)
MONTE_CARLO = dict(rtol=1e-1, atol=1.5e-2)


@pytest.fixture(autouse=True)
def _isolate_home(tmp_path_factory, monkeypatch):
    """Keep every test's writes (Avalanche's config, caches) inside a temporary folder."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    yield


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def interrupt_at_call(monkeypatch, target, name: str, calls: int) -> None:
    """Raise KeyboardInterrupt (as SIGINT does) at the start of call number ``calls`` of ``target.<name>``
    (patched through ``monkeypatch``: undone with it)."""
    original = getattr(target, name)
    count = {"n": 0}

    def wrapped(*args, **kwargs):
        count["n"] += 1
        if count["n"] == calls:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, wrapped)
