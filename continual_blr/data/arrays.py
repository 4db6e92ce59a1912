"""Whole datasets as four tensors, and the ``.npz`` format to bring your own.

A dataset before it is cut into tasks is an :class:`ArraySplits`: train and test inputs and labels.
Loaders inside this package keep images as ``uint8`` (channels-first) until a task is built, so
that only the examples a task keeps are ever converted to float; :func:`to_float` does that step.

The ``.npz`` format (:func:`load_npz_arrays`) holds four arrays, ``x_train``, ``y_train``,
``x_test``, ``y_test``; any other keys are ignored. Inputs may have any shape ``(N, ...)``:

* ``uint8`` inputs are images with values 0..255. ``(N, H, W)`` gets a channel axis
  ``(N, 1, H, W)``; ``(N, H, W, C)`` with ``C`` in 1, 3, 4 (channels-last, e.g. CIFAR arrays) is
  moved to channels-first ``(N, C, H, W)``; the values become float32 divided by 255.
* any other dtype is taken as already preprocessed and only cast to float32.

Labels become int64.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

__all__ = ["ArraySplits", "NPZ_KEYS", "load_npz_arrays", "to_float"]

NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


class ArraySplits(NamedTuple):
    """A dataset's train and test split. Inputs are float32, or uint8 images not yet divided by 255."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor


def to_float(x: Tensor) -> Tensor:
    """Inputs as float32: ``uint8`` images are divided by 255, anything else is only cast."""
    if x.dtype == torch.uint8:
        return x.to(torch.float32).div_(255.0)
    return x.to(torch.float32)


def _channels_first(x: np.ndarray) -> np.ndarray:
    """Give uint8 images the layout ``(N, C, H, W)``; other arrays are returned unchanged."""
    if x.dtype != np.uint8:
        return x
    if x.ndim == 3:
        return x[:, None]
    if x.ndim == 4 and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    return x


def read_npz(path: str | os.PathLike[str], *, as_float: bool = True) -> ArraySplits:
    """Read an ``.npz`` of ``x_train, y_train, x_test, y_test`` (see the module docstring).

    Args:
        path: the ``.npz`` file.
        as_float: convert inputs to float32 now (``False`` keeps uint8 images, channels-first).

    Returns:
        The four arrays as tensors.

    Raises:
        ValueError: a key is missing or inputs and labels disagree in length.
    """
    path = Path(path)
    with np.load(path, allow_pickle=False) as f:
        missing = [k for k in NPZ_KEYS if k not in f.files]
        if missing:
            raise ValueError(
                f"{path}: missing arrays {', '.join(missing)}; an npz dataset needs {', '.join(NPZ_KEYS)}"
            )
        arrays = {k: f[k] for k in NPZ_KEYS}
    out = []
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.shape[0] != y.shape[0] or y.ndim != 1:
            raise ValueError(
                f"{path}: x_{split} has {x.shape[0]} rows but y_{split} has shape {tuple(y.shape)}"
            )
        xt = torch.from_numpy(_channels_first(x))
        out += [to_float(xt) if as_float else xt, torch.from_numpy(y.astype(np.int64))]
    return ArraySplits(*out)


def load_npz_arrays(path: str | os.PathLike[str]) -> ArraySplits:
    """Load a dataset from an ``.npz`` file, preprocessed as the module docstring describes.

    Args:
        path: an ``.npz`` with arrays ``x_train``, ``y_train``, ``x_test``, ``y_test``.

    Returns:
        float32 inputs (uint8 images channels-first and divided by 255) and int64 labels.

    Raises:
        ValueError: a key is missing or inputs and labels disagree in length.
        FileNotFoundError: ``path`` does not exist.

    Examples:
        >>> import numpy as np, tempfile, os
        >>> d = tempfile.mkdtemp(); p = os.path.join(d, "toy.npz")
        >>> x = np.zeros((4, 5, 5, 3), np.uint8); y = np.arange(4)
        >>> np.savez(p, x_train=x, y_train=y, x_test=x[:2], y_test=y[:2])
        >>> load_npz_arrays(p).x_train.shape
        torch.Size([4, 3, 5, 5])
    """
    return read_npz(path, as_float=True)
