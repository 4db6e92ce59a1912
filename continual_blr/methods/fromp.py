"""FROMP and its ablations as methods: the functional regulariser of
:mod:`continual_blr.regularizers.functional` trained with the loop's Adam / SGD.

Registry names (``continual_blr.methods.METHODS``), all with :class:`FROMPParams` fields and different
defaults:

============  ==================  =============
name          kernel              selection
============  ==================  =============
fromp         classwise (paper)   lambda
frorp         classwise           random
fromp-l2      identity (K = I)    lambda
fromp-full    full multi-output   lambda
fromp-kron    classwise, Kron Σ   lambda
============  ==================  =============

Gradient clipping is the loop's ``train.grad_clip`` (the reference code clips at 0.1 on split MNIST).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from ..data.stream import TaskStream
from ..memory import SELECTIONS
from ..regularizers.functional import CLASS_CHOICES, KERNELS, FunctionalRegularizer
from .base import Method, TrainConfig

__all__ = ["FROMPParams", "FRORPParams", "FROMPL2Params", "FROMPFullParams", "FROMPKronParams", "FROMPMethod",
           "memory_store_stats", "FunctionalParams"]


def memory_store_stats(reg: FunctionalRegularizer) -> dict[str, Any]:
    """``Method.memory_stats`` of a functional regulariser's store: the memorable points, the bytes of their
    inputs and labels, and ``derived_bytes`` — what was rebuilt from them (old predictions, kernels, factors)."""
    entries = list(reg.memory)
    return {"stored_examples": sum(len(e) for e in entries),
            "stored_bytes": sum(int(e.x.numel() * e.x.element_size() + e.y.numel() * e.y.element_size())
                                for e in entries),
            "derived_bytes": sum(int(t.numel() * t.element_size()) for e in entries for t in e.extras.values()),
            "selection": reg.selection}


@dataclass
class FunctionalParams:
    """The parameters every FROMP-type method shares (FROMP and its ablations, FROMP with replay).

    Attributes:
        tau: τ, weight of (τ/2) Σ Δpᵀ K⁻¹ Δp relative to the mean cross-entropy (0: no regulariser).
        kernel: ``"classwise"`` | ``"full"`` | ``"kron"`` | ``"identity"`` (FROMP-L2).
        selection: ``"lambda"`` (top tr Λ) | ``"random"`` (FRORP) | ``"lowest"``.
        prior_precision: δ in Σ = diag(1 / (F + δ)).
        jitter: ε added to each kernel's diagonal.
        classes: single-head class-incremental streams only — compare only a past ``"task"``'s own
            classes at its points (default), or ``"all"`` the head's outputs. With ``"all"`` the
            kernels of classes the task never saw are ≈ εI (p_c ≈ 0 there, so J_{p_c} ≈ 0), K⁻¹ ≈ 1/ε
            forbids any new class from gaining probability at old points, and without replay later tasks
            are not learned (split digits, class scenario: 32 % vs 82 %, benchmarks/results/split_digits.md).
            On real split MNIST both collapse and the order flips (33.2 % vs 28.5 %, split_mnist_class.md);
            with replay of the points' labels ``"all"`` is the better choice there (docs/replay.md).
        chunk_size: examples per pass of the curvature engine (None: its default).
    """

    tau: float = 10.0
    kernel: str = "classwise"
    selection: str = "lambda"
    prior_precision: float = 1e-3
    jitter: float = 1e-6
    classes: str = "task"
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        """One-line ``ValueError`` naming the field and what is allowed."""
        if self.kernel not in KERNELS:
            raise ValueError(f"params.kernel: got {self.kernel!r}; allowed: {', '.join(map(repr, KERNELS))}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"params.selection: got {self.selection!r}; allowed: {', '.join(map(repr, SELECTIONS))}")
        if self.classes not in CLASS_CHOICES:
            raise ValueError(f"params.classes: got {self.classes!r}; allowed: {', '.join(map(repr, CLASS_CHOICES))}")
        if not self.tau >= 0:
            raise ValueError(f"params.tau: must be >= 0, got {self.tau}")
        if not self.prior_precision > 0:
            raise ValueError(f"params.prior_precision: must be > 0, got {self.prior_precision}")
        if not self.jitter >= 0:
            raise ValueError(f"params.jitter: must be >= 0, got {self.jitter}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"params.chunk_size: must be >= 1 or null, got {self.chunk_size}")


@dataclass
class FROMPParams(FunctionalParams):
    """Parameters of FROMP (defaults: the reference code's split-MNIST protocol); the shared ones in
    :class:`FunctionalParams`.

    Attributes:
        n_points: memorable points per task (split evenly over its classes).
    """

    n_points: int = 40

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_points < 1:
            raise ValueError(f"params.n_points: must be >= 1, got {self.n_points}")


@dataclass
class FRORPParams(FROMPParams):
    """FRORP: FROMP with memorable points drawn at random per class (seeded)."""

    selection: str = "random"


@dataclass
class FROMPL2Params(FROMPParams):
    """FROMP-L2: the kernel replaced by the identity, (τ/2) Σ ‖Δp‖²."""

    kernel: str = "identity"


@dataclass
class FROMPFullParams(FROMPParams):
    """FROMP with the full multi-output kernel (cross-class terms kept)."""

    kernel: str = "full"


@dataclass
class FROMPKronParams(FROMPParams):
    """FROMP with a Kronecker-factored (K-FAC) weight covariance Σ."""

    kernel: str = "kron"


class FROMPMethod(Method):
    """Functional regularisation of the memorable past with the loop's Adam / SGD."""

    name = "fromp"

    def __init__(self, params: FROMPParams | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.params = params or FROMPParams()
        kw = asdict(self.params)
        self.regularizer: FunctionalRegularizer = FunctionalRegularizer(**kw, generator=self.generator)

    def setup(self, model: nn.Module, stream: TaskStream, train: TrainConfig) -> None:
        """Start from an empty memory; single-head class-incremental streams may restrict the columns."""
        self.regularizer.reset()
        self.regularizer.class_incremental = stream.scenario == "class"

    def memory_stats(self) -> dict[str, Any]:
        return memory_store_stats(self.regularizer) | {"points_per_task": self.params.n_points}
