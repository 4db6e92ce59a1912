"""The compiled training step (``train.compile``, continual_blr/compiled.py) trains what the eager step trains.

Oracle: the same run eagerly. ``aot_eager`` (Dynamo + AOTAutograd, eager kernels) and ``default`` (TorchInductor,
C++ kernels compiled here, a few seconds per graph) reorder and fuse float operations, so the weights after a short
run agree to round-off: ``ATOL`` below, against weights of size ~0.3 that the run moves by ~0.1 (a wrong graph, e.g.
the wrong head or train/eval mode, moves them by that much). Planted and watched to fail: the eager forward not put
back after the epochs (``test_the_task_end_and_evaluation_run_eagerly``); the context manager yielding without
compiling (``test_the_steps_are_compiled``); the compiled forward always given head 0 (every case of
``test_runs_agree_with_eager``). Dropout: ``aot_eager`` draws the eager masks from the global generator (the dropout
case); TorchInductor draws its own, so a dropout net under ``default`` trains on other masks and is not compared."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from torch import nn

from continual_blr.compiled import COMPILE_MODES, compiled_forward
from continual_blr.data.stream import Task, TaskStream
from continual_blr.loop import fit_task, run_stream
from continual_blr.methods import build_method
from continual_blr.methods.base import TrainConfig
from continual_blr.models import MLP, MultiHeadNet

ATOL = 1e-5  # float32 round-off after ~24 steps of Adam (observed differences ~1e-7)


def _stream(n_tasks: int = 3, n: int = 96, d: int = 12, seed: int = 0) -> TaskStream:
    g = torch.Generator().manual_seed(seed)
    tasks = []
    for i in range(n_tasks):
        w = torch.randn(d, generator=g)
        x = torch.randn(n, d, generator=g)
        y = (x @ w > 0).long()
        tasks.append(Task(i, x[:64], y[:64], x[64:], y[64:], (2 * i, 2 * i + 1), head=i, name=f"t{i}"))
    return TaskStream("toy", tasks, "task", (d,), 2, n_tasks)


class _DropoutNet(MultiHeadNet):
    """An MLP with dropout: its train-mode and eval-mode graphs differ (FROMP evaluates its points in eval mode)."""

    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__(nn.Sequential(nn.Linear(d, 16), nn.ReLU(), nn.Dropout(0.5)), 16, 2, n_heads)


def _run(method: str, params: dict, mode: str, net: str = "mlp"):
    torch.manual_seed(0)  # the weights' initialisation only; the run's randomness goes through its generator
    stream = _stream()
    model = MLP(12, (16,), 2, n_heads=3) if net == "mlp" else _DropoutNet(12, 3)
    m = build_method(method, dict(params), seed=0)
    train = TrainConfig(epochs=2, batch_size=16, lr=0.01, compile=mode)
    if net != "mlp":  # dropout draws from the global generator: the same draws in both runs
        torch.manual_seed(1)
    result = run_stream(model, stream, m, train, seed=0, progress=False)
    return result, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("method,params,net,mode", [
    ("none", {}, "mlp", "aot_eager"),
    ("ewc", {"lam": 10.0}, "mlp", "aot_eager"),
    ("fromp", {"tau": 10.0, "n_points": 8}, "mlp", "aot_eager"),
    ("fromp", {"tau": 10.0, "n_points": 8}, "dropout", "aot_eager"),
    pytest.param("fromp", {"tau": 10.0, "n_points": 8}, "mlp", "default", marks=pytest.mark.skipif(
        shutil.which("c++") is None and shutil.which("g++") is None,
        reason="TorchInductor on a CPU compiles C++: no compiler here")),
])
def test_runs_agree_with_eager(method, params, net, mode):
    eager, w_eager = _run(method, params, "off", net)
    compiled, w_compiled = _run(method, params, mode, net)
    assert set(w_eager) == set(w_compiled)
    moved = max((w_eager[k] - v).abs().max().item() for k, v in _run(method, params, "off", net)[1].items())
    assert moved == 0.0  # the eager run is deterministic: any difference below is the compiled step's
    for k in w_eager:
        torch.testing.assert_close(w_compiled[k], w_eager[k], atol=ATOL, rtol=0, msg=f"{method} {mode}: {k}")
    assert abs(compiled.avg_acc - eager.avg_acc) <= 1 / 32 + 1e-9  # at most one of the 32 test points flips


def test_the_steps_are_compiled():
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    _run("none", {}, "aot_eager")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > before


def test_the_task_end_and_evaluation_run_eagerly():
    stream = _stream()
    model = MLP(12, (16,), 2, n_heads=3)
    method = build_method("ewc", {"lam": 1.0}, seed=0)
    train = TrainConfig(epochs=1, batch_size=32, lr=0.01, compile="aot_eager")
    method.setup(model, stream, train)
    fit_task(model, stream.tasks[0], method, train, seen=[stream.tasks[0]], generator=torch.Generator().manual_seed(0),
             progress=False)
    assert "forward" not in model.__dict__  # the class's forward again
    copy.deepcopy(model)  # no compiled function on the module


def test_a_forward_set_on_the_instance_is_put_back():
    model = MLP(4, (3,), 2)
    own = model.forward
    model.__dict__["forward"] = own
    with compiled_forward(model, "aot_eager"):
        assert model.__dict__["forward"] is not own
    assert model.__dict__["forward"] is own


def test_bad_mode_is_one_line():
    with pytest.raises(ValueError, match=r"train.compile: got 'fast'; allowed: 'off', 'default'"):
        TrainConfig(compile="fast")
    assert COMPILE_MODES[0] == "off" and TrainConfig().compile == "off"


def test_the_blr_is_refused():
    stream = _stream(1)
    model = MLP(12, (16,), 2, n_heads=1)
    method = build_method("blr", {}, seed=0)
    train = TrainConfig(epochs=1, batch_size=32, compile="aot_eager")
    method.setup(model, stream, train)
    with pytest.raises(ValueError, match="train.compile: 'aot_eager' is not available with blr"):
        fit_task(model, stream.tasks[0], method, train, seen=[stream.tasks[0]],
                 generator=torch.Generator().manual_seed(0), progress=False)
