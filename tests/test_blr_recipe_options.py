"""Options of the BLR method taken from the VOGN continual-learning reference (issue 41).

``task_start_mean`` (``BLRParams``): ``"carry"`` (the default) starts every task at the previous posterior mean;
``"reinit"`` re-draws the covered Linear / Conv2d weights at the start of every task after the first, as the VOGN
reference does, and leaves the prior (the previous posterior) as it is.

Planted bug, watched once (2026-11-27): with the re-draw in ``BLRMethod.on_task_start`` commented out,
``test_reinit_redraws_the_mean_at_later_task_starts_and_keeps_the_prior`` and
``test_a_restored_method_redraws_at_its_next_task_start`` fail (the weights at task 2's start equal the prior
mean) and ``test_reinit_changes_a_run_and_carry_is_the_default`` fails (the two runs give the same accuracies);
with the counter's restore in ``load_state_dict`` removed, the restore test fails alone.
"""

from __future__ import annotations

import math

import pytest
import torch

from continual_blr.data import make_stream
from continual_blr.loop import fit_task, run_stream
from continual_blr.methods import TrainConfig, build_method
from continual_blr.methods.blr import BLRParams, redraw_layers
from continual_blr.models import build_model


def _setup(params: dict, scenario: str = "domain"):
    torch.set_num_threads(1)
    stream = make_stream("synthetic", scenario=scenario, n_tasks=3, n_train=60, n_test=30, n_features=5, seed=3)
    model = build_model("mlp", (5,), stream.n_outputs, stream.n_heads, hidden=(8,),
                        generator=torch.Generator().manual_seed(0))
    method = build_method("blr", params, seed=0)
    train = TrainConfig(epochs=2, batch_size=20)
    method.setup(model, stream, train)
    return stream, model, method, train


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def test_bad_task_start_mean_is_one_line_naming_the_field_and_the_allowed_values():
    with pytest.raises(ValueError) as err:
        BLRParams(task_start_mean="reset")
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("params.task_start_mean:") and "'carry'" in msg and "'reinit'" in msg
    assert BLRParams().task_start_mean == "carry"


@pytest.mark.parametrize("option", ["carry", "reinit"])
def test_the_first_task_starts_at_the_models_initial_weights(option):
    """No re-draw before the first task: the network's own initialisation is task 1's start either way."""
    stream, model, method, _ = _setup({"task_start_mean": option})
    before = _weights(model)
    method.on_task_start(model, stream.tasks[0])
    after = _weights(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_carry_starts_a_later_task_at_the_previous_posterior_mean():
    stream, model, method, train = _setup({})
    fit_task(model, stream.tasks[0], method, train, seen=stream.tasks[:1], generator=torch.Generator().manual_seed(1),
             progress=False)
    prior_mean = {k: v.clone() for k, v in method.optimizer.prior.mean.items()}
    method.on_task_start(model, stream.tasks[1])
    after = _weights(model)
    assert all(torch.equal(after[k], prior_mean[k]) for k in prior_mean)


def test_reinit_redraws_the_mean_at_later_task_starts_and_keeps_the_prior():
    """After task 1, ``reinit`` draws every Linear weight and bias afresh inside PyTorch's default bound
    1/√fan_in, away from the prior mean; the prior's mean and precision (task 1's posterior) are untouched."""
    stream, model, method, train = _setup({"task_start_mean": "reinit"})
    fit_task(model, stream.tasks[0], method, train, seen=stream.tasks[:1], generator=torch.Generator().manual_seed(1),
             progress=False)
    prior = method.optimizer.prior
    prior_mean = {k: v.clone() for k, v in prior.mean.items()}
    prior_prec = {k: v.clone() for k, v in prior.precision.items()}
    method.on_task_start(model, stream.tasks[1])
    after = _weights(model)
    assert method.optimizer.prior is prior
    for k in prior_mean:
        assert torch.equal(prior.mean[k], prior_mean[k]) and torch.equal(prior.precision[k], prior_prec[k]), k
        assert not torch.equal(after[k], prior_mean[k]), f"{k} still holds the previous posterior mean"
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            bound = 1.0 / math.sqrt(module.weight.shape[1])
            assert float(after[f"{name}.weight"].abs().max()) <= bound
            assert float(after[f"{name}.bias"].abs().max()) <= bound


def test_a_restored_method_redraws_at_its_next_task_start():
    """The count of finished tasks travels with the method's state: a method rebuilt from task 1's saved state
    (a resumed run) re-draws at task 2's start as the uninterrupted one does, with the same numbers."""
    stream, model, method, train = _setup({"task_start_mean": "reinit"})
    fit_task(model, stream.tasks[0], method, train, seen=stream.tasks[:1], generator=torch.Generator().manual_seed(1),
             progress=False)
    state = method.state_dict()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    method.on_task_start(model, stream.tasks[1])
    uninterrupted = _weights(model)

    _, model2, method2, train2 = _setup({"task_start_mean": "reinit"})
    model2.load_state_dict(saved)
    method2.load_state_dict(state)
    method2.on_task_start(model2, stream.tasks[1])
    resumed = _weights(model2)
    assert method2.tasks_done == 1
    assert not torch.equal(resumed["body.1.weight"], saved["body.1.weight"])  # drawn, not the saved mean
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)


def test_redraw_layers_leaves_uncovered_layers_and_the_global_rng_alone():
    model = build_model("mlp", (5,), 3, 1, hidden=(8,), generator=torch.Generator().manual_seed(0))
    before = _weights(model)
    rng = torch.get_rng_state()
    drawn = redraw_layers(model, {"body.1.weight", "body.1.bias"}, torch.Generator().manual_seed(7))
    after = _weights(model)
    assert drawn == ["body.1.weight", "body.1.bias"]
    assert torch.equal(torch.get_rng_state(), rng)
    assert not torch.equal(before["body.1.weight"], after["body.1.weight"])
    assert torch.equal(before["heads.0.weight"], after["heads.0.weight"])
    assert torch.equal(before["heads.0.bias"], after["heads.0.bias"])


def test_reinit_changes_a_run_and_carry_is_the_default():
    """A whole run: ``carry`` gives the numbers of a config without the field (the default is today's behaviour),
    ``reinit`` the same task 1 and other training losses from task 2 on."""
    def run(params):
        torch.set_num_threads(1)
        stream = make_stream("synthetic", scenario="domain", n_tasks=3, n_train=60, n_test=30, n_features=5, seed=3)
        model = build_model("mlp", (5,), stream.n_outputs, stream.n_heads, hidden=(8,),
                            generator=torch.Generator().manual_seed(0))
        res = run_stream(model, stream, build_method("blr", params, seed=0), TrainConfig(epochs=2, batch_size=20),
                         seed=0, progress=False)
        return res.acc_matrix, res.train_loss

    default, carry, reinit = run({}), run({"task_start_mean": "carry"}), run({"task_start_mean": "reinit"})
    assert default == carry
    assert reinit[1][0] == default[1][0] and reinit[0][0] == default[0][0]
    assert all(a != b for a, b in zip(reinit[1][1:], default[1][1:]))
