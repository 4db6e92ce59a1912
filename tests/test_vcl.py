"""VCL: the closed-form KL, the ELBO optimum on the linear-Gaussian oracle, the Bayes-by-backprop
objective, coreset selection and the rule that coreset fine-tuning touches only the predictive copy."""

import dataclasses

import pytest
import torch
from torch.distributions import MultivariateNormal, Normal, kl_divergence

from conftest import EXACT
from continual_blr.data import make_stream
from continual_blr.loop import run_stream
from continual_blr.methods import build_method
from continual_blr.methods.base import TrainConfig
from continual_blr.methods.vcl import VCLMethod, VCLParams, select_coreset
from continual_blr.models import build_model
from continual_blr.posteriors import DiagPosterior, FullPosterior
from continual_blr.regularizers.kl import kl_diag, kl_full
from continual_blr.types import Batch, flatten, params_of

DT = torch.float64
ELBO_OPTIMUM = dict(rtol=1e-5, atol=1e-7)  # L-BFGS to gradient norm ~1e-10 (precision = inverse covariance)


def _like(gen):
    return {"a": torch.randn(3, 2, generator=gen, dtype=DT), "b": torch.randn(4, generator=gen, dtype=DT)}


def test_kl_diag_equals_closed_form_and_torch(gen):
    mean, log_var = _like(gen), {k: 0.3 * v for k, v in _like(gen).items()}
    prior = DiagPosterior(_like(gen), {k: torch.exp(v) for k, v in _like(gen).items()})
    got = kl_diag(mean, log_var, prior)
    ref = sum(kl_divergence(Normal(mean[k], torch.exp(0.5 * log_var[k])),
                            Normal(prior.mean[k], prior.precision[k].rsqrt())).sum() for k in mean)
    torch.testing.assert_close(got, ref, **EXACT)
    # the same number from the posterior classes (non-differentiable path)
    q = DiagPosterior(mean, {k: torch.exp(-v) for k, v in log_var.items()})
    torch.testing.assert_close(got, q.kl(prior), **EXACT)
    # and its gradient, through torch.distributions
    mv = {k: v.clone().requires_grad_(True) for k, v in mean.items()}
    lv = {k: v.clone().requires_grad_(True) for k, v in log_var.items()}
    g1 = torch.autograd.grad(kl_diag(mv, lv, prior), [*mv.values(), *lv.values()])
    ref = sum(kl_divergence(Normal(mv[k], torch.exp(0.5 * lv[k])), Normal(prior.mean[k], prior.precision[k].rsqrt())).sum()
              for k in mv)
    g2 = torch.autograd.grad(ref, [*mv.values(), *lv.values()])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, **EXACT)


def _spd(gen, p):
    m = torch.randn(p, p, generator=gen, dtype=DT)
    return m @ m.T + p * torch.eye(p, dtype=DT)


def test_kl_diag_and_full_with_a_full_prior(gen):
    like = _like(gen)
    p = sum(v.numel() for v in like.values())
    prior = FullPosterior(_like(gen), _spd(gen, p))
    m0, s0 = prior.to_dense()
    mean, log_var = _like(gen), {k: 0.2 * v for k, v in _like(gen).items()}
    ref = kl_divergence(MultivariateNormal(flatten(mean), torch.diag(torch.exp(flatten(log_var)))),
                        MultivariateNormal(m0, precision_matrix=s0))
    torch.testing.assert_close(kl_diag(mean, log_var, prior), ref, **EXACT)
    tril = torch.tril(torch.randn(p, p, generator=gen, dtype=DT), -1) + torch.diag(torch.rand(p, generator=gen, dtype=DT) + 0.5)
    ref = kl_divergence(MultivariateNormal(flatten(mean), scale_tril=tril), MultivariateNormal(m0, precision_matrix=s0))
    torch.testing.assert_close(kl_full(flatten(mean), tril, prior), ref, **EXACT)


def _whitened(gen, s, d):
    """ε_1..ε_S with empirical mean exactly 0 and covariance exactly I: the MC average of a quadratic
    in θ = m + L ε is then its exact expectation."""
    z = torch.randn(s, d, generator=gen, dtype=DT)
    z = z - z.mean(0)
    evals, evecs = torch.linalg.eigh(z.T @ z / s)
    return z @ evecs @ torch.diag(evals.rsqrt()) @ evecs.T


def test_full_gaussian_vcl_optimum_is_the_exact_posterior(gen):
    """Linear-Gaussian oracle, 3 tasks: argmin_q E_q[Σ ℓ] + KL(q ‖ q_{t−1}) over full Gaussians, prior =
    previous q, ends at the batch posterior (reparameterised ELBO, L-BFGS)."""
    d, sigma, delta = 3, 0.5, 1.3
    x = torch.randn(45, d, generator=gen, dtype=DT)
    y = x @ torch.randn(d, generator=gen, dtype=DT) + sigma * torch.randn(45, generator=gen, dtype=DT)
    eps = _whitened(gen, 2 * d + 4, d)
    prior = FullPosterior({"w": torch.zeros(d, dtype=DT)}, delta)
    for xs, ys in zip(x.split(15), y.split(15)):
        mean = prior.mean["w"].clone().requires_grad_(True)
        raw = torch.zeros(d, d, dtype=DT, requires_grad=True)  # L = tril(raw, −1) + 0.3 diag(e^{diag raw})

        def scale_tril():
            return torch.tril(raw, -1) + torch.diag(0.3 * torch.exp(torch.diagonal(raw)))

        def neg_elbo():
            theta = mean + eps @ scale_tril().T  # [S, d]: θ_s = m + L ε_s
            nll = (0.5 * (ys[None] - theta @ xs.T) ** 2 / sigma**2).sum(1).mean()
            return nll + kl_full(mean, scale_tril(), prior)

        opt = torch.optim.LBFGS([mean, raw], lr=1, max_iter=200, tolerance_grad=1e-10, tolerance_change=1e-15,
                                history_size=20, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = neg_elbo()
            loss.backward()
            return loss

        opt.step(closure)
        cov = (scale_tril() @ scale_tril().T).detach()
        prior = FullPosterior({"w": mean.detach().clone()}, torch.linalg.inv(cov))
    prec = delta * torch.eye(d, dtype=DT) + x.T @ x / sigma**2
    post_mean = torch.linalg.solve(prec, x.T @ y / sigma**2)
    torch.testing.assert_close(prior.mean["w"], post_mean, **ELBO_OPTIMUM)
    torch.testing.assert_close(prior.precision, prec, **ELBO_OPTIMUM)


def _stream(scenario="task", n_tasks=2):
    return make_stream("synthetic", scenario=scenario, n_tasks=n_tasks, n_train=40, n_test=20, n_features=5, seed=3)


def _model(stream, dtype=torch.float32):
    return build_model("mlp", stream.input_shape, stream.n_outputs, stream.n_heads, hidden=(8,),
                       generator=torch.Generator().manual_seed(0)).to(dtype)


def test_bbb_loss_is_mc_elbo_over_n(gen):
    """loss = (1/S) Σ_s mean_i ℓ_i(μ + σ ∘ ε_s) + KL(q ‖ q_{t−1}) / N, ε from the method's generator."""
    stream = _stream()
    model = _model(stream, DT)
    method = VCLMethod(VCLParams(optimizer="bbb", mc_samples=3, init_log_variance=-2.0), seed=5)
    method.setup(model, stream, TrainConfig())
    task = stream.tasks[0].to("cpu", DT)
    method.on_task_start(model, task)
    method.make_optimizer(model, task, TrainConfig())
    batch = Batch(task.x_train[:6], task.y_train[:6], task.head)
    state = method.generator.get_state()
    got = method.loss(model, batch, task)
    method.generator.set_state(state)
    mean = params_of(model)
    nll = 0.0
    for _ in range(3):
        theta = {k: m + torch.exp(torch.tensor(-1.0, dtype=DT)) * torch.randn(m.shape, generator=method.generator, dtype=DT)
                 for k, m in mean.items()}
        logits = torch.func.functional_call(model, theta, (batch.x,), {"head": batch.head})
        nll = nll + torch.nn.functional.cross_entropy(logits, batch.y)
    prior = DiagPosterior({k: torch.zeros_like(v) for k, v in mean.items()}, 1.0)
    q = DiagPosterior(mean, {k: torch.full_like(v, torch.e**2) for k, v in mean.items()})
    torch.testing.assert_close(got.detach(), nll / 3 + q.kl(prior) / task.n_train, **EXACT)


@pytest.mark.parametrize("optimizer", ["vogn", "bbb"])
def test_posterior_becomes_prior(optimizer):
    torch.set_num_threads(1)
    stream = _stream()
    model = _model(stream)
    method = build_method("vcl", {"optimizer": optimizer, "predict_samples": 2}, seed=1)
    res = run_stream(model, stream, method, TrainConfig(epochs=2, batch_size=16), progress=False)
    assert 0 <= res.avg_acc <= 1
    post, prior = method.posterior(model), method.prior()
    for k in post.mean:
        torch.testing.assert_close(post.mean[k], prior.mean[k])
        torch.testing.assert_close(post.precision[k], prior.precision[k])


def test_coreset_selection(gen):
    x = torch.tensor([[0.0], [1.0], [2.0], [10.0], [11.0]])
    for _ in range(5):
        idx = select_coreset(x, 2, "kcenter", gen).tolist()
        first = idx[0]
        far = max(range(5), key=lambda j: abs(x[j, 0] - x[first, 0]))
        assert idx[1] == far  # greedy farthest point
    idx = select_coreset(torch.randn(30, 4, generator=gen), 10, "random", gen)
    assert len(set(idx.tolist())) == 10
    with pytest.raises(ValueError, match="kind"):
        select_coreset(x, 2, "herding", gen)


def test_coreset_is_held_out_of_training():
    stream = _stream()
    task = stream.tasks[0]
    method = VCLMethod(VCLParams(coreset_size=7, coreset_kind="kcenter"), seed=0)
    method.on_task_start(_model(stream), task)
    train = method.train_tasks(task, [task])[0]
    core = method.coresets[0]
    assert core.n_train == 7 and train.n_train == task.n_train - 7
    rows = lambda t: {tuple(r.tolist()) for r in t.x_train}  # noqa: E731
    assert rows(core).isdisjoint(rows(train)) and rows(core) | rows(train) == rows(task)


@pytest.mark.parametrize("optimizer", ["vogn", "bbb"])
@pytest.mark.parametrize("scenario", ["task", "class"])
def test_coreset_finetuning_changes_only_the_predictive_copy(optimizer, scenario):
    """Same seed, coreset held out in both runs; with fine-tuning (A) vs without (B): identical
    weights and carried posterior, different predictive."""
    torch.set_num_threads(1)
    stream = _stream(scenario)
    base = {"optimizer": optimizer, "coreset_size": 6, "predict_samples": 0}
    runs = {}
    for label, epochs in (("A", 3), ("B", 0)):
        model = _model(stream)
        method = build_method("vcl", base | {"coreset_epochs": epochs}, seed=2)
        run_stream(model, stream, method, TrainConfig(epochs=2, batch_size=16), progress=False)
        runs[label] = (model, method)
    (ma, a), (mb, b) = runs["A"], runs["B"]
    for (k, pa), pb in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(pa, pb), k
    qa, qb = a.posterior(ma), b.posterior(mb)
    for k in qa.mean:
        assert torch.equal(qa.precision[k], qb.precision[k]), k
    assert b._predictive is None and a._predictive is not None
    assert any(not torch.equal(a._predictive.mean[k], qa.mean[k]) for k in qa.mean)
    x = stream.tasks[0].x_test
    assert not torch.equal(a.predict_proba(ma, x, stream.tasks[0].head), b.predict_proba(mb, x, stream.tasks[0].head))


def test_finetune_does_not_touch_the_model():
    torch.set_num_threads(1)
    stream = _stream()
    model = _model(stream)
    method = build_method("vcl", {"optimizer": "bbb", "coreset_size": 5, "coreset_epochs": 0}, seed=0)
    run_stream(model, stream, method, TrainConfig(epochs=1, batch_size=16), progress=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prior = method.prior()
    method.params = dataclasses.replace(method.params, coreset_epochs=2)
    tuned = method._finetune(model, stream.tasks[-1])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert method.prior() is prior
    assert any(not torch.equal(tuned.mean[k], before[k]) for k in tuned.mean)


def test_vcl_params_validation():
    from continual_blr.config import ConfigError

    for params, field in [({"optimizer": "adam"}, "optimizer"), ({"coreset_kind": "herding"}, "coreset_kind"),
                          ({"mc_samples": 0}, "mc_samples"), ({"rho": 0}, "rho"), ({"coreset_size": -1}, "coreset_size"),
                          ({"lr": 0}, "lr"), ({"prior_precision": 0}, "prior_precision"),
                          ({"predict_samples": -1}, "predict_samples"), ({"beta1": 1.0}, "beta1"),
                          ({"coreset_epochs": -2}, "coreset_epochs")]:
        with pytest.raises(ConfigError, match=field):
            build_method("vcl", params)

