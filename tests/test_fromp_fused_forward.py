"""FROMP's ``fused_forward``: the minibatch and every memorable point in one forward pass.

The guarantee in :mod:`continual_blr.regularizers.functional`: the fused pass computes the same loss and gradient
as the separate passes (one for the minibatch, one per head for the penalty), rounded differently. Oracle: the
separate passes themselves, in float64 (tolerance ``EXACT``), at weights moved after the rebuild so that every Δ is
nonzero. Planted bugs it catches: every block through the minibatch's head, the blocks' rows shifted, the penalty
scaled without n / k, a draw that the fused path makes differently from the separate one. And the guard: a module
whose train and eval forward differ (dropout, BatchNorm, an unknown type) is a one-line error, not a silent change
of the function.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import EXACT
from fromp_cases import store_past_tasks
from continual_blr.data import make_stream
from continual_blr.memory import eval_rows_after, forward, forward_parts, row_split_refusal, train_eval_difference
from continual_blr.methods import MethodParamsError, TrainConfig, build_method
from continual_blr.methods.fromp import functional_loss
from continual_blr.models import CifarNet, ReducedResNet18, _reinit, build_model
from continual_blr.loop import fit_task
from continual_blr.types import Batch, flatten

DT = torch.float64


def _stream(scenario: str, n_tasks: int = 4):
    s = make_stream("synthetic", scenario=scenario, n_tasks=n_tasks, n_classes_per_task=2, n_features=5,
                    n_train=30, n_test=5, seed=0)
    return s, [t.to("cpu", dtype=DT) for t in s.tasks]


def _method_with_past(scenario: str, fused: bool, **params):
    """A float64 MLP and a FROMP method holding all but the last task of a synthetic stream, the weights moved after
    the rebuild (every Δ nonzero). Returns (method, model, the current task)."""
    torch.set_num_threads(1)
    s, tasks = _stream(scenario)
    model = build_model("mlp", (5,), s.n_outputs, s.n_heads, hidden=(8, 8),
                        generator=torch.Generator().manual_seed(0)).to(DT)
    method = build_method("fromp", {"tau": 3.0, "n_points": 6, "prior_precision": 1e-2, "jitter": 1e-6,
                                    "fused_forward": fused, **params}, seed=1)
    method.setup(model, s, TrainConfig(batch_size=8))
    store_past_tasks(method.on_task_end, method.on_task_start, model, tasks, torch.Generator().manual_seed(2))
    return method, model, tasks[-1]


def _loss_and_grad(method, model, task):
    model.zero_grad()
    batch = Batch(task.x_train[:7], task.y_train[:7], task.head)
    loss, penalty = functional_loss(method, method.regularizer, method.penalty_log, model, batch, task)
    loss.backward()
    return loss.detach(), penalty.detach(), flatten({n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                                                     for n, p in model.named_parameters()})


CASES = [
    ("task", {}),                                   # one head per task: 3 heads + the minibatch's
    ("task", {"kernel": "full"}),
    ("task", {"kernel": "identity", "output": "logits"}),
    ("task", {"output": "logits", "drop_below": 1e3}),
    ("class", {}),                                  # one head, the tasks' own columns
    ("domain", {}),                                 # one head, every output
]


@pytest.mark.parametrize("scenario,params", CASES)
@pytest.mark.parametrize("k", [0, 1, 2])
def test_one_pass_gives_the_separate_passes_loss_and_gradient(scenario, params, k):
    """Three consecutive steps' loss, penalty and gradient agree with the separate passes to float64 round-off,
    also when each step draws k of the stored tasks (the same draws: the generators advance alike)."""
    sep, model, task = _method_with_past(scenario, False, tasks_per_step=k, **params)
    fused, model_f, _ = _method_with_past(scenario, True, tasks_per_step=k, **params)
    for _ in range(3):
        ls, ps, gs = _loss_and_grad(sep, model, task)
        lf, pf, gf = _loss_and_grad(fused, model_f, task)
        assert ps > 0
        torch.testing.assert_close(pf, ps, **EXACT)
        torch.testing.assert_close(lf, ls, **EXACT)
        torch.testing.assert_close(gf, gs, **EXACT)
    assert torch.equal(sep.regularizer.generator.get_state(), fused.regularizer.generator.get_state())


def test_training_with_one_pass_follows_the_separate_passes():
    """``fit_task`` (Adam, clipping) on the last task from the same state: the weights after two epochs agree to
    float64 round-off (the loop reaches the fused path through ``Method.loss``)."""
    runs = []
    for fused in (False, True):
        method, model, task = _method_with_past("task", fused, tasks_per_step=1)
        start = flatten(dict(model.named_parameters())).detach().clone()
        fit_task(model, task, method, TrainConfig(epochs=2, batch_size=8, lr=1e-2, grad_clip=1.0), seen=[task],
                 generator=torch.Generator().manual_seed(5), progress=False, end_task=False)
        runs.append(flatten(dict(model.named_parameters())).detach())
        assert (runs[-1] - start).abs().max() > 1e-3  # the steps moved the weights
    torch.testing.assert_close(runs[1], runs[0], **EXACT)


def test_per_task_batchnorm_statistics_are_a_one_line_error():
    from continual_blr.memory import NormStatistics

    method, model, task = _method_with_past("task", True)
    method.regularizer.norm_statistics = NormStatistics()
    with pytest.raises(ValueError, match="params.fused_forward: not with train.batchnorm 'per_task'"):
        method.loss(model, Batch(task.x_train[:4], task.y_train[:4], task.head), task)


def test_forward_heads_equals_one_forward_per_block():
    """MultiHeadNet.forward_heads: each block as ``forward(x_i, head=h_i)``; repeated heads share one product."""
    model = build_model("mlp", (5,), 2, 4, hidden=(6,), generator=torch.Generator().manual_seed(0)).to(DT)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, 5, generator=g, dtype=DT) for n in (3, 4, 2, 5)]
    heads = [2, 0, 2, 3]
    outs = forward_parts(model, xs, heads)
    for x, h, o in zip(xs, heads, outs):
        torch.testing.assert_close(o, forward(model, x, h), **EXACT)
    single = build_model("mlp", (5,), 3, 1, hidden=(6,), generator=torch.Generator().manual_seed(0)).to(DT)
    for x, o in zip(xs, forward_parts(single, xs, [0, 0, 0, 0])):
        torch.testing.assert_close(o, single(x), **EXACT)
    with pytest.raises(ValueError, match="rows"):
        model.forward_heads(torch.cat(xs), [(0, 3), (1, 3)])


def test_forward_parts_on_a_plain_module():
    """A module without heads: one call on the concatenated rows; blocks on different heads of a headed model
    without forward_heads are refused."""
    net = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    xs = [torch.randn(n, 5, dtype=DT, generator=torch.Generator().manual_seed(n)) for n in (2, 3)]
    for x, o in zip(xs, forward_parts(net, xs, [0, 0])):
        torch.testing.assert_close(o, net(x), **EXACT)

    class Headed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 2), nn.Linear(5, 2)

        def forward(self, x, head=0):
            return (self.a if head == 0 else self.b)(x)

    with pytest.raises(ValueError, match="forward_heads"):
        forward_parts(Headed(), xs, [0, 1])


def test_train_eval_difference_names_the_mode_dependent_module():
    assert train_eval_difference(build_model("mlp", (5,), 2, 3, hidden=(4,))) is None
    assert train_eval_difference(CifarNet(n_outputs=2, n_heads=2, dropout=0.0)) is None
    assert "Dropout" in train_eval_difference(CifarNet(n_outputs=2, n_heads=2, dropout=0.5))
    assert train_eval_difference(ReducedResNet18(n_outputs=2)) is not None

    class Custom(nn.Module):
        def forward(self, x):
            return x * 2 if self.training else x

    assert "Custom" in train_eval_difference(nn.Sequential(nn.Linear(2, 2), Custom()))


@pytest.mark.parametrize("model,word,name", [
    (lambda: nn.Sequential(nn.Flatten(), nn.Linear(5, 8), nn.Dropout(0.3, inplace=True), nn.ReLU(), nn.Linear(8, 2)),
     "Dropout", "fromp"),
    # (the curvature engine refuses BatchNorm without running statistics itself, so FROMP-L2 reaches the step)
    (lambda: nn.Sequential(nn.Flatten(), nn.Linear(5, 8), nn.BatchNorm1d(8, track_running_stats=False), nn.ReLU(),
                           nn.Linear(8, 2)), "BatchNorm1d", "fromp-l2"),
    (lambda: nn.Sequential(nn.Flatten(), nn.Linear(5, 8), _Doubler(), nn.Linear(8, 2)), "_Doubler", "fromp"),
])
def test_a_module_that_cannot_be_split_by_rows_is_a_one_line_error(model, word, name):
    """In-place dropout (its eval rows overwritten), BatchNorm without running statistics (its eval rows would be
    normalised by whatever shares the pass) and a module of unknown mode are refused by name."""
    s, tasks = _stream("domain", n_tasks=2)
    net = model().to(DT)
    assert row_split_refusal(net) is not None and word in row_split_refusal(net)
    method = build_method(name, {"n_points": 4, "fused_forward": True})
    method.setup(net, s, TrainConfig(batch_size=8))
    method.on_task_end(net, tasks[0])
    method.on_task_start(net, tasks[1])
    with pytest.raises(ValueError, match=f"params.fused_forward: .*{word}") as err:
        method.loss(net, Batch(tasks[1].x_train[:4], tasks[1].y_train[:4], 0), tasks[1])
    assert "\n" not in str(err.value)


class _Doubler(nn.Module):
    def forward(self, x):
        return x * 2 if self.training else x


def test_row_split_refusal_accepts_the_library_networks():
    assert row_split_refusal(CifarNet(n_outputs=2, n_heads=2, dropout=0.5)) is None
    assert row_split_refusal(ReducedResNet18(n_outputs=2, n_heads=2, nf=4)) is None
    assert "Custom" in row_split_refusal(nn.Sequential(nn.Linear(2, 2), type("Custom", (_Doubler,), {})()))


def _bn_dropout_net() -> nn.Module:
    g = torch.Generator().manual_seed(4)
    net = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.4), nn.Linear(8, 6),
                        nn.Dropout(0.2), nn.BatchNorm1d(6, momentum=None), nn.Linear(6, 3)).to(DT)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=DT))
    return net


def _bn_state(net: nn.Module) -> list[torch.Tensor]:
    return [b.clone() for b in net.buffers()]


def test_eval_rows_after_gives_train_rows_then_eval_rows():
    """One pass in train mode under ``eval_rows_after(net, n)`` equals the minibatch's own train-mode pass (rows :n)
    followed by an eval-mode pass over the rest (rows n:), to float64 round-off: outputs, the gradient of any function
    of both, BatchNorm's running statistics and counters after the pass, and the global generator's state (dropout
    draws for the minibatch's rows only). Oracle: the two separate passes on a copy of the network."""
    import copy

    g = torch.Generator().manual_seed(5)
    xa, xb = torch.randn(7, 5, generator=g, dtype=DT), torch.randn(4, 5, generator=g, dtype=DT)
    wa, wb = torch.randn(7, 3, generator=g, dtype=DT), torch.randn(4, 3, generator=g, dtype=DT)
    sep = _bn_dropout_net().train()
    one = copy.deepcopy(sep)
    with torch.random.fork_rng():
        torch.manual_seed(11)
        ya = sep(xa)
        sep.eval()
        yb = sep(xb)
        sep.train()
        ((ya * wa).sum() + (yb * wb).sum()).backward()
        rng_sep = torch.get_rng_state()
        torch.manual_seed(11)
        with eval_rows_after(one, 7):
            y = one(torch.cat([xa, xb]))
        ((y[:7] * wa).sum() + (y[7:] * wb).sum()).backward()
        rng_one = torch.get_rng_state()
    assert torch.equal(rng_sep, rng_one)
    torch.testing.assert_close(y[:7], ya, **EXACT)
    torch.testing.assert_close(y[7:], yb, **EXACT)
    for a, b in zip(_bn_state(one), _bn_state(sep)):
        torch.testing.assert_close(a, b, **EXACT)
    for (name, p), q in zip(one.named_parameters(), sep.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **EXACT, msg=name)
    assert all("forward" not in m.__dict__ for m in one.modules())  # every forward restored
    one.eval()  # in eval mode nothing is split: the plain eval pass
    with eval_rows_after(one, 7):
        assert all("forward" not in m.__dict__ for m in one.modules())
        torch.testing.assert_close(one(torch.cat([xa, xb])), sep.eval()(torch.cat([xa, xb])), **EXACT)
    assert (ya - sep(xa)).abs().max() > 1e-3  # the control: the train rows' pass differs from an eval pass


def test_eval_rows_after_restores_the_forwards_after_an_error():
    net = _bn_dropout_net().train()
    with pytest.raises(RuntimeError):
        with eval_rows_after(net, 3):
            net(torch.zeros(5, 4, dtype=DT))  # wrong width
    assert all("forward" not in m.__dict__ for m in net.modules())


def test_a_split_module_called_on_fewer_rows_is_a_one_line_error():
    """A pass whose rows are not the ones the split was set up for is refused, not run in train mode throughout."""
    net = _bn_dropout_net().train()
    with eval_rows_after(net, 7):
        with pytest.raises(ValueError, match="got 4 rows, fewer than the 7 train rows") as err:
            net(torch.zeros(4, 5, dtype=DT))
    assert "\n" not in str(err.value)


def _image_method_with_past(arch: str, fused: bool):
    """As :func:`_method_with_past` on images (3 × 12 × 12, the synthetic blobs reshaped), with a CifarNet
    (dropout 0.5) or a reduced ResNet-18 of 4 base filters (BatchNorm), in float64 and train mode."""
    import dataclasses

    torch.set_num_threads(1)
    s = make_stream("synthetic", scenario="task", n_tasks=4, n_classes_per_task=2, n_features=3 * 12 * 12,
                    n_train=30, n_test=5, seed=0)
    shape = (3, 12, 12)
    tasks = [dataclasses.replace(t.to("cpu", dtype=DT), x_train=t.x_train.to(DT).reshape(-1, *shape),
                                 x_test=t.x_test.to(DT).reshape(-1, *shape)) for t in s.tasks]
    s = dataclasses.replace(s, tasks=tasks, input_shape=shape)
    if arch == "cifarnet":
        model = CifarNet(3, s.n_outputs, s.n_heads, dropout=0.5, image_size=12)
    else:
        model = ReducedResNet18(3, s.n_outputs, s.n_heads, nf=4)
    _reinit(model, torch.Generator().manual_seed(0))
    model = model.to(DT).train()
    method = build_method("fromp", {"tau": 3.0, "n_points": 6, "prior_precision": 1e-2, "jitter": 1e-6,
                                    "fused_forward": fused}, seed=1)
    method.setup(model, s, TrainConfig(batch_size=8))
    store_past_tasks(method.on_task_end, method.on_task_start, model, tasks, torch.Generator().manual_seed(2))
    model.train()
    return method, model, tasks[-1]


@pytest.mark.parametrize("arch", ["cifarnet", "reduced_resnet18"])
def test_one_pass_with_dropout_and_batchnorm_gives_the_separate_passes(arch):
    """CifarNet (dropout) and the reduced ResNet-18 (BatchNorm) in train mode: three steps' loss, penalty and
    gradient of the one pass agree with the separate passes (minibatch in train mode, then the penalty in eval mode)
    to float64 round-off, with the same dropout masks (the global generator seeded alike) and the same BatchNorm
    running statistics after each step."""
    sep, model, task = _image_method_with_past(arch, False)
    fused, model_f, _ = _image_method_with_past(arch, True)
    for step in range(3):
        with torch.random.fork_rng():
            torch.manual_seed(20 + step)
            ls, ps, gs = _loss_and_grad(sep, model, task)
            torch.manual_seed(20 + step)
            lf, pf, gf = _loss_and_grad(fused, model_f, task)
        assert ps > 0
        torch.testing.assert_close(pf, ps, **EXACT)
        torch.testing.assert_close(lf, ls, **EXACT)
        torch.testing.assert_close(gf, gs, **EXACT)
        for a, b in zip(_bn_state(model_f), _bn_state(model)):
            torch.testing.assert_close(a, b, **EXACT)
    assert all(m.training for m in model_f.modules())
    if arch == "cifarnet":  # the control: dropout is live, so a step's loss depends on the draw
        with torch.random.fork_rng():
            torch.manual_seed(99)
            other, _, _ = _loss_and_grad(sep, model, task)
        assert abs(float(other) - float(ls)) > 1e-6


def test_an_fp32_penalty_under_bf16_autocast_is_refused_and_the_training_precision_runs():
    method, model, task = _method_with_past("task", True)
    model.float()
    method.regularizer._clear_groups()
    batch = Batch(task.x_train[:4].float(), task.y_train[:4], task.head)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match="forward_precision 'train'"):
            method.loss(model, batch, task)
    method.regularizer.forward_precision = "train"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, pen = method.regularizer.penalty_and_outputs(model, batch, task)
    assert out.dtype == torch.bfloat16 and pen.dtype == torch.float32 and pen > 0


def test_bad_values_are_one_line_errors():
    with pytest.raises(MethodParamsError, match="params.fused_forward must be bool"):
        build_method("fromp", {"fused_forward": "yes"})
    with pytest.raises(MethodParamsError, match="params.fused_forward: not with task_estimator 'saga'"):
        build_method("fromp", {"fused_forward": True, "tasks_per_step": 1, "task_estimator": "saga"})
    with pytest.raises(MethodParamsError, match="params.fused_forward"):
        build_method("fromp-replay", {"fused_forward": 1})
