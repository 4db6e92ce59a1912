"""Task streams for continual learning: synthetic blobs, scikit-learn digits, MNIST and CIFAR.

Every benchmark becomes a :class:`TaskStream` (a list of :class:`Task` s with tensors already
preprocessed); :func:`make_stream` builds one by name. See ``docs/data.md`` for the streams, the
scenario conventions and where data is looked for.

Importing this package reads nothing from disk and imports neither torchvision nor scikit-learn;
the loaders import them when called.
"""

from .arrays import NPZ_KEYS, ArraySplits, load_npz_arrays, to_float
from .builders import draw_permutations, hold_out_validation, permuted_tasks, split_tasks
from .cifar import load_cifar10, load_cifar100, split_cifar, split_cifar10
from .digits import load_digits_arrays, permuted_digits, split_digits
from .mnist import load_mnist, permuted_mnist, split_mnist
from .paths import DATA_ENV_VAR, DataNotFoundError, default_data_dir, resolve_data_dir
from .registry import DEFAULT_SCENARIOS, STREAMS, make_stream
from .stream import SCENARIOS, Task, TaskStream
from .synthetic import synthetic_stream

__all__ = [
    # contract
    "Task",
    "TaskStream",
    "SCENARIOS",
    # registry
    "make_stream",
    "STREAMS",
    "DEFAULT_SCENARIOS",
    # streams
    "synthetic_stream",
    "split_digits",
    "permuted_digits",
    "split_mnist",
    "permuted_mnist",
    "split_cifar10",
    "split_cifar",
    # loaders and builders (bring your own data)
    "ArraySplits",
    "NPZ_KEYS",
    "load_npz_arrays",
    "to_float",
    "load_digits_arrays",
    "load_mnist",
    "load_cifar10",
    "load_cifar100",
    "split_tasks",
    "permuted_tasks",
    "draw_permutations",
    "hold_out_validation",
    # where data lives
    "DATA_ENV_VAR",
    "DataNotFoundError",
    "default_data_dir",
    "resolve_data_dir",
]
