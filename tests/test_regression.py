"""Gaussian regression at method level: the likelihood flows from the stream through Method.loss, the BLR
closure and evaluation; sequential Bayesian linear regression through build_method / run_stream ends at
the closed-form posteriors (float64).

Oracles. With rows x̃ = [xᵀ, 1] (the linear model's weight and bias), noise σ and prior N(0, δ⁻¹ I):

* batch posterior of the data so far:  S = δI + X̃ᵀX̃/σ²,  m = S⁻¹ X̃ᵀy/σ²;
* mean-field (diagonal) VCL recursion, prior N(m₀, diag s₀⁻¹): the ELBO's optimum over
  q = N(μ, diag s⁻¹) sets ∂/∂μ = 0: (diag s₀ + X̃ᵀX̃/σ²) μ = s₀∘m₀ + X̃ᵀy/σ² (the full system), and
  ∂/∂s⁻¹ = 0: s = s₀ + diag(X̃ᵀX̃)/σ² (E_q[½(y − x̃ᵀθ)²]/σ² = ½[(y − x̃ᵀμ)² + Σ_j x̃_j² s_j⁻¹]/σ²).
"""

import pytest
import torch

from conftest import EXACT
from continual_blr.data.stream import Task, TaskStream
from continual_blr.data.synthetic import linear_regression_stream
from continual_blr.loop import evaluate_task, run_stream
from continual_blr.methods import build_method
from continual_blr.methods.base import Method, TrainConfig
from continual_blr.models import build_model
from continual_blr.types import Batch, flatten

DT = torch.float64
SIGMA, DELTA = 0.5, 1.3
# Gradient descent / damped Newton steps on a strongly convex quadratic, run to convergence: the
# contraction per step is ≤ 0.92 (GD at lr 1/λ_max over all tasks) or ≤ 0.58 (damped Newton at α 0.9) on
# these streams, so 350 steps leave ≤ 1e-12 of the start; the rest is float64 rounding.
CONVERGED = dict(rtol=1e-7, atol=1e-9)


def regression_stream(n_tasks=3, seed=1, scenario="domain"):
    return linear_regression_stream(n_tasks=n_tasks, n_features=3, n_train=40, n_test=40, sigma=SIGMA,
                                    input_shift=0.5, seed=seed, scenario=scenario, dtype=DT)


def linear_model(stream):
    return build_model("linear", stream.input_shape, stream.n_outputs, stream.n_heads,
                       generator=torch.Generator().manual_seed(0)).to(DT)


def design(task: Task) -> torch.Tensor:
    """X̃ = [X, 1]: the columns of heads.<h>.weight then heads.<h>.bias (the flatten order)."""
    return torch.cat([task.x_train, torch.ones(task.n_train, 1, dtype=DT)], 1)


def batch_posterior(tasks, delta=DELTA, sigma=SIGMA):
    """(mean, precision) of the exact posterior after ``tasks`` (module docstring)."""
    x = torch.cat([design(t) for t in tasks])
    y = torch.cat([t.y_train for t in tasks])
    prec = delta * torch.eye(x.shape[1], dtype=DT) + x.T @ x / sigma**2
    return torch.linalg.solve(prec, x.T @ y / sigma**2), prec


def mean_field_recursion(tasks, delta=DELTA, sigma=SIGMA):
    """[(μ_t, s_t)] of mean-field VCL at the ELBO's optimum after each task (module docstring)."""
    p = tasks[0].x_train.shape[1] + 1
    m0, s0 = torch.zeros(p, dtype=DT), torch.full((p,), delta, dtype=DT)
    out = []
    for t in tasks:
        x, y = design(t), t.y_train
        xtx = x.T @ x / sigma**2
        mu = torch.linalg.solve(torch.diag(s0) + xtx, s0 * m0 + x.T @ y / sigma**2)
        m0, s0 = mu, s0 + torch.diagonal(xtx)
        out.append((m0, s0))
    return out


def newton_lr(stream, delta=DELTA, sigma=SIGMA):
    """1 / the largest eigenvalue of any task's mean-loss Hessian (S₀ + X̃ᵀX̃/σ²)/N_t under sequential Bayes:
    a gradient-descent step that contracts on every task."""
    s = delta * torch.eye(stream.input_shape[0] + 1, dtype=DT)
    top = 0.0
    for t in stream.tasks:
        s = s + design(t).T @ design(t) / sigma**2
        top = max(top, float(torch.linalg.eigvalsh(s / t.n_train).max()))
    return 1.0 / top


def spy_posteriors(method, model):
    """Record method.posterior(model) right after each on_task_end."""
    seen = []
    original = method.on_task_end

    def on_task_end(m, task, optimizer=None):
        original(m, task, optimizer)
        post = method.posterior(model)
        seen.append({k: v.clone() for k, v in post.mean.items()})
        seen[-1]["__precision__"] = post.precision.clone() if isinstance(post.precision, torch.Tensor) else \
            flatten(post.precision).clone()

    method.on_task_end = on_task_end
    return seen


def test_laplace_full_sequential_equals_batch_posterior():
    """Online Laplace (full GGN, exact for a linear-Gaussian model), task after task through run_stream:
    its posterior after task t is the batch posterior of tasks 1..t."""
    torch.set_num_threads(1)
    stream = regression_stream()
    model = linear_model(stream)
    method = build_method("laplace", {"structure": "full", "prior_precision": DELTA, "temperature": 1.0,
                                      "curvature": "ggn", "subset": "all"})
    seen = spy_posteriors(method, model)
    train = TrainConfig(epochs=350, batch_size=40, lr=newton_lr(stream), optimizer="sgd")
    res = run_stream(model, stream, method, train, progress=False)
    assert len(seen) == 3
    for t, snap in enumerate(seen):
        mean, prec = batch_posterior(stream.tasks[: t + 1])
        torch.testing.assert_close(flatten({k: snap[k] for k in ("heads.0.weight", "heads.0.bias")}), mean, **CONVERGED)
        torch.testing.assert_close(snap["__precision__"], prec, **CONVERGED)
    # the accuracy slot holds R² of the posterior mean (well above 0 on a 3-feature linear signal)
    assert all(0.3 < r < 1 for r in res.acc_matrix[-1])


def test_blr_diag_newton_reaches_the_mean_field_optimum():
    """The diagonal BLR with ρ = 1 (S = S₀ + N ĥ, ĥ the exact GGN), the delta method and a damped Newton
    mean step equals mean-field VCL's closed-form optimum after every task (full-batch steps)."""
    torch.set_num_threads(1)
    stream = regression_stream()
    model = linear_model(stream)
    method = build_method("blr", {"structure": "diag", "prior_precision": DELTA, "init_precision": 1.0, "lr": 0.9,
                                  "rho": 1.0, "beta1": 0.0, "mc_samples": 0, "ess_factor": 1.0,
                                  "temperature": 1.0, "clip_radius": None, "curvature": "ggn",
                                  "precision_debias": False, "predict_samples": 0})
    seen = spy_posteriors(method, model)
    run_stream(model, stream, method, TrainConfig(epochs=100, batch_size=40), progress=False)
    for snap, (mu, s) in zip(seen, mean_field_recursion(stream.tasks)):
        torch.testing.assert_close(flatten({k: snap[k] for k in ("heads.0.weight", "heads.0.bias")}), mu, **CONVERGED)
        torch.testing.assert_close(snap["__precision__"], s, **CONVERGED)
    # not the batch posterior: the mean-field recursion forgets the cross-task correlations
    last = flatten({k: seen[-1][k] for k in ("heads.0.weight", "heads.0.bias")})
    assert not torch.allclose(last, batch_posterior(stream.tasks)[0], rtol=1e-3)


def test_method_loss_and_evaluation_use_the_gaussian_likelihood():
    """Method.loss = (1/B) Σ ‖f − y‖²/(2σ²); evaluate_task = R² = 1 − SSE/SST of the predictive mean."""
    stream = regression_stream(n_tasks=1)
    task = stream.tasks[0]
    model = linear_model(stream)
    method = Method()
    method.use_likelihood(stream.likelihood, stream.sigma)
    f = model(task.x_train, head=0).squeeze(1)
    got = method.loss(model, Batch(task.x_train, task.y_train, 0), task)
    torch.testing.assert_close(got, ((f - task.y_train) ** 2).sum() / (2 * SIGMA**2) / task.n_train, **EXACT)
    with torch.no_grad():
        f = model(task.x_test, head=0).squeeze(1)
    y = task.y_test
    r2 = 1 - ((y - f) ** 2).sum() / ((y - y.mean()) ** 2).sum()
    assert evaluate_task(model, method, task, batch_size=7) == pytest.approx(float(r2), rel=1e-12)


def test_run_stream_hands_the_likelihood_to_the_method_and_its_regulariser():
    stream = regression_stream(n_tasks=1)
    method = build_method("laplace", {"structure": "diag"})
    run_stream(linear_model(stream), stream, method, TrainConfig(epochs=1), progress=False)
    assert (method.likelihood, method.sigma) == ("regression", SIGMA)
    assert (method.regularizer.likelihood, method.regularizer.sigma) == ("regression", SIGMA)


def test_a_misspelt_likelihood_is_a_one_line_value_error():
    task = regression_stream(n_tasks=1).tasks[0]
    with pytest.raises(ValueError, match="likelihood") as err:
        TaskStream("s", [task], "domain", (3,), 1, 1, likelihood="regresion", sigma=SIGMA)
    assert "\n" not in str(err.value) and "'regression'" in str(err.value)
    with pytest.raises(ValueError, match="sigma"):
        TaskStream("s", [task], "domain", (3,), 1, 1, likelihood="regression", sigma=0.0)
    with pytest.raises(ValueError, match="likelihood") as err:
        Method().use_likelihood("gaussian")
    assert "\n" not in str(err.value)
