"""The training loop on the synthetic stream: shapes, determinism, metrics, and that a prior helps."""

import json
import math

import pytest
import torch

from continual_blr.data import make_stream
from continual_blr.loop import StreamResult, run_stream, stream_metrics
from continual_blr.methods import TrainConfig, build_method
from continual_blr.models import build_model


def _run(name, params=None, scenario="task", seed=0, epochs=3):
    stream = make_stream("synthetic", scenario=scenario, seed=0)
    model = build_model("mlp", stream.input_shape, stream.n_outputs, stream.n_heads, hidden=(32,),
                        generator=torch.Generator().manual_seed(seed))
    method = build_method(name, params or {}, seed=seed)
    return run_stream(model, stream, method, TrainConfig(epochs=epochs, batch_size=32, lr=1e-2), seed=seed, progress=False)


def test_accuracy_matrix_shape_and_entries():
    r = _run("none")
    t = len(r.acc_matrix)
    assert t == 3 and all(len(row) == t for row in r.acc_matrix)
    for i in range(t):
        for j in range(t):
            v = r.acc_matrix[i][j]
            assert math.isnan(v) if j > i else 0.0 <= v <= 1.0
    assert r.avg_acc == pytest.approx(sum(r.acc_matrix[-1]) / t)
    assert len(r.task_times) == t and all(x > 0 for x in r.task_times)


def test_same_seed_identical_results():
    a, b = _run("blr", seed=3), _run("blr", seed=3)
    assert a.acc_matrix == b.acc_matrix and a.train_loss == b.train_loss
    c = _run("blr", seed=4)
    assert c.train_loss != a.train_loss


def test_metrics_by_hand():
    acc = [[0.9, math.nan, math.nan], [0.7, 0.8, math.nan], [0.6, 0.75, 1.0]]
    m = stream_metrics(acc)
    assert m["avg_acc"] == pytest.approx((0.6 + 0.75 + 1.0) / 3)
    assert m["avg_acc_per_step"] == pytest.approx([0.9, 0.75, (0.6 + 0.75 + 1.0) / 3])
    assert m["bwt"] == pytest.approx(((0.6 - 0.9) + (0.75 - 0.8)) / 2)
    assert m["forgetting"] == pytest.approx(((0.9 - 0.6) + (0.8 - 0.75)) / 2)


def test_result_json_roundtrip(tmp_path):
    r = _run("none", epochs=1)
    r.save(tmp_path / "r.json")
    json.loads((tmp_path / "r.json").read_text())  # valid JSON (NaN stored as null)
    back = StreamResult.load(tmp_path / "r.json")
    assert back.avg_acc == r.avg_acc
    assert all((math.isnan(a) and math.isnan(b)) or a == b
               for ra, rb in zip(r.acc_matrix, back.acc_matrix) for a, b in zip(ra, rb))


def test_prior_forgets_less_than_no_prior():
    """Class-incremental synthetic stream: the BLR's posterior-as-prior forgets less than fine-tuning."""
    none = _run("none", scenario="class", epochs=5)
    blr = _run("blr", scenario="class", epochs=5)
    assert blr.forgetting < none.forgetting


def test_joint_trains_on_all_seen_tasks():
    joint = _run("joint", scenario="class", epochs=5)
    none = _run("none", scenario="class", epochs=5)
    assert joint.avg_acc > none.avg_acc


def test_build_method_errors():
    with pytest.raises(ValueError, match="allowed: .*blr.*none"):
        build_method("nope")
    with pytest.raises(ValueError, match="unknown key 'lrr'"):
        build_method("blr", {"lrr": 1.0})
    with pytest.raises(ValueError, match="structure"):
        build_method("blr", {"structure": "banana"})
    with pytest.raises(ValueError, match="takes no params"):
        build_method("none", {"x": 1})


@pytest.mark.parametrize("temperature", [1.0, 0.1])
def test_blr_temperature_carries_the_tasks_precision_divided_by_t(temperature):
    """At a task end the next prior's precision is s₀ + max(s − s₀, 0) / T (T = 1: the posterior itself)."""
    from continual_blr.posteriors import DiagPosterior

    stream = make_stream("synthetic", scenario="task", seed=0)
    model = build_model("mlp", stream.input_shape, stream.n_outputs, stream.n_heads, hidden=(8,),
                        generator=torch.Generator().manual_seed(0))
    method = build_method("blr", {"prior_precision": 2.0, "temperature": temperature}, seed=0)
    train = TrainConfig(epochs=1, batch_size=32, lr=1e-2)
    method.setup(model, stream, train)
    opt = method.make_optimizer(model, stream.tasks[0], train)
    g = torch.Generator().manual_seed(3)
    # a posterior precision on both sides of the prior's 2.0 (below it: the clamp keeps the prior)
    s = {k: 4.0 * torch.rand(v.shape, generator=g, dtype=v.dtype) for k, v in opt.prior.mean.items()}
    opt._post = DiagPosterior(opt.posterior().mean, s)
    method.on_task_end(model, stream.tasks[0], opt)
    for k, v in s.items():
        expected = 2.0 + (v - 2.0).clamp_min(0.0) / temperature if temperature != 1.0 else v
        torch.testing.assert_close(opt.prior.precision[k], expected, rtol=1e-6, atol=0.0)


def test_blr_temperature_is_diag_only():
    with pytest.raises(ValueError, match="params.temperature"):
        build_method("blr", {"structure": "kron", "temperature": 0.5})
    with pytest.raises(ValueError, match="params.temperature"):
        build_method("blr", {"temperature": 0.0})


def test_a_diverging_run_stops_with_a_one_line_error():
    """Adam with lr 1e30 drives the logits to inf: the loop raises instead of reporting chance accuracy."""
    from continual_blr.loop import DivergenceError

    stream = make_stream("synthetic", scenario="task", seed=0)
    model = build_model("mlp", stream.input_shape, stream.n_outputs, stream.n_heads, hidden=(32,),
                        generator=torch.Generator().manual_seed(0))
    with pytest.raises(DivergenceError, match=r"none: the training loss on task 0 .* became nan in epoch 1"):
        run_stream(model, stream, build_method("none", {}), TrainConfig(epochs=2, lr=1e30), seed=0, progress=False)
