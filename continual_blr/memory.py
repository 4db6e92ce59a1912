"""Memorable examples: which past inputs a functional regulariser keeps, and the store that holds them.

Selection (Pan et al. 2020, Sec. 3.2 "Identifying memorable past"): after training task t, score every
training input by the trace of the softmax-cross-entropy output Hessian on the task's own head,

    λ(x) = tr Λ(x) = Σ_k p_k(x) (1 − p_k(x)),      Λ(x) = diag(p) − ppᵀ,  p = softmax(f_θ(x, head)),

and keep, **per class** (grouped by the stored label), the ``k_c`` inputs with the largest λ. λ is
largest where the network is least certain: these are the examples closest to the decision boundary
(the ones a GP's posterior depends on most). Two ablations: ``"random"`` (FRORP: k_c inputs drawn
uniformly per class with a seeded ``torch.Generator``) and ``"lowest"`` (the k_c smallest λ).

Selection by measured value (:data:`SENSITIVITY_SELECTIONS`; Nickl et al., "The memory-perturbation equation",
NeurIPS 2023): the memory-perturbation sensitivity

    s(x_i) = ‖V_i e_i‖₁,    V_i = J_i Σ J_iᵀ (the example's logit covariance),  e_i = softmax(f_i) − onehot(y_i),

estimates how far example i's own logits would move were it left out of training (error × variance), with Σ
the diagonal Laplace–GGN covariance diag(1 / (F + δ)) at the task's end (FROMP's Σ; F from the same pass,
:func:`continual_blr.curvature.prediction_covariance.ggn_diag_and_sensitivity`).

* ``"sensitivity"`` — per class, the k_c largest s (the examples the fit depends on most).
* ``"stratified"`` — per class, a sample stratified over the sensitivity range: the class's n examples sorted by
  s are cut into k_c strata of ⌊n/k_c⌋ or ⌈n/k_c⌉ consecutive ranks and one example is drawn uniformly (from
  ``generator``) in each. A random memory covers the class's typical examples and misses its rare, influential
  ones; a top-s memory holds only those (for FROMP's top tr Λ the replay accuracy fell from 86 % to 59 % on
  split MNIST's validation split). The stratified draw keeps both: the memory spans the whole range of s like a
  random one, with one example from the top 1/k_c of s guaranteed. The strata are listed in the van der Corput
  order of their rank from the top (top stratum, median, quartiles, …), so every prefix of the list — what a
  budget that shrinks as classes arrive keeps (``share_memory``) — is itself spread over the range.

Allocation: ``n_points`` per task are split over the C classes present as evenly as possible,
``k_c = n_points // C`` plus one for the first ``n_points % C`` classes in increasing label order (the
reference code uses ``n_points // C``; with n_points divisible by C, as in every published protocol,
the two agree). A class with fewer than k_c examples contributes all of them. Ties in λ are broken by
the lower index (stable sort), so the selection is deterministic.

The store (:class:`MemoryStore`) holds one :class:`MemoryEntry` per past task: the inputs, their labels
and indices into the task's training set, the task id and the head, the scores and the selection rule,
plus ``extras`` — whatever the regulariser rebuilt from them (FROMP: old predictions, kernels,
Cholesky factors). ``state_dict()`` holds only tensors and plain Python values, so ``torch.save`` /
``torch.load(weights_only=True)`` round-trip it and an inspection tool can read it from a finished run.

Normalisation statistics (:class:`NormStatistics`): BatchNorm's running mean and variance are state of the
network like its weights, but no optimiser moves them — every train-mode forward does. With the loop's
``train.batchnorm: per_task`` each task's statistics, as the task ends, are kept here (one copy per task id)
and swapped in (:meth:`NormStatistics.use`) wherever that task's function is evaluated: its test accuracy and a
functional regulariser's old predictions, kernels and penalty at its memorable points.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from . import distributed
from .types import ParamDict

__all__ = [
    "SELECTIONS",
    "SENSITIVITY_SELECTIONS",
    "selection_scores",
    "share_budget",
    "hessian_trace_scores",
    "select_per_class",
    "select_memorable",
    "MemoryEntry",
    "MemoryStore",
    "forward",
    "forward_parts",
    "train_eval_difference",
    "row_split_refusal",
    "eval_rows_after",
    "NORM_MODES",
    "NormStatistics",
    "norm_layers",
]

SELECTIONS = ("lambda", "random", "lowest", "sensitivity", "stratified")
SENSITIVITY_SELECTIONS = ("sensitivity", "stratified")
"""The selections that rank by the memory-perturbation sensitivity (they need Σ at the task's end)."""
NORM_MODES = ("shared", "per_task", "frozen")
"""How BatchNorm's running statistics are kept across tasks (``TrainConfig.batchnorm``, ``continual_blr.loop``)."""


def _accepts_head(model: nn.Module) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return False
    return "head" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def forward(model: nn.Module, x: Tensor, head: int = 0, params: ParamDict | None = None) -> Tensor:
    """``model(x, head=head)`` (or ``model(x)`` for a module without heads), optionally at ``params``
    through ``torch.func.functional_call`` (so ``torch.func`` transforms can differentiate it)."""
    kw = {"head": int(head)} if _accepts_head(model) else {}
    if not kw and head not in (0, None):
        raise ValueError(f"head: got {head!r}, but {type(model).__name__}.forward takes no 'head' argument")
    if params is None:
        return model(x, **kw)
    return functional_call(model, params, (x,), kw)


# Modules whose forward does not read ``training`` (and so runs the same in train and eval mode).
_MODE_FREE = (
    nn.Linear, nn.Bilinear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
    nn.ConvTranspose3d, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
    nn.Mish, nn.Tanh, nn.Sigmoid, nn.Softplus, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softmax,
    nn.LogSoftmax, nn.Flatten, nn.Unflatten, nn.Identity, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d,
    nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d, nn.LayerNorm, nn.GroupNorm, nn.Sequential, nn.ModuleList, nn.ModuleDict,
)


def train_eval_difference(model: nn.Module) -> str | None:
    """A module of ``model`` whose forward may differ between train and eval mode, as ``"name (Type)"``; None when
    every module is known to run the same in both: the layers and containers of :data:`_MODE_FREE`, dropout with
    p = 0, and :class:`~continual_blr.models.MultiHeadNet` (and its subclasses that keep its forward). Anything
    else — dropout with p > 0, BatchNorm (running statistics), any other module type — is named: its mode is not
    known, so it counts as mode-dependent."""
    from .models import MultiHeadNet  # a leaf module (torch only); imported here to keep this module's imports lean

    for name, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p == 0:
            continue
        if isinstance(m, MultiHeadNet) and type(m).forward is MultiHeadNet.forward:
            continue
        if type(m) in _MODE_FREE:
            continue
        return f"{name or '<model>'} ({type(m).__name__})"
    return None


def _row_splittable(m: nn.Module) -> bool:
    """Whether :func:`eval_rows_after` can run ``m`` in train mode on leading rows and in eval mode on the rest."""
    if isinstance(m, nn.modules.dropout._DropoutNd):
        return not m.inplace or m.p == 0
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        return m.track_running_stats and m.running_mean is not None and m.running_var is not None
    return False


def row_split_refusal(model: nn.Module) -> str | None:
    """A module of ``model`` that :func:`eval_rows_after` cannot split by rows, as ``"name (Type)"``; None when every
    module is mode-free (:func:`train_eval_difference`, and the containers of
    :data:`~continual_blr.models.MODE_FREE_CONTAINERS`) or row-splittable: dropout (any p, not in place) and
    BatchNorm with running statistics. In-place dropout (its input is overwritten, so the eval rows are lost), BatchNorm
    without running statistics (its eval forward normalises by the statistics of whatever rows share the pass) and any
    other module type are named."""
    from .models import MODE_FREE_CONTAINERS, MultiHeadNet  # a leaf module (torch only), imported here as above

    for name, m in model.named_modules():
        if isinstance(m, MultiHeadNet) and type(m).forward is MultiHeadNet.forward:
            continue
        if type(m) in _MODE_FREE or type(m) in MODE_FREE_CONTAINERS or _row_splittable(m):
            continue
        return f"{name or '<model>'} ({type(m).__name__})"
    return None


def _split_forward(m: nn.Module, n: int):
    """A forward for ``m`` (in train mode) that runs rows [:n] through its own train-mode forward and rows [n:] as
    its eval-mode forward would: the identity for dropout, the running statistics for BatchNorm — read after the
    train rows have updated them, as a separate eval pass after the minibatch's would."""
    own = m.forward
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        def rest(x: Tensor) -> Tensor:
            return nn.functional.batch_norm(x, m.running_mean, m.running_var, m.weight, m.bias, False, 0.0, m.eps)
    else:
        def rest(x: Tensor) -> Tensor:
            return x

    def fwd(x: Tensor) -> Tensor:
        if x.shape[0] < n:  # not the pass it was set up for: no row would be evaluated as it should
            raise ValueError(f"eval_rows_after: {type(m).__name__} got {x.shape[0]} rows, fewer than the {n} train rows "
                             "of the pass (rows must be the first axis of every module's input)")
        return own(x) if x.shape[0] == n else torch.cat([own(x[:n]), rest(x[n:])])

    return fwd


@contextmanager
def eval_rows_after(model: nn.Module, n: int) -> Iterator[None]:
    """Within the block, every dropout and BatchNorm module of ``model`` that is in train mode runs its train-mode
    forward on the first ``n`` rows of its input and its eval-mode forward on the rest.

    This is what one pass over ``[minibatch; memorable points]`` needs to compute the separate passes' function: the
    minibatch in train mode, then the penalty's points in eval mode (:func:`forward_parts`, FROMP's
    ``fused_forward``). Every layer between them treats rows independently, so row i of the pass equals row i of the
    separate pass it belongs to:

    * dropout draws its mask for the n train rows only — the same shape, so the same draws from the global generator
      as the minibatch's own pass — and passes the rest unchanged (its eval forward);
    * BatchNorm normalises the n rows by their batch statistics and updates its running statistics from them (as
      the minibatch's pass does), then normalises the rest by the updated running statistics, which is what the
      penalty's eval pass after the minibatch's reads.

    Modules in eval mode (``train.batchnorm: frozen``, a model put in eval mode) keep their forward: it is the eval
    one for every row. Each module's forward is restored on exit, also after an error.

    Raises:
        ValueError: a module that cannot be split by rows (:func:`row_split_refusal`), in train mode; within the block,
            a split module called on fewer than ``n`` rows.
    """
    patched = []
    try:
        for name, m in model.named_modules():
            dropout = isinstance(m, nn.modules.dropout._DropoutNd)
            if not m.training or not (dropout or isinstance(m, nn.modules.batchnorm._BatchNorm)) or (dropout and m.p == 0):
                continue  # eval mode, or a module that runs alike in both modes
            if not _row_splittable(m):
                raise ValueError(f"eval_rows_after: {name} ({type(m).__name__}) cannot run its train and eval forward "
                                 "on separate rows of one pass (in-place dropout, or BatchNorm without running "
                                 "statistics)")
            m.forward = _split_forward(m, int(n))
            patched.append(m)
        yield
    finally:
        for m in patched:
            del m.forward


def forward_parts(model: nn.Module, xs: list[Tensor], heads: list[int]) -> list[Tensor]:
    """``[forward(model, x_i, head=h_i) for each i]`` from one pass over the rows of all ``xs`` together.

    A model with ``forward_heads`` (:meth:`continual_blr.models.MultiHeadNet.forward_heads`) runs its shared body
    once and each block through its own head; any other model is called once on the concatenated inputs, which
    needs one head for all blocks (or a forward without ``head``). The model's mode is the caller's: the blocks are
    evaluated in the same mode (see :func:`train_eval_difference`). Equal to the separate forwards up to the
    rounding of the larger matrix products (the gradient of a weight sums the blocks' rows in one product).

    Raises:
        ValueError: blocks on different heads of a model without ``forward_heads``.
    """
    x = torch.cat(xs)
    sizes = [int(t.shape[0]) for t in xs]
    if callable(getattr(model, "forward_heads", None)):
        return list(model.forward_heads(x, list(zip(heads, sizes))))
    if len(set(int(h) for h in heads)) > 1 and _accepts_head(model):
        raise ValueError(f"forward_parts: {type(model).__name__} has no forward_heads, so blocks on different heads "
                         f"({sorted(set(int(h) for h in heads))}) cannot share one pass")
    return list(torch.split(forward(model, x, int(heads[0])), sizes))


@torch.no_grad()
def hessian_trace_scores(model: nn.Module, x: Tensor, *, head: int = 0, batch_size: int = 1024) -> Tensor:
    """λ(x_i) = Σ_k p_ik (1 − p_ik) with p_i = softmax(f_θ(x_i, head)) over all the head's outputs.

    The model runs in eval mode (dropout off, BatchNorm on running statistics); its flags are restored.

    Returns:
        [N] scores in the model's dtype, on the inputs' device.
    """
    was = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        out = []
        for s in range(0, x.shape[0], batch_size):
            p = torch.softmax(forward(model, x[s : s + batch_size], head), dim=-1)
            out.append((p * (1.0 - p)).sum(-1))
        return torch.cat(out) if out else x.new_zeros(0)
    finally:
        for m, flag in was:
            m.training = flag


def _allocation(classes: list[int], n_points: int) -> dict[int, int]:
    c = len(classes)
    base, extra = divmod(int(n_points), c)
    return {cls: base + (1 if i < extra else 0) for i, cls in enumerate(classes)}


def _strata_order(k: int) -> list[int]:
    """The k strata (0 = the top one) in van der Corput order: stratum ⌊r_m k⌋ for the base-2 radical inverses
    r_0, r_1, … = 0, ½, ¼, ¾, ⅛, … (first occurrences only), so every prefix is spread over the range."""
    order, seen, m = [], set(), 0
    while len(order) < k:
        r, f, n = 0.0, 0.5, m
        while n:
            r += f * (n & 1)
            n >>= 1
            f *= 0.5
        s = min(int(r * k), k - 1)
        if s not in seen:
            seen.add(s)
            order.append(s)
        m += 1
    return order


def _stratified(scores: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """Positions into ``scores`` [n]: one uniform draw in each of k strata of consecutive ranks by descending
    score (stratum j: ranks ⌊jn/k⌋ … ⌊(j+1)n/k⌋ − 1), listed in :func:`_strata_order`."""
    n = scores.numel()
    ranked = torch.sort(scores, descending=True, stable=True).indices
    u = torch.rand(k, generator=generator, dtype=torch.float64, device=generator.device).tolist()
    picks = []
    for j in _strata_order(k):
        lo, hi = (j * n) // k, ((j + 1) * n) // k
        picks.append(ranked[lo + min(int(u[j] * (hi - lo)), hi - lo - 1)])
    return torch.stack(picks)


def select_per_class(
    scores: Tensor,
    labels: Tensor,
    n_points: int,
    *,
    selection: str = "lambda",
    generator: torch.Generator | None = None,
) -> Tensor:
    """Indices of the memorable examples: per class, top-k (``"lambda"``, ``"sensitivity"``), bottom-k
    (``"lowest"``) by ``scores``, k at random (``"random"``), or one random draw in each of k strata of ``scores``
    (``"stratified"``), drawn from ``generator``. See the module docstring for k and the rules.

    Returns:
        int64 indices into ``scores`` / ``labels``, grouped by class (increasing label), within a class
        in rank order (random order for ``"random"``, strata in van der Corput order for ``"stratified"``).
    """
    if selection not in SELECTIONS:
        raise ValueError(f"selection: got {selection!r}; allowed: {', '.join(map(repr, SELECTIONS))}")
    if int(n_points) < 1:
        raise ValueError(f"n_points: must be >= 1, got {n_points}")
    if scores.shape != labels.shape or scores.dim() != 1:
        raise ValueError(f"scores and labels: expected two [N] tensors, got {tuple(scores.shape)} and "
                         f"{tuple(labels.shape)}")
    if selection in ("random", "stratified") and generator is None:
        raise ValueError(f"generator: selection {selection!r} needs a torch.Generator (the choice must be "
                         "reproducible)")
    classes = sorted(int(c) for c in torch.unique(labels).tolist())
    if not classes:
        return torch.zeros(0, dtype=torch.long, device=labels.device)
    alloc = _allocation(classes, n_points)
    out = []
    for cls in classes:
        idx = (labels == cls).nonzero().squeeze(1)
        k = min(alloc[cls], idx.numel())
        if k == 0:
            continue
        if selection == "random":
            pick = torch.randperm(idx.numel(), generator=generator, device=generator.device)[:k].to(idx.device)
        elif selection == "stratified":
            pick = _stratified(scores[idx], k, generator).to(idx.device)
        else:
            order = torch.sort(scores[idx], descending=(selection != "lowest"), stable=True).indices
            pick = order[:k]
        out.append(idx[pick])
    return torch.cat(out)


def select_memorable(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    n_points: int,
    *,
    head: int = 0,
    selection: str = "lambda",
    generator: torch.Generator | None = None,
    batch_size: int = 1024,
    shard: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Score ``x`` by λ(x) on ``head`` and pick ``n_points`` per task (per class, see module docstring).

    Data parallel (``shard``; default: whenever a process group of more than one process is
    initialised): each rank scores its contiguous part of ``x`` and the scores are all-gathered, so
    every rank holds all N scores and chooses the same memorable points (top k globally; ``"random"``
    draws from a generator in the same state on every rank). Every rank must then call this.

    Returns:
        ``(indices, scores)``: the chosen indices into ``x`` and the λ scores of **all** inputs.
    """
    if shard is None:
        shard = distributed.is_distributed()
    if shard and distributed.is_distributed():
        scores = distributed.all_gather_cat(
            hessian_trace_scores(model, distributed.shard(x), head=head, batch_size=batch_size), "memory scores")
    else:
        scores = hessian_trace_scores(model, x, head=head, batch_size=batch_size)
    return select_per_class(scores, y, n_points, selection=selection, generator=generator), scores


def selection_scores(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    selection: str,
    head: int = 0,
    prior_precision: float = 1e-3,
    prior_ggn: dict[str, Tensor] | None = None,
    chunk_size: int | None = None,
) -> tuple[Tensor, dict[str, Tensor] | None]:
    """The scores a selection ranks by, and the diagonal GGN when forming them needed one.

    ``"lambda"`` / ``"lowest"`` / ``"random"``: λ(x) = tr Λ(x) (:func:`hessian_trace_scores`; ``"random"`` stores
    them without using them), no GGN. ``"sensitivity"`` / ``"stratified"``: s(x) = ‖J Σ Jᵀ e‖₁ with
    Σ = diag(1 / (F₀ + F + δ)) and this data's diagonal GGN F from the same backward pass
    (:func:`~continual_blr.curvature.prediction_covariance.ggn_diag_and_sensitivity`; F₀ = ``prior_ggn``,
    δ = ``prior_precision``). Not sharded over data-parallel ranks: every rank scores all of ``x``.

    Returns:
        ``(scores [N], F or None)``.
    """
    if selection not in SELECTIONS:
        raise ValueError(f"selection: got {selection!r}; allowed: {', '.join(map(repr, SELECTIONS))}")
    if selection in SENSITIVITY_SELECTIONS:
        from .curvature.prediction_covariance import ggn_diag_and_sensitivity

        ggn, scores = ggn_diag_and_sensitivity(model, x, y, prior_precision=prior_precision, head=head,
                                               prior_ggn=prior_ggn, chunk_size=chunk_size)
        return scores, ggn
    return hessian_trace_scores(model, x, head=head), None


def share_budget(old_groups: list[Any], n_new_groups: int, memory_size: int) -> tuple[dict[Any, int], int]:
    """A budget of M points in all shared over G = (old + new) groups: ⌊M/G⌋ each, the r = M − G⌊M/G⌋ left over
    one each to the newest groups — the new ones first, then the old ones from the latest back (FROMP's
    ``share_memory``). Returns ``({old group: its quota}, the new groups' share in all)``."""
    if int(memory_size) < 1:
        raise ValueError(f"memory_size: must be >= 1, got {memory_size}")
    g = len(old_groups) + int(n_new_groups)
    q, r = divmod(int(memory_size), max(g, 1))
    share_new = q * int(n_new_groups) + min(r, int(n_new_groups))
    left = r - min(r, int(n_new_groups))
    quota = {grp: q + (1 if k < left else 0) for k, grp in enumerate(reversed(old_groups))}
    return quota, share_new


@dataclass
class MemoryEntry:
    """The memorable past of one task.

    Attributes:
        task_id: the task's id.
        head: the output head its points are evaluated on.
        x: the memorable inputs [M, ...].
        y: their labels [M] (in the task's label convention).
        indices: their positions in the task's training set [M].
        scores: their λ(x) at selection time [M].
        selection: the rule that chose them (``"lambda"``, ``"random"``, ``"lowest"``).
        columns: the output columns the regulariser compares (None: all of the head's outputs).
        extras: what the regulariser derived from them (FROMP: ``p_old``, ``kernel``, ``chol``, ``kinv``).
    """

    task_id: int
    head: int
    x: Tensor
    y: Tensor
    indices: Tensor
    scores: Tensor
    selection: str
    columns: tuple[int, ...] | None = None
    extras: dict[str, Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "MemoryEntry":
        """A copy with tensors on ``device``; floating inputs / extras cast to ``dtype`` if given."""

        def mv(t: Tensor) -> Tensor:
            return t.to(device=device, dtype=dtype if (dtype is not None and t.is_floating_point()) else None)

        return MemoryEntry(self.task_id, self.head, mv(self.x), self.y.to(device), self.indices.to(device),
                           mv(self.scores), self.selection, self.columns,
                           {k: mv(v) for k, v in self.extras.items()})

    def state_dict(self) -> dict[str, Any]:
        return {
            "task_id": int(self.task_id),
            "head": int(self.head),
            "x": self.x,
            "y": self.y,
            "indices": self.indices,
            "scores": self.scores,
            "selection": self.selection,
            "columns": None if self.columns is None else [int(c) for c in self.columns],
            "extras": dict(self.extras),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "MemoryEntry":
        cols = state.get("columns")
        return cls(int(state["task_id"]), int(state["head"]), state["x"], state["y"], state["indices"],
                   state["scores"], str(state["selection"]), None if cols is None else tuple(int(c) for c in cols),
                   dict(state.get("extras", {})))


class MemoryStore:
    """The memorable past of every finished task, in task order."""

    def __init__(self) -> None:
        self.entries: list[MemoryEntry] = []

    def add(self, entry: MemoryEntry) -> None:
        """Append a task's memory (a task id may appear once)."""
        if any(e.task_id == entry.task_id for e in self.entries):
            raise ValueError(f"task_id: the store already holds memorable points of task {entry.task_id}")
        self.entries.append(entry)

    def clear(self) -> None:
        self.entries = []

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries)

    def __getitem__(self, i: int) -> MemoryEntry:
        return self.entries[i]

    @property
    def n_points(self) -> int:
        """Memorable points over all tasks."""
        return sum(len(e) for e in self.entries)

    def state_dict(self) -> dict[str, Any]:
        return {"entries": [e.state_dict() for e in self.entries]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.entries = [MemoryEntry.from_state_dict(s) for s in state["entries"]]


# ------------------------------------------------------------------------------ normalisation statistics

_NORM_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def norm_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs of ``model``'s batch-normalisation layers that keep running statistics."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


class NormStatistics:
    """BatchNorm running statistics of a network, one copy per task: the state ``train.batchnorm: per_task`` keeps.

    For every normalisation layer l (:func:`norm_layers`) it holds, per task id s, the running mean μ_l^s, variance
    (σ_l^s)² and batch counter the layer had when task s ended. In eval mode layer l computes

        BN_l^s(h) = γ_l (h − μ_l^s) / √((σ_l^s)² + ε_l) + β_l,

    so under :meth:`use` the network is the function task s ended with, up to the weights (γ, β and the rest are
    shared and trained as usual). Tensors only: :meth:`state_dict` round-trips through ``torch.save`` /
    ``torch.load(weights_only=True)``.
    """

    def __init__(self) -> None:
        self.tasks: dict[int, dict[str, Tensor]] = {}

    def __contains__(self, task_id: object) -> bool:
        return task_id in self.tasks

    def __len__(self) -> int:
        return len(self.tasks)

    @torch.no_grad()
    def save(self, model: nn.Module, task_id: int) -> None:
        """Keep a copy of the running statistics ``model`` has now as task ``task_id``'s (replacing an older copy)."""
        self.tasks[int(task_id)] = {f"{n}.{b}": getattr(m, b).detach().clone()
                                    for n, m in norm_layers(model) for b in _NORM_BUFFERS if getattr(m, b) is not None}

    @contextmanager
    def use(self, model: nn.Module, task_id: int | None) -> Iterator[None]:
        """Run ``model`` on task ``task_id``'s statistics inside the block (nothing changes for a task not kept).

        The stored tensors are swapped in as the layers' buffers (the tensor objects are replaced, not copied into:
        an autograd graph built inside the block keeps the stored tensors, and a later train-mode forward that
        updates the layers' own buffers in place cannot touch them); the layers' own tensors are put back on exit,
        also on an exception. Use the block for eval-mode forwards: a train-mode forward inside it would update the
        stored copy."""
        stats = self.tasks.get(int(task_id)) if task_id is not None else None
        if not stats:
            yield
            return
        swapped: list[tuple[nn.Module, str, Tensor]] = []
        try:
            for n, m in norm_layers(model):
                for b in _NORM_BUFFERS:
                    key = f"{n}.{b}"
                    own = m._buffers.get(b)
                    if key not in stats or own is None:
                        continue
                    t = stats[key]
                    if t.device != own.device or t.dtype != own.dtype:
                        t = stats[key] = t.to(device=own.device, dtype=own.dtype)
                    swapped.append((m, b, own))
                    m._buffers[b] = t
            yield
        finally:
            for m, b, own in reversed(swapped):
                m._buffers[b] = own

    def state_dict(self) -> dict[str, Any]:
        return {"tasks": {int(k): dict(v) for k, v in self.tasks.items()}}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.tasks = {} if not state else {int(k): dict(v) for k, v in state.get("tasks", {}).items()}
