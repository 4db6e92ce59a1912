"""The local reparameterisation (continual_blr.methods.local_reparam): the same expected loss as drawing the
weights, checked against the closed form of the linear-Gaussian model (value and gradients) and, for a
ReLU network, against the weight-sampling estimate; the draws are independent per example; VCL-bbb with
``estimator: local`` reaches the mean-field ELBO optimum; models it does not cover get a one-line error."""

import math

import pytest
import torch
from torch.func import functional_call

from continual_blr.methods import build_method
from continual_blr.methods import local_reparam
from continual_blr.methods.vcl import VCLParams
from continual_blr.models import MLP, CifarNet

DT = torch.float64
# A Monte-Carlo mean of S iid terms is within Z_BOUND standard errors of its expectation except with
# probability ~6e-7 (two-sided normal tail at 5).
Z_BOUND = 5.0
# float64 outputs of a small network computed over different row counts agree to this (about 100 ulps of 1).
ROUND_OFF = 1e-14


def _linear_q(gen, d=4, out=1):
    model = MLP(d, (), out, 1).to(DT)
    mean = {"heads.0.weight": torch.randn(out, d, generator=gen, dtype=DT, requires_grad=True),
            "heads.0.bias": torch.randn(out, generator=gen, dtype=DT, requires_grad=True)}
    log_var = {k: (torch.rand(v.shape, generator=gen, dtype=DT) - 1.5).requires_grad_() for k, v in mean.items()}
    return model, mean, log_var


def test_the_linear_gaussian_expected_loss_and_its_gradients_match_the_closed_form(gen):
    """For f = wᵀx + b under q = N(μ, diag σ²) and ℓ = (f − y)²/2:
    E_q[ℓ] = ((μ_wᵀx + μ_b − y)² + Σ_j σ²_j x_j² + σ²_b)/2, ∂/∂μ_w = r x, ∂/∂σ²_j = x_j²/2 (r the mean's
    residual). The local estimate's mean over S draws matches within Z_BOUND standard errors, and its
    gradients (averaged over the S draws) within the same bound."""
    model, mean, log_var = _linear_q(gen)
    x = 2.0 * torch.randn(6, 4, generator=gen, dtype=DT)  # signed inputs: x ≠ x² catches a wrong variance
    y = torch.randn(6, 1, generator=gen, dtype=DT)
    S = 20000
    var = {k: torch.exp(v) for k, v in log_var.items()}
    out = local_reparam.expected_outputs(model, mean, var, x, S, torch.Generator().manual_seed(3), {"head": 0})
    assert out.shape == (S * 6, 1)
    per_row = 0.5 * (out - y.repeat(S, 1)).pow(2).squeeze(1)  # (S·B,)
    per_draw = per_row.view(S, 6).mean(1)  # iid over draws
    est = per_draw.mean()
    se = per_draw.std() / math.sqrt(S)
    grads = torch.autograd.grad(est, [mean["heads.0.weight"], var["heads.0.weight"], var["heads.0.bias"]])

    with torch.no_grad():
        w, b = mean["heads.0.weight"][0], mean["heads.0.bias"][0]
        s2w, s2b = var["heads.0.weight"][0], var["heads.0.bias"][0]
        r = x @ w + b - y[:, 0]
        v = (x**2) @ s2w + s2b  # each example's output variance
        exact = (0.5 * (r**2 + v)).mean()
        # per draw, the gradients are means over the B examples of independent terms (ε_i per example):
        # ∂/∂μ_w: (r_i + √v_i ε_i) x_i;  ∂/∂σ²_j: x_ij² (r_i ε_i / (2√v_i) + ε_i²/2); their exact SEs over S draws
        n = x.shape[0]
        d_mu_w, se_mu_w = (r[:, None] * x).mean(0), (v[:, None] * x**2).sum(0).sqrt() / n / math.sqrt(S)
        d_s2w = 0.5 * (x**2).mean(0)
        se_s2w = (x**4 * (r**2 / (4 * v) + 0.5)[:, None]).sum(0).sqrt() / n / math.sqrt(S)
        se_s2b = (r**2 / (4 * v) + 0.5).sum().sqrt() / n / math.sqrt(S)
    est, se = est.detach(), se.detach()
    assert abs(float(est - exact)) < Z_BOUND * float(se), (float(est), float(exact), float(se))
    g_mu, g_s2w, g_s2b = (g[0] for g in grads)
    assert ((g_mu - d_mu_w).abs() < Z_BOUND * se_mu_w).all(), (g_mu, d_mu_w, se_mu_w)
    assert ((g_s2w - d_s2w).abs() < Z_BOUND * se_s2w).all(), (g_s2w, d_s2w, se_s2w)
    assert abs(float(g_s2b) - 0.5) < Z_BOUND * float(se_s2b), (float(g_s2b), float(se_s2b))


def _relu_q(gen):
    with torch.random.fork_rng():  # the same network whatever ran before (MLP draws its init from the global RNG)
        torch.manual_seed(int(torch.randint(0, 2**31, (), generator=gen)))
        model = MLP(5, (7,), 3, 1).to(DT)
    mean = {k: v.detach().clone() for k, v in model.named_parameters()}
    log_var = {k: torch.full_like(v, -1.0) for k, v in mean.items()}
    return model, mean, {k: torch.exp(v) for k, v in log_var.items()}


def test_a_relu_network_has_the_expected_loss_of_weight_sampling(gen):
    """E_q[mean_i CE(f(x_i; θ), y_i)] by the local estimate and by drawing θ (one draw per minibatch, the
    paper's estimator): both Monte-Carlo means agree within Z_BOUND combined standard errors (each
    example's pre-activations have the same distribution under both)."""
    model, mean, var = _relu_q(gen)
    x = torch.randn(8, 5, generator=gen, dtype=DT)
    y = torch.randint(0, 3, (8,), generator=gen)
    S = 6000
    with torch.no_grad():
        out = local_reparam.expected_outputs(model, mean, var, x, S, torch.Generator().manual_seed(1))
        local = torch.nn.functional.cross_entropy(out, y.repeat(S), reduction="none").view(S, 8).mean(1)
        g = torch.Generator().manual_seed(2)
        draws = []
        for _ in range(S):
            theta = {k: m + var[k].sqrt() * torch.randn(m.shape, generator=g, dtype=DT) for k, m in mean.items()}
            draws.append(torch.nn.functional.cross_entropy(functional_call(model, theta, (x,)), y))
        weights = torch.stack(draws)
    se = math.sqrt(float(local.var() / S + weights.var() / S))
    assert abs(float(local.mean() - weights.mean())) < Z_BOUND * se, (float(local.mean()), float(weights.mean()), se)
    # and the two are not trivially equal: the local draws vary per example, the weight draws do not
    assert float(local.var()) < float(weights.var())


def test_the_draws_are_independent_per_example_and_per_sample(gen):
    """Two identical inputs in one batch, and the same input across the S draws, get different outputs;
    with σ² = 0 every draw is the mean network's output, to float64 round-off (ROUND_OFF: the layers after the
    first run on S·B rows, the reference on B, and a matrix product over another row count may round the last
    bit differently: measured 2026-11-26, 163 of 300 random initialisations differ, by at most 1.1e-16)."""
    model, mean, var = _relu_q(gen)
    x = torch.randn(1, 5, generator=gen, dtype=DT).repeat(2, 1)
    with torch.no_grad():
        out = local_reparam.expected_outputs(model, mean, var, x, 3, torch.Generator().manual_seed(0))
        assert out.shape == (6, 3)
        rows = out.unique(dim=0)
        assert rows.shape[0] == 6
        zero = {k: torch.zeros_like(v) for k, v in var.items()}
        det = local_reparam.expected_outputs(model, mean, zero, x, 3, torch.Generator().manual_seed(0))
        torch.testing.assert_close(det, functional_call(model, mean, (x,)).repeat(3, 1), rtol=0, atol=ROUND_OFF)


def test_vcl_bbb_with_the_local_estimate_reaches_the_mean_field_elbo_optimum():
    """The same check as test_vcl.py's Bayes-by-backprop one, with ``estimator: local``: the closed-form
    mean-field optimum of every task's ELBO on the linear-Gaussian oracle, up to Adam's jitter."""
    torch.set_num_threads(1)
    from test_regression import DELTA, regression_stream
    from test_vcl import BBB_JITTER_MEAN_SD, BBB_JITTER_PRECISION, _mean_field_check

    params = {"coreset_size": 0, "optimizer": "bbb", "prior_precision": DELTA, "mc_samples": 4, "predict_samples": 0,
              "init_log_variance": -10.0, "lr": 0.01, "log_var_lr": 0.02, "estimator": "local"}
    errors = _mean_field_check(regression_stream(n_tasks=2), build_method("vcl", params, seed=0), epochs=500)
    for mean_sd, prec_rel in errors:
        assert mean_sd < BBB_JITTER_MEAN_SD and prec_rel < BBB_JITTER_PRECISION, errors


def test_models_and_settings_it_does_not_cover_get_one_line_errors(gen):
    net = CifarNet(3, 10, 1, image_size=16).to(DT)
    names = [k for k, _ in net.named_parameters()]
    assert not local_reparam.covers(net, names)
    assert local_reparam.covers(net, [k for k in names if k.startswith("heads.")])
    assert not local_reparam.covers(MLP(5, (7,), 3, 1), ["heads.0.bias"])  # a bias whose weight is not drawn
    mean = {k: v.detach() for k, v in net.named_parameters()}
    with pytest.raises(ValueError, match="nn.Linear") as err:
        local_reparam.expected_outputs(net, mean, mean, torch.randn(2, 3, 16, 16, dtype=DT), 2, torch.Generator())
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"params\.estimator: 'local' is for optimizer 'bbb'"):
        VCLParams(optimizer="vogn", estimator="local")
    with pytest.raises(ValueError, match=r"params\.estimator: got 'lrt'; allowed: 'weights', 'local'"):
        VCLParams(optimizer="bbb", estimator="lrt")


def _grad_draws(loss_of_draw, params, draws: int) -> torch.Tensor:
    """``draws`` independent one-draw gradients of a minibatch loss with respect to ``params``, flattened:
    shape (draws, Σ numel)."""
    rows = []
    for _ in range(draws):
        grads = torch.autograd.grad(loss_of_draw(), params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def test_the_gradient_of_the_mean_has_the_closed_form_covariance_of_each_estimator(gen):
    """Linear-Gaussian model, ℓ = (f − y)²/2, minibatch loss L = mean_i ℓ_i, B = 16 inputs in [0, 1] (pixel-like).
    One draw's ∂L/∂μ_w is mean_i (r_i + δ_i) x_i with δ_i the output's noise; its covariance is
    (1/B²) Xᵀ C X with C = K = X diag(σ²_w) Xᵀ + σ²_b 11ᵀ when the weights are drawn (one draw for the whole
    minibatch: the examples' noises are correlated) and C = diag(K) under the local estimate (independent noise per
    example). The trace of each sample covariance over DRAWS one-draw gradients matches its closed form within
    Z_BOUND relative standard errors (a Gaussian gradient: Var tr Ŝ = 2 tr Σ² / (DRAWS − 1) ≤ 2 (tr Σ)² / (DRAWS − 1)),
    and the local one is the smaller, as the module's docstring says (for inputs of one sign the dropped
    cross-example terms are all positive)."""
    draws, n, d = 3000, 16, 6
    model, mean, log_var = _linear_q(gen, d=d)
    var = {k: torch.exp(v).detach() for k, v in log_var.items()}
    x = torch.rand(n, d, generator=gen, dtype=DT)
    y = torch.randn(n, 1, generator=gen, dtype=DT)
    mu_w = mean["heads.0.weight"]
    g_local, g_weights = torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)

    def local_loss():
        out = local_reparam.expected_outputs(model, mean, var, x, 1, g_local, {"head": 0})
        return 0.5 * (out - y).pow(2).mean()

    def weight_loss():
        theta = {k: m + var[k].sqrt() * torch.randn(m.shape, generator=g_weights, dtype=DT) for k, m in mean.items()}
        return 0.5 * (functional_call(model, theta, (x,), {"head": 0}) - y).pow(2).mean()

    with torch.no_grad():
        kernel = x @ torch.diag(var["heads.0.weight"][0]) @ x.T + var["heads.0.bias"][0]
        exact_weights = float(torch.trace(x.T @ kernel @ x)) / n**2
        exact_local = float(torch.trace(x.T @ torch.diag(torch.diag(kernel)) @ x)) / n**2
    rel_se = math.sqrt(2.0 / (draws - 1))
    for loss, exact in ((local_loss, exact_local), (weight_loss, exact_weights)):
        grads = _grad_draws(loss, [mu_w], draws)
        est = float(grads.var(0).sum())
        assert abs(est / exact - 1.0) < Z_BOUND * rel_se, (est, exact)
    assert exact_local < 0.5 * exact_weights, (exact_local, exact_weights)


def test_a_relu_network_gets_a_lower_variance_gradient_from_the_local_estimate(gen):
    """ReLU MLP 5-7-3, cross-entropy, a minibatch of 32 inputs in [0, 1] (pixel-like): the summed variance of one
    draw's gradient with respect to every mean is lower under the local estimate than under weight sampling (one draw
    of θ for the minibatch), by at least a factor 2 here; measured over DRAWS one-draw gradients each."""
    draws = 1500
    model, mean, var = _relu_q(gen)
    mean = {k: v.requires_grad_() for k, v in mean.items()}
    x = torch.rand(32, 5, generator=gen, dtype=DT)
    y = torch.randint(0, 3, (32,), generator=gen)
    g_local, g_weights = torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)
    params = list(mean.values())

    def local_loss():
        out = local_reparam.expected_outputs(model, mean, var, x, 1, g_local)
        return torch.nn.functional.cross_entropy(out, y)

    def weight_loss():
        theta = {k: m + var[k].sqrt() * torch.randn(m.shape, generator=g_weights, dtype=DT) for k, m in mean.items()}
        return torch.nn.functional.cross_entropy(functional_call(model, theta, (x,)), y)

    local = float(_grad_draws(local_loss, params, draws).var(0).sum())
    weights = float(_grad_draws(weight_loss, params, draws).var(0).sum())
    assert local < 0.5 * weights, (local, weights)
