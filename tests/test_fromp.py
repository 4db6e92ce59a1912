"""FROMP (continual_blr.regularizers.functional, continual_blr.methods.fromp) against brute force, float64.

The oracle: per-example, per-output autograd Jacobians (tests/oracles.py) and dense matrices:

    F  = Σ_tasks diag(Σ_i J_iᵀ Λ_i J_i)  at each task's end weights      Σ = diag(1 / (F + δ))
    K_{s,c} = J_{p_c}(X_s) Σ J_{p_c}(X_s)ᵀ + εI  at the weights of the rebuild
    penalty = (τ/2) Σ_s Σ_c Δp_{s,c}ᵀ K_{s,c}⁻¹ Δp_{s,c},   gradient = τ Σ_s Σ_c J_{p_c}ᵀ K_{s,c}⁻¹ Δp_{s,c}

"Training" between task boundaries is a random perturbation of the weights (the regulariser only
sees the weights at its hooks).
"""

from __future__ import annotations

import io

import pytest
import torch
from torch.nn import functional as F

import oracles as O
from conftest import EXACT
from continual_blr.config import ConfigError
from continual_blr.data import make_stream
from continual_blr.loop import run_stream
from continual_blr.methods import TrainConfig, build_method
from continual_blr.models import build_model
from continual_blr.regularizers.functional import FunctionalRegularizer
from continual_blr.types import Batch, KronBlock, KronCurvature, flatten, params_of

DT = torch.float64
TAU, DELTA, EPS = 3.0, 0.5, 1e-3
SOFTMAX = staticmethod(lambda f: f.softmax(-1))


def _stream(scenario="task", n_tasks=3, k=3):
    s = make_stream("synthetic", scenario=scenario, n_tasks=n_tasks, n_classes_per_task=k, n_features=4,
                    n_train=12, n_test=6, seed=3)
    return s, [t.to("cpu", dtype=DT) for t in s.tasks]


def _model(stream, seed=0):
    return build_model("mlp", (4,), stream.n_outputs, stream.n_heads, hidden=(5,),
                       generator=torch.Generator().manual_seed(seed)).to(DT)


def _perturb(model, gen, scale=0.3):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def _columns(entry):
    return list(entry.columns) if entry.columns is not None else None


def _probs(model, x, head, cols=None):
    p = model(x, head=head).softmax(-1)
    return p if cols is None else p[:, cols]


def _run_boundaries(reg, model, tasks, gen):
    """on_task_end for tasks[:-1] with perturbations in between, then on_task_start of the last task.
    Returns the oracle F (diag GGN accumulated at each task's end weights) as a flat vector."""
    fisher = 0
    for t in tasks[:-1]:
        _perturb(model, gen)
        reg.on_task_end(model, t)
        fisher = fisher + torch.diagonal(O.ggn(model, t.x_train, head=t.head))
    _perturb(model, gen)
    reg.on_task_start(model, tasks[-1])
    return fisher


def _oracle_jp(model, entry, cols):
    fn = SOFTMAX if cols is None else (lambda f: f.softmax(-1)[:, cols])
    return O.jacobians(model, entry.x, head=entry.head, output_fn=fn)  # [M, C, P]


@pytest.mark.parametrize("scenario,classes", [("task", "all"), ("class", "task"), ("class", "all")])
def test_classwise_kernels_and_old_predictions_equal_brute_force(gen, scenario, classes):
    stream, tasks = _stream(scenario)
    model = _model(stream)
    reg = FunctionalRegularizer(tau=TAU, n_points=6, prior_precision=DELTA, jitter=EPS, classes=classes,
                                class_incremental=scenario == "class")
    fisher = _run_boundaries(reg, model, tasks, gen)
    torch.testing.assert_close(flatten(reg.fisher), fisher, **EXACT)
    sigma = torch.diag(1.0 / (fisher + DELTA))
    assert len(reg.memory) == 2
    for entry, task in zip(reg.memory, tasks):
        assert torch.equal(entry.x, task.x_train[entry.indices])
        cols = _columns(entry)
        if scenario == "class" and classes == "task":
            assert cols == list(task.classes)
        else:
            assert cols is None
        jp = _oracle_jp(model, entry, cols)
        expect = O.kernel(jp, sigma, blockwise=True) + EPS * torch.eye(len(entry), dtype=DT)
        torch.testing.assert_close(entry.extras["kernel"], expect, **EXACT)
        chol = entry.extras["chol"]
        torch.testing.assert_close(chol @ chol.mT, expect, **EXACT)
        assert torch.equal(chol, torch.tril(chol))
        with torch.no_grad():
            torch.testing.assert_close(entry.extras["p_old"], _probs(model, entry.x, entry.head, cols), **EXACT)


def _penalty_and_grad(reg, model, task):
    model.zero_grad()
    batch = Batch(task.x_train[:2], task.y_train[:2], task.head)
    pen = reg.penalty(model, batch, task)
    pen.backward()
    return pen.detach(), flatten({n: torch.zeros_like(p) if p.grad is None else p.grad
                                  for n, p in model.named_parameters()})


def test_classwise_penalty_and_gradient_equal_jt_kinv_dp(gen):
    stream, tasks = _stream("task")
    model = _model(stream)
    reg = FunctionalRegularizer(tau=TAU, n_points=6, prior_precision=DELTA, jitter=EPS)
    fisher = _run_boundaries(reg, model, tasks, gen)
    sigma = torch.diag(1.0 / (fisher + DELTA))
    kinvs, p_olds = [], []
    for entry in reg.memory:
        k = O.kernel(_oracle_jp(model, entry, None), sigma, blockwise=True) + EPS * torch.eye(len(entry), dtype=DT)
        kinvs.append(torch.linalg.inv(k))
        with torch.no_grad():
            p_olds.append(_probs(model, entry.x, entry.head))
    _perturb(model, gen, 0.2)  # a training step away from the rebuild weights
    pen, grad = _penalty_and_grad(reg, model, tasks[-1])
    exp_pen, exp_grad = 0.0, 0.0
    for entry, kinv, p_old in zip(reg.memory, kinvs, p_olds):
        jp = _oracle_jp(model, entry, None)  # [M, C, P] at the current weights
        with torch.no_grad():
            dp = _probs(model, entry.x, entry.head) - p_old  # [M, C]
        for c in range(dp.shape[1]):
            a = kinv[c] @ dp[:, c]
            exp_pen = exp_pen + 0.5 * TAU * dp[:, c] @ a
            exp_grad = exp_grad + TAU * jp[:, c, :].T @ a
    torch.testing.assert_close(pen, exp_pen, **EXACT)
    torch.testing.assert_close(grad, exp_grad, **EXACT)


def test_full_kernel_is_the_pseudo_inverse_of_the_all_class_kernel(gen):
    stream, tasks = _stream("task")
    model = _model(stream)
    reg = FunctionalRegularizer(tau=TAU, n_points=6, kernel="full", prior_precision=DELTA, jitter=0.0)
    fisher = _run_boundaries(reg, model, tasks, gen)
    sigma = torch.diag(1.0 / (fisher + DELTA))
    pinvs, p_olds = [], []
    for entry in reg.memory:
        jp = _oracle_jp(model, entry, None)
        torch.testing.assert_close(entry.extras["kernel"], O.kernel(jp[:, :-1], sigma, blockwise=False), **EXACT)
        pinvs.append(torch.linalg.pinv(O.kernel(jp, sigma, blockwise=False), hermitian=True, rtol=1e-10))
        with torch.no_grad():
            p_olds.append(_probs(model, entry.x, entry.head))
    _perturb(model, gen, 0.2)
    pen, _ = _penalty_and_grad(reg, model, tasks[-1])
    expect = 0.0
    for entry, pinv, p_old in zip(reg.memory, pinvs, p_olds):
        with torch.no_grad():
            d = (_probs(model, entry.x, entry.head) - p_old).reshape(-1)  # index m·C + c
        expect = expect + 0.5 * TAU * d @ pinv @ d
    torch.testing.assert_close(pen, expect, rtol=1e-7, atol=1e-10)


def test_full_kernel_on_a_class_incremental_tasks_columns(gen):
    """classes="task": the compared columns do not sum to one, so all of them enter the full kernel."""
    stream, tasks = _stream("class")
    model = _model(stream)
    reg = FunctionalRegularizer(tau=TAU, n_points=6, kernel="full", prior_precision=DELTA, jitter=EPS,
                                classes="task", class_incremental=True)
    fisher = _run_boundaries(reg, model, tasks, gen)
    sigma = torch.diag(1.0 / (fisher + DELTA))
    kinvs, p_olds = [], []
    for entry, task in zip(reg.memory, tasks):
        cols = list(task.classes)
        k = O.kernel(_oracle_jp(model, entry, cols), sigma, blockwise=False) + EPS * torch.eye(6 * len(cols), dtype=DT)
        torch.testing.assert_close(entry.extras["kernel"], k, **EXACT)
        kinvs.append(torch.linalg.inv(k))
        with torch.no_grad():
            p_olds.append(_probs(model, entry.x, entry.head, cols))
    _perturb(model, gen, 0.2)
    pen, _ = _penalty_and_grad(reg, model, tasks[-1])
    expect = 0.0
    for entry, task, kinv, p_old in zip(reg.memory, tasks, kinvs, p_olds):
        with torch.no_grad():
            d = (_probs(model, entry.x, entry.head, list(task.classes)) - p_old).reshape(-1)
        expect = expect + 0.5 * TAU * d @ kinv @ d
    torch.testing.assert_close(pen, expect, rtol=1e-7, atol=1e-10)


def test_kron_kernel_equals_dense_damped_kfac_sigma(gen):
    stream, tasks = _stream("task")
    model = _model(stream)
    reg = FunctionalRegularizer(tau=TAU, n_points=6, kernel="kron", prior_precision=DELTA, jitter=EPS)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    acc = {n: [0, 0, 0] for n in layers}  # Σ N·A, N, Σ G over the tasks that used the layer
    for t in tasks[:-1]:
        _perturb(model, gen)
        reg.on_task_end(model, t)
        for n, layer in layers.items():
            if n.startswith("heads.") and n != f"heads.{t.head}":
                continue  # another task's head: not reached by this task's data
            a, g = O.kfac_factors(model, layer, t.x_train, head=t.head)
            acc[n][0] += t.n_train * a
            acc[n][1] += t.n_train
            acc[n][2] = acc[n][2] + g
    _perturb(model, gen)
    reg.on_task_start(model, tasks[-1])
    blocks = []
    sq = DELTA**0.5
    for n, (a_sum, cnt, g) in acc.items():
        if cnt == 0:  # never used: Σ = I/δ
            d_in, d_out = layers[n].in_features + 1, layers[n].out_features
            a_cov, g_cov = torch.eye(d_in, dtype=DT) / sq, torch.eye(d_out, dtype=DT) / sq
        else:
            a = a_sum / cnt
            pi = ((a.trace() / a.shape[0]) / (g.trace() / g.shape[0])).sqrt()
            a_cov = torch.linalg.inv(a + pi * sq * torch.eye(a.shape[0], dtype=DT))
            g_cov = torch.linalg.inv(g + sq / pi * torch.eye(g.shape[0], dtype=DT))
        blocks.append(KronBlock(f"{n}.weight", f"{n}.bias", a_cov, g_cov))
    sigma = O.kron_to_dense(KronCurvature(blocks, {}), params_of(model))
    for entry in reg.memory:
        expect = O.kernel(_oracle_jp(model, entry, None), sigma, blockwise=True) + EPS * torch.eye(len(entry), dtype=DT)
        torch.testing.assert_close(entry.extras["kernel"], expect, rtol=1e-7, atol=1e-10)


def _grown_output_layer(layer, extra):
    new = torch.nn.Linear(layer.in_features, layer.out_features + extra).to(DT)
    with torch.no_grad():
        new.weight[: layer.out_features] = layer.weight
        new.bias[: layer.out_features] = layer.bias
    return new


@pytest.mark.parametrize("growth", ["new_head", "more_outputs"])
def test_growing_model_gets_zero_past_curvature_for_new_parameters(gen, growth):
    """A head added after a task (Avalanche's MultiHeadClassifier) or a head that gains output units
    (IncrementalClassifier): the accumulated F is zero for the new entries, Σ = 1/δ there."""
    stream, tasks = _stream("class", n_tasks=3, k=2)  # classes (0,1), (2,3), (4,5)
    model = build_model("mlp", (4,), 2, 1, hidden=(5,), generator=torch.Generator().manual_seed(0)).to(DT)
    reg = FunctionalRegularizer(tau=TAU, n_points=4, prior_precision=DELTA, jitter=EPS, classes="task",
                                class_incremental=True)
    t0, t1 = tasks[0], tasks[1]
    if growth == "new_head":  # task 0 on head 0 with labels 0/1, task 1 on a head added afterwards
        t0 = type(t0)(0, t0.x_train, t0.y_train, t0.x_test, t0.y_test, (0, 1), head=0)
        t1 = type(t1)(1, t1.x_train, t1.y_train - 2, t1.x_test, t1.y_test - 2, (0, 1), head=1)
        reg.class_incremental = False
    _perturb(model, gen)
    reg.on_task_end(model, t0)
    f0 = {n: t.clone() for n, t in zip(params_of(model), torch.diagonal(O.ggn(model, t0.x_train, head=0))
                                         .split([p.numel() for p in params_of(model).values()]))}
    if growth == "new_head":
        model.heads.append(_grown_output_layer(model.heads[0], 0))
    else:
        model.heads[0] = _grown_output_layer(model.heads[0], 2)
    _perturb(model, gen)
    reg.on_task_end(model, t1)
    fisher = torch.diagonal(O.ggn(model, t1.x_train, head=t1.head)).clone()
    _perturb(model, gen)
    reg.on_task_start(model, tasks[2])
    offset = 0
    for n, p in params_of(model).items():
        if n in f0:
            old = f0[n].reshape(-1 if p.dim() == 1 else f0[n].numel() // p.shape[1], *p.shape[1:])
            padded = torch.zeros_like(p)
            padded[tuple(slice(0, s) for s in old.shape)] = old
            fisher[offset: offset + p.numel()] += padded.reshape(-1)
        offset += p.numel()
    sigma = torch.diag(1.0 / (fisher + DELTA))
    for entry in reg.memory:
        cols = _columns(entry)
        expect = O.kernel(_oracle_jp(model, entry, cols), sigma, blockwise=True) + EPS * torch.eye(len(entry), dtype=DT)
        torch.testing.assert_close(entry.extras["kernel"], expect, **EXACT)
    _penalty_and_grad(reg, model, tasks[2])  # the step runs on the grown model


def test_fromp_l2_is_half_tau_squared_distance(gen):
    stream, tasks = _stream("task")
    model = _model(stream)
    reg = FunctionalRegularizer(tau=TAU, n_points=6, kernel="identity")
    _run_boundaries(reg, model, tasks, gen)
    assert reg.fisher is None and "kernel" not in reg.memory[0].extras  # no curvature for K = I
    with torch.no_grad():
        p_olds = [_probs(model, e.x, e.head) for e in reg.memory]
    _perturb(model, gen, 0.2)
    pen, _ = _penalty_and_grad(reg, model, tasks[-1])
    with torch.no_grad():
        expect = sum(0.5 * TAU * ((_probs(model, e.x, e.head) - p) ** 2).sum() for e, p in zip(reg.memory, p_olds))
    torch.testing.assert_close(pen, expect, **EXACT)


def test_tau_zero_is_exactly_the_unregularised_loss(gen):
    stream, tasks = _stream("task")
    model = _model(stream)
    method = build_method("fromp", {"tau": 0.0, "n_points": 6}, seed=0)
    method.setup(model, stream, TrainConfig())
    for t in tasks[:-1]:
        method.on_task_start(model, t)
        _perturb(model, gen)
        method.on_task_end(model, t)
    method.on_task_start(model, tasks[-1])
    _perturb(model, gen, 0.2)
    t = tasks[-1]
    batch = Batch(t.x_train[:5], t.y_train[:5], t.head)
    loss = method.loss(model, batch, t)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    ce = F.cross_entropy(model(batch.x, head=batch.head), batch.y)
    grads_ce = torch.autograd.grad(ce, list(model.parameters()), allow_unused=True)
    assert torch.equal(loss, ce)
    for a, b in zip(grads, grads_ce):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("kernel", ["classwise", "full", "identity"])
def test_functional_params_path_matches_module_path(gen, kernel):
    """penalty(..., params=θ) (what the BLR optimisers differentiate with torch.func) equals the module path."""
    stream, tasks = _stream("task")
    model = _model(stream)
    reg = FunctionalRegularizer(tau=TAU, n_points=6, kernel=kernel, prior_precision=DELTA, jitter=EPS)
    _run_boundaries(reg, model, tasks, gen)
    _perturb(model, gen, 0.2)
    t = tasks[-1]
    batch = Batch(t.x_train[:2], t.y_train[:2], t.head)
    pen, grad = _penalty_and_grad(reg, model, t)
    theta = params_of(model)
    pen_f = reg.penalty(model, batch, t, params=theta)
    grad_f = torch.func.grad(lambda p: reg.penalty(model, batch, t, params=p))(theta)
    torch.testing.assert_close(pen_f, pen, **EXACT)
    torch.testing.assert_close(flatten(grad_f), grad, **EXACT)


@pytest.mark.parametrize("name", ["fromp", "fromp-kron"])
def test_state_dict_round_trip_through_torch_save(gen, name):
    stream, tasks = _stream("task")
    model = _model(stream)
    method = build_method(name, {"n_points": 6, "tau": TAU}, seed=0)
    method.setup(model, stream, TrainConfig())
    _run_boundaries(method.regularizer, model, tasks, gen)
    _perturb(model, gen, 0.2)
    t = tasks[-1]
    batch = Batch(t.x_train[:2], t.y_train[:2], t.head)
    buf = io.BytesIO()
    torch.save(method.state_dict(), buf)
    buf.seek(0)
    other = build_method(name, {"n_points": 6, "tau": TAU}, seed=5)
    other.load_state_dict(torch.load(buf, weights_only=True))
    torch.testing.assert_close(other.regularizer.penalty(model, batch, t), method.regularizer.penalty(model, batch, t),
                               **EXACT)
    e = other.regularizer.memory[1]
    assert (e.task_id, e.head, e.selection) == (1, 1, "lambda") and e.indices.shape == (6,)
    other.regularizer.rebuild(model)  # rebuilding from the reloaded store works as well
    with pytest.raises(ValueError, match="kernel"):
        build_method("fromp-l2").load_state_dict(method.state_dict())


def test_registry_names_params_and_errors():
    cases = {"fromp": ("classwise", "lambda"), "frorp": ("classwise", "random"),
             "fromp-l2": ("identity", "lambda"), "fromp-full": ("full", "lambda"), "fromp-kron": ("kron", "lambda")}
    for name, (kernel, selection) in cases.items():
        m = build_method(name, {"tau": 1})
        assert (m.regularizer.kernel, m.regularizer.selection, m.regularizer.tau) == (kernel, selection, 1.0)
    m = build_method("fromp", {"selection": "lowest", "kernel": "full", "classes": "task"})
    assert (m.regularizer.selection, m.regularizer.kernel, m.regularizer.classes) == ("lowest", "full", "task")
    for bad, field in [({"kernel": "diag"}, "kernel"), ({"selection": "top"}, "selection"), ({"tau": -1}, "tau"),
                       ({"n_points": 0}, "n_points"), ({"prior_precision": 0}, "prior_precision"),
                       ({"classes": "some"}, "classes"), ({"taus": 1}, "taus"), ({"tau": "big"}, "tau")]:
        with pytest.raises(ConfigError, match=field):
            build_method("fromp", bad)


@pytest.mark.parametrize("name", ["fromp", "frorp", "fromp-l2", "fromp-full", "fromp-kron"])
def test_methods_run_through_the_loop(name):
    stream = make_stream("synthetic", scenario="task", n_tasks=3, n_features=6, n_train=40, n_test=20, seed=1)
    runs = []
    for _ in range(2 if name == "frorp" else 1):
        model = build_model("mlp", stream.input_shape, stream.n_outputs, stream.n_heads, hidden=(8,),
                            generator=torch.Generator().manual_seed(0))
        method = build_method(name, {"n_points": 4, "tau": 1.0}, seed=3)
        res = run_stream(model, stream, method, TrainConfig(epochs=2, batch_size=16, grad_clip=1.0), seed=0,
                         progress=False)
        runs.append((res, method))
    res, method = runs[0]
    assert len(res.acc_matrix) == 3 and all(0.0 <= v <= 1.0 for v in res.acc_matrix[-1])
    assert [e.task_id for e in method.regularizer.memory] == [0, 1, 2]
    if name == "frorp":  # the random selection is seeded by the method's seed
        assert all(torch.equal(a.indices, b.indices) for a, b in zip(runs[0][1].regularizer.memory,
                                                                     runs[1][1].regularizer.memory))


def test_penalty_forward_runs_in_eval_mode_under_dropout(gen):
    """A dropout network in train mode gives the same penalty twice, equal to the eval-mode oracle
    ½τ Σ_c Δp_cᵀ K_c⁻¹ Δp_c; the model's own train flags are left as they were."""
    from continual_blr.models import CifarNet

    stream, tasks = _stream("task")
    model = build_model("mlp", (4,), stream.n_outputs, stream.n_heads, hidden=(5,),
                        generator=torch.Generator().manual_seed(0)).to(DT)
    model.body.append(torch.nn.Dropout(0.5))  # body = Flatten, Linear, ReLU, Dropout
    reg = FunctionalRegularizer(tau=TAU, n_points=6, prior_precision=DELTA, jitter=EPS)
    _run_boundaries(reg, model, tasks, gen)
    _perturb(model, gen, 0.2)
    model.train()
    batch = Batch(tasks[-1].x_train[:2], tasks[-1].y_train[:2], tasks[-1].head)
    first, second = reg.penalty(model, batch, tasks[-1]), reg.penalty(model, batch, tasks[-1])
    assert first.item() > 0.0
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert all(m.training for m in model.modules())
    model.eval()
    expect = reg.penalty(model, batch, tasks[-1])
    torch.testing.assert_close(first, expect, **EXACT)
    # the train-mode forward differs under dropout (the check above could not pass by accident)
    model.train()
    x = reg.memory.entries[0].x
    with torch.no_grad():
        assert not torch.equal(model(x, head=0), model(x, head=0))
