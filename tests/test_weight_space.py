"""Weight-space priors (EWC, online Laplace, L2) and the methods built on them, against float64
brute force: per-example Fisher loops, dense GGNs, hand-written K-FAC factors and batch Bayes."""

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

import oracles as O
from conftest import EXACT, EXACT32
from continual_blr.config import ConfigError
from continual_blr.data import make_stream
from continual_blr.data.stream import Task
from continual_blr.loop import run_stream
from continual_blr.methods import METHODS, build_method
from continual_blr.methods.base import TrainConfig
from continual_blr.models import MLP, build_model
from continual_blr.regularizers.weight_space import GaussianPrior, last_layer_names
from continual_blr.types import Batch, flatten, params_of, unflatten

DT = torch.float64
REL_CONJUGATE = 1e-8  # sequential vs batch Bayes: exact up to round-off


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def _mlp(gen, n_in=3, hidden=(4,), n_out=3, n_heads=1):
    model = build_model("mlp", (n_in,), n_out, n_heads, hidden=hidden, generator=gen).to(DT)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=DT))
    return model.eval()


def _task(gen, n=7, n_in=3, n_out=3, task_id=0, head=0):
    x = torch.randn(n, n_in, generator=gen, dtype=DT)
    y = torch.randint(n_out, (n,), generator=gen)
    return Task(task_id, x, y, x[:2], y[:2], tuple(range(n_out)), head=head, name=f"t{task_id}")


def _perturb(model, gen, scale=0.3):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=DT))


def _flat(model):
    return flatten(params_of(model))


def _brute_fisher(model, task, kind):
    """Diagonal per-example-mean Fisher, [P]: one backward per example (EF) or the dense GGN (ggn)."""
    if kind == "empirical_fisher":
        _, g = O.per_example_grads(model, task.x_train, task.y_train, head=task.head)
        return (g**2).mean(0)
    return torch.diagonal(O.ggn(model, task.x_train, head=task.head)) / task.n_train


def _penalty_and_grad(reg, model, task, theta_flat):
    theta = theta_flat.clone().requires_grad_(True)
    batch = Batch(task.x_train[:2], task.y_train[:2], task.head)
    pen = reg.penalty(model, batch, task, unflatten(theta, params_of(model)))
    (grad,) = torch.autograd.grad(pen, theta)
    return pen.detach(), grad


# ----------------------------------------------------------------------------------------------
# EWC
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fisher", ["empirical_fisher", "ggn"])
def test_ewc_penalty_and_gradient_equal_formula(gen, fisher):
    """(λ/2) Σ F̄ (θ − θ*)² and its gradient λ F̄ (θ − θ*), F̄ from a per-example loop."""
    lam = 3.7
    model = _mlp(gen)
    task = _task(gen)
    method = build_method("ewc", {"lam": lam, "fisher": fisher})
    method.regularizer.setup(model)
    method.on_task_end(model, task)
    f = _brute_fisher(model, task, fisher)
    star = _flat(model)
    theta = star + 0.5 * torch.randn(star.shape, generator=gen, dtype=DT)
    pen, grad = _penalty_and_grad(method.regularizer, model, _task(gen, task_id=1), theta)
    torch.testing.assert_close(pen, 0.5 * lam * (f * (theta - star) ** 2).sum(), **EXACT)
    torch.testing.assert_close(grad, lam * f * (theta - star), **EXACT)


@pytest.mark.parametrize("mode", ["online", "separate"])
def test_ewc_modes_equal_hand_written_recursion_over_three_tasks(gen, mode):
    """online: F̃_k = γ F̃_{k−1} + F̄_k at θ*_k; separate: one term per task."""
    lam, gamma = 2.0, 0.6
    model = _mlp(gen)
    method = build_method("ewc", {"lam": lam, "mode": mode, "decay": gamma, "fisher": "empirical_fisher"})
    method.regularizer.setup(model)
    stars, fishers = [], []
    for k in range(3):
        _perturb(model, gen)  # "training" moves the weights
        task = _task(gen, n=5 + k, task_id=k)
        method.on_task_end(model, task)
        stars.append(_flat(model))
        fishers.append(_brute_fisher(model, task, "empirical_fisher"))
    theta = stars[-1] + 0.4 * torch.randn(stars[-1].shape, generator=gen, dtype=DT)
    pen, grad = _penalty_and_grad(method.regularizer, model, _task(gen, task_id=3), theta)
    if mode == "online":
        f_run = fishers[0]
        f_run = gamma * f_run + fishers[1]
        f_run = gamma * f_run + fishers[2]
        want = 0.5 * lam * (f_run * (theta - stars[2]) ** 2).sum()
        want_grad = lam * f_run * (theta - stars[2])
    else:
        want = sum(0.5 * lam * (f * (theta - s) ** 2).sum() for f, s in zip(fishers, stars))
        want_grad = sum(lam * f * (theta - s) for f, s in zip(fishers, stars))
    assert len(method.regularizer.terms) == (1 if mode == "online" else 3)
    torch.testing.assert_close(pen, want, **EXACT)
    torch.testing.assert_close(grad, want_grad, **EXACT)


# ----------------------------------------------------------------------------------------------
# Laplace
# ----------------------------------------------------------------------------------------------
class _LinearGaussian(nn.Module):
    """f(x) = w·x + b, the linear-Gaussian oracle (called like every model, with ``head``)."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, 1).to(DT)

    def forward(self, x, head=0):
        return self.lin(x)


def _newton_map(model, reg, task, sigma):
    """argmin (1/N) Σ ½(y − f)²/σ² + penalty: a quadratic, so Newton steps are exact."""
    like = params_of(model)

    def objective(v):
        p = unflatten(v, like)
        f = torch.func.functional_call(model, p, (task.x_train,))[:, 0]
        nll = (0.5 * (task.y_train - f) ** 2 / sigma**2).mean()
        return nll + reg.penalty(model, Batch(task.x_train, task.y_train), task, p)

    v = flatten(like).clone()
    for _ in range(2):
        v = v - torch.linalg.solve(torch.func.hessian(objective)(v), torch.func.grad(objective)(v))
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(unflatten(v, like)[k])


def test_online_laplace_full_reproduces_sequential_bayes(gen):
    """Full structure on the linear-Gaussian oracle: posterior of task t as the prior of t+1 equals
    the batch posterior N(S⁻¹ X̃ᵀy/σ², S = δI + X̃ᵀX̃/σ²), X̃ = [x, 1]."""
    d, sigma, delta = 4, 0.4, 0.7
    x = torch.randn(60, d, generator=gen, dtype=DT)
    y = x @ torch.randn(d, generator=gen, dtype=DT) + 0.3 + sigma * torch.randn(60, generator=gen, dtype=DT)
    model = _LinearGaussian(d)
    reg = GaussianPrior(structure="full", curvature="ggn", mode="online", divide_by_n=True,
                        prior_precision=delta, likelihood="regression", sigma=sigma)
    reg.setup(model)
    for k, (xs, ys) in enumerate(zip(x.split([10, 30, 20]), y.split([10, 30, 20]))):
        task = Task(k, xs, ys, xs, ys, (0,))
        _newton_map(model, reg, task, sigma)
        reg.on_task_end(model, task)
    xt = torch.cat([x, torch.ones(60, 1, dtype=DT)], 1)
    prec = delta * torch.eye(d + 1, dtype=DT) + xt.T @ xt / sigma**2
    mean = torch.linalg.solve(prec, xt.T @ y / sigma**2)
    m_seq, s_seq = reg.posterior().to_dense()
    assert torch.linalg.norm(m_seq - mean) / torch.linalg.norm(mean) < REL_CONJUGATE
    assert torch.linalg.norm(s_seq - prec) / torch.linalg.norm(prec) < REL_CONJUGATE


def _laplace(structure, delta, temperature, model, tasks):
    method = build_method("laplace", {"structure": structure, "prior_precision": delta, "temperature": temperature})
    method.regularizer.setup(model)
    for t in tasks:
        method.on_task_end(model, t)
    return method.posterior()


def _layer_index(model):
    """Flat indices (``types.flatten`` order) of each Linear layer's weight and bias."""
    offsets, start = {}, 0
    for k, p in params_of(model).items():
        offsets[k] = torch.arange(start, start + p.numel())
        start += p.numel()
    return {w: torch.cat([offsets[w], offsets[b]]) for w, b in (("body.1.weight", "body.1.bias"),
                                                               ("heads.0.weight", "heads.0.bias"))}


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_laplace_diag_and_full_against_dense_ggn(gen, structure):
    """S = δI + Σ_t C_t / T with C_t the dense GGN (full) or its exact diagonal (diag), over 2 tasks."""
    delta, temp = 0.3, 0.5
    model = _mlp(gen)
    tasks = [_task(gen, n=6), _task(gen, n=9, task_id=1)]
    ggns = []
    post = None
    method = build_method("laplace", {"structure": structure, "prior_precision": delta, "temperature": temp})
    method.regularizer.setup(model)
    for t in tasks:
        _perturb(model, gen)
        ggns.append(O.ggn(model, t.x_train))
        method.on_task_end(model, t)
    post = method.posterior()
    want = delta * torch.eye(ggns[0].shape[0], dtype=DT) + sum(ggns) / temp
    if structure == "diag":
        want = torch.diag(torch.diagonal(want))
    mean, got = post.to_dense()
    torch.testing.assert_close(got, want, **EXACT)
    torch.testing.assert_close(mean, _flat(model), **EXACT)


def test_laplace_kron_is_exact_per_layer_for_one_example(gen):
    """One example: each layer's K-FAC block A ⊗ G equals that layer's block of the dense GGN;
    blocks between layers are dropped (zero)."""
    delta, temp = 0.2, 2.0
    model = _mlp(gen)
    task = _task(gen, n=1)
    g_dense = O.ggn(model, task.x_train)
    _, got = _laplace("kron", delta, temp, model, [task]).to_dense()
    want = torch.zeros_like(g_dense)
    for idx in _layer_index(model).values():
        want[idx.unsqueeze(1), idx.unsqueeze(0)] = g_dense[idx.unsqueeze(1), idx.unsqueeze(0)] / temp
    want = want + delta * torch.eye(want.shape[0], dtype=DT)
    torch.testing.assert_close(got, want, **EXACT)


def _kfac_brute(model, x):
    """K-FAC factors by hand for MLP(·, (h,), K): A = (1/N) Σ ããᵀ, G = Σ_b J_bᵀ Λ_b J_b with J_b the
    Jacobian of the logits with respect to the layer's pre-activation; keyed by weight name."""
    w1, b1 = model.body[1].weight, model.body[1].bias
    w2, b2 = model.heads[0].weight, model.heads[0].bias
    out = {}
    with torch.no_grad():
        z1 = x @ w1.T + b1
        h = torch.relu(z1)
        f = h @ w2.T + b2
        p = torch.softmax(f, -1)
        lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
        one = torch.ones(x.shape[0], 1, dtype=DT)
        a1, a2 = torch.cat([x, one], 1), torch.cat([h, one], 1)
        j1 = w2[None] * (z1 > 0).to(DT)[:, None, :]  # ∂f/∂z1 = W2 diag(relu'(z1))
        out["body.1.weight"] = (a1.T @ a1 / x.shape[0], torch.einsum("bki,bkl,blj->ij", j1, lam, j1))
        out["heads.0.weight"] = (a2.T @ a2 / x.shape[0], lam.sum(0))
    return out


def test_laplace_kron_equals_hand_written_kfac_over_two_tasks(gen):
    """N > 1 and two tasks: the penalty's quadratic form is δ‖v‖² + Σ_t Σ_layers tr(Vᵀ G_t V A_t)/T with
    V = [ΔW | Δb] and the K-FAC factors written out by hand — the documented approximation."""
    delta, temp = 0.4, 0.25
    model = _mlp(gen)
    method = build_method("laplace", {"structure": "kron", "prior_precision": delta, "temperature": temp})
    method.regularizer.setup(model)
    factors = []
    for k in range(2):
        _perturb(model, gen)
        task = _task(gen, n=8, task_id=k)
        factors.append(_kfac_brute(model, task.x_train))
        method.on_task_end(model, task)
    post = method.posterior()
    v = {k: torch.randn(p.shape, generator=gen, dtype=DT) for k, p in params_of(model).items()}
    got = post.quadratic({k: post.mean[k] + v[k] for k in v})
    want = delta * sum((t**2).sum() for t in v.values())
    for fac in factors:
        for w, (a, g) in fac.items():
            vm = torch.cat([v[w], v[w.replace("weight", "bias")][:, None]], 1)
            want = want + torch.trace(vm.T @ g @ vm @ a) / temp
    torch.testing.assert_close(got, want, **EXACT)


def test_laplace_penalty_is_prior_over_n(gen):
    """penalty = (1/(2N_t)) (θ − m)ᵀ S (θ − m) with N_t the *current* task's size; task 1 sees N(0, δ⁻¹I)."""
    delta = 0.9
    model = _mlp(gen)
    method = build_method("laplace", {"structure": "diag", "prior_precision": delta})
    method.setup(model, None, TrainConfig())
    task = _task(gen, n=11)
    theta = _flat(model)
    pen, _ = _penalty_and_grad(method.regularizer, model, task, theta)
    torch.testing.assert_close(pen, 0.5 * delta * (theta**2).sum() / 11, **EXACT)


def test_last_layer_subset_and_full_structure(gen):
    model = _mlp(gen, n_heads=2)
    assert last_layer_names(model) == ["heads.0.weight", "heads.0.bias", "heads.1.weight", "heads.1.bias"]
    method = build_method("laplace", {"structure": "full", "subset": "last_layer", "prior_precision": 1.0,
                                      "temperature": 1.0})
    method.regularizer.setup(model)
    task = _task(gen, n=5, head=1)
    method.on_task_end(model, task)
    post = method.posterior()
    assert list(post.mean) == last_layer_names(model)
    names = last_layer_names(model)
    g = O.ggn(model, task.x_train, head=1, param_names=names)
    torch.testing.assert_close(post.to_dense()[1], torch.eye(g.shape[0], dtype=DT) + g, **EXACT)


def test_full_structure_refuses_large_models():
    model = MLP(100, (200,), 10)  # 22,210 parameters
    reg = GaussianPrior(structure="full", prior_precision=1.0)
    with pytest.raises(ValueError, match="last_layer"):
        reg.setup(model)


# ----------------------------------------------------------------------------------------------
# L2
# ----------------------------------------------------------------------------------------------
def test_l2_penalises_the_union_of_used_parameters(gen):
    """(λ/2) Σ_j u_j (θ_j − θ*_j)², u = parameters some past task used (not unseen heads)."""
    lam = 0.7
    model = _mlp(gen, n_heads=3)
    method = build_method("l2", {"lam": lam})
    method.regularizer.setup(model)
    method.on_task_end(model, _task(gen, head=0))
    _perturb(model, gen)
    method.on_task_end(model, _task(gen, task_id=1, head=1))
    post = method.regularizer.posterior()
    for k, s in post.precision.items():
        assert torch.all(s == (0.0 if k.startswith("heads.2") else 1.0)), k
    star = _flat(model)
    theta = star + torch.randn(star.shape, generator=gen, dtype=DT)
    pen, grad = _penalty_and_grad(method.regularizer, model, _task(gen, task_id=2, head=2), theta)
    u = flatten(post.precision)
    torch.testing.assert_close(pen, 0.5 * lam * (u * (theta - star) ** 2).sum(), **EXACT)
    torch.testing.assert_close(grad, lam * u * (theta - star), **EXACT)


# ----------------------------------------------------------------------------------------------
# registry, configs, validation, end to end
# ----------------------------------------------------------------------------------------------
def test_registry_names():
    for name in ("ewc", "laplace", "vcl", "l2", "ivon", "blr", "none", "joint"):
        assert name in METHODS


@pytest.mark.parametrize(
    "name, params, field",
    [
        ("ewc", {"mode": "both"}, "params.mode"),
        ("ewc", {"fisher": "hessian"}, "params.fisher"),
        ("ewc", {"lam": "big"}, "params.lam"),
        ("ewc", {"decay": 1.5}, "params.decay"),
        ("laplace", {"structure": "block"}, "params.structure"),
        ("laplace", {"temperature": 0}, "params.temperature"),
        ("laplace", {"prior_precision": -1}, "params.prior_precision"),
        ("laplace", {"subset": "first_layer"}, "params.subset"),
        ("laplace", {"curvature": "hessian"}, "params.curvature"),
        ("l2", {"lam": -1}, "params.lam"),
        ("l2", {"lambda": 1}, "lambda"),
        ("blr", {"structure": "full"}, "params.structure"),
    ],
)
def test_bad_params_are_one_line_errors(name, params, field):
    with pytest.raises(ConfigError, match=field):
        build_method(name, params)


def test_gaussian_prior_validation():
    for kwargs, match in [
        (dict(mode="twice"), "mode"), (dict(decay=2.0), "decay"), (dict(scale=-1.0), "scale"),
        (dict(curvature_scale=0.0), "curvature_scale"), (dict(prior_precision=-1.0), "prior_precision"),
        (dict(mode="separate", prior_precision=1.0), "prior_precision"), (dict(curvature="bogus"), "curvature"),
        (dict(curvature="identity", structure="kron"), "identity"),
        (dict(curvature="hessian", structure="kron"), "hessian"),
    ]:
        with pytest.raises(ValueError, match=match):
            GaussianPrior(**kwargs)
    with pytest.raises(ValueError, match="param_names"):
        GaussianPrior(param_names="body").names(MLP(2, (2,), 2))


# Bounds of the end-to-end runs below. The synthetic stream's tasks are two well-separated Gaussian
# blobs with balanced test sets (10 + 10 examples per task), so a network that ignores its input
# scores exactly 0.5 on a task's own 2-way head (task scenario) and, on the one 4-way head of the
# class scenario, at most 0.5 on one task and 0 on the other (uniform guessing: 0.25 on each).
# Measured at these settings (model seeds 0-5, 10 epochs, Adam 0.02; the test runs seed 0): the task
# scenario reaches R[i][i] >= 0.95 and an average >= 0.95 for every method listed; the class scenario
# R[i][i] >= 0.9 and an average >= 0.725 (0.775 at seed 0) except where a strong pull on the shared head
# costs the second task: L2 0.45-0.9 (0.65 at seed 0), the BLR defaults (T = 0.01) 0.0-0.9 (0.75 at seed
# 0), the Kronecker BLR 0.5-0.9 (0.9 at seed 0), IVON 0.7-1.0 (1.0 at seed 0).
E2E_TASK_MIN = 0.85  # R[i][i] and the final average, task scenario (chance 0.5)
E2E_CLASS_JUST_TRAINED_MIN = 0.6  # R[i][i], class scenario (input-blind: <= 0.5)
E2E_CLASS_AVG_MIN = 0.7  # final average, class scenario (input-blind: <= 0.25)


@pytest.mark.parametrize(
    "name, params",
    [
        ("ewc", {"mode": "online", "decay": 0.9, "fisher": "mc_fisher"}),
        ("ewc", {"fisher": "empirical_fisher"}),
        ("laplace", {"structure": "diag"}),
        ("laplace", {"structure": "kron"}),
        ("laplace", {"structure": "full", "subset": "last_layer"}),
        ("l2", {}),
        ("blr", {}),
        ("blr", {"structure": "kron", "init_precision": 400.0}),
        ("ivon", {}),
    ],
)
@pytest.mark.parametrize("scenario", ["task", "class"])
def test_methods_run_end_to_end(name, params, scenario):
    """Each method trains a 2-task stream to accuracies no input-blind predictor reaches (bounds above),
    and its state_dict restores the same regulariser / prior into a fresh method."""
    torch.set_num_threads(1)
    stream = make_stream("synthetic", scenario=scenario, n_tasks=2, n_train=40, n_test=20, n_features=5, seed=3)
    model = build_model("mlp", (5,), stream.n_outputs, stream.n_heads, hidden=(8,), generator=torch.Generator().manual_seed(0))
    method = build_method(name, params, seed=0)
    res = run_stream(model, stream, method, TrainConfig(epochs=10, batch_size=16, lr=0.02), progress=False)
    acc = res.acc_matrix
    assert all(math.isfinite(acc[i][j]) for i in range(2) for j in range(i + 1))
    just_trained = [acc[i][i] for i in range(2)]
    if scenario == "task":
        assert min(just_trained) >= E2E_TASK_MIN, acc
        assert res.avg_acc >= E2E_TASK_MIN, acc
    else:
        assert min(just_trained) >= E2E_CLASS_JUST_TRAINED_MIN, acc
        assert res.avg_acc >= E2E_CLASS_AVG_MIN, acc
    state = method.state_dict()
    fresh = build_method(name, params, seed=0)
    fresh.setup(model, stream, TrainConfig())
    fresh.load_state_dict(state)
    # the restored method pulls toward the same place: equal penalties at a point away from the weights
    theta = {k: p.detach() + 0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1))
             for k, p in model.named_parameters()}
    batch = Batch(stream.tasks[1].x_train[:4], stream.tasks[1].y_train[:4], stream.tasks[1].head)
    if name in ("blr", "ivon"):  # ivon is the IVON-form BLR
        before, after = method.posterior().quadratic(theta), fresh.optimizer.prior.quadratic(theta)
    else:
        before = method.regularizer.penalty(model, batch, stream.tasks[1], theta)
        after = fresh.regularizer.penalty(model, batch, stream.tasks[1], theta)
    assert float(before) > 0
    torch.testing.assert_close(after, before, **EXACT32)


def _weights(model):
    return {k: p.detach().clone() for k, p in model.named_parameters()}


PULL_RATIO = 0.75  # task 2's movement away from task 1's mean, carried prior / counterfactual prior


def test_blr_kron_posterior_is_carried_as_prior():
    """Kronecker BLR: every step of task 2 uses as its prior the posterior the optimiser held when task 1's
    training ended (snapshotted after the last step, *before* the task boundary runs) — mean = the model's
    weights then, precision ⪰ the initial δI and far from it — and task 2's training is held near it:
    closer to task 1's mean than the same run of task 2 under the initial prior N(0, δ⁻¹I) or under task
    1's precision centred at 0 (the pull toward the prior's mean, not only the smaller steps a larger
    precision takes)."""
    from continual_blr.loop import fit_task
    from continual_blr.posteriors import KronPosterior, kron_layers, load_posterior

    torch.set_num_threads(1)
    delta = 1.0
    # T = 1: the posterior itself is carried. The step is bounded by damping rather than clip_radius: a clip
    # caps how far task 2 can move whatever its prior, which would hide the pull this test looks for.
    params = {"structure": "kron", "init_precision": 100.0, "prior_precision": delta, "temperature": 1.0,
              "damping": 0.1, "clip_radius": None}
    stream = make_stream("synthetic", scenario="task", n_tasks=2, n_train=40, n_test=20, n_features=5, seed=3)
    model = build_model("mlp", (5,), stream.n_outputs, stream.n_heads, hidden=(8,), generator=torch.Generator().manual_seed(0))
    method = build_method("blr", params, seed=0)
    train = TrainConfig(epochs=5, batch_size=16)
    method.setup(model, stream, train)
    opt = method.optimizer
    v = {k: torch.randn(t.shape, generator=torch.Generator().manual_seed(5)) for k, t in _weights(model).items()}
    log = []

    def spy_step(closure):
        """Records the prior this step uses (mean, S₀v) and, after the step, the weights and the posterior."""
        used = ({k: t.clone() for k, t in opt.prior.mean.items()}, opt.prior.precision_matvec(v))
        loss = type(opt).step(opt, closure)
        log.append((_weights(model), copy.deepcopy(opt.posterior().state_dict()), used))
        return loss

    opt.step = spy_step
    fit_task(model, stream.tasks[0], method, train, seen=stream.tasks[:1], generator=torch.Generator().manual_seed(1),
             progress=False)
    n_steps_1 = len(log)
    weights_1 = log[-1][0]
    post_1 = load_posterior(log[-1][1])  # task 1's posterior before on_task_end ran
    assert post_1.structure.value == "kron"

    # counterfactuals of task 2 from the same state, generator and minibatches: under the initial prior
    # N(0, δ⁻¹I), and under task 1's precision centred at 0 instead of at task 1's mean
    zeros = {k: torch.zeros_like(w) for k, w in weights_1.items()}
    others = {}
    for case, prior in (("initial", KronPosterior.isotropic(zeros, delta, kron_layers(model))),
                        ("centred at 0", post_1.with_mean(zeros))):
        other = copy.deepcopy(model)
        m = build_method("blr", params, seed=0)
        m.setup(other, stream, train)
        m.optimizer.load_state_dict(copy.deepcopy(opt.state_dict()))
        m.generator.set_state(method.generator.get_state())
        m.optimizer.set_prior(prior)
        fit_task(other, stream.tasks[1], m, train, seen=stream.tasks, generator=torch.Generator().manual_seed(2),
                 progress=False)
        others[case] = other
    fit_task(model, stream.tasks[1], method, train, seen=stream.tasks, generator=torch.Generator().manual_seed(2),
             progress=False)
    del opt.step
    priors_2 = [prior for _, _, prior in log[n_steps_1:]]
    assert len(priors_2) == 5 * 3  # 5 epochs of 3 minibatches

    s1v = post_1.precision_matvec(v)
    for k in v:  # the posterior's mean is the weights; its precision is not the initial δI where task 1's
        # data reached (head 1 got no data: its precision may be the prior's or the starting one)
        torch.testing.assert_close(post_1.mean[k], weights_1[k], rtol=0, atol=0)
        if not k.startswith("heads.1."):
            assert float((s1v[k] - delta * v[k]).norm()) > 1.0 * float((delta * v[k]).norm()), k
    _, s1 = post_1.to_dense()
    eig = torch.linalg.eigvalsh(s1.double() - delta * torch.eye(s1.shape[0], dtype=torch.float64))
    assert float(eig.min()) >= -1e-4 * float(eig.max()), "the posterior's precision is not ⪰ the prior's δI"
    for prior_mean, sv in priors_2:
        for k in v:
            torch.testing.assert_close(prior_mean[k], weights_1[k], **EXACT32)
            torch.testing.assert_close(sv[k], s1v[k], **EXACT32)

    # pulled toward task 1's posterior: the layer both tasks train moves less, in task 1's precision
    body = {k for k in v if k.startswith("body.")}

    def moved(m):
        d = {k: (p.detach() - weights_1[k]) if k in body else torch.zeros_like(p) for k, p in m.named_parameters()}
        return float(sum((d[k] * sd).sum() for k, sd in post_1.precision_matvec(d).items()))

    # measured on this machine with exact sampling from S (perturb-and-solve) and the exact preconditioner:
    # 42.6 against 69.0 centred at 0 (0.62) and far less than under the initial prior; with the nearest-
    # Kronecker sampler and preconditioner of before, 246 against 207 (the pull did not show)
    carried = moved(model)
    for case, other in others.items():
        assert carried < PULL_RATIO * moved(other), (case, carried, moved(other))


# ----------------------------------------------------------------------------------------------
# IVON (the IVON-form BLR; its carried prior is tested in tests/test_blr_engine.py)
# ----------------------------------------------------------------------------------------------
def test_ivon_runs_reproducibly():
    torch.set_num_threads(1)
    stream = make_stream("synthetic", scenario="class", n_tasks=2, n_train=40, n_test=20, n_features=5, seed=3)
    accs = []
    for _ in range(2):
        model = build_model("mlp", (5,), stream.n_outputs, stream.n_heads, hidden=(8,),
                            generator=torch.Generator().manual_seed(0))
        res = run_stream(model, stream, build_method("ivon", {"predict_samples": 3}, seed=0),
                         TrainConfig(epochs=2, batch_size=16), progress=False)
        accs.append(res.acc_matrix)
    assert accs[0] == accs[1]


def test_params_dataclasses_roundtrip():
    for name in ("ewc", "laplace", "l2", "vcl", "ivon"):
        cls = METHODS[name][1]
        assert dataclasses.is_dataclass(cls)
        method = build_method(name, dataclasses.asdict(cls()))
        assert method.name == name
