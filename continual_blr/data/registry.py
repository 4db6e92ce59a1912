"""Build any stream by name: the one entry point the CLI and configs use.

    >>> from continual_blr.data import make_stream
    >>> s = make_stream("synthetic", seed=1, n_tasks=2)
    >>> s.name, len(s), s.scenario
    ('synthetic', 2, 'task')

Every builder takes ``seed`` and ``scenario`` (``None`` = the stream's default); streams read from
disk also take ``data_dir`` (resolved by :func:`~continual_blr.data.paths.resolve_data_dir`). Other
keyword arguments go to the builder unchanged (e.g. ``n_tasks``, ``max_per_task``, ``download``).

``validation=f`` (0 < f < 1) returns the *validation stream* instead: ``f`` of every task's training
data (stratified by label, drawn from a generator seeded with ``seed``) is held out and evaluated on in
place of the test set, which is dropped (:func:`~continual_blr.data.builders.hold_out_validation`).
Hyper-parameters are chosen on validation streams, never on test data:

    >>> v = make_stream("synthetic", seed=1, n_tasks=2, n_train=100, validation=0.1)
    >>> v.name, v.meta["validation"], v.tasks[0].n_train, int(v.tasks[0].y_test.numel())
    ('synthetic[validation 0.1]', 0.1, 90, 10)
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable

from .builders import check_validation, hold_out_validation, validation_generator
from .cifar import split_cifar, split_cifar10
from .digits import permuted_digits, split_digits
from .mnist import permuted_mnist, split_mnist
from .stream import TaskStream
from .synthetic import synthetic_stream

__all__ = ["STREAMS", "DEFAULT_SCENARIOS", "make_stream", "stream_options"]

# name -> (builder, whether it reads files under data_dir, default scenario)
_BUILDERS: dict[str, tuple[Callable[..., TaskStream], bool, str]] = {
    "synthetic": (synthetic_stream, False, "task"),
    "split_digits": (split_digits, False, "task"),
    "permuted_digits": (permuted_digits, False, "domain"),
    "split_mnist": (split_mnist, True, "task"),
    "permuted_mnist": (permuted_mnist, True, "domain"),
    "split_cifar10": (split_cifar10, True, "task"),
    "split_cifar": (split_cifar, True, "task"),
}

STREAMS: tuple[str, ...] = tuple(_BUILDERS)
DEFAULT_SCENARIOS: dict[str, str] = {name: entry[2] for name, entry in _BUILDERS.items()}


def stream_options(name: str) -> tuple[str, ...]:
    """The options (``make_stream``'s ``**kwargs``) that the stream ``name`` takes: its builder's keyword
    parameters other than those ``make_stream`` sets itself (``seed``, ``scenario``, ``data_dir``).

    Raises:
        ValueError: unknown ``name``.
    """
    if name not in _BUILDERS:
        raise ValueError(f"stream: got {name!r}; allowed: {', '.join(STREAMS)}")
    params = inspect.signature(_BUILDERS[name][0]).parameters
    return tuple(p for p in params if p not in ("seed", "scenario", "data_dir"))


def make_stream(
    name: str,
    *,
    data_dir: str | os.PathLike[str] | None = None,
    seed: int = 0,
    scenario: str | None = None,
    validation: float = 0.0,
    **kwargs,
) -> TaskStream:
    """Build the stream called ``name``.

    Args:
        name: one of :data:`STREAMS`.
        data_dir: the data root for streams read from disk (ignored by ``synthetic`` and the
            digits streams, whose data ships with scikit-learn).
        seed: seeds the stream's ``torch.Generator`` s (permutations, subsets, synthetic draws).
        scenario: ``"task"``, ``"class"`` or ``"domain"``; ``None`` takes the stream's default
            (:data:`DEFAULT_SCENARIOS`). A scenario the stream does not support raises ``ValueError``.
        validation: in [0, 1). 0: the stream as it is (evaluated on its test set). Otherwise this
            fraction of every task's training data (stratified by label, drawn from
            :func:`~continual_blr.data.builders.validation_generator` ``(seed)``) is held out and
            replaces the task's test set, which is dropped; the stream's name ends in
            ``[validation <fraction>]`` and ``meta["validation"]`` is the fraction.
        **kwargs: passed to the builder (e.g. ``n_tasks``, ``max_per_task``, ``download``).

    Returns:
        The stream.

    Raises:
        ValueError: unknown ``name``, unsupported ``scenario`` or ``validation`` outside [0, 1).
        DataNotFoundError: the stream's files are missing (a ``ValueError`` too).
    """
    if name not in _BUILDERS:
        raise ValueError(f"stream: got {name!r}; allowed: {', '.join(STREAMS)}")
    validation = check_validation(validation)  # before any data is read
    builder, reads_files, default_scenario = _BUILDERS[name]
    if reads_files:
        kwargs["data_dir"] = data_dir
    stream = builder(seed=seed, scenario=scenario or default_scenario, **kwargs)
    return hold_out_validation(stream, validation, validation_generator(seed))
