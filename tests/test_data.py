"""Tests of the data layer (continual_blr.data), on generated data only.

Expected values are computed here from the raw generated arrays (numpy), not read back from the code
under test. Fake MNIST is written in the real idx format and fake CIFAR in the npz and in
torchvision's pickle layout, so the same readers run as on real data. One test marked ``data`` reads
real MNIST from ``$CONTINUAL_BLR_DATA`` (``pytest -m data``).
"""

from __future__ import annotations

import gzip
import os
import pickle
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import continual_blr.data as D
from continual_blr.data import mnist as mnist_module

ALL_STREAMS = {"synthetic", "split_digits", "permuted_digits", "split_mnist", "permuted_mnist",
               "split_cifar10", "split_cifar"}


# ----------------------------------------------------------------------------- generated datasets

def _write_idx(path: Path, arr: np.ndarray, gz: bool) -> None:
    """Write ``arr`` (uint8) in the idx format MNIST ships in: magic 0x0000 08 <ndim>, big-endian dims."""
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(struct.pack(">I", d) for d in arr.shape)
    payload = header + np.ascontiguousarray(arr, dtype=np.uint8).tobytes()
    if gz:
        with gzip.open(f"{path}.gz", "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)


def _fake_mnist(root: Path, gz: bool, per_class=(6, 3), seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    out = {}
    for split, prefix, n in (("train", "train", per_class[0]), ("test", "t10k", per_class[1])):
        y = rng.permutation(np.repeat(np.arange(10), n)).astype(np.uint8)
        x = rng.integers(0, 256, size=(y.size, 28, 28), dtype=np.uint8)
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", x, gz)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", y, gz)
        out[f"x_{split}"], out[f"y_{split}"] = x, y
    return out


def _fake_cifar(n_classes: int, per_class=(3, 2), seed: int = 0) -> dict[str, np.ndarray]:
    """Channels-last uint8 images (N, 32, 32, 3) with shuffled labels, like cifar10.npz."""
    rng = np.random.default_rng(seed)
    out = {}
    for split, n in (("train", per_class[0]), ("test", per_class[1])):
        y = rng.permutation(np.repeat(np.arange(n_classes), n)).astype(np.int64)
        out[f"x_{split}"] = rng.integers(0, 256, size=(y.size, 32, 32, 3), dtype=np.uint8)
        out[f"y_{split}"] = y
    return out


def _write_cifar_pickles(folder: Path, arrays: dict[str, np.ndarray], train_names, test_names, key) -> None:
    """torchvision's layout: pickled dicts with 'data' (N, 3072) channel-major rows and a label list."""
    folder.mkdir(parents=True)
    for split, names in (("train", train_names), ("test", test_names)):
        x = arrays[f"x_{split}"].transpose(0, 3, 1, 2).reshape(-1, 3 * 32 * 32)
        y = arrays[f"y_{split}"]
        for chunk, name in zip(np.array_split(np.arange(len(y)), len(names)), names):
            with open(folder / name, "wb") as f:
                pickle.dump({"data": x[chunk], key: y[chunk].tolist()}, f, protocol=2)


def _chw_float(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(x.transpose(0, 3, 1, 2).astype(np.float32) / 255.0)


# ----------------------------------------------------------------------------- paths and registry

def test_resolve_data_dir_order(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("CONTINUAL_BLR_DATA", raising=False)
    assert D.resolve_data_dir() == tmp_path / "xdg" / "continual_blr" / "data"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert D.resolve_data_dir() == tmp_path / "home" / ".cache" / "continual_blr" / "data"
    monkeypatch.setenv("CONTINUAL_BLR_DATA", str(tmp_path / "env"))
    assert D.resolve_data_dir() == tmp_path / "env"
    assert D.resolve_data_dir(tmp_path / "arg") == tmp_path / "arg"
    assert D.resolve_data_dir(str(tmp_path / "arg")) == tmp_path / "arg"


def test_make_stream_unknown_name_lists_allowed_names():
    assert set(D.STREAMS) == ALL_STREAMS
    with pytest.raises(ValueError) as info:
        D.make_stream("split_mnits")
    msg = str(info.value)
    assert "\n" not in msg and "split_mnits" in msg
    assert all(name in msg for name in ALL_STREAMS)


@pytest.mark.parametrize("name, scenario", [("permuted_digits", "task"), ("split_digits", "domain"),
                                            ("split_cifar", "class"), ("synthetic", "online")])
def test_make_stream_rejects_unsupported_scenario(name, scenario, tmp_path):
    with pytest.raises(ValueError, match=f"'{scenario}'"):
        D.make_stream(name, scenario=scenario, data_dir=tmp_path, download=False) if name == "split_cifar" \
            else D.make_stream(name, scenario=scenario)


def test_public_api_is_explicit():
    assert {"Task", "TaskStream", "make_stream", "STREAMS", "DataNotFoundError", "resolve_data_dir",
            "load_npz_arrays", "synthetic_stream"} <= set(D.__all__)
    assert all(hasattr(D, name) for name in D.__all__)
    assert issubclass(D.DataNotFoundError, ValueError)


# ----------------------------------------------------------------------------- synthetic

@pytest.mark.parametrize("scenario", ["task", "class", "domain"])
def test_synthetic_conventions(scenario):
    n_tasks, k = 4, 3
    s = D.make_stream("synthetic", scenario=scenario, n_tasks=n_tasks, n_classes_per_task=k,
                      n_features=5, n_train=31, n_test=12)
    assert len(s) == n_tasks and s.scenario == scenario and s.input_shape == (5,)
    assert (s.n_heads, s.n_outputs) == {"task": (4, 3), "class": (1, 12), "domain": (1, 3)}[scenario]
    for t, task in enumerate(s):
        assert task.task_id == t and task.head == (t if scenario == "task" else 0)
        assert task.x_train.shape == (31, 5) and task.x_test.shape == (12, 5)
        assert task.x_train.dtype == torch.float32 and task.y_train.dtype == torch.int64
        local = set(range(k))
        expected_labels = {t * k + j for j in local} if scenario == "class" else local
        assert set(task.y_train.tolist()) == expected_labels == set(task.y_test.tolist())
        assert task.classes == (tuple(range(k)) if scenario == "domain" else tuple(range(t * k, t * k + k)))
        counts = torch.bincount(task.y_train - task.y_train.min())
        assert counts.max() - counts.min() <= 1  # 31 over 3 classes: 11, 10, 10


def test_synthetic_is_seeded_separable_and_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b, c = (D.synthetic_stream(seed=s) for s in (0, 0, 1))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(a.tasks[2].x_train, b.tasks[2].x_train)
    assert not torch.allclose(a.tasks[0].x_train, c.tasks[0].x_train)
    for task in a:  # nearest class mean (fitted on train) classifies the test set well
        means = torch.stack([task.x_train[task.y_train == j].mean(0) for j in range(2)])
        pred = torch.cdist(task.x_test, means).argmin(1)
        assert (pred == task.y_test).float().mean() > 0.95


# ----------------------------------------------------------------------------- digits

@pytest.fixture(scope="module")
def sk_digits():
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.images, bunch.target


def test_split_digits_task_scenario(sk_digits):
    images, target = sk_digits
    s = D.make_stream("split_digits")
    assert (len(s), s.n_heads, s.n_outputs, s.input_shape, s.scenario) == (5, 5, 2, (1, 8, 8), "task")
    for t, task in enumerate(s):
        a, b = 2 * t, 2 * t + 1
        assert task.classes == (a, b) and task.head == t
        assert task.n_train + task.y_test.numel() == int(np.isin(target, [a, b]).sum())
        assert set(task.y_train.tolist()) == {0, 1} == set(task.y_test.tolist())
        for c, local in ((a, 0), (b, 1)):  # stratified 80/20 per class
            n_c = int((target == c).sum())
            assert int((task.y_test == local).sum()) == round(0.2 * n_c)
            # all images of class c, train + test, sum to the same total as the raw images / 16
            got = task.x_train[task.y_train == local].sum() + task.x_test[task.y_test == local].sum()
            assert got.item() == pytest.approx(images[target == c].sum() / 16.0, rel=1e-5)
        assert task.x_train.shape[1:] == (1, 8, 8) and task.x_train.dtype == torch.float32
        assert 0.0 <= task.x_train.min() and task.x_train.max() == 1.0


def test_split_digits_class_scenario_and_fixed_split():
    s = D.make_stream("split_digits", scenario="class", seed=3)
    assert (s.n_heads, s.n_outputs) == (1, 10)
    for t, task in enumerate(s):
        assert task.head == 0 and set(task.y_train.tolist()) == {2 * t, 2 * t + 1}
    ref = D.make_stream("split_digits", scenario="class", seed=0)
    other = D.make_stream("split_digits", scenario="class", split_seed=1)
    assert torch.equal(s.tasks[1].x_test, ref.tasks[1].x_test)  # the split does not move with seed
    assert not torch.equal(other.tasks[1].x_test, ref.tasks[1].x_test)  # but does with split_seed


def test_permuted_digits(sk_digits):
    state = torch.random.get_rng_state()
    D.make_stream("permuted_digits")  # warm-up: the first call imports scikit-learn
    start = time.perf_counter()
    s = D.make_stream("permuted_digits", seed=0)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0  # target < 0.5 s; slack for a loaded machine
    assert torch.equal(torch.random.get_rng_state(), state)
    assert (len(s), s.scenario, s.n_heads, s.n_outputs) == (5, "domain", 1, 10)
    plain = D.make_stream("split_digits", scenario="class")  # same split, no permutation
    x0 = torch.cat([t.x_train for t in plain.tasks])
    assert torch.equal(torch.sort(x0.reshape(-1, 64), 0).values,
                       torch.sort(s.tasks[0].x_train.reshape(-1, 64), 0).values)  # task 0 unpermuted
    base = s.tasks[0].x_train.reshape(-1, 64)
    perms = s.meta["permutations"]
    for t, task in enumerate(s):
        assert task.head == 0 and task.classes == tuple(range(10))
        assert torch.equal(task.y_train, s.tasks[0].y_train)
        assert torch.equal(torch.sort(perms[t]).values, torch.arange(64))
        assert torch.equal(task.x_train.reshape(-1, 64), base[:, perms[t]])
        assert torch.equal(task.x_test.reshape(-1, 64), s.tasks[0].x_test.reshape(-1, 64)[:, perms[t]])
    assert torch.equal(perms[0], torch.arange(64))
    assert all(not torch.equal(perms[i], perms[j]) for i in range(5) for j in range(i))
    again = D.make_stream("permuted_digits", seed=0)
    other = D.make_stream("permuted_digits", seed=1)
    assert torch.equal(again.tasks[3].x_train, s.tasks[3].x_train)
    assert not torch.equal(other.tasks[3].x_train, s.tasks[3].x_train)
    assert torch.equal(other.tasks[0].x_train, s.tasks[0].x_train)


def test_max_per_task_subsamples_deterministically():
    full = D.make_stream("split_digits")
    a = D.make_stream("split_digits", max_per_task=40, max_test_per_task=10, seed=5)
    b = D.make_stream("split_digits", max_per_task=40, max_test_per_task=10, seed=5)
    c = D.make_stream("split_digits", max_per_task=40, max_test_per_task=10, seed=6)
    assert [t.n_train for t in a] == [40] * 5 and [t.y_test.numel() for t in a] == [10] * 5
    assert torch.equal(a.tasks[2].x_train, b.tasks[2].x_train)
    assert not torch.equal(a.tasks[2].x_train, c.tasks[2].x_train)
    rows = {tuple(r.tolist()) for r in full.tasks[2].x_train.reshape(-1, 64)}
    assert all(tuple(r.tolist()) in rows for r in a.tasks[2].x_train.reshape(-1, 64))


# ----------------------------------------------------------------------------- MNIST

@pytest.mark.parametrize("gz", [False, True])
def test_split_mnist_from_idx_files(tmp_path, gz):
    raw = _fake_mnist(tmp_path, gz)
    s = D.make_stream("split_mnist", data_dir=tmp_path, download=False)
    assert (len(s), s.n_heads, s.n_outputs, s.input_shape) == (5, 5, 2, (1, 28, 28))
    for t, task in enumerate(s):
        mask = np.isin(raw["y_train"], [2 * t, 2 * t + 1])
        expected_x = torch.from_numpy(raw["x_train"][mask].astype(np.float32) / 255.0).unsqueeze(1)
        assert torch.equal(task.x_train, expected_x)
        assert task.y_train.tolist() == (raw["y_train"][mask] == 2 * t + 1).astype(int).tolist()
        assert task.head == t and task.classes == (2 * t, 2 * t + 1)
        assert task.y_test.numel() == int(np.isin(raw["y_test"], [2 * t, 2 * t + 1]).sum())
    c = D.make_stream("split_mnist", data_dir=tmp_path, scenario="class", download=False)
    assert (c.n_heads, c.n_outputs) == (1, 10)
    assert c.tasks[4].y_test.tolist() == [int(v) for v in raw["y_test"] if v in (8, 9)]
    if gz:  # extracted beside the archives for the next run
        assert (tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte").is_file()


def test_mnist_gz_in_read_only_folder_uses_a_temporary_copy(tmp_path, monkeypatch):
    raw = _fake_mnist(tmp_path, gz=True)
    monkeypatch.setattr(mnist_module, "_extract_in_place", lambda folder, names: False)
    data = D.load_mnist(tmp_path, download=False)
    assert torch.equal(data.x_test[:, 0], torch.from_numpy(raw["x_test"]))
    assert not (tmp_path / "MNIST" / "raw" / "t10k-images-idx3-ubyte").exists()


def test_permuted_mnist_from_env_var(tmp_path, monkeypatch):
    raw = _fake_mnist(tmp_path, gz=False)
    monkeypatch.setenv("CONTINUAL_BLR_DATA", str(tmp_path))
    s = D.make_stream("permuted_mnist", seed=7, download=False)
    assert (len(s), s.scenario, s.n_heads, s.n_outputs) == (10, "domain", 1, 10)
    x0 = torch.from_numpy(raw["x_train"].reshape(-1, 784).astype(np.float32) / 255.0)
    assert torch.equal(s.tasks[0].x_train.reshape(-1, 784), x0)
    for t in range(1, 10):
        xt = s.tasks[t].x_train.reshape(-1, 784)
        assert torch.equal(torch.sort(xt, 1).values, torch.sort(x0, 1).values)  # same pixels, moved
        assert not torch.equal(xt, x0)
        perm = s.meta["permutations"][t]
        assert torch.equal(xt, x0[:, perm]) and torch.equal(torch.sort(perm).values, torch.arange(784))
        assert s.tasks[t].y_train.tolist() == raw["y_train"].astype(int).tolist()
    again = D.permuted_mnist(tmp_path, seed=7, n_tasks=3, download=False)
    other = D.permuted_mnist(tmp_path, seed=8, n_tasks=3, download=False)
    assert torch.equal(again.tasks[2].x_test, s.tasks[2].x_test)
    assert not torch.equal(other.tasks[1].x_test, s.tasks[1].x_test)


def test_missing_mnist_names_folder_and_files(tmp_path, monkeypatch):
    root = tmp_path / "nowhere"
    with pytest.raises(D.DataNotFoundError) as info:
        D.make_stream("split_mnist", data_dir=root, download=False)
    msg = str(info.value)
    assert "\n" not in msg
    assert str(root / "MNIST" / "raw") in msg and "train-images-idx3-ubyte" in msg
    assert "t10k-labels-idx1-ubyte" in msg and "CONTINUAL_BLR_DATA" in msg
    assert isinstance(info.value, ValueError)

    import torchvision.datasets

    def offline(self):
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz:\nTried a mirror, got:\nno network\n")

    monkeypatch.setattr(torchvision.datasets.MNIST, "download", offline)
    with pytest.raises(D.DataNotFoundError, match="download failed") as info:
        D.make_stream("permuted_mnist", data_dir=root)  # download=True by default
    assert "\n" not in str(info.value) and str(root) in str(info.value)


# ----------------------------------------------------------------------------- npz and CIFAR

def test_load_npz_arrays_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    x_rgb = rng.integers(0, 256, size=(5, 6, 7, 3), dtype=np.uint8)
    y = np.array([3, 1, 4, 1, 5], dtype=np.int32)
    np.savez(tmp_path / "rgb.npz", x_train=x_rgb, y_train=y, x_test=x_rgb[:2], y_test=y[:2], extra=np.ones(3))
    got = D.load_npz_arrays(tmp_path / "rgb.npz")
    assert got.x_train.shape == (5, 3, 6, 7) and got.x_train.dtype == torch.float32
    assert torch.allclose(got.x_train, _chw_float(x_rgb), atol=0) and torch.equal(got.x_test, got.x_train[:2])
    assert got.y_train.dtype == torch.int64 and got.y_train.tolist() == [3, 1, 4, 1, 5]
    # grey uint8 images gain a channel axis; float features pass through unchanged
    x_grey = rng.integers(0, 256, size=(4, 9, 9), dtype=np.uint8)
    x_feat = rng.normal(size=(4, 11)).astype(np.float64)
    np.savez(tmp_path / "grey.npz", x_train=x_grey, y_train=y[:4], x_test=x_feat, y_test=y[:4])
    got = D.load_npz_arrays(tmp_path / "grey.npz")
    assert torch.equal(got.x_train, torch.from_numpy(x_grey[:, None].astype(np.float32) / 255.0))
    assert got.x_test.dtype == torch.float32 and torch.allclose(got.x_test, torch.from_numpy(x_feat).float())
    np.savez(tmp_path / "bad.npz", x_train=x_grey, y_train=y[:4], x_test=x_grey)
    with pytest.raises(ValueError, match="y_test"):
        D.load_npz_arrays(tmp_path / "bad.npz")


@pytest.fixture
def fake_cifar_root(tmp_path):
    c10, c100 = _fake_cifar(10, seed=2), _fake_cifar(100, per_class=(2, 1), seed=3)
    (tmp_path / "cifar10").mkdir()
    np.savez(tmp_path / "cifar10" / "cifar10.npz", **c10)
    return tmp_path, c10, c100


@pytest.mark.parametrize("c100_layout", ["npz", "pickle"])
def test_split_cifar_follows_fromp_protocol(fake_cifar_root, c100_layout):
    root, c10, c100 = fake_cifar_root
    if c100_layout == "npz":
        (root / "cifar100").mkdir()
        np.savez(root / "cifar100" / "cifar100.npz", **c100)
    else:
        _write_cifar_pickles(root / "cifar-100-python", c100, ["train"], ["test"], "fine_labels")
    s = D.make_stream("split_cifar", data_dir=root, download=False)
    assert (len(s), s.scenario, s.n_heads, s.n_outputs, s.input_shape) == (6, "task", 6, 10, (3, 32, 32))
    t0 = s.tasks[0]  # all of CIFAR-10, in file order, labels as they are
    assert t0.head == 0 and t0.classes == tuple(range(10))
    assert torch.equal(t0.x_train, _chw_float(c10["x_train"]))
    assert t0.y_train.tolist() == c10["y_train"].tolist() and t0.y_test.tolist() == c10["y_test"].tolist()
    for t in range(1, 6):
        task, lo = s.tasks[t], 10 * (t - 1)  # CIFAR-100 classes lo .. lo+9, renumbered 0..9
        assert task.task_id == t and task.head == t
        assert task.classes == tuple(range(10 * t, 10 * t + 10))  # joint 110-class space
        for split in ("train", "test"):
            mask = (c100[f"y_{split}"] >= lo) & (c100[f"y_{split}"] < lo + 10)
            assert torch.equal(getattr(task, f"x_{split}"), _chw_float(c100[f"x_{split}"][mask]))
            assert getattr(task, f"y_{split}").tolist() == (c100[f"y_{split}"][mask] - lo).tolist()
    short = D.split_cifar(root, n_tasks=3, download=False)
    assert len(short) == 3 and short.n_heads == 3


def test_split_cifar10_from_torchvision_pickles_and_direct_path(tmp_path, fake_cifar_root):
    root, c10, _ = fake_cifar_root
    tv_root = tmp_path / "tv"
    names = [f"data_batch_{i}" for i in range(1, 6)]
    _write_cifar_pickles(tv_root / "cifar-10-batches-py", c10, names, ["test_batch"], "labels")
    from_pickles = D.make_stream("split_cifar10", data_dir=tv_root, download=False)
    from_path = D.split_cifar10(cifar10_path=root / "cifar10" / "cifar10.npz", download=False)
    assert (len(from_pickles), from_pickles.n_heads, from_pickles.n_outputs) == (5, 5, 2)
    for t in range(5):
        mask = np.isin(c10["y_train"], [2 * t, 2 * t + 1])
        assert torch.equal(from_pickles.tasks[t].x_train, _chw_float(c10["x_train"][mask]))
        assert torch.equal(from_path.tasks[t].x_train, from_pickles.tasks[t].x_train)
        assert from_path.tasks[t].y_test.tolist() == \
            (c10["y_test"][np.isin(c10["y_test"], [2 * t, 2 * t + 1])] == 2 * t + 1).astype(int).tolist()
    small = D.split_cifar10(root, scenario="class", max_per_task=4, download=False)
    assert [t.n_train for t in small] == [4] * 5 and small.n_outputs == 10
    assert set(small.tasks[3].y_train.tolist()) <= {6, 7}


def test_missing_cifar100_names_expected_files(fake_cifar_root):
    root, _, _ = fake_cifar_root
    with pytest.raises(D.DataNotFoundError) as info:
        D.make_stream("split_cifar", data_dir=root, download=False)
    msg = str(info.value)
    assert "\n" not in msg and str(root / "cifar100" / "cifar100.npz") in msg
    assert "cifar-100-python" in msg
    with pytest.raises(D.DataNotFoundError, match="no file at"):
        D.split_cifar10(cifar10_path=root / "missing.npz", download=False)


def test_split_cifar10_validation_stream_and_missing_file_error(tmp_path, fake_cifar_root):
    """The validation option holds out part of each task's training images (stratified) and drops the test
    set; a data root without the arrays fails in one line naming <root>/cifar10/cifar10.npz."""
    root, c10, _ = fake_cifar_root
    base = D.make_stream("split_cifar10", data_dir=root, download=False)
    val = D.make_stream("split_cifar10", data_dir=root, download=False, validation=0.5)
    assert val.meta["evaluates_on"] == "validation" and (val.n_heads, val.n_outputs) == (5, 2)
    for b, v in zip(base, val):
        assert v.n_train + v.y_test.numel() == b.n_train and v.head == b.head == b.task_id
        assert sorted(v.y_train.tolist() + v.y_test.tolist()) == sorted(b.y_train.tolist())
    with pytest.raises(D.DataNotFoundError) as info:
        D.make_stream("split_cifar10", data_dir=tmp_path / "empty", download=False)
    msg = str(info.value)
    assert "\n" not in msg and str(tmp_path / "empty" / "cifar10" / "cifar10.npz") in msg


def test_split_cifar10_configs_parse_and_build():
    """Every shipped split CIFAR-10 config (both protocols, full and CPU budget, and the class-incremental replay
    configs under resnet18/class/, the ResNet CPU screen) is a valid run config whose methods build; the CPU budgets
    say so in their path and train fewer epochs than the full protocol; only the class/ folder is class-incremental."""
    import yaml

    from continual_blr.config import RunConfig, from_dict
    from continual_blr.methods import build_method

    folder = Path(__file__).resolve().parent.parent / "configs" / "split_cifar10"
    paths = sorted(folder.rglob("*.yaml"))
    assert len(paths) >= 28
    for path in paths:
        cfg = from_dict(RunConfig, yaml.safe_load(path.read_text()))
        assert cfg.stream.name == "split_cifar10"
        assert cfg.stream.scenario == ("class" if "class" in path.parts else "task"), path
        assert cfg.model.arch == ("reduced_resnet18" if "resnet18" in path.parts else "cifarnet")
        assert (cfg.train.epochs == 1) == ("cpu_budget" in path.parts), path
        screen = "cpu_screen" in path.parts  # the ResNet screen: every task memorised small (batch 128, 20 epochs)
        assert cfg.train.batch_size == (128 if screen else 256) and cfg.train.lr == 1e-3, path
        assert not screen or (cfg.train.epochs == 20 and cfg.train.precision == "bf16"), path
        for m in cfg.methods:
            build_method(m.name, m.params)


# ----------------------------------------------------------------------------- real data (opt-in)

@pytest.mark.data
def test_real_mnist_sizes():
    if not os.environ.get("CONTINUAL_BLR_DATA"):
        pytest.skip("set CONTINUAL_BLR_DATA to the folder holding MNIST/raw")
    data = D.load_mnist(os.environ["CONTINUAL_BLR_DATA"], download=False)
    assert data.x_train.shape == (60000, 1, 28, 28) and data.x_test.shape == (10000, 1, 28, 28)
    assert torch.bincount(data.y_train).tolist()[:2] == [5923, 6742]  # published class counts
    s = D.make_stream("split_mnist", data_dir=os.environ["CONTINUAL_BLR_DATA"], download=False)
    assert sum(t.n_train for t in s) == 60000 and sum(t.y_test.numel() for t in s) == 10000


@pytest.mark.data
def test_real_split_cifar10_sizes():
    root = os.environ.get("CONTINUAL_BLR_DATA")
    if not root or not (Path(root) / "cifar10" / "cifar10.npz").is_file():
        pytest.skip("set CONTINUAL_BLR_DATA to the folder holding cifar10/cifar10.npz")
    s = D.make_stream("split_cifar10", data_dir=root, download=False)
    assert [t.n_train for t in s] == [10000] * 5 and [t.y_test.numel() for t in s] == [2000] * 5
    assert s.tasks[0].x_train.shape[1:] == (3, 32, 32)
    mean = torch.stack([t.x_train.mean((0, 2, 3)) for t in s]).mean(0)  # published per-channel train mean
    torch.testing.assert_close(mean, torch.tensor([0.4914, 0.4822, 0.4465]), rtol=0, atol=5e-4)


# ----------------------------------------------------------------------------- validation streams

def _rows(x: torch.Tensor, y: torch.Tensor) -> list[tuple]:
    """Every example as a hashable (label, input values) tuple, for multiset comparisons."""
    return [(int(label), *row.tolist()) for label, row in zip(y, x.reshape(x.shape[0], -1))]


def _expected_held(y: torch.Tensor, fraction: float) -> dict[int, int]:
    """Held-out count per label by the documented rule: min(round(f * n_c), n_c - 1)."""
    counts = torch.bincount(y).tolist()
    return {c: min(round(fraction * n), n - 1) for c, n in enumerate(counts) if n}


@pytest.mark.parametrize("name, kwargs", [
    ("split_digits", {"scenario": "task"}),
    ("split_digits", {"scenario": "class"}),
    ("permuted_digits", {"n_tasks": 3}),
    ("synthetic", {"scenario": "domain", "n_train": 57, "n_test": 13}),
])
def test_validation_stream_partitions_each_tasks_training_data(name, kwargs):
    from collections import Counter

    fraction = 0.1
    base = D.make_stream(name, seed=2, **kwargs)
    val = D.make_stream(name, seed=2, validation=fraction, **kwargs)
    assert val.name == f"{name}[validation 0.1]" and val.meta["validation"] == fraction
    assert val.meta["evaluates_on"] == "validation" and "validation" not in base.meta
    assert (val.scenario, val.n_heads, val.n_outputs, val.input_shape, len(val)) == \
        (base.scenario, base.n_heads, base.n_outputs, base.input_shape, len(base))
    for b, v in zip(base, val):
        assert (v.task_id, v.head, v.classes) == (b.task_id, b.head, b.classes)
        assert v.name == f"{b.name}[validation]"
        kept, held, original = _rows(v.x_train, v.y_train), _rows(v.x_test, v.y_test), _rows(b.x_train, b.y_train)
        # the held-out part and the reduced training set partition the original training set
        assert Counter(kept) + Counter(held) == Counter(original)
        assert v.n_train + v.y_test.numel() == b.n_train
        # stratified sizes, computed from the original labels
        assert dict(Counter(v.y_test.tolist())) == {c: n for c, n in _expected_held(b.y_train, fraction).items() if n}
        if name == "synthetic":  # continuous inputs: no held-out example is a test example
            assert not set(held) & set(_rows(b.x_test, b.y_test))


def test_validation_stream_is_seeded_and_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    a = D.make_stream("split_digits", seed=0, validation=0.2)
    b = D.make_stream("split_digits", seed=0, validation=0.2)
    c = D.make_stream("split_digits", seed=1, validation=0.2)
    assert torch.equal(torch.random.get_rng_state(), state)
    for ta, tb, tc in zip(a, b, c):
        assert torch.equal(ta.x_test, tb.x_test) and torch.equal(ta.x_train, tb.x_train)
        assert ta.y_test.numel() == tc.y_test.numel()
    # the digits' train/test split does not move with seed, the held-out part does
    assert any(not torch.equal(ta.x_test, tc.x_test) for ta, tc in zip(a, c))


def test_validation_zero_is_the_plain_stream():
    base = D.make_stream("synthetic", seed=4)
    same = D.make_stream("synthetic", seed=4, validation=0.0)
    assert same.name == "synthetic" and "validation" not in same.meta
    assert all(torch.equal(p.x_test, q.x_test) for p, q in zip(base, same))


@pytest.mark.parametrize("bad", [1.0, 1, -0.1, float("nan"), "0.1", True])
def test_validation_outside_unit_interval_is_a_one_line_error(bad):
    with pytest.raises(ValueError) as info:
        D.make_stream("synthetic", validation=bad)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("validation:") and "[0, 1)" in msg


def test_validation_that_holds_out_nothing_is_an_error():
    with pytest.raises(ValueError, match="holds out none") as info:
        D.make_stream("synthetic", n_train=4, validation=0.1)  # 2 per class: round(0.2) = 0
    assert "\n" not in str(info.value)
    tiny = D.make_stream("synthetic", n_train=4, validation=0.6)  # round(1.2) = 1: each class keeps one
    assert [t.n_train for t in tiny] == [2, 2, 2] and [t.y_test.numel() for t in tiny] == [2, 2, 2]


@pytest.mark.parametrize("name", ["split_mnist", "permuted_mnist"])
def test_validation_stream_from_mnist_files_never_evaluates_on_test(tmp_path, name):
    raw = _fake_mnist(tmp_path, gz=False, per_class=(10, 3))
    kwargs = {"n_tasks": 3} if name == "permuted_mnist" else {}
    val = D.make_stream(name, data_dir=tmp_path, download=False, seed=1, validation=0.3, **kwargs)
    base = D.make_stream(name, data_dir=tmp_path, download=False, seed=1, **kwargs)
    assert val.name == f"{name}[validation 0.3]"
    test_rows = {tuple(r) for r in raw["x_test"].reshape(len(raw["x_test"]), -1).tolist()}
    for t, (b, v) in enumerate(zip(base, val)):
        assert v.n_train + v.y_test.numel() == b.n_train
        # 3 of every class's 10 training images held out (split: 2 classes a task, permuted: 10)
        assert v.y_test.numel() == 3 * len(b.classes)
        x = (v.x_test.reshape(v.x_test.shape[0], -1) * 255).round().to(torch.uint8)
        if t == 0:  # unpermuted: held-out images are raw training images, never test images
            train_rows = {tuple(r) for r in raw["x_train"].reshape(len(raw["x_train"]), -1).tolist()}
            assert all(tuple(r) in train_rows and tuple(r) not in test_rows for r in x.tolist())


def test_stream_config_validation_field():
    from continual_blr.config import ConfigError, RunConfig, from_dict
    from continual_blr.runner import build_stream

    cfg = from_dict(RunConfig, {"stream": {"name": "synthetic", "validation": 0.25, "options": {"n_train": 40}},
                                "seed": 3})
    s = build_stream(cfg)
    assert s.meta["validation"] == 0.25 and [t.y_test.numel() for t in s] == [10, 10, 10]
    assert torch.equal(s.tasks[1].x_test, D.make_stream("synthetic", seed=3, n_train=40, validation=0.25).tasks[1].x_test)
    with pytest.raises(ConfigError, match=r"stream\.validation") as info:
        from_dict(RunConfig, {"stream": {"validation": 1.5}})
    assert "\n" not in str(info.value)
