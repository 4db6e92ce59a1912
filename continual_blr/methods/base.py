"""What a continual-learning method is: a posterior / regulariser / optimiser choice plugged into the
one training loop (``continual_blr.loop``).

A method is *not* a training loop. It answers the loop's questions:

* ``make_optimizer`` — which optimiser trains this task (Adam by default; a BLR optimiser whose
  prior is the previous posterior for Bayesian methods);
* ``regularizer`` — how the past enters the loss (``penalty``), refreshed by ``on_task_start`` /
  ``on_task_end``;
* ``loss`` — the minibatch objective (the mean negative log-likelihood of the stream's likelihood +
  penalty by default);
* ``train_tasks`` — which tasks' data are trained on now (just the current one, or all seen ones
  for the joint-training upper bound);
* ``predict_proba`` / ``predict_mean`` — how predictions are made (the network's softmax or outputs,
  or a Monte-Carlo average under the posterior).

**Likelihood.** The stream names it (``TaskStream.likelihood``, ``TaskStream.sigma``); ``run_stream``
hands it to the method with :meth:`Method.use_likelihood` before ``setup`` (so a subclass whose
``setup`` does not call ``super()`` still gets it) and the method keeps it as ``self.likelihood`` /
``self.sigma``. ``"classification"``: ℓ_i = −log softmax(f_i)_{y_i}; ``"regression"``: the Gaussian
ℓ_i = ‖f_i − y_i‖²/(2σ²), the constant (K/2) log 2πσ² left out (:mod:`continual_blr.curvature.likelihoods`).

**Auxiliary fits.** A method that must train a *second* model (VCL's coreset copies, its
maximum-likelihood start) does it through the one training loop with :func:`fit_auxiliary`. The loop
(``continual_blr.loop``) imports the methods, so they cannot import it; instead the loop registers its
``fit_task`` here when it is imported (:func:`register_fit_task`), and :func:`fit_auxiliary` calls it.
Both drivers of a method — ``run_stream`` and the Avalanche plugin — import the loop, so the same
auxiliary fits run under either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..compiled import check_compile
from ..curvature import likelihoods as lk
from ..data.augment import check_augment
from ..data.stream import Task, TaskStream
from ..memory import NORM_MODES
from ..mixed_precision import channels_last_on, check_precision
from ..regularizers.base import Regularizer
from ..types import Batch

__all__ = ["Method", "TrainConfig", "make_torch_optimizer", "OPTIMIZERS", "mean_nll", "fit_auxiliary",
           "register_fit_task"]

OPTIMIZERS = ("adam", "sgd")


@dataclass
class TrainConfig:
    """How each task is trained.

    Attributes:
        epochs: passes over each task's training data.
        batch_size: minibatch size.
        lr: learning rate of the (non-BLR) optimiser.
        optimizer: ``"adam"`` or ``"sgd"``.
        grad_clip: clip the gradient norm to this value (None: off).
        eval_batch_size: minibatch size for evaluation.
        precision: ``"fp32"`` or ``"bf16"``: bf16 runs the training step's forward and loss under
            ``torch.autocast(bfloat16)`` (weights, gradients, optimiser state, curvature, posteriors and
            evaluation stay fp32; :mod:`continual_blr.mixed_precision`).
        channels_last: store convolution weights and 4-D inputs in ``torch.channels_last`` format; None (the
            default): on exactly when ``precision`` is ``"bf16"``.
        batchnorm: how BatchNorm's running statistics are kept across tasks, for every method alike
            (``continual_blr.loop``): ``"shared"`` (default: one set, moved by every train-mode batch of every
            task), ``"per_task"`` (each task's statistics as it ends are kept and used for its evaluation and for a
            functional penalty at its memorable points), ``"frozen"`` (from the second task on the layers
            normalise with the statistics task 1 ended with, in training too, and never update them; their
            affine weights γ, β stay trainable). No effect on a network without BatchNorm.
        compile: ``"off"`` (default) | ``"default"`` | ``"reduce-overhead"`` | ``"aot_eager"``: train each task's
            minibatches with the model's forward under ``torch.compile`` (:mod:`continual_blr.compiled`: for GPUs,
            where a small network's step is bound by Python and kernel launches); with it, Adam on CUDA uses its
            fused kernel. Numbers agree with eager ones to round-off. Not with the BLR optimisers.
        warmup_steps: k — each task's first k optimiser steps run at ``lr · i / k`` (step i = 1..k; every
            parameter group's own step size, so the BLR optimisers' too), then at the full step size: a linear
            warm-up (Goyal et al. 2017) against the first steps of an optimiser whose state is fresh at every task
            (Adam's bias-corrected first step moves every weight by lr, whatever the gradient's size). 0 (default):
            none. For every method alike.
        augment: ``"off"`` (default) | ``"crop_flip"``: each training minibatch, and each replayed batch of a
            replay buffer (``er``, ``derpp``), augmented afresh (:mod:`continual_blr.data.augment`: the DER
            protocol's random 4-pixel-padded crop and horizontal flip) from the loop's seeded generator (the
            buffers' from their own); buffers store the images as drawn, and evaluation, a task's end and FROMP's
            memorable points never see an augmented image. Image streams only. For every method alike.
    """

    epochs: int = 10
    batch_size: int = 32
    lr: float = 1e-3
    optimizer: str = "adam"
    grad_clip: float | None = None
    eval_batch_size: int = 1024
    precision: str = "fp32"
    channels_last: bool | None = None
    batchnorm: str = "shared"
    compile: str = "off"
    warmup_steps: int = 0
    augment: str = "off"

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "eval_batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"train.{name}: must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"train.lr: must be > 0, got {self.lr}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"train.optimizer: got {self.optimizer!r}; allowed: {', '.join(map(repr, OPTIMIZERS))}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"train.grad_clip: must be > 0 or null, got {self.grad_clip}")
        check_precision(self.precision, "train.precision")
        if self.channels_last not in (None, True, False):
            raise ValueError(f"train.channels_last: got {self.channels_last!r}; allowed: true, false, null")
        if self.batchnorm not in NORM_MODES:
            raise ValueError(f"train.batchnorm: got {self.batchnorm!r}; allowed: {', '.join(map(repr, NORM_MODES))}")
        check_compile(self.compile, "train.compile")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"train.warmup_steps: must be an integer >= 0 (0: no warm-up), got {self.warmup_steps!r}")
        check_augment(self.augment, "train.augment")

    @property
    def use_channels_last(self) -> bool:
        """Whether convolution weights and 4-D inputs use ``torch.channels_last`` (``channels_last``, or bf16)."""
        return channels_last_on(self.precision, self.channels_last)


def make_torch_optimizer(params, train: TrainConfig) -> torch.optim.Optimizer:
    """Adam or SGD over ``params`` with ``train.lr`` (under ``train.compile`` on CUDA, Adam's fused kernel)."""
    if train.optimizer == "adam":
        params = list(params)
        first = params[0]["params"][0] if params and isinstance(params[0], dict) else (params[0] if params else None)
        fused = train.compile != "off" and first is not None and first.device.type == "cuda"
        return torch.optim.Adam(params, lr=train.lr, **({"fused": True} if fused else {}))
    return torch.optim.SGD(params, lr=train.lr)


def mean_nll(f: Tensor, y: Tensor, likelihood: str = "classification", sigma: float = 1.0) -> Tensor:
    """(1/B) Σ_i ℓ(f_i, y_i): the mean per-example negative log-likelihood of a minibatch.

    Classification: ``F.cross_entropy(f, y)`` itself (the same kernel as before likelihoods were named,
    so classification runs are bit-identical); regression: the mean of
    :func:`continual_blr.curvature.likelihoods.nll`, ‖f_i − y_i‖²/(2σ²) without the constant.
    """
    if likelihood == "classification":
        return F.cross_entropy(f, y)
    return lk.nll(f, y, likelihood, sigma).mean()


_FIT_TASK: Callable[..., float] | None = None


def register_fit_task(fit_task: Callable[..., float]) -> None:
    """Install the training loop's ``fit_task`` for :func:`fit_auxiliary` (``continual_blr.loop`` does this
    when imported; see the module docstring)."""
    global _FIT_TASK
    _FIT_TASK = fit_task


def fit_auxiliary(model: nn.Module, task: Task, method: "Method", train: TrainConfig, *, seen: list[Task],
                  seed: int) -> float:
    """Train ``model`` on ``task`` with ``method`` through the one training loop (``loop.fit_task``), with a
    minibatch order of its own (a ``torch.Generator`` seeded with ``seed``) and no progress bar.

    Raises:
        RuntimeError: the training loop was never imported (nothing registered a ``fit_task``).
    """
    if _FIT_TASK is None:
        raise RuntimeError("fit_auxiliary: no training loop registered; import continual_blr.loop first")
    return _FIT_TASK(model, task, method, train, seen=seen, generator=torch.Generator().manual_seed(seed),
                     progress=False)


class Method:
    """Fine-tuning: no regulariser, the network's own predictions (the ``"none"`` baseline).

    Subclasses override the hooks they need. ``self.generator`` is the method's own random stream.
    """

    name = "none"
    likelihood: str = "classification"
    sigma: float = 1.0

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed + 7919)
        self.regularizer: Regularizer | None = None

    def use_likelihood(self, likelihood: str, sigma: float = 1.0) -> None:
        """Train and predict with ``likelihood`` (``"classification"`` | ``"regression"``) and noise σ.

        Also handed to the regulariser(s) that compute a curvature of the loss (those with a
        ``likelihood`` attribute, e.g. the Laplace / EWC prior). ``run_stream`` calls this before ``setup``.

        Raises:
            ValueError: an unknown likelihood or σ ≤ 0 for regression (one line).
        """
        lk.check_likelihood(likelihood, sigma)
        self.likelihood, self.sigma = likelihood, float(sigma)
        stack = [self.regularizer]
        while stack:
            reg = stack.pop()
            if reg is None:
                continue
            if hasattr(reg, "likelihood"):
                reg.likelihood, reg.sigma = likelihood, float(sigma)  # type: ignore[attr-defined]
            stack.extend(getattr(reg, "parts", []))

    # called once by run_stream before the first task
    def setup(self, model: nn.Module, stream: TaskStream, train: TrainConfig) -> None:
        """Prepare state that depends on the model (e.g. an initial prior); records the stream's likelihood."""
        if stream is not None:
            self.use_likelihood(stream.likelihood, stream.sigma)

    def make_optimizer(self, model: nn.Module, task: Task, train: TrainConfig) -> torch.optim.Optimizer:
        """The optimiser for ``task`` (fresh Adam/SGD by default)."""
        return make_torch_optimizer(model.parameters(), train)

    def train_tasks(self, task: Task, seen: list[Task]) -> list[Task]:
        """Tasks whose training data are used now (``seen`` includes ``task``)."""
        return [task]

    def loss(self, model: nn.Module, batch: Batch, task: Task) -> Tensor:
        """(1/B) Σ_i ℓ_i(θ) (the likelihood's, :func:`mean_nll`) plus the regulariser's penalty."""
        loss = mean_nll(model(batch.x, head=batch.head), batch.y, self.likelihood, self.sigma)
        if self.regularizer is not None:
            loss = loss + self.regularizer.penalty(model, batch, task)
        return loss

    def on_task_start(self, model: nn.Module, task: Task) -> None:
        if self.regularizer is not None:
            self.regularizer.on_task_start(model, task)

    def epoch_stats(self) -> dict[str, float]:
        """Diagnostics of the epoch just finished, for the run's ``train_log.csv`` (a column each; empty here)."""
        return {}

    def on_task_end(self, model: nn.Module, task: Task, optimizer: torch.optim.Optimizer | None = None) -> None:
        if self.regularizer is not None:
            self.regularizer.on_task_end(model, task)

    def after_step(self, model: nn.Module, batch: Batch, task: Task) -> None:
        """Called after every optimiser step with the step's minibatch (nothing here; replay methods fill their
        buffer). In a data-parallel run it gets the *global* minibatch on every rank, so state kept from it
        stays identical across ranks."""

    def memory_stats(self) -> dict[str, Any]:
        """What the method stores of past examples: ``stored_examples`` (count) and ``stored_bytes`` (their
        inputs and labels), plus method-specific entries; recorded in ``results.json`` as ``memory``."""
        return {"stored_examples": 0, "stored_bytes": 0}

    @torch.no_grad()
    def predict_proba(self, model: nn.Module, x: Tensor, head: int) -> Tensor:
        """Class probabilities for inputs ``x`` on output ``head``."""
        return torch.softmax(model(x, head=head), dim=-1)

    @torch.no_grad()
    def predict_mean(self, model: nn.Module, x: Tensor, head: int) -> Tensor:
        """The predictive mean of the outputs (regression): f(x; θ) at the current weights, [B, K]."""
        return model(x, head=head)

    def state_dict(self) -> dict[str, Any]:
        """The regulariser's state (the carried past) and the method's random stream (``generator``), so
        that a reloaded method draws the same weight samples as the one that was saved."""
        return {"regularizer": self.regularizer.state_dict() if self.regularizer is not None else None,
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.regularizer is not None and state.get("regularizer") is not None:
            self.regularizer.load_state_dict(state["regularizer"])
        if state.get("generator") is not None:  # absent in method.pt files written before it was saved
            self.generator.set_state(state["generator"])
