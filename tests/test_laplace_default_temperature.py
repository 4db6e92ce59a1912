"""Laplace's default temperature follows the stream's head layout (``LaplaceParams.temperature: None``).

Guarantee (``continual_blr/methods/laplace.py``): T 0.002 on a single-head class-incremental stream, T 0.01 on every
other; a temperature that is set is used as it is. Oracle: the carried precision after one task is δ + C_1 / T
(the K-FAC factors scaled by 1/T), so a default run must give the same posterior, bit for bit, as a run with the
resolved T written out, and a different one from the other layout's T. Planted bug it catches: the default resolved
without the scenario (the class stream then carries C_1 / 0.01).
"""

from __future__ import annotations

import pytest
import torch

from continual_blr.data import make_stream
from continual_blr.loop import fit_task
from continual_blr.methods import MethodParamsError, TrainConfig, build_method
from continual_blr.methods.laplace import DEFAULT_TEMPERATURE, LaplaceParams
from continual_blr.models import build_model


def _carried(scenario: str, params: dict) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    s = make_stream("synthetic", scenario=scenario, n_tasks=2, n_classes_per_task=2, n_features=4, n_train=40,
                    n_test=5, seed=0)
    model = build_model("mlp", (4,), s.n_outputs, s.n_heads, hidden=(6,), generator=torch.Generator().manual_seed(0))
    method = build_method("laplace", {"structure": "diag", **params}, seed=0)
    train = TrainConfig(epochs=1, batch_size=20, lr=0.01)
    method.setup(model, s, train)
    fit_task(model, s.tasks[0], method, train, seen=s.tasks[:1], generator=torch.Generator().manual_seed(0),
             progress=False)
    return {k: v.clone() for k, v in method.posterior().precision.items()}


@pytest.mark.parametrize("scenario,expected", [("class", 0.002), ("task", 0.01), ("domain", 0.01)])
def test_the_default_is_the_head_layouts_temperature(scenario, expected):
    assert LaplaceParams().temperature_for(scenario) == expected
    m = build_method("laplace", {})
    m.setup(build_model("mlp", (4,), 2, 1, hidden=(3,)), make_stream("synthetic", scenario=scenario, n_tasks=2,
            n_classes_per_task=2, n_features=4, n_train=8, n_test=2, seed=0), TrainConfig())
    assert m.memory_stats()["temperature"] == expected  # what results.json records
    default, explicit = _carried(scenario, {}), _carried(scenario, {"temperature": expected})
    for k in default:
        assert torch.equal(default[k], explicit[k]), k
    other = 0.01 if expected == 0.002 else 0.002
    wrong = _carried(scenario, {"temperature": other})
    assert any(not torch.allclose(default[k], wrong[k]) for k in default)


def test_a_set_temperature_is_used_on_every_layout():
    p = LaplaceParams(temperature=0.3)
    assert p.temperature_for("class") == p.temperature_for("task") == 0.3
    assert DEFAULT_TEMPERATURE == {"other": 0.01, "single_head_class": 0.002}


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), "cold", True])
def test_a_bad_temperature_is_a_one_line_error(bad):
    with pytest.raises(MethodParamsError, match="temperature"):
        build_method("laplace", {"temperature": bad})
