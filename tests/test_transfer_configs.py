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
