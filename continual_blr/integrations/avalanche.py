"""Every continual_blr method as a plugin for Avalanche's strategies (Naive and other SupervisedTemplates).

Usage — a diff against fine-tuning with Avalanche:

      strategy = Naive(model=model, optimizer=Adam(model.parameters(), lr=1e-3), train_mb_size=128,
    +                  plugins=[FROMPPlugin("fromp", {"tau": 10.0})],
                       evaluator=EvaluationPlugin(accuracy_metrics(experience=True)))
      for experience in benchmark.train_stream:
          strategy.train(experience)
          strategy.eval(benchmark.test_stream)

A plugin holds a :class:`~continual_blr.methods.Method` — built by ``build_method`` from the registry,
or passed in — and answers Avalanche's hooks with that method's own hooks, so the regulariser,
posterior and optimiser objects are exactly those ``continual_blr.loop.run_stream`` uses. There is
no second implementation of any method here; this module only translates:

| library loop (``loop.py``)     | Avalanche hook                                                                         |
|--------------------------------|----------------------------------------------------------------------------------------|
| ``method.setup``               | ``before_training_exp`` of the first experience                                        |
| ``method.on_task_start``       | ``before_training_exp``, with a ``Task`` materialised once from ``experience.dataset`` (eval transforms, dataset order) |
| ``method.make_optimizer``      | ``before_training_exp``, only if the method overrides it                               |
| penalty / ``method.loss``      | ``before_backward``: ``strategy.loss += regularizer.penalty(...)``; a method that overrides ``loss`` replaces the criterion instead |
| gradient clipping              | ``after_backward`` (``grad_clip``)                                                     |
| ``train_step`` (own optimiser) | ``before_update``; then the strategy's optimiser sees no gradients                     |
| ``method.after_step``          | ``after_update`` (replay buffers; the ranks' minibatches gathered first)               |
| ``method.on_task_end``         | ``after_training_exp`` (posteriors, memories, kernels refreshed)                       |
| ``method.predict_proba``       | ``after_eval_forward`` (``mb_output`` ← log-probabilities), only if the method overrides it |

Two ways a minibatch becomes an update, chosen from the method alone (no per-method code):

* **The strategy's optimiser** (methods that keep ``Method.make_optimizer``: fine-tuning, EWC,
  Laplace, FROMP, …). Avalanche runs forward, criterion, backward and ``optimizer.step()`` as usual;
  the plugin adds the method's penalty to ``strategy.loss``. With ``fresh_optimizer=True`` (default)
  the optimiser's state is cleared at every experience, as the library's loop builds a fresh one per
  task (Avalanche keeps Adam's moments across experiences otherwise).
* **The method's own optimiser** (methods that override ``make_optimizer``: the BLR optimisers VON /
  VOGN / Kronecker BLR, IVON, …). The plugin calls ``continual_blr.loop.train_step`` — the very
  function ``fit_task`` calls — on Avalanche's minibatch in ``before_update``: the BLR samples weights
  θ ~ q around its forward/backward passes inside that step (per-example gradients through
  ``torch.func``) and restores the mean in a ``finally``. Afterwards every gradient is set to
  ``None``, so the strategy's optimiser (pass any, e.g. ``SGD(model.parameters(), lr=0.0)``) skips
  every parameter the method's optimiser covers. The method's optimiser is not the strategy's, so
  Avalanche's optimiser reset at each experience never touches it. Parameters Avalanche appends for
  new heads (``MultiHeadClassifier``) are added to a BLR optimiser at the next experience with the
  method's initial prior (see :meth:`MethodPlugin._cover_new_parameters`); parameters another
  method's optimiser does not cover (e.g. IVON's, built over the parameters seen at ``setup``) keep
  the gradient of ``method.loss`` and are trained by the strategy's optimiser, as point estimates.

Models. The library calls networks as ``model(x, head=h)``; Avalanche as ``model(x, task_labels)``
for a ``MultiTaskModule`` and ``model(x)`` otherwise. :class:`HeadModel` presents an Avalanche
network in the library's convention (head ↦ task label) and :class:`TaskLabelModel` presents a
library network to Avalanche; :func:`library_model` picks the right view (unwrapping a
``TaskLabelModel``, so parameter names then match a ``run_stream`` run exactly).

``method.train_tasks``: a method may train on its own selection of the experience's data (VCL holds a
coreset out): the plugin then replaces the strategy's training data by that selection (preprocessed
tensors, through Avalanche 0.6.0's ``_make_taskaware_tensor_classification_dataset``). Methods that
train on several tasks at once (``"joint"``) are refused at their second experience — use Avalanche's
``Cumulative`` / ``JointTraining`` for that. One task label per training experience and minibatch.
"""

from __future__ import annotations

import copy
import re
from collections import defaultdict
from typing import Any

import torch
from torch import Tensor, nn

from . import AVALANCHE_INSTALL_HINT

try:  # Avalanche is the optional [avalanche] extra
    from avalanche.core import SupervisedPlugin
    from avalanche.models import MultiTaskModule
    from avalanche.models.utils import is_multi_task_module
except ImportError as _err:
    raise ImportError(f"continual_blr.integrations.avalanche needs Avalanche (avalanche-lib): "
                      f"{AVALANCHE_INSTALL_HINT} ({_err})") from _err
from torch.utils.data import DataLoader

from ..data.stream import SCENARIOS, Task, TaskStream
from ..loop import train_step
from ..methods import Method, TrainConfig, build_method
from ..optim.blr import BayesianLearningRule
from ..posteriors import DiagPosterior, FullPosterior, GaussianPosterior, KronPosterior
from ..types import Batch

__all__ = [
    "MethodPlugin",
    "WeightPriorPlugin",
    "BufferReplayPlugin",
    "VCLPlugin",
    "FROMPPlugin",
    "BLRPlugin",
    "HeadModel",
    "TaskLabelModel",
    "library_model",
    "task_from_experience",
    "stream_to_benchmark",
    "accuracy_matrix",
]


# ----------------------------------------------------------------------------------------------
# Models: the library's call convention  <->  Avalanche's
# ----------------------------------------------------------------------------------------------
class HeadModel(nn.Module):
    """An Avalanche network seen with the library's convention ``model(x, head=h)``.

    A ``MultiTaskModule`` is called as ``model(x, h)`` (head ``h`` = task label ``h``); any other
    network as ``model(x)`` — exactly what Avalanche's ``avalanche_forward`` does. Parameters keep
    their objects (the names gain a ``model.`` prefix), so gradients and in-place updates through
    this view reach the strategy's model.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor, head: int = 0) -> Tensor:
        if is_multi_task_module(self.model):
            return self.model(x, int(head))
        return self.model(x)


class TaskLabelModel(MultiTaskModule):
    """A library network (``model(x, head=h)``, e.g. :class:`~continual_blr.models.MLP`) as an
    Avalanche ``MultiTaskModule``: task label ``t`` selects head ``t``.

    All heads exist from the start (no head is added by Avalanche's model adaptation), as in
    ``run_stream``; with a single-head network every task label uses head 0.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward_single_task(self, x: Tensor, task_label: int) -> Tensor:
        return self.model(x, head=int(task_label))

    def forward(self, x: Tensor, task_labels: Tensor | int | None = None) -> Tensor:  # type: ignore[override]
        if task_labels is None:
            return self.forward_single_task(x, 0)
        if isinstance(task_labels, int):
            return self.forward_single_task(x, task_labels)
        labels = torch.unique(task_labels)
        if labels.numel() == 1:  # the usual case: skip the scatter, keep the computation identical
            return self.forward_single_task(x, int(labels))
        out: Tensor | None = None
        for label in labels.tolist():
            mask = task_labels == label
            part = self.forward_single_task(x[mask], label)
            if out is None:
                out = part.new_zeros(x.shape[0], part.shape[1])
            out[mask] = part
        assert out is not None
        return out


def library_model(model: nn.Module) -> nn.Module:
    """The network as the library's methods call it (``model(x, head=h)``).

    A :class:`TaskLabelModel` is unwrapped (same module, same parameter names as in ``run_stream``);
    any other Avalanche network is wrapped in a :class:`HeadModel`.
    """
    if isinstance(model, TaskLabelModel):
        return model.model
    return HeadModel(model)


# ----------------------------------------------------------------------------------------------
# Data: Avalanche experiences  <->  the library's Task / TaskStream
# ----------------------------------------------------------------------------------------------
def _task_label(experience: Any) -> int:
    labels = sorted({int(t) for t in getattr(experience, "task_labels", [0])})
    if len(labels) != 1:
        raise ValueError(f"experience {experience.current_experience}: one task label per experience is supported, "
                         f"got {labels}")
    return labels[0]


def task_from_experience(experience: Any, device: torch.device | str | None = None, batch_size: int = 1024) -> Task:
    """The library's :class:`Task` for an Avalanche training experience (tensors materialised once).

    Inputs go through the dataset's *eval* transforms (no augmentation — the library's tasks hold
    preprocessed tensors), in dataset order. ``head`` is the experience's task label, ``classes``
    its ``classes_in_this_experience``; the test tensors are empty (Avalanche keeps them in another
    stream).
    """
    dataset = experience.dataset.eval()
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=getattr(dataset, "collate_fn", None))
    xs, ys = [], []
    for mb in loader:
        xs.append(mb[0])
        ys.append(mb[1])
    x = torch.cat(xs)
    y = torch.cat(ys).long()
    if device is not None:
        x, y = x.to(device), y.to(device)
    classes = tuple(sorted(int(c) for c in getattr(experience, "classes_in_this_experience", torch.unique(y).tolist())))
    idx = int(experience.current_experience)
    return Task(idx, x, y, x[:0], y[:0], classes, _task_label(experience), f"avalanche/exp{idx}")


def stream_to_benchmark(stream: TaskStream) -> Any:
    """An Avalanche benchmark (``tensors_benchmark``) holding the same tensors as a library stream.

    Experience ``i`` trains on ``stream.tasks[i]``'s training tensors and tests on its test tensors;
    its task label is the task's ``head`` (so a task-incremental stream gives one label per task).
    """
    from avalanche.benchmarks import tensors_benchmark

    return tensors_benchmark(
        train_tensors=[(t.x_train, t.y_train) for t in stream.tasks],
        test_tensors=[(t.x_test, t.y_test) for t in stream.tasks],
        task_labels=[t.head for t in stream.tasks],
    )


_ACC = re.compile(r"^Top1_Acc_Exp/eval_phase/test_stream/Task\d+/Exp(\d+)$")


def accuracy_matrix(metrics_after_each_experience: list[dict[str, Any]],
                    n_experiences: int | None = None) -> list[list[float]]:
    """``R[i][j]`` (test accuracy on experience j after training experience i; NaN where j > i) from the
    dictionaries ``strategy.eval(...)`` returned after each training experience.

    Needs ``accuracy_metrics(experience=True)`` in the ``EvaluationPlugin`` and evaluation on the test
    stream; the same matrix as ``StreamResult.acc_matrix``.

    Raises:
        ValueError: no per-experience test accuracy in any of the dictionaries (instead of a matrix of NaN).
    """
    n = n_experiences if n_experiences is not None else len(metrics_after_each_experience)
    acc = [[float("nan")] * n for _ in metrics_after_each_experience]
    found = False
    for i, metrics in enumerate(metrics_after_each_experience):
        for name, value in metrics.items():
            m = _ACC.match(name)
            if m is not None and int(m.group(1)) <= i and int(m.group(1)) < n:
                acc[i][int(m.group(1))] = float(value)
                found = True
    if metrics_after_each_experience and not found:
        raise ValueError("accuracy_matrix: the metrics hold no per-experience test accuracy (Top1_Acc_Exp/eval_phase/"
                         "test_stream/Task…/Exp…); add accuracy_metrics(experience=True) to the EvaluationPlugin and "
                         "evaluate on the test stream")
    return acc


# ----------------------------------------------------------------------------------------------
# Posteriors over a growing set of parameters (new heads)
# ----------------------------------------------------------------------------------------------
def _restrict(post: GaussianPosterior, names: list[str]) -> GaussianPosterior:
    """The Gaussian over ``names`` only. For a full precision this is the conditional, which equals the
    marginal for the block-diagonal (e.g. isotropic initial) priors it is used on."""
    keep = set(names)
    mean = {k: v for k, v in post.mean.items() if k in keep}
    if isinstance(post, DiagPosterior):
        return DiagPosterior(mean, {k: post.precision[k] for k in mean})
    if isinstance(post, KronPosterior):
        blocks = [(w, b, terms) for w, b, terms in post.blocks if w in keep]
        return KronPosterior(mean, blocks, {k: v for k, v in post.diag.items() if k in keep}, post.delta)
    if isinstance(post, FullPosterior):
        sizes = [v.numel() for v in post.mean.values()]
        offsets = torch.tensor([0] + sizes).cumsum(0).tolist()
        idx = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i, k in enumerate(post.mean) if k in keep])
        idx = idx.to(post.precision.device)
        return FullPosterior(mean, post.precision[idx][:, idx])
    raise TypeError(f"unsupported posterior type {type(post).__name__}")


def _lower_delta(post: KronPosterior, delta: float) -> KronPosterior:
    """The same Gaussian with its isotropic part lowered to ``delta``: the excess (δ − delta) I becomes one
    more Kronecker term (c I ⊗ I) per block and is added to the diagonal part."""
    c = post.delta - delta
    if c == 0:
        return post
    blocks = []
    for w, b, terms in post.blocks:
        m = post.mean[w]
        d_out, d_in = m.shape[0], m[0].numel() + (b is not None)
        eye_in = c * torch.eye(d_in, dtype=m.dtype, device=m.device)
        blocks.append((w, b, [*terms, (eye_in, torch.eye(d_out, dtype=m.dtype, device=m.device))]))
    return KronPosterior(post.mean, blocks, {k: v + c for k, v in post.diag.items()}, delta)


def _join(a: GaussianPosterior, b: GaussianPosterior) -> GaussianPosterior:
    """The product Gaussian over the disjoint parameters of ``a`` and ``b`` (block-diagonal precision)."""
    if set(a.mean) & set(b.mean):
        raise ValueError(f"_join: overlapping parameters {sorted(set(a.mean) & set(b.mean))}")
    mean = {**a.mean, **b.mean}
    if isinstance(a, DiagPosterior) and isinstance(b, DiagPosterior):
        return DiagPosterior(mean, {**a.precision, **b.precision})
    if isinstance(a, KronPosterior) and isinstance(b, KronPosterior):
        delta = min(a.delta, b.delta)
        a, b = _lower_delta(a, delta), _lower_delta(b, delta)
        return KronPosterior(mean, a.blocks + b.blocks, {**a.diag, **b.diag}, delta)
    if isinstance(a, FullPosterior) and isinstance(b, FullPosterior):
        return FullPosterior(mean, torch.block_diag(a.precision, b.precision))
    raise TypeError(f"_join: cannot join {type(a).__name__} and {type(b).__name__}")


# ----------------------------------------------------------------------------------------------
# The plugins
# ----------------------------------------------------------------------------------------------
def _overrides(method: Method, hook: str) -> bool:
    return getattr(type(method), hook) is not getattr(Method, hook)


class MethodPlugin(SupervisedPlugin):
    """Any registered continual_blr method as an Avalanche plugin (see the module docstring).

    Not declared supports_distributed: whether a method is correct under Avalanche's ``DistributedHelper``
    depends on the method; the family plugins declare it where it holds (:class:`WeightPriorPlugin`).

    Args:
        method: a registered method name (``continual_blr.methods.METHODS``) or a ``Method`` instance.
        params: the method's parameters when ``method`` is a name (validated by ``build_method``).
        seed: seeds the method's own random stream (weight samples, random memories) when built here.
        train: the ``TrainConfig`` handed to the method's hooks; default: built from the strategy
            (``train_epochs``, ``train_mb_size``, ``eval_mb_size``, the optimiser's class and lr).
        grad_clip: clip the gradient norm to this value after backward, as ``TrainConfig.grad_clip``
            does in the library's loop (only when ``train`` is not given; pass it inside ``train``
            otherwise).
        fresh_optimizer: clear the strategy optimiser's state at every experience (the library's loop
            uses a fresh optimiser per task).
        scenario: ``"task"``, ``"class"`` or ``"domain"`` as ``Method.setup`` sees it (default: ``"task"``
            for a ``MultiTaskModule``, else ``"domain"`` when every experience of the benchmark holds the
            same classes, else ``"class"``).

    Attributes:
        method: the wrapped method — its ``regularizer``, posterior and optimiser are the library's.
        task: the current experience as a library :class:`Task` (``None`` before training).
        train_task: what the method trains on in it (``method.train_tasks``; usually ``task`` itself).
        view: the strategy's model in the library's convention (see :func:`library_model`).
        optimizer: the method's own optimiser, or ``None`` when the strategy's optimiser is used.
    """

    #: name prefixes of the methods this plugin family accepts (empty: any method)
    family: tuple[str, ...] = ()
    default_method: str = "none"

    def __init__(
        self,
        method: str | Method | None = None,
        params: dict[str, Any] | None = None,
        *,
        seed: int = 0,
        train: TrainConfig | None = None,
        grad_clip: float | None = None,
        fresh_optimizer: bool = True,
        scenario: str | None = None,
    ) -> None:
        super().__init__()
        if scenario is not None and scenario not in SCENARIOS:
            raise ValueError(f"scenario: got {scenario!r}; allowed: {', '.join(map(repr, SCENARIOS))}")
        self.scenario = scenario
        method = self.default_method if method is None else method
        if isinstance(method, Method):
            if params:
                raise ValueError("params: pass them to the Method you built, or pass the method's name")
            self.method = method
        else:
            self.method = build_method(method, params, seed=seed)
        name = self.method.name
        if self.family and not name.startswith(self.family):
            raise ValueError(f"{type(self).__name__}: method {name!r} is not in this family "
                             f"({', '.join(p + '*' for p in self.family)}); use MethodPlugin for any method")
        if train is not None and grad_clip is not None:
            raise ValueError("grad_clip: pass it inside train (TrainConfig.grad_clip) when train is given")
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"grad_clip: must be > 0 or None, got {grad_clip}")
        if train is not None and train.augment != "off":
            raise ValueError(f"train.augment: got {train.augment!r}, but a plugin trains on Avalanche's minibatches; "
                             "augment them with the benchmark's train transforms; allowed here: 'off'")
        self.train_config = train
        self.grad_clip = grad_clip
        self.fresh_optimizer = fresh_optimizer
        self.task: Task | None = None
        self.train_task: Task | None = None
        self._seen: list[Task] = []
        self.view: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._train: TrainConfig | None = None
        self._stream: TaskStream | None = None
        self._wrapped: nn.Module | None = None
        self._own_optimizer = _overrides(self.method, "make_optimizer")
        self._replaces_loss = _overrides(self.method, "loss")
        self._predicts = _overrides(self.method, "predict_proba")
        self._observes = _overrides(self.method, "after_step")

    # ----- helpers ---------------------------------------------------------------------------
    def _view(self, strategy: Any) -> nn.Module:
        model = strategy.model
        # DistributedHelper.wrap_model: the library works on the module inside DistributedDataParallel (the
        # same Parameter objects, so DDP still averages their gradients; torch.func cannot trace DDP's forward)
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        if self.view is None or self._wrapped is not model:
            self._wrapped = model
            self.view = library_model(model)
        return self.view

    def _make_train_config(self, strategy: Any) -> TrainConfig:
        if self.train_config is not None:
            return self.train_config
        opt = strategy.optimizer
        return TrainConfig(
            epochs=int(strategy.train_epochs),
            batch_size=int(strategy.train_mb_size),
            lr=float(opt.param_groups[0].get("lr", 1e-3)) or 1e-3,
            optimizer="sgd" if isinstance(opt, torch.optim.SGD) else "adam",
            grad_clip=self.grad_clip,
            eval_batch_size=int(strategy.eval_mb_size or strategy.train_mb_size),
        )

    def _stream_info(self, strategy: Any, task: Task) -> TaskStream:
        """What ``Method.setup`` gets for a stream: its first experience and what it shows about the rest."""
        origin = getattr(strategy.experience, "origin_stream", None)
        n_exp = len(origin) if origin is not None and hasattr(origin, "__len__") else 1
        try:  # the classic (and tensor) benchmarks list every experience's classes
            per_exp = [set(c) for c in getattr(origin, "benchmark").classes_in_experience["train"]]
            same_classes = all(c == per_exp[0] for c in per_exp)
        except (AttributeError, KeyError, TypeError):
            same_classes = False
        model = strategy.model
        multi = is_multi_task_module(model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model)
        scenario = self.scenario or ("task" if multi else "domain" if same_classes else "class")
        return TaskStream(
            name="avalanche",
            tasks=[task],
            scenario=scenario,
            input_shape=tuple(task.x_train.shape[1:]),
            n_outputs=len(task.classes),
            n_heads=n_exp if scenario == "task" else 1,
            meta={"source": "avalanche", "note": "tasks holds the first experience only"},
        )

    def _training_task(self, strategy: Any, task: Task, loader_kwargs: dict[str, Any]) -> Task:
        """``method.train_tasks`` under Avalanche: the experience itself, or the method's own selection of
        its data (e.g. VCL holding a coreset out), which then replaces the strategy's training data."""
        tasks = self.method.train_tasks(task, [*self._seen, task])
        if len(tasks) != 1 or tasks[0].task_id != task.task_id:
            raise ValueError(f"method {self.method.name!r} trains on several tasks' data at once (train_tasks); "
                             "under Avalanche use a replay or cumulative strategy (e.g. avalanche.training."
                             "Cumulative) with MethodPlugin('none') instead")
        fit = tasks[0]
        if fit is not task:
            from avalanche.benchmarks.utils import _make_taskaware_tensor_classification_dataset

            y = fit.y_train.cpu()
            data = _make_taskaware_tensor_classification_dataset(fit.x_train.cpu(), y, task_labels=fit.head,
                                                                  targets=y.tolist())
            strategy.adapted_dataset = data.train()
            strategy.make_train_dataloader(**loader_kwargs)
        return fit

    def _batch(self, strategy: Any) -> Batch:
        assert self.task is not None
        labels = strategy.mb_task_id
        if torch.is_tensor(labels) and labels.numel() and bool((labels != labels.reshape(-1)[0]).any()):
            raise ValueError("MethodPlugin: one task label per minibatch is supported, got several")
        head = int(labels.reshape(-1)[0]) if torch.is_tensor(labels) and labels.numel() else self.task.head
        return Batch(strategy.mb_x, strategy.mb_y, head)

    def _cover_new_parameters(self, optimizer: BayesianLearningRule, view: nn.Module, task: Task,
                              train: TrainConfig) -> None:
        """Extend a BLR optimiser to parameters that appeared since it was built (new heads).

        The new parameters get the prior (and starting precision) the method gives them at the start of
        a stream — read from a shallow copy of the method set up afresh on the current model — and keep
        their freshly initialised weights as the mean; the covered parameters keep their posterior and
        prior. The optimiser is rebuilt in place (``BayesianLearningRule.rebuild``, all its settings kept), so
        every reference the method holds stays valid. Called at a task boundary, where the BLR's momentum and
        step count are reset anyway (``set_prior``).
        """
        known = set(optimizer.names)
        new = [k for k, p in view.named_parameters() if p.requires_grad and k not in known]
        if not new:
            return
        fresh = copy.copy(self.method)
        assert self._stream is not None
        fresh.setup(view, self._stream, train)
        fresh_opt = fresh.make_optimizer(view, task, train)
        if not isinstance(fresh_opt, BayesianLearningRule):
            raise TypeError(f"method {self.method.name!r}: make_optimizer returned {type(fresh_opt).__name__} "
                            "after setup on the grown model; expected a BayesianLearningRule")
        prior = _join(optimizer.prior, _restrict(fresh_opt.prior, new))
        start = _join(optimizer.preconditioner(), _restrict(fresh_opt.preconditioner(), new))
        optimizer.rebuild(view, prior, start)

    @staticmethod
    def _all_reduce_gradients(strategy: Any) -> None:
        """Under a process group (Avalanche's ``DistributedHelper``; each rank holds its own minibatch of b_r
        examples): the gradient becomes Σ_r (b_r / Σ b) ∇L_r, the gradient of the mean loss over all ranks'
        examples, with one all-reduce (``continual_blr.distributed``). Do not also wrap the model in
        ``DistributedDataParallel``: a penalty on the parameters outside its forward breaks DDP's reducer."""
        from .. import distributed

        if not distributed.is_distributed():
            return
        b = int(strategy.mb_y.shape[0])
        total = distributed.all_reduce_float(b, "batch size")
        grads = [p.grad for p in strategy.model.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, b / total)
        distributed.all_reduce_sum_(grads, "gradient")

    # ----- training hooks ----------------------------------------------------------------------
    def before_training_exp(self, strategy: Any, **kwargs: Any) -> None:
        view = self._view(strategy)
        task = task_from_experience(strategy.experience, device=strategy.device)
        train = self._make_train_config(strategy)
        if self._stream is None:  # first experience: run_stream's method.setup
            self._stream = self._stream_info(strategy, task)
            self.method.setup(view, self._stream, train)
        self.task, self._train = task, train
        self.method.on_task_start(view, task)
        if self._own_optimizer:
            self.optimizer = self.method.make_optimizer(view, task, train)
            if isinstance(self.optimizer, BayesianLearningRule):
                self._cover_new_parameters(self.optimizer, view, task, train)
        if self.fresh_optimizer:
            strategy.optimizer.state = defaultdict(dict)
        self.train_task = self._training_task(strategy, task, kwargs)
        # what later experiences' train_tasks see of this one (metadata; its tensors are not kept)
        self._seen.append(Task(task.task_id, task.x_train[:0], task.y_train[:0], task.x_test, task.y_test,
                               task.classes, task.head, task.name))

    def before_backward(self, strategy: Any, **kwargs: Any) -> None:
        if self._own_optimizer:
            return
        assert self.train_task is not None, "before_training_exp must run first"
        view, batch, task = self._view(strategy), self._batch(strategy), self.train_task
        if self._replaces_loss:
            # the method's objective replaces the strategy's criterion (other plugins' terms are kept)
            strategy.loss = strategy.loss - strategy.criterion() + self.method.loss(view, batch, task)
        elif self.method.regularizer is not None:
            strategy.loss = strategy.loss + self.method.regularizer.penalty(view, batch, task)

    def after_backward(self, strategy: Any, **kwargs: Any) -> None:
        if not self._own_optimizer:
            self._all_reduce_gradients(strategy)
        clip = self._train.grad_clip if self._train is not None else None
        if clip is not None and not self._own_optimizer:
            nn.utils.clip_grad_norm_(strategy.model.parameters(), clip)

    def before_update(self, strategy: Any, **kwargs: Any) -> None:
        if not self._own_optimizer:
            return
        assert self.train_task is not None and self.optimizer is not None and self._train is not None
        view = self._view(strategy)
        params = list(strategy.model.parameters())
        for p in params:  # Avalanche's gradient (at the mean, of its criterion) is not used
            p.grad = None
        # the library's own update (BLR: sampled per-example gradients; others: method.loss + step)
        train_step(view, self.method, self.optimizer, self._batch(strategy), self.train_task, self._train,
                   observe=False)  # after_update hands the step's minibatch to the method
        # the method's parameters are updated: nothing left for the strategy's optimiser to apply to them;
        # parameters it does not cover (e.g. a head Avalanche added) keep the gradient of method.loss
        covered = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        for p in params:
            if id(p) in covered:
                p.grad = None

    def after_update(self, strategy: Any, **kwargs: Any) -> None:
        """``method.after_step`` with the step's minibatch (replay buffers fill from it), as ``train_step`` does
        in the library's loop. Under a process group each rank holds its own minibatch: they are gathered in
        rank order first, so every rank offers the same examples and keeps an identical buffer."""
        if not self._observes:
            return
        assert self.train_task is not None
        from .. import distributed

        batch = self._batch(strategy)
        if distributed.is_distributed():
            batch = Batch(distributed.all_gather_cat(batch.x, "replay batch"),
                          distributed.all_gather_cat(batch.y, "replay batch"), batch.head)
        self.method.after_step(self._view(strategy), batch, self.train_task)

    def after_training_exp(self, strategy: Any, **kwargs: Any) -> None:
        assert self.task is not None
        optimizer = self.optimizer if self._own_optimizer else strategy.optimizer
        self.method.on_task_end(self._view(strategy), self.task, optimizer)

    # ----- evaluation --------------------------------------------------------------------------
    def after_eval_forward(self, strategy: Any, **kwargs: Any) -> None:
        """Predictions of methods with their own predictive (e.g. a Monte-Carlo average under the
        posterior): ``mb_output`` becomes log-probabilities, so accuracy takes their argmax and the
        cross-entropy loss metric is the predictive's negative log-likelihood. Before the first training
        experience (the method is not set up yet) the network's own outputs are kept."""
        if not self._predicts or self._stream is None:
            return
        view = self._view(strategy)
        x, labels = strategy.mb_x, strategy.mb_task_id
        out: Tensor | None = None
        for label in torch.unique(labels).tolist():
            mask = labels == label
            probs = self.method.predict_proba(view, x[mask], int(label))
            logp = torch.log(probs.clamp_min(torch.finfo(probs.dtype).tiny))
            if out is None:
                out = logp.new_zeros(x.shape[0], logp.shape[1])
            out[mask] = logp
        if out is not None:
            strategy.mb_output = out


class WeightPriorPlugin(MethodPlugin, supports_distributed=True):
    """Weight-space Gaussian prior ½(θ−m)ᵀS(θ−m) from the previous task(s): EWC, Laplace (diag / Kronecker),
    online Laplace, L2. The regulariser's posterior is refreshed in ``after_training_exp``.

    Declares ``supports_distributed`` (Avalanche's ``DistributedHelper``; leave the model unwrapped, no
    ``wrap_model``): the penalty depends only on the weights and the carried Gaussian, which are the same on
    every rank, so after each rank's backward one all-reduce weighted by the ranks' minibatch sizes gives
    the data-parallel gradient (``MethodPlugin._all_reduce_gradients``); the task-end curvature is computed
    on each rank's part of the experience and all-reduced (``continual_blr.curvature``), so every rank
    carries the same, exact Gaussian (``tests/test_distributed.py``).
    """

    family = ("ewc", "laplace", "online", "l2")
    default_method = "ewc"


class BufferReplayPlugin(MethodPlugin, supports_distributed=True):
    """Replay from the method's own fixed-size buffer: experience replay (``er``) and DER++ (``derpp``). The
    buffer fills in ``after_update`` from each minibatch (``Method.after_step``) and the replay terms are part of
    ``method.loss``, which replaces the strategy's criterion. (Avalanche's own ``ReplayPlugin`` instead mixes
    stored examples into the data loader; this plugin runs the library's objects, as ``run_stream`` does.)

    Declares ``supports_distributed`` (Avalanche's ``DistributedHelper``; leave the model unwrapped): the
    ranks' minibatches are gathered before they are offered to the buffer, so every rank keeps an identical
    buffer and draws identical replay examples from its generator; the replay terms are then the same on every
    rank and enter the gradient all-reduced with weights b_r / Σ b (``MethodPlugin._all_reduce_gradients``)
    exactly once, as a penalty does.
    """

    family = ("er", "derpp")
    default_method = "er"


class VCLPlugin(MethodPlugin):
    """Variational continual learning: KL to the previous task's variational posterior.

    Not declared supports_distributed: its coreset and maximum-likelihood fits train auxiliary models on
    data Avalanche shards per rank, and the Monte-Carlo predictions draw from the method's generator a
    number of times that depends on each rank's evaluation part, so the ranks' generators drift apart;
    not verified under ``DistributedHelper``.
    """

    family = ("vcl",)
    default_method = "vcl"


class FROMPPlugin(MethodPlugin):
    """Functional regularisation on memorable past (FROMP) and its ablations (FRORP: random memory;
    FROMP-L2: no kernel). Memories, old predictions and kernels are refreshed at the task boundaries
    exactly as the library's regulariser does it.

    Not declared supports_distributed: the penalty runs a second forward pass (through the memorable points)
    per step, which a ``DistributedDataParallel``-wrapped model does not expect within one backward; the
    library's own loop (``torchrun -m continual_blr run``) is the data-parallel path for FROMP, with the
    memorability scores gathered and the kernels identical on every rank.
    """

    family = ("fromp", "frorp")
    default_method = "fromp"


class BLRPlugin(MethodPlugin):
    """A Bayesian-learning-rule optimiser whose prior is the previous posterior (VOGN, Kronecker BLR,
    VON, IVON). It trains with its own optimiser; pass the strategy any optimiser (it is not used).

    Not declared supports_distributed: its step all-reduces ĝ and ĥ itself, but Avalanche still runs (and,
    under DDP, all-reduces) the strategy's own backward every iteration, and Monte-Carlo predictions in
    evaluation advance the ranks' generators differently; use the library's loop under torchrun.
    """

    family = ("blr", "ivon", "von", "vogn")
    default_method = "blr"

