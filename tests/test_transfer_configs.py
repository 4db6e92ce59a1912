"""The permuted-digits transfer configs are the permuted-MNIST configs with only the stream changed (issue 41:
"a domain-incremental stream that no one tuned on should see the same gains with the permuted-MNIST configs
unchanged"); the ``*_defaults`` rows are the library defaults on ``none.yaml``'s budget."""

from pathlib import Path

import pytest

from continual_blr.config import yaml_load

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
COPIES = ("none", "ewc", "fromp", "blr", "blr_price", "ivon", "vcl")
DEFAULTS = ("blr", "ivon", "vcl")


def _load(folder: str, name: str) -> dict:
    return yaml_load((CONFIGS / folder / f"{name}.yaml").read_text())


@pytest.mark.parametrize("name", COPIES)
def test_everything_but_the_stream_is_the_permuted_mnist_config(name):
    digits, mnist = _load("permuted_digits", name), _load("permuted_mnist", name)
    assert digits["stream"] == {"name": "permuted_digits", "scenario": "domain", "options": {"n_tasks": 10}}
    assert mnist["stream"]["name"] == "permuted_mnist"
    assert {k: v for k, v in digits.items() if k != "stream"} == {k: v for k, v in mnist.items() if k != "stream"}


@pytest.mark.parametrize("name", DEFAULTS)
def test_defaults_rows_are_the_library_defaults_on_the_none_budget(name):
    cfg, none = _load("permuted_digits", f"{name}_defaults"), _load("permuted_digits", "none")
    assert cfg["methods"] == [{"name": name}]
    assert {k: v for k, v in cfg.items() if k != "methods"} == {k: v for k, v in none.items() if k != "methods"}


STEPS_MATCHED = ("none", "ewc", "fromp", "blr", "ivon", "blr_defaults", "ivon_defaults")


@pytest.mark.parametrize("name", STEPS_MATCHED)
def test_steps_matched_rows_change_only_the_epochs(name):
    """391 epochs of 12 batches = 4,692 steps per task, permuted MNIST's 469 × 10 = 4,690."""
    cfg, base = _load("permuted_digits/steps_matched", name), _load("permuted_digits", name)
    assert cfg["train"]["epochs"] == 391 and base["train"]["epochs"] == 10
    strip = lambda c: {**c, "train": {k: v for k, v in c["train"].items() if k != "epochs"}}  # noqa: E731
    assert strip(cfg) == strip(base)
