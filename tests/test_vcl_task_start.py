"""VCL's ``task_start`` (bbb): where q starts each task after the first, improved VCL's re-initialisation.

The guarantee in ``VCLParams``: only the optimisation's start moves; the prior q_{t−1} the task trains against is
the same under every ``task_start``. Oracles: q_1 snapshotted from the optimiser's state at task 1's end (the
model's weights and e^{−log σ²}), the initial log-variance, and PyTorch's initialisation bound U(±1/√fan_in).
Planted bugs they catch (each seen failing once): the reset written into the prior too, the means not redrawn, the
variances not reset.
"""

from __future__ import annotations

import pytest
import torch

from continual_blr.data import make_stream
from continual_blr.loop import fit_task
from continual_blr.methods import MethodParamsError, build_method
from continual_blr.methods.base import TrainConfig
from continual_blr.models import build_model

INIT_LOG_VAR = -5.0


def _after_task_1(task_start: str):
    """A bbb VCL method with task 1 trained and task 2 started. Returns (method, model, q_1 means, q_1 log σ²,
    log σ² at task 1's start, the prior of task 2 as (mean, precision))."""
    torch.set_num_threads(1)
    stream = make_stream("synthetic", scenario="task", n_tasks=2, n_train=40, n_test=20, n_features=5, seed=3)
    model = build_model("mlp", stream.input_shape, stream.n_outputs, stream.n_heads, hidden=(8,),
                        generator=torch.Generator().manual_seed(0))
    method = build_method("vcl", {"optimizer": "bbb", "coreset_size": 0, "predict_samples": 2, "lr": 0.01,
                                  "log_var_lr": 0.05, "init_log_variance": INIT_LOG_VAR, "task_start": task_start},
                          seed=1)
    method.use_likelihood(stream.likelihood, stream.sigma)
    train = TrainConfig(epochs=3, batch_size=16)
    method.setup(model, stream, train)
    t1, t2 = stream.tasks
    fit_task(model, t1, method, train, seen=[t1], generator=torch.Generator().manual_seed(2), progress=False,
             end_task=False)
    means = {k: v.detach().clone() for k, v in model.named_parameters() if k in method.active}
    log_var = {k: method.kl.log_var[k].detach().clone() for k in method.active}
    method.on_task_end(model, t1)
    method.on_task_start(model, t2)
    prior = method.prior()
    return method, model, means, log_var, ({k: v.clone() for k, v in prior.mean.items()},
                                           {k: v.clone() for k, v in prior.precision.items()})


@pytest.mark.parametrize("task_start", ["carry", "reinit_variance", "reinit"])
def test_the_prior_of_task_2_is_q_1_whatever_the_start(task_start):
    method, _, means, log_var, (pm, pp) = _after_task_1(task_start)
    for k in means:
        assert torch.equal(pm[k], means[k]), k
        torch.testing.assert_close(pp[k], torch.exp(-log_var[k]), rtol=1e-6, atol=0)


def test_carry_starts_task_2_at_q_1():
    method, model, means, log_var, _ = _after_task_1("carry")
    weights = dict(model.named_parameters())
    for k in means:
        assert torch.equal(weights[k].detach(), means[k]) and torch.equal(method.kl.log_var[k], log_var[k]), k
    assert any(not torch.allclose(v, torch.full_like(v, INIT_LOG_VAR)) for v in log_var.values())  # task 1 moved them


def test_reinit_variance_resets_every_active_log_variance_and_keeps_the_means():
    method, model, means, _, _ = _after_task_1("reinit_variance")
    weights = dict(model.named_parameters())
    assert set(means) < set(method.active)  # task 2's head became active too
    for k in method.active:
        assert torch.equal(method.kl.log_var[k], torch.full_like(method.kl.log_var[k], INIT_LOG_VAR)), k
    for k in means:
        assert torch.equal(weights[k].detach(), means[k]), k


def test_reinit_redraws_the_active_layers_from_the_initialisation_bound():
    method, model, means, _, _ = _after_task_1("reinit")
    weights = dict(model.named_parameters())
    for k in method.active:
        assert torch.equal(method.kl.log_var[k], torch.full_like(method.kl.log_var[k], INIT_LOG_VAR)), k
    for k in means:
        w = weights[k].detach()
        fan_in = weights[k.rsplit(".", 1)[0] + ".weight"][0].numel()
        assert not torch.allclose(w, means[k]), k
        assert w.abs().max() <= 1.0 / fan_in ** 0.5 + 1e-7, k


def test_task_start_values_are_one_line_errors():
    with pytest.raises(MethodParamsError, match="params.task_start: got 'fresh'; allowed: 'carry', 'reinit'"):
        build_method("vcl", {"optimizer": "bbb", "task_start": "fresh"})
    with pytest.raises(MethodParamsError, match="params.task_start: 'reinit' is for optimizer 'bbb' only"):
        build_method("vcl", {"optimizer": "vogn", "task_start": "reinit"})


@pytest.mark.parametrize("task_start", ["reinit_variance", "reinit"])
def test_the_coreset_copy_fine_tunes_q_t_whatever_the_start(task_start):
    """The predictive copy is q_t fine-tuned on the coresets: it starts at q_t, not afresh. Task 1 trains alike under
    every start (the reset comes at task 2), so after task 1 the copy must be the carry run's, bit for bit."""
    torch.set_num_threads(1)
    copies = []
    for start in ("carry", task_start):
        stream = make_stream("synthetic", scenario="domain", n_tasks=2, n_train=40, n_test=20, n_features=5, seed=3)
        model = build_model("mlp", stream.input_shape, stream.n_outputs, stream.n_heads, hidden=(8,),
                            generator=torch.Generator().manual_seed(0))
        method = build_method("vcl", {"optimizer": "bbb", "coreset_size": 6, "coreset_kind": "random",
                                      "coreset_epochs": 3, "predict_samples": 2, "lr": 0.01, "log_var_lr": 0.05,
                                      "init_log_variance": INIT_LOG_VAR, "task_start": start}, seed=1)
        method.use_likelihood(stream.likelihood, stream.sigma)
        train = TrainConfig(epochs=2, batch_size=16)
        method.setup(model, stream, train)
        t1 = stream.tasks[0]
        fit_task(model, t1, method, train, seen=[t1], generator=torch.Generator().manual_seed(2), progress=False)
        copies.append(method._predictive)
    carry, other = copies
    assert carry is not None and other is not None
    for k in carry.mean:
        assert torch.equal(other.mean[k], carry.mean[k]) and torch.equal(other.precision[k], carry.precision[k]), k
