"""The embedded digits are read without importing scikit-learn, and are exactly what ``load_digits`` returns.

Planted once: with the loader going back to ``sklearn.datasets.load_digits``, the import test fails; with the
label column dropped by one (``data[:, -2]``), the oracle test fails."""

from __future__ import annotations

import subprocess
import sys

import numpy as np


def test_bundled_digits_equal_sklearn_load_digits():
    from sklearn.datasets import load_digits

    from continual_blr.data.digits import _bundled_digits

    images, target = _bundled_digits()
    bunch = load_digits()
    assert np.array_equal(images, bunch.images) and images.dtype == bunch.images.dtype
    assert np.array_equal(target, bunch.target)


def test_loading_the_digits_does_not_import_sklearn():
    code = ("import sys; from continual_blr.data.digits import load_digits_arrays; d = load_digits_arrays(); "
            "assert d[0].shape[1:] == (1, 8, 8), d[0].shape; print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
