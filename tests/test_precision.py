"""``train.precision: bf16`` (mixed precision) and channels_last (:mod:`continual_blr.mixed_precision`).

Oracles: the same run in fp32 (accuracy within :data:`BF16_ACCURACY_BAND`); the fp32 curvature / kernel /
posterior computed outside autocast (equal to fp32 round-off inside an active bf16 autocast); the
uninterrupted bf16 run (an interrupted-and-resumed one equals it bit for bit, CPU). Every run here is
small: scikit-learn's digits for two epochs, a 12×12 image stream, the synthetic blobs.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import continual_blr.loop as loop
from continual_blr.cli import main
from continual_blr.curvature import curvature, kernel
from continual_blr.data import make_stream
from continual_blr.data.stream import Task, TaskStream
from continual_blr.loop import run_stream
from continual_blr.methods import build_method
from continual_blr.methods.base import TrainConfig
from continual_blr.mixed_precision import is_channels_last
from continual_blr.models import build_model
from continual_blr.posteriors import DiagPosterior, FullPosterior, KronPosterior
from continual_blr.regularizers.functional import FunctionalRegularizer

BF16_ACCURACY_BAND = 0.03
"""|avg acc(bf16) − avg acc(fp32)| allowed on split digits (2 epochs). bf16 operands keep 8 bits of mantissa
(relative rounding 2⁻⁸ ≈ 0.4 %), which perturbs every minibatch step like a change of minibatch order does:
the measured gaps are ≤ 0.6 points (none 0.0, ewc 0.6, fromp 0.6, blr 0.6). The test set holds ~360 digits, so
one digit moves the 5-task average by ~0.3 points; 3 points (~10 digits) leaves room for the order-of-updates
noise while a broken mixed precision (bf16 weights and updates, a penalty rounded to bf16) costs far more."""

FP32_UNDER_AUTOCAST = dict(rtol=1e-5, atol=1e-7)
"""fp32 results computed inside an active bf16 autocast against the same computation outside: the same fp32
arithmetic (the entry points switch autocast off), so round-off only. bf16 arithmetic would be ~1e-2 off."""

DIGITS_METHODS = {"none": {}, "ewc": {}, "fromp": {"n_points": 40}, "blr": {}}


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def digits():
    return make_stream("split_digits", seed=0)


class _DtypeRecorder:
    """Forward hooks on every Linear / Conv2d: the set of (module in training mode, output dtype) seen."""

    def __init__(self, model: nn.Module) -> None:
        self.seen: set[tuple[bool, torch.dtype]] = set()
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules()
                        if isinstance(m, (nn.Linear, nn.Conv2d))]

    def _hook(self, module, inp, out) -> None:
        self.seen.add((module.training, out.dtype))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _digits_run(stream: TaskStream, name: str, precision: str, record: bool = False):
    model = build_model("mlp", stream.input_shape, stream.n_outputs, stream.n_heads, hidden=(100, 100),
                        generator=torch.Generator().manual_seed(0))
    method = build_method(name, DIGITS_METHODS[name], seed=0)
    rec = _DtypeRecorder(model) if record else None
    try:
        result = run_stream(model, stream, method, TrainConfig(epochs=2, batch_size=32, precision=precision), seed=0,
                            progress=False)
    finally:
        if rec is not None:
            rec.close()
    return result, model, method, rec


@pytest.mark.parametrize("name", list(DIGITS_METHODS))
def test_bf16_accuracy_is_within_the_band_of_fp32_on_split_digits(digits, name):
    ref, _, _, _ = _digits_run(digits, name, "fp32")
    res, model, method, rec = _digits_run(digits, name, "bf16", record=True)
    assert rec is not None
    # bf16 really ran: the training forward's layers produced bf16 outputs
    assert any(dtype == torch.bfloat16 for _, dtype in rec.seen), rec.seen
    if name != "blr":  # the BLR's closure runs in eval mode (per-example gradients); the others train in train mode
        # eval-mode forwards (evaluation, FROMP's memorable points, curvature) never ran in bf16
        assert (False, torch.bfloat16) not in rec.seen, rec.seen
    # mixed precision, not bf16 training: weights and carried state stay fp32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    post = getattr(method, "optimizer", None)
    if post is not None:
        q = post.posterior()
        assert all(v.dtype == torch.float32 for v in q.mean.values())
    assert abs(res.avg_acc - ref.avg_acc) <= BF16_ACCURACY_BAND, (name, res.avg_acc, ref.avg_acc)
    assert res.avg_acc > 0.8, res.avg_acc  # and both actually learnt the tasks


def _image_stream(n_tasks: int = 2, n: int = 48, size: int = 12, seed: int = 0) -> TaskStream:
    """Two 2-class tasks of 3×size×size images: class c is noise around its own random pattern."""
    g = torch.Generator().manual_seed(seed)
    tasks = []
    for t in range(n_tasks):
        pats = torch.randn(2, 3, size, size, generator=g)
        def draw(m):
            y = torch.arange(m) % 2
            return pats[y] + 0.5 * torch.randn(m, 3, size, size, generator=g), y
        (xtr, ytr), (xte, yte) = draw(n), draw(n // 2)
        tasks.append(Task(t, xtr, ytr, xte, yte, (2 * t, 2 * t + 1), head=t, name=f"images {t}"))
    return TaskStream("tiny_images", tasks, "task", (3, size, size), 2, n_tasks)


@pytest.mark.parametrize("arch, method", [("cifarnet", "none"), ("cifarnet", "blr"), ("reduced_resnet18", "ewc")])
def test_a_conv_net_trains_under_bf16_and_channels_last(arch, method):
    stream = _image_stream(size=12 if arch == "cifarnet" else 8)
    model = build_model(arch, stream.input_shape, stream.n_outputs, stream.n_heads,
                        generator=torch.Generator().manual_seed(0))
    if arch == "cifarnet":
        model.body[0][5].p = model.body[0][11].p = model.body[3].p = 0.0  # dropout off: 4 epochs of 48 images
    seen_inputs: list[bool] = []
    first_conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    def on_input(m, inp):
        if inp[0].shape[0] == train.batch_size:  # a training minibatch (evaluation runs on whole test sets)
            x = inp[0]
            seen_inputs.append(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())

    train = TrainConfig(epochs=4, batch_size=16, lr=1e-3, precision="bf16")
    hook = first_conv.register_forward_pre_hook(on_input)
    rec = _DtypeRecorder(model)
    assert train.use_channels_last
    try:
        method_obj = build_method(method, {}, seed=0)
        res = run_stream(model, stream, method_obj, train, seed=0, progress=False)
    finally:
        hook.remove()
        rec.close()
    assert is_channels_last(model)  # the conv weights were converted once, and stay so through the optimiser
    assert seen_inputs and all(seen_inputs)  # the step converted the fp32 image batches to channels_last
    assert (True, torch.bfloat16) in rec.seen or (False, torch.bfloat16) in rec.seen
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.isfinite(torch.tensor(r)) for r in res.train_loss)
    if method == "blr":  # the split-digits defaults barely move in 12 steps; the step must run, fp32 state
        q = method_obj.optimizer.posterior()
        assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in q.precision.values())
    else:
        # chance is 0.5; the patterns are easy (BatchNorm's running statistics may need the 2nd task's steps)
        assert max(res.acc_matrix[i][i] for i in range(2)) >= 0.75, res.acc_matrix


def test_channels_last_follows_the_flag_not_only_bf16():
    assert not TrainConfig().use_channels_last
    assert TrainConfig(precision="bf16").use_channels_last
    assert not TrainConfig(precision="bf16", channels_last=False).use_channels_last
    assert TrainConfig(channels_last=True).use_channels_last


# ------------------------------------------------------------------------------- fp32 under autocast


def _small_net():
    return build_model("mlp", (6,), 3, 1, hidden=(7,), generator=torch.Generator().manual_seed(1))


def _close_fp32(a, b):
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _close_fp32(a[k], b[k])
        return
    assert a.dtype == torch.float32 and b.dtype == torch.float32, (a.dtype, b.dtype)
    torch.testing.assert_close(a, b, **FP32_UNDER_AUTOCAST)


@pytest.mark.parametrize("kind, structure", [("ggn", "diag"), ("empirical_fisher", "diag"), ("ggn", "kron"),
                                             ("ggn", "full")])
def test_curvature_is_fp32_inside_an_active_bf16_autocast(gen, kind, structure):
    model = _small_net()
    x, y = torch.randn(20, 6, generator=gen), torch.randint(0, 3, (20,), generator=gen)
    ref = curvature(model, x, y, kind=kind, structure=structure)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = curvature(model, x, y, kind=kind, structure=structure)
    if structure == "kron":
        for ra, ga in zip(ref.blocks, got.blocks):
            _close_fp32(ra.A, ga.A)
            _close_fp32(ra.G, ga.G)
        _close_fp32(ref.diag, got.diag)
    else:
        _close_fp32(ref, got)


def _stored_then_moved(model, task, gen, *regs):
    """Each regulariser stores ``task``'s points and kernels; then the weights move, so that Δp ≠ 0."""
    for reg in regs:
        reg.on_task_end(model, task)
        reg.on_task_start(model, task)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return regs


def test_fromp_kernel_and_penalty_are_fp32_inside_an_active_bf16_autocast(gen):
    model = _small_net()
    x, y = torch.randn(12, 6, generator=gen), torch.randint(0, 3, (12,), generator=gen)
    sigma = {k: torch.rand(p.shape, generator=gen) for k, p in model.named_parameters()}
    probs = lambda f: f.softmax(-1)  # noqa: E731
    ref = kernel(model, x, sigma, output_fn=probs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = kernel(model, x, sigma, output_fn=probs)
    _close_fp32(ref, got)

    task = Task(0, x, y, x, y, (0, 1, 2), name="t0")
    (reg,) = _stored_then_moved(model, task, gen, FunctionalRegularizer(n_points=6))
    batch = loop.Batch(x[:4], y[:4], 0)
    ref_pen = reg.penalty(model, batch, task)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_pen = reg.penalty(model, batch, task)
    _close_fp32(ref_pen, got_pen)


@pytest.fixture
def tf32_on(monkeypatch):
    """TF32 switched on for cuDNN convolutions (PyTorch's default) and CUDA matrix products, as on an Ampere GPU,
    and CUDA reported initialised (only then does :func:`full_precision` look at TF32); every switch is put back
    after the test."""
    from continual_blr.mixed_precision import _tf32_switches

    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in _tf32_switches()]
    for obj, name, ieee in _tf32_switches():
        setattr(obj, name, "tf32" if isinstance(ieee, str) else True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    yield
    for obj, name, old in reversed(saved):
        setattr(obj, name, old)


def _tf32_state() -> list[bool]:
    from continual_blr.mixed_precision import _is_tf32, _tf32_switches

    return [_is_tf32(*switch) for switch in _tf32_switches()]


def test_full_precision_switches_tf32_off_inside_and_restores_it(tf32_on):
    """On an Ampere-or-later GPU fp32 convolutions run in TF32 by default (u = 2⁻¹¹); FROMP's kernels, the
    curvature and the posteriors must not (docs in :mod:`continual_blr.mixed_precision`)."""
    from continual_blr.mixed_precision import full_precision, tf32_enabled

    seen = []

    @full_precision
    def fn(fail: bool) -> None:
        seen.append(_tf32_state())
        if fail:
            raise ValueError("inside")

    assert _tf32_state() == [True, True] and tf32_enabled()
    fn(False)
    assert seen[-1] == [False, False]
    assert _tf32_state() == [True, True]  # the caller's setting is back
    with pytest.raises(ValueError, match="inside"):
        fn(True)
    assert seen[-1] == [False, False] and _tf32_state() == [True, True]
    # the library's FROMP rebuild and penalty go through it
    model = _small_net()
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(12, 6, generator=gen), torch.randint(0, 3, (12,), generator=gen)
    task = Task(0, x, y, x, y, (0, 1, 2), name="t0")
    reg = FunctionalRegularizer(n_points=6)
    reg.on_task_end(model, task)
    import continual_blr.regularizers.functional as functional

    inner, states = functional.forward, []

    def spy(*a, **k):  # the network forward inside the rebuild and the penalty
        states.append(_tf32_state())
        return inner(*a, **k)

    functional.forward = spy
    try:
        reg.on_task_start(model, task)
        reg.penalty(model, loop.Batch(x[:4], y[:4], 0), task)
    finally:
        functional.forward = inner
    assert len(states) >= 2 and all(st == [False, False] for st in states)
    assert _tf32_state() == [True, True]


def test_a_global_tf32_setting_is_switched_off_too():
    """``torch.backends.fp32_precision = "tf32"`` (the global switch, per-operation switches at ``"none"``) is TF32
    for convolutions and matrix products, and :func:`ieee_fp32` overrides it for the block only."""
    from continual_blr.mixed_precision import _tf32_switches, ieee_fp32, tf32_enabled

    switches = _tf32_switches()
    if not isinstance(switches[0][2], str):
        pytest.skip("this torch has only the legacy allow_tf32 flags")
    parents = (torch.backends.cudnn, torch.backends)
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in switches]
    saved += [(p, "fp32_precision", p.fp32_precision) for p in parents]
    try:
        for obj in (*parents[::-1], *(s[0] for s in switches)):
            obj.fp32_precision = "none"
        torch.backends.fp32_precision = "ieee"
        assert not tf32_enabled()
        torch.backends.fp32_precision = "tf32"
        assert tf32_enabled()
        with ieee_fp32():
            assert not tf32_enabled()
        assert tf32_enabled()
    finally:
        for obj, name, old in reversed(saved):
            setattr(obj, name, old)


def test_posteriors_are_fp32_inside_an_active_bf16_autocast(gen):
    model = _small_net()
    mean = {k: p.detach().clone() for k, p in model.named_parameters()}
    c = curvature(model, torch.randn(10, 6, generator=gen), kind="ggn", structure="kron")
    posts = [DiagPosterior(mean, 2.0), FullPosterior(mean, 2.0), KronPosterior.from_curvature(mean, c, 0.5)]
    theta = {k: v + 0.1 for k, v in mean.items()}
    for post in posts:
        ref = (post.log_prob(theta), post.sample(torch.Generator().manual_seed(3)), post.covariance_diag())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = (post.log_prob(theta), post.sample(torch.Generator().manual_seed(3)), post.covariance_diag())
        for r, g in zip(ref, got):
            _close_fp32(r, g)


# ------------------------------------------------------------------------------------------ resume

RESUME_CONFIG = """\
stream: {name: synthetic, options: {n_tasks: 3, n_train: 40}}
model: {hidden: [8]}
train: {epochs: 2, batch_size: 10, precision: bf16}
seed: 3
progress: false
methods:
  - {name: blr, params: {mc_samples: 1}}
  - {name: fromp, params: {n_points: 6}}
"""


def _matrices(run):
    payload = json.loads((run / "results.json").read_text())
    return {r["method"]: r["acc_matrix"] for r in payload["results"]}, payload["config"]["train"]


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _same_state(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b)):
            _same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), where


def test_an_interrupted_bf16_run_resumes_to_the_uninterrupted_one(tmp_path, monkeypatch):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(RESUME_CONFIG)
    ref, out, fp32 = tmp_path / "ref", tmp_path / "run", tmp_path / "fp32"
    assert main(["run", str(cfg), "--out", str(ref)]) == 0
    assert main(["run", str(cfg), "--out", str(fp32), "--precision", "fp32"]) == 0
    original, count = loop.train_step, {"n": 0}

    def interrupting(*args, **kwargs):
        count["n"] += 1
        if count["n"] == 8 + 3:  # mid-task: step 3 of blr's 2nd task
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(loop, "train_step", interrupting)
        assert main(["run", str(cfg), "--out", str(out)]) == 130
    assert main(["run", "--resume", str(out)]) == 0
    (ref_acc, ref_train), (out_acc, out_train) = _matrices(ref), _matrices(out)
    assert ref_train["precision"] == out_train["precision"] == "bf16"
    assert ref_acc == out_acc
    for m in ("blr", "fromp"):
        for f in ("model.pt", "method.pt"):
            _same_state(_load(ref / m / f), _load(out / m / f), f"{m}/{f}")
    # the precision matters to the result, so the resumed run's equality shows it continued in bf16
    fp32_model = _load(fp32 / "blr" / "model.pt")
    assert _matrices(fp32)[1]["precision"] == "fp32"
    assert any(not torch.equal(v, fp32_model[k]) for k, v in _load(ref / "blr" / "model.pt").items())


# ------------------------------------------------------------------------------------------ errors


def test_a_bad_precision_is_a_one_line_error_naming_the_field(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"^train\.precision: got 'fp16'; allowed: 'fp32', 'bf16'$"):
        TrainConfig(precision="fp16")
    with pytest.raises(ValueError, match=r"^train\.channels_last: got 'yes'; allowed: true, false, null$"):
        TrainConfig(channels_last="yes")  # type: ignore[arg-type]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("stream: {name: synthetic, options: {n_tasks: 2, n_train: 20}}\ntrain: {precision: fp16}\n"
                   "methods: [none]\n")
    assert main(["run", str(cfg), "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.precision: got 'fp16'; allowed: 'fp32', 'bf16'" in err, err
    cfg.write_text("stream: {name: synthetic, options: {n_tasks: 2, n_train: 20}}\nmethods: [none]\n")
    assert main(["run", str(cfg), "--out", str(tmp_path / "b"), "--precision", "half"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--precision: got 'half'; allowed: 'fp32', 'bf16'" in err, err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_fromp_forward_precision_train_runs_the_points_forward_in_bf16_and_the_rest_in_fp32(gen):
    """``forward_precision="train"``: outside autocast the penalty is the fp32 one bit for bit; inside bf16 autocast
    the network's outputs at the memorable points are those of the bf16 forward (oracle: the same forward under
    autocast, then the fp32 formula by hand), and the penalty and its gradient stay fp32. Planted: the option
    ignored (the penalty's forward in fp32) and the outputs left in bf16 (softmax and Δp in bf16) both fail."""
    model = _small_net()
    x, y = torch.randn(12, 6, generator=gen), torch.randint(0, 3, (12,), generator=gen)
    task = Task(0, x, y, x, y, (0, 1, 2), name="t0")
    regs = {p: FunctionalRegularizer(n_points=6, forward_precision=p) for p in ("fp32", "train")}
    _stored_then_moved(model, task, gen, *regs.values())
    batch = loop.Batch(x[:4], y[:4], 0)
    assert torch.equal(regs["train"].penalty(model, batch, task), regs["fp32"].penalty(model, batch, task))

    reg = regs["train"]
    entry = next(iter(reg.memory))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        f = model(entry.x)
    assert f.dtype == torch.bfloat16
    d = (f.float().softmax(-1) - entry.extras["p_old"]).T.unsqueeze(-1)  # [C, M, 1]
    z = torch.linalg.solve_triangular(entry.extras["chol"], d, upper=False)
    oracle = 0.5 * reg.tau * (z * z).sum()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = reg.penalty(model, batch, task)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, oracle, rtol=1e-5, atol=1e-7)
    fp32 = regs["fp32"].penalty(model, batch, task)
    assert not torch.equal(got, fp32)  # the bf16 forward moved it, by bf16's rounding, not more:
    torch.testing.assert_close(got, fp32, rtol=5e-2, atol=0)
    got.backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_fromp_forward_precision_is_checked():
    with pytest.raises(ValueError, match="forward_precision: got 'bf16'; allowed: 'fp32', 'train'"):
        FunctionalRegularizer(forward_precision="bf16")
    from continual_blr.methods import build_method
    with pytest.raises(ValueError, match="params.forward_precision: got 'x'"):
        build_method("fromp", {"forward_precision": "x"})
