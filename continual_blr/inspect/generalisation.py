"""Generalisation from training data alone: the leave-one-out estimate of a task's test NLL and accuracy.

For the training examples i = 1..N of a task, scored at the network's weights θ̂ under a weight covariance Σ
(:func:`~continual_blr.inspect.scores.score_examples`: logits f_i, error e_i = p_i − onehot(y_i), V_i = J_i Σ J_iᵀ),
the memory-perturbation equation (Nickl et al. 2023, "The Memory-Perturbation Equation", NeurIPS; in its logit
form, the LOO shift of :mod:`.scores`) estimates the logits example i would get from the network trained without it,

    f_i^{∖i} ≈ f_i + V_i e_i,

so the leave-one-out (cross-validation) estimate of the expected loss on new data — computed from the training data
alone, without refitting and without test data — is

    NLL_loo = (1/N) Σ_i −log softmax(f_i + V_i e_i)_{y_i},
    acc_loo = (1/N) Σ_i 1[argmax_k (f_i + V_i e_i)_k = y_i],

beside the plug-in training values and the measured values on the task's test set,

    NLL_train = (1/N) Σ_i −log softmax(f_i)_{y_i}       (optimistic: each example was fitted)
    NLL_test  = (1/M) Σ_m −log softmax(f(x_m))_{y_m},   acc_test likewise.

All are the network's own softmax at θ̂ (not a method's sampled predictive), so the four are comparable.

What it estimates: the expected loss of the network on new examples from the task's training distribution (a test
set drawn from the same distribution has the same expectation). How well rests on (a) the linearisation and the
one-Newton-step approximation (the leverage factor (I − V_iΛ_i)⁻¹ is dropped, so the shift of high-leverage examples
is underestimated) and (b) Σ being the inverse Hessian of the objective the weights minimise. A diagonal Σ with the
weak prior δ = 1e-3 (FROMP's, the fallback Laplace of ``none`` / ``ewc``) is far too broad — on split MNIST the
estimate overshoots the measured test NLL by up to 21 nats — and the BLR's tempered posterior is narrow, putting the
estimate next to the training NLL (``docs/inspect.md``, "Generalisation from training data alone").
``tests/test_inspect_forgetting.py`` checks it against exact leave-one-out refits of an L2-regularised logistic
regression in float64, where (b) holds.

Probabilities are float32 in :class:`~continual_blr.inspect.scores.ExampleScores`; logs are taken in float64 of the
probabilities clamped at the smallest normal float32 (so a loss is at most 87.3, never infinite).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from ..curvature import eval_mode
from ..curvature._engine import model_kwargs
from ..data.stream import Task
from .scores import ExampleScores

__all__ = ["Generalisation", "log_probs", "loo_estimate", "test_fit", "generalisation", "generalisation_at_task_end",
           "LOG_FLOOR"]

LOG_FLOOR = float(torch.finfo(torch.float32).tiny)
"""Probabilities are clamped at this value before their log (float32's smallest normal number: −log ≤ 87.3)."""


@dataclass
class Generalisation:
    """One task's training, leave-one-out and test fit at one set of weights.

    Attributes:
        task_id: the task (0-based).
        n_train, n_test: examples.
        train_nll, train_acc: the plug-in fit of the training examples (mean −log p_y, accuracy).
        loo_nll, loo_acc: the leave-one-out estimate from the training examples (module docstring).
        test_nll, test_acc: measured on the task's test set (NaN without one).
    """

    task_id: int
    n_train: int
    n_test: int
    train_nll: float
    train_acc: float
    loo_nll: float
    loo_acc: float
    test_nll: float
    test_acc: float

    @property
    def nll_gap(self) -> float:
        """NLL_loo − NLL_test: positive when the estimate is pessimistic."""
        return self.loo_nll - self.test_nll

    @property
    def acc_gap(self) -> float:
        """acc_loo − acc_test."""
        return self.loo_acc - self.test_acc

    def to_dict(self) -> dict[str, float]:
        return asdict(self) | {"nll_gap": self.nll_gap, "acc_gap": self.acc_gap}


def log_probs(logits_or_log_probs: Tensor) -> Tensor:
    """log softmax in float64, [N, K]."""
    return torch.log_softmax(logits_or_log_probs.double(), dim=-1)


def loo_estimate(scores: ExampleScores) -> dict[str, float]:
    """The leave-one-out estimate of NLL and accuracy over a task's training examples, and their plug-in values.

    With log p_i = log max(p_i, LOG_FLOOR) (float64) standing in for the logits (softmax is shift-invariant),

        NLL_loo = mean_i −log softmax(log p_i + V_i e_i)_{y_i},    acc_loo = mean_i 1[argmax(log p_i + V_i e_i) = y_i],
        NLL_train = mean_i −log p_{i,y_i},                         acc_train = mean_i 1[argmax p_i = y_i].

    Args:
        scores: from :func:`~continual_blr.inspect.scores.score_examples` (``probs``, ``loo_shift`` = V e, ``label``).

    Returns:
        ``{"n", "train_nll", "train_acc", "loo_nll", "loo_acc"}``.
    """
    y = scores.label.cpu().long()
    rows = torch.arange(y.shape[0])
    logp = scores.probs.detach().cpu().double().clamp_min(LOG_FLOOR).log()
    loo = log_probs(logp + scores.loo_shift.detach().cpu().double())
    n = int(y.shape[0])
    if n == 0:
        nan = float("nan")
        return {"n": 0, "train_nll": nan, "train_acc": nan, "loo_nll": nan, "loo_acc": nan}
    return {
        "n": n,
        "train_nll": float(-log_probs(logp)[rows, y].mean()),
        "train_acc": float((logp.argmax(-1) == y).double().mean()),
        "loo_nll": float(-loo[rows, y].mean()),
        "loo_acc": float((loo.argmax(-1) == y).double().mean()),
    }


@torch.no_grad()
def test_fit(model: nn.Module, x: Tensor, y: Tensor, head: int = 0, batch: int = 1024) -> dict[str, float]:
    """Mean −log softmax(f(x_m))_{y_m} (float64 log-softmax of the logits) and accuracy of the network on (x, y),
    in eval mode; ``{"n", "nll", "acc"}`` (NaN for no examples)."""
    n = int(x.shape[0])
    if n == 0:
        return {"n": 0, "nll": float("nan"), "acc": float("nan")}
    ref = next(model.parameters())
    kw = model_kwargs(model, head)
    nll, correct = 0.0, 0
    with eval_mode(model):
        for s in range(0, n, batch):
            xb = x[s : s + batch].to(device=ref.device, dtype=ref.dtype)
            yb = y[s : s + batch].to(ref.device).long()
            lp = log_probs(model(xb, **kw))
            nll += float(-lp[torch.arange(yb.shape[0], device=yb.device), yb].sum())
            correct += int((lp.argmax(-1) == yb).sum())
    return {"n": n, "nll": nll / n, "acc": correct / n}


def generalisation(model: nn.Module, task: Task, scores: ExampleScores) -> Generalisation:
    """:func:`loo_estimate` of ``scores`` (the task's training examples, scored at ``model``'s weights) beside the
    network's measured fit of the task's test set (:func:`test_fit` on ``task.x_test``, ``task.y_test``)."""
    est = loo_estimate(scores)
    test = test_fit(model, task.x_test, task.y_test, task.head)
    return Generalisation(task_id=int(task.task_id), n_train=est["n"], n_test=test["n"],
                          train_nll=est["train_nll"], train_acc=est["train_acc"], loo_nll=est["loo_nll"],
                          loo_acc=est["loo_acc"], test_nll=test["nll"], test_acc=test["acc"])


def generalisation_at_task_end(model: nn.Module, method, stream, method_name: str, task_index: int, *,
                               prior_precision: float | None = None) -> list[Generalisation]:
    """:func:`generalisation` of every task seen so far (0..``task_index``) at the current weights, with the Σ the
    inspection would use at this boundary (:func:`~.saved_run.run_covariance` of the method as the next task
    starts; a method without its own Σ: the diagonal Laplace over tasks 0..``task_index`` only). What
    ``continual-blr run --log-loo`` writes to ``<method>/generalisation.csv`` at every task end.

    Reads the model and the method and changes neither (eval mode inside, no generator drawn from).

    Args:
        model: the network as the task ended.
        method: the method after its task-end update.
        stream: the run's stream (its tasks' training and test data).
        method_name: the method's name (for Σ's description).
        task_index: the task that just ended (0-based index into ``stream.tasks``).
        prior_precision: δ of the fallback diagonal Laplace Σ.
    """
    from pathlib import Path

    from .saved_run import SavedRun, run_covariance
    from .scores import score_examples

    run = SavedRun(path=Path("."), method_name=method_name, stream=stream, model=model, method=method)
    seen = range(int(task_index) + 1)
    sigma, _ = run_covariance(run, prior_precision, tasks=seen)
    dev = next(model.parameters()).device
    out = []
    for j in seen:
        task = stream.tasks[j]
        s = score_examples(model, task.x_train.to(dev), task.y_train.to(dev), sigma, head=task.head,
                           task_id=task.task_id)
        out.append(generalisation(model, task, s))
    return out
