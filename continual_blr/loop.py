"""THE training loop: ``run_stream`` trains a method task after task and fills the accuracy matrix.

Every method and benchmark goes through :func:`fit_task` and :func:`run_stream`; methods only
answer the loop's questions (see ``continual_blr.methods.base.Method``).

Metrics (Lopez-Paz & Ranzato 2017; Chaudhry et al. 2018), with R[i, j] the test accuracy on task j
after training task i and T tasks (for a regression stream R[i, j] is the test R², see
:func:`evaluate_task`, and the same formulas apply):

    average accuracy   A = (1/T) Σ_j R[T−1, j]
    backward transfer  BWT = (1/(T−1)) Σ_{j<T−1} (R[T−1, j] − R[j, j])
    forgetting         F = (1/(T−1)) Σ_{j<T−1} (max_{i<T−1} R[i, j] − R[T−1, j])

BatchNorm (``train.batchnorm``): normalisation statistics are state, like weights, and how they are kept across tasks
is a choice of the loop that every method sees the same way:

* ``shared`` (default): one set of running statistics, updated by every train-mode batch of every task; each task
  is evaluated on the statistics the last task left.
* ``per_task``: when task i's training ends (before ``method.on_task_end``) its statistics are kept
  (:class:`~continual_blr.memory.NormStatistics`); task j is evaluated on task j's, and a regulariser with a
  ``norm_statistics`` attribute (FROMP's) evaluates its stored tasks' memorable points on theirs. Training itself
  is unchanged (batch statistics in train mode, the running ones carried on from the previous task).
* ``frozen``: from the second task on, the BatchNorm layers run in eval mode during training — they normalise with
  the running statistics task 1 ended with and never update them — while their affine weights γ, β are trained
  (and regularised) like every other weight. Every task is evaluated on task 1's statistics.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from . import distributed
from .compiled import compiled_forward
from .data.augment import augment, check_images
from .data.stream import Task, TaskStream
from .memory import NormStatistics, norm_layers
from .methods.base import Method, TrainConfig, register_fit_task
from .mixed_precision import autocast_dtype, match_input_format, to_channels_last, training_autocast
from .optim.blr import BatchClosure, BayesianLearningRule
from .types import Batch, DivergenceError

__all__ = ["StreamResult", "LoopProgress", "TaskProgress", "DivergenceError", "run_stream", "fit_task", "train_step",
           "evaluate_task", "stream_metrics"]

EpochHook = Callable[[int, int, float], None]
"""``on_epoch(task_index, epoch, mean_training_loss)``, called after every epoch of :func:`fit_task`."""


@dataclass
class StreamResult:
    """What a run over a stream produced; saved as JSON and reloadable with :meth:`load`."""

    method: str
    stream: str
    scenario: str
    seed: int
    acc_matrix: list[list[float]]  # R[i][j]: NaN where task j was not seen yet
    avg_acc: float
    avg_acc_per_step: list[float]
    forgetting: float
    bwt: float
    task_times: list[float]
    train_loss: list[float]
    config: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)  # Method.memory_stats() at the end of the stream

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["acc_matrix"] = [[None if math.isnan(v) else v for v in row] for row in self.acc_matrix]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StreamResult":
        d = dict(d)
        d["acc_matrix"] = [[math.nan if v is None else v for v in row] for row in d["acc_matrix"]]
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "StreamResult":
        return cls.from_dict(json.loads(Path(path).read_text()))


@dataclass
class LoopProgress:
    """Where :func:`run_stream` stands after a finished task: enough to continue it exactly.

    Attributes:
        next_task: index of the first task still to train (tasks ``0 .. next_task - 1`` are finished).
        acc_matrix: ``R[i][j]`` so far (rows ``>= next_task`` all NaN).
        task_times: training seconds of each finished task.
        train_loss: last-epoch mean training loss of each finished task.
        generator_state: the minibatch-order generator's state (``torch.Generator.get_state()``) at the boundary.
        torch_rng_state: torch's global CPU generator at the boundary (``torch.get_rng_state()``: dropout
            masks); None in checkpoints written before it was kept.
        cuda_rng_state: the CUDA generator of the run's device at the boundary (CUDA runs only).
        norm_statistics: the per-task BatchNorm statistics kept so far (``NormStatistics.state_dict()``) under
            ``train.batchnorm: per_task``; None otherwise.
    """

    next_task: int
    acc_matrix: list[list[float]]
    task_times: list[float]
    train_loss: list[float]
    generator_state: Tensor
    torch_rng_state: Tensor | None = None
    cuda_rng_state: Tensor | None = None
    norm_statistics: dict[str, Any] | None = None


@dataclass
class TaskProgress:
    """Where :func:`fit_task` stands inside a task after a finished epoch: with the model's and the method's state
    at that point (which the caller saves beside it), enough to continue the task exactly. A run that is stopped
    mid-task then loses at most the epoch under way, not the whole task.

    The task's start is not saved: on resume it is replayed from the boundary before the task (the method's
    ``on_task_start`` and ``make_optimizer``, which are deterministic functions of that state), and the saved
    state is then loaded over it, so that whatever the task's start builds and never changes (FROMP's kernels, a
    redrawn initialisation) is rebuilt exactly. ``tests/test_resume.py`` checks the result bit for bit for every
    method.

    Attributes:
        task: index in the stream of the task under way (``LoopProgress.next_task`` of the boundary before it).
        epochs_done: epochs of the task finished (0-based, the next epoch to train).
        optimizer: the task's optimiser's ``state_dict`` (the one ``method.make_optimizer`` returned).
        warmup_done: steps of ``train.warmup_steps`` taken so far in the task (0 without a warm-up).
        generator_state: the minibatch-order generator after the epoch.
        torch_rng_state: torch's global CPU generator after the epoch (dropout masks).
        cuda_rng_state: the CUDA generator of the model's device after the epoch (CUDA runs only).
        seconds: training seconds of the task so far (for ``task_times``).
    """

    task: int
    epochs_done: int
    optimizer: dict[str, Any]
    warmup_done: int
    generator_state: Tensor
    torch_rng_state: Tensor
    cuda_rng_state: Tensor | None = None
    seconds: float = 0.0


def stream_metrics(acc: list[list[float]]) -> dict[str, Any]:
    """Average accuracy (final and after each task), forgetting and BWT from R (see module docstring)."""
    t = len(acc)
    per_step = [sum(acc[i][: i + 1]) / (i + 1) for i in range(t)]
    if t < 2:
        return dict(avg_acc=per_step[-1], avg_acc_per_step=per_step, forgetting=0.0, bwt=0.0)
    last = acc[-1]
    bwt = sum(last[j] - acc[j][j] for j in range(t - 1)) / (t - 1)
    forgetting = sum(max(acc[i][j] for i in range(j, t - 1)) - last[j] for j in range(t - 1)) / (t - 1)
    return dict(avg_acc=per_step[-1], avg_acc_per_step=per_step, forgetting=forgetting, bwt=bwt)


@torch.no_grad()
def evaluate_task(model: nn.Module, method: Method, task: Task, batch_size: int = 1024) -> float:
    """The score of ``method``'s predictions on ``task``'s test set (its own head); higher is better.

    Classification (``method.likelihood``): the accuracy of argmax ``method.predict_proba``.
    Regression: the coefficient of determination of the predictive mean ŷ = ``method.predict_mean``,

        R² = 1 − Σ_i ‖y_i − ŷ_i‖² / Σ_i ‖y_i − ȳ‖²,      ȳ = the test targets' mean,

    1 for a perfect fit, 0 for predicting ȳ (negative when worse), so the accuracy matrix and its
    average / forgetting / BWT read the same way. Returns NaN for a regression task whose test targets
    are all equal (the denominator is 0).

    Data parallel (``continual_blr.distributed``): the test set is cut into the same chunks of
    ``batch_size`` as in one process, each chunk is split over the ranks, and the counts (squared
    errors) are summed over the ranks (one all-reduce of one number). Every rank calls the predictor
    once per chunk, as one process does, so a sampling predictor draws the same weight samples from the
    method's generator on every rank and the result equals one process's.
    """
    was_training = model.training
    model.eval()
    try:
        if method.likelihood == "regression":
            return _r_squared(model, method, task, batch_size)
        correct = 0
        for start in range(0, task.x_test.shape[0], batch_size):
            x = distributed.shard(task.x_test[start : start + batch_size])
            y = distributed.shard(task.y_test[start : start + batch_size])
            probs = method.predict_proba(model, x, task.head)
            correct += int((probs.argmax(-1) == y).sum())
        correct = round(distributed.all_reduce_float(correct, "evaluation"))
        return correct / max(1, task.x_test.shape[0])
    finally:
        model.train(was_training)


def _r_squared(model: nn.Module, method: Method, task: Task, batch_size: int) -> float:
    """R² of the predictive mean on the task's test set (see :func:`evaluate_task`; Σ‖y − ŷ‖² summed
    over the ranks' parts of each chunk)."""
    y_all = task.y_test.to(torch.float64)
    y_all = y_all.reshape(y_all.shape[0], -1)
    sse = 0.0
    for start in range(0, task.x_test.shape[0], batch_size):
        f = method.predict_mean(model, distributed.shard(task.x_test[start : start + batch_size]), task.head)
        y = distributed.shard(y_all[start : start + batch_size])
        sse += float(((f.to(torch.float64).reshape(y.shape) - y) ** 2).sum())
    sse = distributed.all_reduce_float(sse, "evaluation")
    sst = float(((y_all - y_all.mean(0)) ** 2).sum())
    return 1.0 - sse / sst if sst > 0 else math.nan


def _batches(tasks: list[Task], batch_size: int, generator: torch.Generator, leave_out: tuple[Task, Tensor] | None = None):
    """Shuffled minibatches of each task, interleaved in a random order; each batch holds one task.

    The batches are *global*: in a data-parallel run every rank draws the same order from its copy of
    the seeded ``generator`` and :func:`train_step` keeps the rank's contiguous part of each batch.

    ``leave_out = (task, indices)``: those training examples of that task are taken out of the minibatches
    they were drawn into, after the draw, so that every other batch, and the random numbers drawn, are the
    ones of the full task (a batch left empty is skipped). A retraining without example i then differs from
    one with it only by i's gradient contributions (``inspect --validate``).
    """
    order = []
    for i, t in enumerate(tasks):
        # Drawn on the CPU generator (the same order on every device), moved once per task and epoch.
        perm = torch.randperm(t.n_train, generator=generator).to(t.x_train.device)
        chunks = [perm[s : s + batch_size] for s in range(0, t.n_train, batch_size)]
        if leave_out is not None and t is leave_out[0]:
            out = leave_out[1].to(perm.device)
            chunks = [c[~torch.isin(c, out)] for c in chunks]
        order += [(i, idx) for idx in chunks]
    for k in torch.randperm(len(order), generator=generator).tolist() if len(tasks) > 1 else range(len(order)):
        i, idx = order[k]
        if idx.numel() == 0:
            continue
        t = tasks[i]
        yield t, Batch(t.x_train[idx], t.y_train[idx], t.head)


def _blr_closure(model: nn.Module, method: Method, batch: Batch, task: Task, shard: bool = True,
                 precision: str = "fp32") -> BatchClosure:
    """closure(params) -> (per-example losses, penalty) for a BLR optimiser (see optim.blr), with the
    method's likelihood (the curvature engine gets it from the closure). With ``shard`` the closure
    holds the global batch and evaluates this rank's part of it (``BatchClosure``'s data parallelism).
    ``precision`` ``"bf16"``: the closure's forward runs under autocast (its penalty does not)."""
    reg = method.regularizer
    penalty = None if reg is None else (lambda params: reg.penalty(model, batch, task, params))
    return BatchClosure(model, batch.x, batch.y, batch.head, penalty, likelihood=method.likelihood,
                        sigma=method.sigma, data_parallel=shard, autocast_dtype=autocast_dtype(precision))


def train_step(
    model: nn.Module,
    method: Method,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    task: Task,
    train: TrainConfig,
    *,
    shard: bool = True,
    observe: bool = True,
) -> Tensor:
    """One optimisation step on one minibatch; returns its loss (detached or not, before the step).

    The single place a minibatch becomes an update: :func:`fit_task` and the Avalanche plugins
    (``continual_blr.integrations.avalanche``) both call it. A BLR optimiser steps from a closure over
    per-example losses (see ``optim.blr``); any other optimiser steps on the gradient of
    ``method.loss``, clipped to ``train.grad_clip``.

    Data parallel (``continual_blr.distributed`` with more than one process) and ``shard`` (the batch
    is the global batch, the same on every rank): rank r computes the loss L_r of its contiguous part
    of b_r of the B examples and the gradients are all-reduced as

        ĝ = Σ_r (b_r / B) ∇L_r = (1/B) Σ_i ∇ℓ_i + ∇penalty       (one all-reduce per step)

    — exactly one process's gradient of the global-batch mean loss, also for uneven parts (a rank
    without examples contributes zero). The penalty must be the same on every rank (it is: the past's
    state is identical everywhere). The returned loss is the global one, the same on every rank. With
    ``shard=False`` (Avalanche's ``DistributedHelper``: each rank already holds its own batch) the
    ranks' gradients are averaged with weights b_r / Σ b_r. The BLR optimisers reduce ĝ and ĥ
    themselves (``optim.blr``).

    ``train.precision`` ``"bf16"`` (:mod:`continual_blr.mixed_precision`): the forward and loss
    (``method.loss``; for a BLR optimiser the closure's forward) run under ``torch.autocast(bfloat16)``;
    the backward, the gradient clip, the optimiser step, penalties' kernels / posteriors and the BLR's
    curvature stay fp32. A 4-D input is converted to the model's memory format (channels_last when the
    model's convolution weights are, see ``train.channels_last``).

    After the step, ``method.after_step(model, batch, task)`` sees the minibatch (replay buffers fill from
    it); with ``shard`` that is the global batch on every rank. ``observe=False`` leaves the call to the
    caller (the Avalanche plugins, which first gather the ranks' own minibatches).
    """
    batch = batch._replace(x=match_input_format(batch.x, model))
    if isinstance(optimizer, BayesianLearningRule):
        # Per-example gradients under torch.func: deterministic layers (dropout off).
        model.eval()
        try:
            loss = optimizer.step(_blr_closure(model, method, batch, task, shard, train.precision))
        finally:
            model.train()
        if observe:
            method.after_step(model, batch, task)
        return loss
    optimizer.zero_grad(set_to_none=True)
    if not distributed.is_distributed():
        with training_autocast(train.precision, batch.x.device):
            loss = method.loss(model, batch, task)
        loss.backward()
    else:
        loss = _data_parallel_backward(model, method, batch, task, shard, train.precision)
    if train.grad_clip is not None:
        nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
    optimizer.step()
    if observe:
        method.after_step(model, batch, task)
    return loss


def _data_parallel_backward(model: nn.Module, method: Method, batch: Batch, task: Task, shard: bool,
                            precision: str = "fp32") -> Tensor:
    """Backward pass of this rank's part, gradients all-reduced with weights b_r / B (see :func:`train_step`);
    returns the global mean loss (detached). The forward runs under ``precision``'s autocast."""
    if shard:
        s, e = distributed.shard_bounds(batch.y.shape[0])
        local, total = Batch(batch.x[s:e], batch.y[s:e], batch.head), batch.y.shape[0]
    else:
        local = batch
        total = round(distributed.all_reduce_float(batch.y.shape[0], "batch size"))
    b = local.y.shape[0]
    weight = b / max(total, 1)
    if b == 0:  # no examples here: the same graph on one example, times 0 (same grads that are None)
        local, weight = Batch(batch.x[:1], batch.y[:1], batch.head), 0.0
    with training_autocast(precision, local.x.device):
        loss = method.loss(model, local, task)
    (weight * loss).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    value = loss.detach().reshape(1).to(grads[0].dtype if grads else loss.dtype) * weight
    distributed.all_reduce_sum_([*grads, value], "gradient")
    return value[0]


def fit_task(
    model: nn.Module,
    task: Task,
    method: Method,
    train: TrainConfig,
    *,
    seen: list[Task],
    generator: torch.Generator,
    progress: bool = True,
    on_epoch: Callable[[int, float], None] | None = None,
    norm_statistics: NormStatistics | None = None,
    end_task: bool = True,
    leave_out: Tensor | None = None,
    resume: tuple[TaskProgress, Callable[[nn.Module, Method], None]] | None = None,
    checkpoint: Callable[[Callable[[], TaskProgress]], None] | None = None,
) -> float:
    """Train ``model`` on ``task`` with ``method``; returns the mean training loss of the last epoch.

    ``end_task=False`` leaves out ``method.on_task_end`` (the method's memory, posterior or prior update at the
    task's end): for a retraining the method should not remember, e.g. ``inspect --validate``'s leave-one-out.
    ``leave_out``: indices of ``task``'s training examples to train without, taken out of the minibatches they
    were drawn into (the other batches and the random numbers are those of the full task; :func:`_batches`).

    ``on_epoch(epoch, mean_loss)`` (optional) is called after every epoch (for logs). ``norm_statistics``
    (``train.batchnorm: per_task``) receives the BatchNorm statistics the task ends with, before
    ``method.on_task_end``. Under ``train.batchnorm: frozen`` and a task after the first (``len(seen) > 1``) the
    BatchNorm layers are put in eval mode before every step (module docstring). ``train.compile`` other than
    ``"off"``: the epochs' steps run the model's forward under ``torch.compile`` (:mod:`continual_blr.compiled`);
    the task's start and end run eagerly. ``train.augment`` other than ``"off"``: each step trains on its minibatch
    augmented from ``generator`` (:mod:`continual_blr.data.augment`), and ``method.after_step`` (replay buffers)
    sees the minibatch as drawn.

    Mid-task checkpoints (:class:`TaskProgress`). ``checkpoint(make)`` (optional) is called after every epoch but the
    last, once ``on_epoch`` has been; ``make()`` returns the task's progress at that point (the caller saves it
    with the model's and the method's state, when it chooses to). ``resume = (progress, restore)`` continues the
    task from such a point: the task's start runs as usual, then ``restore(model, method)`` loads the saved model
    and method state, the optimiser and the generators take the saved states, and training goes on with epoch
    ``progress.epochs_done``: the result equals the uninterrupted task's bit for bit (CPU).

    Raises:
        DivergenceError: an epoch's mean training loss is not finite (checked once per epoch).
        ValueError: ``train.compile`` with a Bayesian-learning-rule optimiser; ``train.augment`` on a task whose
            inputs are not images.
    """
    check_images(train.augment, tuple(task.x_train.shape[1:]), f"task {task.task_id} ({task.name})")
    method.on_task_start(model, task)
    optimizer = method.make_optimizer(model, task, train)
    if train.compile != "off" and isinstance(optimizer, BayesianLearningRule):
        raise ValueError(f"train.compile: {train.compile!r} is not available with {method.name}'s Bayesian learning "
                         "rule (per-example gradients under torch.func); allowed: 'off'")
    tasks = method.train_tasks(task, seen)
    frozen = [m for _, m in norm_layers(model)] if train.batchnorm == "frozen" and len(seen) > 1 else []
    first, warmup_done, seconds = 0, 0, 0.0
    if resume is not None:  # the task's start has run as it did: now its state after the saved epoch
        state, restore = resume
        restore(model, method)
        optimizer.load_state_dict(state.optimizer)
        _set_generators(generator, state.generator_state, state.torch_rng_state, state.cuda_rng_state, model)
        first, warmup_done, seconds = state.epochs_done, state.warmup_done, state.seconds
    t0 = time.perf_counter()

    def after_epoch(epochs_done: int, warmup_steps_done: int) -> None:
        if checkpoint is None or epochs_done >= train.epochs:  # the last epoch ends at the task's boundary
            return
        cuda = next((p.device for p in model.parameters() if p.device.type == "cuda"), None)
        checkpoint(lambda: TaskProgress(-1, epochs_done, optimizer.state_dict(), warmup_steps_done,
                                        generator.get_state(), torch.get_rng_state(),
                                        torch.cuda.get_rng_state(cuda) if cuda is not None else None,
                                        seconds + time.perf_counter() - t0))

    last = math.nan
    bar = tqdm(range(first, train.epochs), desc=f"task {task.task_id}", leave=False, disable=None if progress else True,
               initial=first, total=train.epochs)
    with compiled_forward(model, train.compile):  # the minibatches only: the task's end runs eagerly
        last = _epochs(model, task, method, train, optimizer, tasks, bar, frozen, generator, leave_out, on_epoch,
                       warmup_done, after_epoch)
    if norm_statistics is not None:
        norm_statistics.save(model, task.task_id)
    if end_task:
        method.on_task_end(model, task, optimizer)
    return last


def _set_generators(generator: torch.Generator, state: Tensor, torch_state: Tensor, cuda_state: Tensor | None,
                    model: nn.Module) -> None:
    """The loop's minibatch-order generator and torch's global ones (dropout) back to saved states."""
    generator.set_state(state)
    torch.set_rng_state(torch_state)
    cuda = next((p.device for p in model.parameters() if p.device.type == "cuda"), None)
    if cuda_state is not None and cuda is not None:
        torch.cuda.set_rng_state(cuda_state, cuda)


def _epochs(model: nn.Module, task: Task, method: Method, train: TrainConfig, optimizer: torch.optim.Optimizer,
            tasks: list[Task], bar: Any, frozen: list[nn.Module], generator: torch.Generator,
            leave_out: Tensor | None, on_epoch: Callable[[int, float], None] | None, warmup_done: int = 0,
            after_epoch: Callable[[int, int], None] | None = None) -> float:
    """:func:`fit_task`'s epochs over ``task`` (and the tasks ``method.train_tasks`` adds), from the epoch ``bar``
    starts at; the last epoch's mean training loss. ``warmup_done``: warm-up steps already taken in the task (a
    resumed task). ``after_epoch(epochs_done, warmup_steps_done)`` is called after every epoch, after
    ``on_epoch``."""
    last = math.nan
    warmup = _Warmup(optimizer, train.warmup_steps) if train.warmup_steps else None
    if warmup is not None:
        warmup.done = warmup_done
    for epoch in bar:
        total, n = 0.0, 0  # summed on the loss's device: no host synchronisation per step
        for t, batch in _batches(tasks, train.batch_size, generator,
                                 None if leave_out is None else (task, leave_out)):
            for m in frozen:  # again at every step: evaluation and the BLR's step put the model back in train mode
                m.eval()
            if warmup is not None:
                warmup.before_step()
            if train.augment == "off":
                loss = train_step(model, method, optimizer, batch, t, train)
            else:  # the step on augmented images drawn from the loop's generator; the buffers see them as stored
                seen = batch._replace(x=augment(batch.x, train.augment, generator))
                loss = train_step(model, method, optimizer, seen, t, train, observe=False)
                method.after_step(model, batch._replace(x=match_input_format(batch.x, model)), t)
            total = total + loss.detach() * batch.y.shape[0]
            n += batch.y.shape[0]
        last = float(total) / max(n, 1)
        if not math.isfinite(last):
            raise DivergenceError(
                f"{method.name}: the training loss on task {task.task_id} ({task.name}) became {last} in epoch "
                f"{epoch + 1}; lower the step size (train.lr, or the method's lr) or bound it (train.grad_clip, "
                "the BLR's clip_radius)")
        bar.set_postfix(loss=f"{last:.4f}")
        if on_epoch is not None:
            on_epoch(epoch, last)
        if after_epoch is not None:
            after_epoch(epoch + 1, 0 if warmup is None else warmup.done)
    return last


class _Warmup:
    """``train.warmup_steps`` k: before the i-th step of a task (i = 1..k) every parameter group's ``lr`` is set to
    its full value times i / k; from step k + 1 on, back to that value.

    The full value is read once per parameter group and kept in the group (``"warmup_lr"``): an optimiser kept
    across tasks (the BLR's, whose state is the posterior) may end a task of at most k steps inside its ramp, and
    the next task must ramp to the full value again, not to that reduced one."""

    def __init__(self, optimizer: torch.optim.Optimizer, steps: int) -> None:
        self.optimizer, self.steps, self.done = optimizer, int(steps), 0
        try:
            self.base = [float(g.setdefault("warmup_lr", g["lr"])) for g in optimizer.param_groups]
        except KeyError:
            raise ValueError(f"train.warmup_steps: the optimiser {type(optimizer).__name__} has no 'lr' in its "
                             "parameter groups; allowed: 0") from None

    def before_step(self) -> None:
        if self.done > self.steps:
            return
        self.done += 1
        factor = min(self.done / self.steps, 1.0)
        for g, base in zip(self.optimizer.param_groups, self.base):
            g["lr"] = base * factor


def _use_norm_statistics(method: Method, store: NormStatistics) -> None:
    """Hand ``store`` to the method's regularisers that evaluate stored tasks' functions (a ``norm_statistics``
    attribute: FROMP's), walking composed regularisers' ``parts`` as ``Method.use_likelihood`` does."""
    stack = [method.regularizer]
    while stack:
        reg = stack.pop()
        if reg is None:
            continue
        if hasattr(reg, "norm_statistics"):
            reg.norm_statistics = store  # type: ignore[attr-defined]
        stack.extend(getattr(reg, "parts", []))


def run_stream(
    model: nn.Module,
    stream: TaskStream,
    method: Method,
    train: TrainConfig,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    progress: bool = True,
    config: dict[str, Any] | None = None,
    resume: LoopProgress | None = None,
    restore: Callable[[nn.Module, Method], None] | None = None,
    on_task_end: Callable[[LoopProgress, nn.Module, Method], None] | None = None,
    on_epoch: EpochHook | None = None,
    resume_task: tuple[TaskProgress, Callable[[nn.Module, Method], None]] | None = None,
    on_epoch_state: Callable[[Callable[[], TaskProgress], nn.Module, Method], None] | None = None,
) -> StreamResult:
    """Train ``method`` over ``stream`` task by task and evaluate on every task seen so far.

    A run can be continued from a task boundary: ``on_task_end`` receives a :class:`LoopProgress` after
    every task (with the model and method, to checkpoint them); passing that progress back as ``resume``
    together with ``restore`` (which loads the saved model and method state after ``method.setup``)
    skips the finished tasks and continues with the same minibatch order, so the result equals an
    uninterrupted run's.

    Args:
        model: the network (moved to ``device``); called as ``model(x, head=h)``.
        stream: the tasks (and their likelihood, handed to ``method.use_likelihood``).
        method: the continual-learning method (its state carries the past between tasks).
        train: per-task training settings.
        seed: seeds the minibatch order (a ``torch.Generator``; no global RNG is touched).
        device: where to train.
        progress: tqdm bars over tasks and epochs.
        config: the configuration to record in the result.
        resume: continue from this boundary (tasks before ``resume.next_task`` are not retrained).
        restore: ``restore(model, method)``, called after ``method.setup`` when resuming.
        on_task_end: ``on_task_end(progress, model, method)``, called after each task is trained and evaluated.
        on_epoch: ``on_epoch(task_index, epoch, mean_loss)``, called after every epoch.
        resume_task: ``(progress, restore)``: continue the task ``progress.task`` (the first one this call trains:
            ``resume.next_task``, or 0) from inside, after its epoch ``progress.epochs_done`` (:func:`fit_task`);
            ``restore(model, method)`` loads the model and method state saved with ``progress``.
        on_epoch_state: ``on_epoch_state(make, model, method)``, called after every epoch but a task's last, where
            ``make()`` gives the :class:`TaskProgress` to save with the model and method for a mid-task resume.

    Returns:
        A :class:`StreamResult` with the accuracy matrix and its summary metrics.
    """
    device = torch.device(device)
    cuda = [device] if device.type == "cuda" else []
    # Layers that draw from torch's global generators (dropout) are seeded from ``seed`` inside a forked
    # RNG state: the run is reproducible and the caller's global state is left as it was.
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        return _run_stream(model, stream, method, train, seed=seed, device=device, progress=progress,
                           config=config, resume=resume, restore=restore, on_task_end=on_task_end,
                           on_epoch=on_epoch, resume_task=resume_task, on_epoch_state=on_epoch_state)


def _run_stream(model, stream, method, train, *, seed, device, progress, config, resume, restore, on_task_end,
                on_epoch, resume_task=None, on_epoch_state=None) -> StreamResult:
    """The body of :func:`run_stream`, run inside its forked global RNG state."""
    model.to(device)
    distributed.broadcast_module(model)  # under torchrun every rank starts from rank 0's weights
    if train.use_channels_last:  # before the optimisers and priors are made; the step converts the inputs
        to_channels_last(model)
    model.train()
    tasks = [t.to(device) for t in stream.tasks]
    generator = torch.Generator().manual_seed(seed)
    method.use_likelihood(stream.likelihood, stream.sigma)  # before setup: subclasses' setup may not call super
    method.setup(model, stream, train)
    # per-task BatchNorm statistics (only for a network that has BatchNorm: otherwise nothing would change)
    norm = NormStatistics() if train.batchnorm == "per_task" and norm_layers(model) else None
    if norm is not None:
        _use_norm_statistics(method, norm)
    n = len(tasks)
    acc = [[math.nan] * n for _ in range(n)]
    times: list[float] = []
    losses: list[float] = []
    start = 0
    if resume is not None:
        if restore is not None:
            restore(model, method)
        start = resume.next_task
        acc = [list(row) for row in resume.acc_matrix]
        times, losses = list(resume.task_times), list(resume.train_loss)
        generator.set_state(resume.generator_state)
        if resume.torch_rng_state is not None:
            torch.set_rng_state(resume.torch_rng_state)
        if resume.cuda_rng_state is not None and device.type == "cuda":
            torch.cuda.set_rng_state(resume.cuda_rng_state, device)
        if norm is not None:
            norm.load_state_dict(resume.norm_statistics)
    bar = tqdm(range(start, n), desc=f"{method.name} on {stream.name}", disable=None if progress else True,
               initial=start, total=n)  # disable=None: bars only on a terminal, not in a log
    for i in bar:
        task = tasks[i]
        t0 = time.perf_counter()
        epoch_hook = None if on_epoch is None else (lambda epoch, loss, i=i: on_epoch(i, epoch, loss))
        within = resume_task if resume_task is not None and resume_task[0].task == i == start else None
        checkpoint = None if on_epoch_state is None else (
            lambda make, i=i: on_epoch_state(lambda: dataclasses.replace(make(), task=i), model, method))
        losses.append(fit_task(model, task, method, train, seen=tasks[: i + 1], generator=generator, progress=progress,
                               on_epoch=epoch_hook, norm_statistics=norm, resume=within, checkpoint=checkpoint))
        times.append(time.perf_counter() - t0 + (within[0].seconds if within is not None else 0.0))
        for j in range(i + 1):
            with norm.use(model, tasks[j].task_id) if norm is not None else nullcontext():
                acc[i][j] = evaluate_task(model, method, tasks[j], train.eval_batch_size)
        bar.set_postfix(avg_acc=f"{sum(acc[i][: i + 1]) / (i + 1):.4f}")
        if on_task_end is not None:
            on_task_end(LoopProgress(i + 1, [list(row) for row in acc], list(times), list(losses), generator.get_state(),
                                     torch.get_rng_state(),
                                     torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                                     norm.state_dict() if norm is not None else None),
                        model, method)
    metrics = stream_metrics(acc)
    return StreamResult(
        method=method.name,
        stream=stream.name,
        scenario=stream.scenario,
        seed=seed,
        acc_matrix=acc,
        task_times=times,
        train_loss=losses,
        config=config or {},
        memory=method.memory_stats(),
        **metrics,
    )


register_fit_task(fit_task)  # methods train auxiliary models through this loop (methods.base.fit_auxiliary)
