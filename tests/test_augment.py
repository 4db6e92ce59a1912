"""``train.augment: crop_flip`` (``continual_blr.data.augment``): the DER protocol's random padded crop and flip.

Oracles: the brute-force set of every crop/flip window of an image (2 · (2p + 1)² of them, built by slicing a padded
copy in a Python loop), against which every image a training step or a replay draw sees is matched exactly; the
stored images themselves (the buffers and FROMP's points must hold them as drawn); and the uninterrupted run (an
interrupted augmented DER++ run resumes bit for bit). Each of the loop tests was planted against once: the buffer
fed the augmented batch, the replay draws not augmented, the replay generator held where a checkpoint cannot see it (a closure) on resume; each failed.
"""

from __future__ import annotations

import json

import pytest
import torch

from continual_blr.data.augment import PADDING, augment, crop_flip
from continual_blr.data.stream import Task, TaskStream
from continual_blr.loop import run_stream
from continual_blr.methods import build_method
from continual_blr.methods.base import TrainConfig
from continual_blr.models import build_model

SHAPE = (3, 8, 8)


def _windows(img: torch.Tensor, p: int = PADDING) -> torch.Tensor:
    """Every crop/flip window of one image [C, H, W]: [2 (2p + 1)², C, H, W], by slicing (the oracle)."""
    c, h, w = img.shape
    padded = torch.zeros(c, h + 2 * p, w + 2 * p, dtype=img.dtype)
    padded[:, p:p + h, p:p + w] = img
    out = []
    for r in range(2 * p + 1):
        for s in range(2 * p + 1):
            win = padded[:, r:r + h, s:s + w]
            out += [win, win.flip(-1)]
    return torch.stack(out)


def _is_window_of(x: torch.Tensor, images: torch.Tensor) -> bool:
    """Whether ``x`` [C, H, W] equals exactly one of the windows of one of ``images`` [N, C, H, W]."""
    return any((_windows(img) == x).flatten(1).all(1).any() for img in images)


def _is_one_of(x: torch.Tensor, images: torch.Tensor) -> bool:
    return bool((images == x).flatten(1).all(1).any())


def test_crop_flip_gives_a_window_of_each_image_and_keeps_its_format():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, *SHAPE, generator=g)
    out = crop_flip(x, torch.Generator().manual_seed(1))
    assert out.shape == x.shape and out.dtype == x.dtype
    for i in range(16):
        assert _is_window_of(out[i], x[i : i + 1]), i
    # the draws are those named in the module docstring: rows, columns, then flips, from the generator given
    g2 = torch.Generator().manual_seed(1)
    r = torch.randint(0, 2 * PADDING + 1, (16,), generator=g2)
    c = torch.randint(0, 2 * PADDING + 1, (16,), generator=g2)
    f = torch.rand(16, generator=g2) < 0.5
    for i in range(16):
        want = _windows(x[i])[2 * (int(r[i]) * (2 * PADDING + 1) + int(c[i])) + int(f[i])]
        assert torch.equal(out[i], want), i
    assert f.any() and not f.all()  # both branches met by this seed
    cl = x.contiguous(memory_format=torch.channels_last)
    out_cl = crop_flip(cl, torch.Generator().manual_seed(1))
    assert out_cl.is_contiguous(memory_format=torch.channels_last) and torch.equal(out_cl, out)


def test_off_returns_the_input_and_draws_nothing():
    x = torch.randn(4, *SHAPE)
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    assert augment(x, "off", g) is x
    assert torch.equal(g.get_state(), state)
    with pytest.raises(ValueError, match="train.augment"):
        TrainConfig(augment="cutout")
    with pytest.raises(ValueError, match="crop_flip: needs a batch of images"):
        crop_flip(torch.randn(4, 10), g)


def _image_stream(n_tasks: int = 2, n: int = 24, seed: int = 0) -> TaskStream:
    g = torch.Generator().manual_seed(seed)
    tasks = []
    for t in range(n_tasks):
        x = torch.randn(n, *SHAPE, generator=g)
        y = torch.randint(0, 2, (n,), generator=g)
        tasks.append(Task(t, x, y, x[:8], y[:8], (2 * t, 2 * t + 1), head=t, name=f"t{t}"))
    return TaskStream("images", tasks, "task", SHAPE, 2, n_tasks)


def _seen_inputs(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every input the network's training-mode forward gets (a forward pre-hook)."""
    seen: list[torch.Tensor] = []

    def hook(module, args, kwargs):
        if module.training:
            seen.append(args[0].detach().clone())

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def _run(method: str, params: dict, augment_mode: str, stream: TaskStream):
    model = build_model("mlp", SHAPE, 2, stream.n_heads, hidden=(8,), generator=torch.Generator().manual_seed(0))
    seen = _seen_inputs(model)
    m = build_method(method, params, seed=0)
    train = TrainConfig(epochs=2, batch_size=8, augment=augment_mode)
    run_stream(model, stream, m, train, seed=0, progress=False)
    return m, seen


@pytest.mark.parametrize("method, params", [("er", {"memory_size": 10, "replay_batch_size": 4}),
                                            ("derpp", {"memory_size": 10, "replay_batch_size": 4}),
                                            ("fromp-replay", {"memory_size": 6, "replay_batch_size": 4})])
def test_steps_and_replays_see_windows_and_memories_hold_the_drawn_images(method, params):
    stream = _image_stream()
    everything = torch.cat([t.x_train for t in stream.tasks])
    first = stream.tasks[0].x_train
    m, seen = _run(method, params, "crop_flip", stream)
    rows = torch.cat(seen)
    assert all(_is_window_of(x, everything) for x in rows)
    assert sum(not _is_one_of(x, everything) for x in rows) > rows.shape[0] // 2  # augmented, not stored images
    # the memory holds images as drawn (never an augmented copy)
    if method == "fromp-replay":
        stored = torch.cat([e.x for e in m.regularizer.memory])
    else:
        stored = m.buffer.stored()[0]
    assert all(_is_one_of(x, everything) for x in stored)
    # task 2's replayed task-1 images are augmented too: some of its rows are windows of task 1's images only
    replayed = [x for x in rows if _is_window_of(x, first) and not _is_one_of(x, first)]
    assert replayed, "no augmented task-1 image was replayed in task 2"
    _, plain = _run(method, params, "off", stream)
    assert all(_is_one_of(x, everything) for x in torch.cat(plain))


def test_fromp_points_and_kernels_see_stored_images():
    """FROMP's memorable points are the task's images as stored, whatever ``train.augment`` says."""
    stream = _image_stream()
    everything = torch.cat([t.x_train for t in stream.tasks])
    m, _ = _run("fromp", {"n_points": 4}, "crop_flip", stream)
    for e in m.regularizer.memory:
        assert all(_is_one_of(x, everything) for x in e.x)


def test_a_non_image_stream_is_a_one_line_error(tmp_path, capsys):
    from continual_blr.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("stream: {name: synthetic, options: {n_tasks: 2, n_train: 20, n_features: 6}}\n"
                   "model: {hidden: [8]}\ntrain: {epochs: 1, batch_size: 10, augment: crop_flip}\n"
                   "methods: [none]\nprogress: false\n")
    rc = main(["run", str(cfg), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "train.augment" in err and "'off'" in err, err


AUG_CONFIG = """\
stream: {{name: split_cifar10, data_dir: "{root}", options: {{download: false, max_per_task: 8, max_test_per_task: 4}}}}
model: {{arch: cifarnet}}
train: {{epochs: 2, batch_size: 4, augment: crop_flip}}
seed: 3
methods:
  - {{name: derpp, params: {{memory_size: 6, replay_batch_size: 3}}}}
"""


def test_interrupted_augmented_derpp_resumes_bit_for_bit(tmp_path, monkeypatch, capsys):
    """The loop's and the buffer's augmentation draws survive a resume: an augmented DER++ run interrupted in its
    3rd task and resumed equals the uninterrupted run (accuracy matrix, weights, buffer, logs)."""
    from test_blr_contracts import _fake_cifar10
    from test_resume import _interrupt_after, _matrices, _same
    from test_resume import _load as load_saved

    from continual_blr.cli import main

    data = tmp_path / "data"
    _fake_cifar10(data)
    cfg = tmp_path / "aug.yaml"
    cfg.write_text(AUG_CONFIG.format(root=data))
    ref, out = tmp_path / "ref", tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(ref), "--no-progress", "--threads", "1"]) == 0
    steps_per_task = 2 * 2  # 8 images a task (max_per_task), batch 4, 2 epochs
    with monkeypatch.context() as patch:
        _interrupt_after(patch, "train_step", 2 * steps_per_task + 3)
        assert main(["run", str(cfg), "--out", str(out), "--no-progress", "--threads", "1"]) == 130
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--no-progress", "--threads", "1"]) == 0
    assert _matrices(ref) == _matrices(out)
    _same(load_saved(ref / "derpp" / "model.pt"), load_saved(out / "derpp" / "model.pt"), "model")
    _same(load_saved(ref / "derpp" / "method.pt"), load_saved(out / "derpp" / "method.pt"), "method")
    assert (ref / "derpp" / "train_log.csv").read_text() == (out / "derpp" / "train_log.csv").read_text()
    resolved = json.loads((ref / "results.json").read_text())
    assert "crop_flip" in json.dumps(resolved)
