"""The GPU path: curvature estimates, kernels, a FROMP step and a BLR step on CUDA equal the CPU results.

Every comparison runs the same float64 computation twice — once on the CPU, once on ``device`` — and
compares the results moved back to the CPU with the exact tier (rtol 1e-8, atol 1e-10: float64 on both
sides; only the order of floating-point reductions differs between the devices). The ``_on_cuda`` tests
are skipped without a CUDA device; the ``_on_cpu`` twin runs each comparison with ``device="cpu"`` so that
the comparison code itself (device moves, generators, closures) is exercised on every machine.

Small networks keep the tests fast: an MLP and a small CifarNet-like conv net with dropout and max-pool
(dropout is off wherever the engine runs, eval mode).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import EXACT
from continual_blr.curvature import curvature, kernel
from continual_blr.data.stream import Task
from continual_blr.models import MultiHeadNet, build_model
from continual_blr.optim import BayesianLearningRule
from continual_blr.optim.blr import BatchClosure
from continual_blr.posteriors import DiagPosterior
from continual_blr.regularizers.functional import FunctionalRegularizer
from continual_blr.types import Batch, KronCurvature, flatten, params_of

DT = torch.float64
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _conv_net(seed: int) -> nn.Module:
    """Conv(3→4) ReLU Conv(4→4) ReLU MaxPool Dropout Flatten Linear(64→8) ReLU Dropout, two heads of 3."""
    body = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Dropout(0.25), nn.Flatten(), nn.Linear(4 * 4 * 4, 8), nn.ReLU(), nn.Dropout(0.5),
    )
    net = MultiHeadNet(body, 8, 3, n_heads=2)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(0.4 * torch.randn(p.shape, generator=g))
    return net.to(DT)


def _mlp(seed: int) -> nn.Module:
    return build_model("mlp", (6,), 3, 2, hidden=(7,), generator=torch.Generator().manual_seed(seed)).to(DT)


CASES = {
    "mlp": (_mlp, (6,)),
    "conv": (_conv_net, (3, 8, 8)),
}


def _data(shape: tuple[int, ...], n: int = 10, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *shape), generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)


def _cpu(c: object) -> object:
    if isinstance(c, KronCurvature):
        return torch.cat([torch.cat([b.A.reshape(-1), b.G.reshape(-1)]) for b in c.blocks]
                         + [t.reshape(-1) for t in c.diag.values()]).cpu()
    if isinstance(c, dict):
        return flatten(c).cpu()
    return c.cpu()


def _device_of(c: object) -> torch.device:
    if isinstance(c, KronCurvature):
        return c.blocks[0].A.device
    if isinstance(c, dict):
        return next(iter(c.values())).device
    return c.device


# ------------------------------------------------------------------------------------- comparisons


def check_curvature(device: str, case: str) -> None:
    """diag / kron / full of the GGN, the empirical Fisher and the MC Fisher (same seeded generator)."""
    build, shape = CASES[case]
    model = build(0)
    x, y = _data(shape)
    model_d = copy.deepcopy(model).to(device)
    for kind in ("ggn", "empirical_fisher", "mc_fisher"):
        for structure in ("diag", "kron", "full"):
            kw = dict(kind=kind, structure=structure, head=1)
            if kind == "mc_fisher":
                cpu = curvature(model, x, y, generator=torch.Generator().manual_seed(5), mc_samples=2, **kw)
                dev = curvature(model_d, x.to(device), y.to(device), generator=torch.Generator().manual_seed(5),
                                mc_samples=2, **kw)
            else:
                cpu = curvature(model, x, y, **kw)
                dev = curvature(model_d, x.to(device), y.to(device), **kw)
            assert _device_of(dev).type == torch.device(device).type, (kind, structure)
            torch.testing.assert_close(_cpu(dev), _cpu(cpu), **EXACT, msg=f"{kind} {structure}")


def check_kernels(device: str, case: str) -> None:
    """FROMP's classwise kernel of the softmax and the full kernel of the logits, diagonal Σ."""
    build, shape = CASES[case]
    model = build(0)
    x, _ = _data(shape, n=6)
    g = torch.Generator().manual_seed(3)
    sig = {n: torch.rand(p.shape, generator=g, dtype=DT) for n, p in params_of(model).items()}
    model_d = copy.deepcopy(model).to(device)
    sig_d = {n: s.to(device) for n, s in sig.items()}
    for output_fn, blockwise in ((lambda f: f.softmax(-1), True), (None, False)):
        cpu = kernel(model, x, sig, head=0, output_fn=output_fn, blockwise=blockwise)
        dev = kernel(model_d, x.to(device), sig_d, head=0, output_fn=output_fn, blockwise=blockwise)
        assert dev.device.type == torch.device(device).type
        torch.testing.assert_close(dev.cpu(), cpu, **EXACT)


def _tasks(shape: tuple[int, ...]) -> list[Task]:
    out = []
    for t in range(2):
        x, y = _data(shape, n=12, seed=10 + t)
        xt, yt = _data(shape, n=4, seed=20 + t)
        out.append(Task(t, x, y, xt, yt, (0, 1, 2), t, f"task {t}"))
    return out


def _fromp_step(model: nn.Module, tasks: list[Task], device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Task 0's end, task 1's start, then one Adam step on CE + FROMP penalty (the minibatch in eval mode so
    that dropout draws no random masks and both devices compute the same function).
    Returns (penalty, gradient, parameters after the step)."""
    model = model.to(device)
    tasks = [t.to(device) for t in tasks]
    reg = FunctionalRegularizer(tau=5.0, n_points=4, prior_precision=0.1, jitter=1e-6)
    reg.on_task_end(model, tasks[0])
    reg.on_task_start(model, tasks[1])
    with torch.no_grad():  # move away from the rebuild point (a training step would) so that Δp ≠ 0
        for p in model.parameters():
            p.mul_(1.05)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = Batch(tasks[1].x_train[:5], tasks[1].y_train[:5], tasks[1].head)
    model.eval()
    model.zero_grad()
    pen = reg.penalty(model, batch, tasks[1])
    loss = nn.functional.cross_entropy(model(batch.x, head=batch.head), batch.y) + pen
    loss.backward()
    grad = flatten({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    opt.step()
    return pen.detach().cpu(), grad.detach().cpu(), flatten(params_of(model)).cpu()


def check_fromp_step(device: str, case: str) -> None:
    build, shape = CASES[case]
    tasks = _tasks(shape)
    cpu = _fromp_step(build(0), tasks, "cpu")
    dev = _fromp_step(build(0), tasks, device)
    assert cpu[0].item() > 0
    for a, b in zip(dev, cpu):
        torch.testing.assert_close(a, b, **EXACT)


def _blr_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Two BLR steps (VOGN-style, momentum 0.9) with the engine's GGN ĥ at the mean (mc_samples 0: weight noise from a CPU and a CUDA
    generator would differ, so the delta method is what both devices can compute identically)."""
    model = model.to(device).eval()  # dropout off: the same function on both devices
    params = params_of(model)
    prior = DiagPosterior({n: torch.zeros_like(p) for n, p in params.items()}, 2.0)
    opt = BayesianLearningRule(model, prior, n_data=100, lr=0.05, rho=0.1, beta1=0.9, mc_samples=0, curvature="ggn")
    closure = BatchClosure(model, x.to(device), y.to(device), head=1)
    for _ in range(2):
        opt.step(closure)
    post = opt.posterior()
    mean, prec = post.to_dense()  # (flat mean, dense precision)
    return flatten(params_of(model)).cpu(), prec.cpu()


def check_blr_step(device: str, case: str) -> None:
    build, shape = CASES[case]
    x, y = _data(shape)
    m_cpu, s_cpu = _blr_step(build(0), x, y, "cpu")
    m_dev, s_dev = _blr_step(build(0), x, y, device)
    torch.testing.assert_close(m_dev, m_cpu, **EXACT)
    torch.testing.assert_close(s_dev, s_cpu, **EXACT)


CHECKS = {"curvature": check_curvature, "kernels": check_kernels, "fromp_step": check_fromp_step,
          "blr_step": check_blr_step}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_comparison_runs_on_cpu(check, case):
    CHECKS[check]("cpu", case)


@CUDA
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_cuda_agrees_with_cpu(check, case):
    CHECKS[check]("cuda", case)


def _wide_conv_net(seed: int) -> nn.Module:
    """A conv net wide enough (64 channels, 3×3 over 16×16) that TF32's operand rounding shows in its outputs."""
    body = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten())
    net = MultiHeadNet(body, 256, 2, n_heads=1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return net


@CUDA
def test_fp32_kernels_on_cuda_are_not_computed_in_tf32():
    """PyTorch runs fp32 convolutions in TF32 on Ampere-or-later GPUs by default (unit roundoff 2⁻¹¹ ≈ 4.9e-4);
    the kernel engine is :func:`full_precision`, so its fp32 kernel on CUDA must agree with the float64 one to
    fp32 accuracy (relative Frobenius error ≤ 1e-5), with the default TF32 setting left on outside it. The control:
    the same network's plain fp32 forward on CUDA under that setting is off by more than 1e-5 where the GPU has
    TF32 (compute capability ≥ 8), so the tolerance separates the two."""
    from continual_blr.mixed_precision import tf32_enabled

    model64 = _wide_conv_net(0).to(DT)
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1), dtype=DT)
    sig = {n: torch.full_like(p, 0.5) for n, p in params_of(model64).items()}
    ref = kernel(model64, x, sig, head=0, output_fn=lambda f: f.softmax(-1), blockwise=True)
    model32 = _wide_conv_net(0).float().cuda()
    sig32 = {n: s.float().cuda() for n, s in sig.items()}
    conv = getattr(torch.backends.cudnn, "conv", None)
    legacy = conv is None or not hasattr(conv, "fp32_precision")
    old = torch.backends.cudnn.allow_tf32 if legacy else conv.fp32_precision
    try:
        if legacy:
            torch.backends.cudnn.allow_tf32 = True
        else:
            conv.fp32_precision = "tf32"
        assert tf32_enabled()
        got = kernel(model32, x.float().cuda(), sig32, head=0, output_fn=lambda f: f.softmax(-1), blockwise=True)
        err = float((got.double().cpu() - ref).norm() / ref.norm())
        assert err <= 1e-5, f"kernel relative error {err:.2e}: computed in TF32?"
        if torch.cuda.get_device_capability()[0] >= 8:
            with torch.no_grad():
                f32 = model32(x.float().cuda(), 0).double().cpu()
                f64 = model64(x, 0)
            control = float((f32 - f64).norm() / f64.norm())
            assert control > 1e-5, f"plain TF32 forward error {control:.2e}: TF32 not in effect, test cannot fail"
    finally:
        if legacy:
            torch.backends.cudnn.allow_tf32 = old
        else:
            conv.fp32_precision = old
