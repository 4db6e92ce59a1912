"""Curvature engine against brute-force float64 references (tests/oracles.py).

Models: a tiny two-head MLP (called with head=1, so head 0's parameters must get zero curvature), a
tiny CNN with BatchNorm (eval, non-trivial running statistics) that takes no ``head`` argument, and a
tiny CNN with dropout. Tolerance tiers are named below; every comparison is relative to the
reference's scale.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import oracles as O
from continual_blr.curvature import (
    curvature,
    kernel,
    kernel_vector_product,
    per_example_grads,
    per_example_jacobians,
)
from continual_blr.models import MLP
from continual_blr.types import Curvature, KronBlock, KronCurvature, Structure, flatten, params_of

EXACT = dict(rtol=1e-6, atol=1e-10)  # float64 engine vs float64 brute force
FLOAT32 = dict(rtol=1e-4, atol=1e-6)  # float32 vs float64 of the same model
MC = dict(rtol=0.1, atol=0.02)  # Monte-Carlo estimate vs its expectation (relative to max |entry|)

SOFTMAX = staticmethod(lambda f: f.softmax(-1))


def close(actual, expected, tol=EXACT):
    """assert_close with atol scaled by the reference's magnitude (so tiny entries do not pass vacuously)."""
    expected = expected.to(actual.dtype) if isinstance(expected, torch.Tensor) else expected
    scale = max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(actual, expected, rtol=tol["rtol"], atol=tol["atol"] * scale)


class TinyCNN(nn.Module):
    """Conv → BatchNorm → ReLU → Conv(stride 2) → ReLU → Linear; plain forward(x) (no head argument)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(),
            nn.Conv2d(3, 4, 3, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(16, 3),
        )

    def forward(self, x):
        return self.net(x)


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Dropout(0.5), nn.Linear(6, 3))

    def forward(self, x, head: int = 0):
        return self.body(x)


def make_mlp():
    torch.manual_seed(0)
    return MLP(5, (4, 3), 3, n_heads=2).double()


def make_cnn():
    torch.manual_seed(1)
    m = TinyCNN().double()
    bn = m.net[1]
    with torch.no_grad():
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return m.eval()


CASES = {
    # name: (model factory, inputs, head passed to the engine, head passed to the oracle)
    "mlp": (make_mlp, lambda g: torch.randn(6, 5, generator=g, dtype=torch.float64), 1, 1),
    "cnn": (make_cnn, lambda g: torch.randn(5, 2, 6, 6, generator=g, dtype=torch.float64), 0, None),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    make, data, head, ohead = CASES[request.param]
    g = torch.Generator().manual_seed(2)
    x = data(g)
    model = make()
    y = torch.randint(0, 3, (x.shape[0],), generator=g)
    ref = {}  # cache of dense oracles for this case
    return dict(name=request.param, model=model, x=x, y=y, head=head, ohead=ohead, ref=ref)


def oracle(case, key, fn):
    if key not in case["ref"]:
        case["ref"][key] = fn()
    return case["ref"][key]


def ggn_ref(case):
    return oracle(case, "ggn", lambda: O.ggn(case["model"], case["x"], head=case["ohead"]))


def ef_ref(case):
    return oracle(case, "ef", lambda: O.empirical_fisher(case["model"], case["x"], case["y"], head=case["ohead"]))


def sampled_labels(model, x, head, seed, samples):
    """The MC Fisher's documented sampling rule: u ~ U[0,1) from the generator (float64, [N, S]) and
    ŷ = min{k : cdf_k > u} of softmax(f)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(x.shape[0], samples, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        f = model(x) if head is None else model(x, head=head)
    cdf = f.softmax(-1).cumsum(-1)
    return torch.searchsorted(cdf, u.to(f.dtype), right=True).clamp(max=f.shape[1] - 1)


def mc_ref(case, seed=7, samples=3):
    labels = sampled_labels(case["model"], case["x"], case["ohead"], seed, samples)
    return oracle(case, f"mc{seed}{samples}", lambda: O.mc_fisher(case["model"], case["x"], labels, head=case["ohead"]))


def dense_ref(case, kind):
    return {"ggn": ggn_ref, "empirical_fisher": ef_ref, "mc_fisher": mc_ref}[kind](case)


def run(case, kind, structure, **kw):
    kw.setdefault("generator", torch.Generator().manual_seed(7))
    kw.setdefault("mc_samples", 3)
    return curvature(case["model"], case["x"], case["y"], kind=kind, structure=structure, head=case["head"], **kw)


# ------------------------------------------------------------------------------------------- Jacobians


def test_jacobians_match_brute_force(case):
    model, x = case["model"], case["x"]
    jac = per_example_jacobians(model, x, head=case["head"])
    params = params_of(model)
    assert list(jac) == list(params)
    for n, t in jac.items():
        assert t.shape == (x.shape[0], 3) + params[n].shape
    flat = torch.cat([t.reshape(x.shape[0], 3, -1) for t in jac.values()], -1)
    close(flat, oracle(case, "jac", lambda: O.jacobians(model, x, head=case["ohead"])))


def test_jacobians_output_fn_and_subset(case):
    model, x = case["model"], case["x"]
    names = [n for n in params_of(model)][-2:]  # last layer (weight, bias)
    if case["name"] == "cnn":
        names += ["net.1.weight"]  # a BatchNorm scale as well
    jac = per_example_jacobians(model, x, head=case["head"], param_names=names, output_fn=lambda f: f.softmax(-1),
                                chunk_size=2)
    assert set(jac) == set(names)
    flat = torch.cat([t.reshape(x.shape[0], 3, -1) for t in jac.values()], -1)
    ref = O.jacobians(model, x, head=case["ohead"], param_names=names, output_fn=lambda f: f.softmax(-1))
    close(flat, ref)


def test_per_example_grads_match_brute_force(case):
    model, x, y = case["model"], case["x"], case["y"]
    loss_fn = lambda f, t: nn.functional.cross_entropy(f, t, reduction="none")  # noqa: E731
    losses, grads = per_example_grads(model, loss_fn, x, y, head=case["head"], chunk_size=4)
    ref_l, ref_g = O.per_example_grads(model, x, y, head=case["ohead"])
    close(losses, ref_l)
    close(torch.cat([t.reshape(x.shape[0], -1) for t in grads.values()], 1), ref_g)


def test_per_example_grads_reject_mean_loss():
    model = make_mlp()
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    with pytest.raises(ValueError, match="per-example"):
        per_example_grads(model, lambda f, t: nn.functional.cross_entropy(f, t), x, y)


# --------------------------------------------------------------------------------------- curvatures


@pytest.mark.parametrize("kind", ["ggn", "empirical_fisher", "mc_fisher"])
def test_full_and_diag_match_brute_force(case, kind):
    ref = dense_ref(case, kind)
    full = run(case, kind, "full")
    close(full, ref)
    diag = run(case, kind, "diag")
    assert list(diag) == list(params_of(case["model"]))
    close(flatten(diag), torch.diagonal(ref))


def test_ggn_reference_is_not_trivial(case):
    """Guards against vacuous passes: the GGN is positive semidefinite, non-zero, and differs from the EF."""
    ref = ggn_ref(case)
    assert ref.abs().max() > 1e-2
    assert torch.linalg.eigvalsh(ref).min() > -1e-10
    assert (ref - ef_ref(case)).abs().max() > 1e-3


def test_unused_head_gets_zero_curvature():
    case = dict(model=make_mlp(), x=torch.randn(4, 5, dtype=torch.float64), y=None, head=1)
    diag = run(case, "ggn", "diag")
    assert diag["heads.0.weight"].abs().max() == 0 and diag["heads.1.weight"].abs().max() > 0
    diag0 = curvature(case["model"], case["x"], head=0)
    assert diag0["heads.1.weight"].abs().max() == 0 and diag0["heads.0.weight"].abs().max() > 0


@pytest.mark.parametrize("kind", ["ggn", "empirical_fisher"])
def test_kfac_factors_match_definitions(case, kind):
    model, x, y = case["model"], case["x"], case["y"]
    kc = run(case, kind, "kron")
    assert isinstance(kc, KronCurvature)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
    names = {blk.weight for blk in kc.blocks}
    expected = {f"{n}.weight" for n in layers if case["name"] == "cnn" or n.startswith("body") or n == "heads.1"}
    assert expected <= names
    mode = "ggn" if kind == "ggn" else "grad"
    for blk in kc.blocks:
        layer = layers[blk.weight[: -len(".weight")]]
        if blk.weight.startswith("heads.0"):  # not reached with head=1
            assert blk.G.abs().max() == 0
            continue
        a_ref, g_ref = O.kfac_factors(model, layer, x, y=y, head=case["ohead"], mode=mode)
        close(blk.A, a_ref)
        close(blk.G, g_ref)
    # everything outside the blocks (BatchNorm) carries its exact diagonal
    ref_diag = torch.diagonal(dense_ref(case, kind))
    params = params_of(model)
    offs = {}
    start = 0
    for n, t in params.items():
        offs[n] = (start, start + t.numel())
        start += t.numel()
    for n, d in kc.diag.items():
        close(d.reshape(-1), ref_diag[offs[n][0]:offs[n][1]])
    if case["name"] == "cnn":
        assert set(kc.diag) == {"net.1.weight", "net.1.bias"}


def test_kfac_single_linear_one_example_is_exact_ggn():
    torch.manual_seed(3)
    lin = nn.Linear(4, 3).double()
    x = torch.randn(1, 4, dtype=torch.float64)
    kc = curvature(lin, x, structure="kron")
    assert len(kc.blocks) == 1 and kc.blocks[0].bias == "bias"
    ggn = O.ggn(lin, x)
    close(O.kron_to_dense(kc, params_of(lin)), ggn)
    # regression likelihood: G = I/σ², still exact
    kc = curvature(lin, x, structure="kron", likelihood="regression", sigma=0.5)
    close(O.kron_to_dense(kc, params_of(lin)), O.ggn(lin, x, likelihood="regression", sigma=0.5))
    close(kc.blocks[0].G, torch.eye(3, dtype=torch.float64) / 0.25)


def test_kfac_is_an_approximation_for_several_examples():
    torch.manual_seed(3)
    lin = nn.Linear(4, 3).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    kc = curvature(lin, x, structure="kron")
    dense = O.kron_to_dense(kc, params_of(lin))
    ggn = O.ggn(lin, x)
    assert (dense - ggn).abs().max() > 1e-3  # not exact ...
    a_ref, g_ref = O.kfac_factors(lin, lin, x)  # ... but A and G are exactly their definitions
    close(kc.blocks[0].A, a_ref)
    close(kc.blocks[0].G, g_ref)
    # A is a mean over examples, G a sum: the trace of A⊗G matches the GGN's order of magnitude
    ratio = float(torch.trace(dense) / torch.trace(ggn))
    assert 0.2 < ratio < 5


def test_hessian_full_and_diag():
    model = make_mlp()
    x, y = torch.randn(5, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 1, 0])
    ref = O.hessian(model, x, y, head=1)
    close(curvature(model, x, y, kind="hessian", structure="full", head=1, chunk_size=2), ref)
    close(flatten(curvature(model, x, y, kind="hessian", structure="diag", head=1)), torch.diagonal(ref))
    with pytest.raises(ValueError, match="kron"):
        curvature(model, x, y, kind="hessian", structure="kron")


def test_regression_likelihood():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    x = torch.randn(6, 3, dtype=torch.float64)
    y = torch.randn(6, 2, dtype=torch.float64)
    sig = 0.5
    kw = dict(likelihood="regression", sigma=sig, head=None)
    close(curvature(model, x, structure="full", **kw), O.ggn(model, x, likelihood="regression", sigma=sig))
    close(curvature(model, x, y, kind="empirical_fisher", structure="full", **kw),
          O.empirical_fisher(model, x, y, likelihood="regression", sigma=sig))
    # MC: ŷ = f + σ ε with ε ~ N(0, I) drawn as float64 [N, S, K] from the generator
    gen = torch.Generator().manual_seed(5)
    eps = torch.randn(6, 2, 2, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        f = model(x)
    targets = f.unsqueeze(1) + sig * eps
    ref = sum(O.empirical_fisher(model, x, targets[:, s], likelihood="regression", sigma=sig) for s in range(2)) / 2
    got = curvature(model, x, kind="mc_fisher", structure="full", generator=torch.Generator().manual_seed(5),
                    mc_samples=2, **kw)
    close(got, ref)


def test_mc_fisher_converges_to_ggn():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(8, 3, dtype=torch.float64)
    ggn = O.ggn(model, x)
    mc = curvature(model, x, kind="mc_fisher", structure="full", head=None, mc_samples=4000,
                   generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(mc, ggn, rtol=MC["rtol"], atol=MC["atol"] * float(ggn.abs().max()))


def test_mc_fisher_reproducible_and_needs_generator(case):
    a = run(case, "mc_fisher", "diag", generator=torch.Generator().manual_seed(11))
    b = run(case, "mc_fisher", "diag", generator=torch.Generator().manual_seed(11))
    c = run(case, "mc_fisher", "diag", generator=torch.Generator().manual_seed(12))
    close(flatten(a), flatten(b), dict(rtol=0, atol=0))
    assert not torch.equal(flatten(a), flatten(c))
    with pytest.raises(ValueError, match="generator"):
        curvature(case["model"], case["x"], kind="mc_fisher", head=case["head"])


# ------------------------------------------------------------------------------ chunking, data, dtype


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
@pytest.mark.parametrize("kind", ["ggn", "mc_fisher"])
def test_chunked_equals_unchunked_and_batches_equal_tensor(case, structure, kind):
    whole = run(case, kind, structure, chunk_size=None)
    chunked = run(case, kind, structure, chunk_size=2)
    ones = run(case, kind, structure, batch_size=1)

    def as_tensor(r):
        if structure == "diag":
            return flatten(r)
        if structure == "kron":
            return torch.cat([torch.cat([b.A.reshape(-1), b.G.reshape(-1)]) for b in r.blocks]
                             + [t.reshape(-1) for t in r.diag.values()])
        return r

    close(as_tensor(chunked), as_tensor(whole))
    close(as_tensor(ones), as_tensor(whole))
    if kind == "ggn":  # an iterable of (x, y) batches gives the same sum (MC draws noise per batch)
        batches = [(case["x"][:3], case["y"][:3]), (case["x"][3:], case["y"][3:])]
        it = curvature(case["model"], batches, kind=kind, structure=structure, head=case["head"], chunk_size=2)
        close(as_tensor(it), as_tensor(whole))


def test_float32_model_agrees_with_float64(case):
    m64 = case["model"]
    m32 = copy.deepcopy(m64).float()
    x = case["x"]
    for kind in ["ggn", "empirical_fisher"]:
        d64 = curvature(m64, x, case["y"], kind=kind, head=case["head"])
        d32 = curvature(m32, x.float(), case["y"], kind=kind, head=case["head"])
        assert next(iter(d32.values())).dtype == torch.float32
        close(flatten(d32).double(), flatten(d64), FLOAT32)
    # float64 inputs are cast to the model's dtype
    d = curvature(m32, x, head=case["head"])
    assert flatten(d).dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_agrees_with_cpu(case):
    mc = copy.deepcopy(case["model"]).cuda()
    x = case["x"]
    for structure in ["diag", "full"]:
        cpu = run(case, "mc_fisher", structure)
        gpu = curvature(mc, x, kind="mc_fisher", structure=structure, head=case["head"],
                        generator=torch.Generator().manual_seed(7), mc_samples=3)
        got = flatten(gpu) if structure == "diag" else gpu
        assert got.device.type == "cuda"
        close(got.cpu(), flatten(cpu) if structure == "diag" else cpu)
    sig = {n: torch.rand_like(p) for n, p in params_of(mc).items()}
    k = kernel(mc, x, sig, head=case["head"])
    assert k.device.type == "cuda"
    close(k.cpu(), kernel(case["model"], x, {n: s.cpu() for n, s in sig.items()}, head=case["head"]))


# --------------------------------------------------------------------------------------- eval mode


def test_dropout_off_and_training_flags_restored():
    torch.manual_seed(6)
    model = DropoutNet().double().train()
    model.body[1].train(False)  # a mixed state must come back exactly
    flags = [m.training for m in model.modules()]
    x = torch.randn(5, 4, dtype=torch.float64)
    full = curvature(model, x, structure="full")
    assert [m.training for m in model.modules()] == flags
    model.eval()
    ref = O.ggn(model, x, head=0)
    model.train()
    model.body[1].train(False)
    close(full, ref)
    with pytest.raises(ValueError):  # the flags are restored when the body raises, too
        curvature(model, x, kind="empirical_fisher")  # no labels
    assert [m.training for m in model.modules()] == flags


def test_batchnorm_without_running_stats_is_rejected():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=False), nn.Linear(4, 2)).double()
    with pytest.raises(ValueError, match="running"):
        curvature(model, torch.randn(4, 3, dtype=torch.float64), head=None)


def test_weight_shared_layer_falls_back_to_generic_path():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.out = nn.Linear(3, 2)

        def forward(self, x):
            return self.out(torch.tanh(self.a(torch.tanh(self.a(x)))))  # self.a used twice

    torch.manual_seed(8)
    model = Tied().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    close(curvature(model, x, structure="full", head=None), O.ggn(model, x))
    model.train()
    with pytest.raises(NotImplementedError, match="more than once"):  # raised by the reducer, not the engine
        curvature(model, x, structure="kron", head=None)
    assert all(m.training for m in model.modules())  # eval mode undone at once, not at garbage collection


def test_argument_errors():
    model = make_mlp()
    x = torch.randn(3, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="kind"):
        curvature(model, x, kind="fisher")
    with pytest.raises(ValueError, match="structure"):
        curvature(model, x, structure="block")
    with pytest.raises(ValueError, match="likelihood"):
        curvature(model, x, likelihood="poisson")
    with pytest.raises(ValueError, match="sigma"):
        curvature(model, x, likelihood="regression", sigma=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        curvature(model, x, chunk_size=0)
    with pytest.raises(KeyError, match="nope"):
        curvature(model, x, param_names=["nope"])
    with pytest.raises(ValueError, match="head"):
        curvature(nn.Linear(5, 2).double(), x, head=1)
    with pytest.raises(ValueError, match="y"):
        curvature(model, x, kind="empirical_fisher")
    assert isinstance(Curvature("ggn"), Curvature) and Structure("kron") is Structure.KRON


# ----------------------------------------------------------------------------------------- kernels


def sigma_variants(model, names=None):
    params = params_of(model, names)
    g = torch.Generator().manual_seed(9)
    diag = {n: torch.rand(p.shape, generator=g, dtype=p.dtype) + 0.1 for n, p in params.items()}
    p = sum(t.numel() for t in params.values())
    q = torch.randn(p, p, generator=g, dtype=torch.float64)
    full = q @ q.T / p + 0.1 * torch.eye(p, dtype=torch.float64)
    # Kronecker covariance: SPD factors per Linear/Conv2d block, variances elsewhere
    blocks, kdiag = [], {}
    covered = set()
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)) and f"{name}.weight" in params:
            d_in = m.weight[0].numel() + 1
            a = torch.randn(d_in, d_in, generator=g, dtype=torch.float64)
            gg = torch.randn(m.weight.shape[0], m.weight.shape[0], generator=g, dtype=torch.float64)
            blocks.append(KronBlock(f"{name}.weight", f"{name}.bias", a @ a.T / d_in + 0.1 * torch.eye(d_in),
                                    gg @ gg.T / len(gg) + 0.1 * torch.eye(len(gg))))
            covered |= {f"{name}.weight", f"{name}.bias"}
    for n in params:
        if n not in covered:
            kdiag[n] = diag[n]
    kron = KronCurvature(blocks, kdiag)
    return params, {"diag": (diag, torch.diag(flatten(diag))), "full": (full, full),
                    "kron": (kron, O.kron_to_dense(kron, params).double())}


@pytest.mark.parametrize("blockwise", [True, False])
def test_kernels_match_brute_force(case, blockwise):
    model, x = case["model"], case["x"]
    params, variants = sigma_variants(model)
    j = oracle(case, "jac_softmax", lambda: O.jacobians(model, x, head=case["ohead"], output_fn=lambda f: f.softmax(-1)))
    m = x.shape[0]
    for name, (sig, dense) in variants.items():
        ref = O.kernel(j, dense, blockwise)
        got = kernel(model, x, sig, head=case["head"], output_fn=lambda f: f.softmax(-1), blockwise=blockwise,
                     chunk_size=2)
        assert got.shape == ((3, m, m) if blockwise else (3 * m, 3 * m))
        close(got, ref)
        if name != "full":
            jv = kernel(model, x, sig, head=case["head"], output_fn=lambda f: f.softmax(-1), blockwise=blockwise,
                        method="jvp", chunk_size=4)
            close(jv, ref)
        v = torch.randn(m, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        kv = kernel_vector_product(model, x, sig, v, head=case["head"], output_fn=lambda f: f.softmax(-1),
                                   blockwise=blockwise)
        expect = (torch.einsum("cmn,nc->mc", ref, v) if blockwise else (ref @ v.reshape(-1)).reshape(m, 3))
        close(kv, expect)


def test_kernel_on_subset_and_logits(case):
    model, x = case["model"], case["x"]
    names = list(params_of(model))[-2:]
    params, variants = sigma_variants(model, names)
    j = O.jacobians(model, x, head=case["ohead"], param_names=names)
    for name, (sig, dense) in variants.items():
        got = kernel(model, x, sig, head=case["head"], param_names=names if name == "full" else None)
        close(got, O.kernel(j, dense, True))


def test_kernel_class_groups_and_budget(monkeypatch, case):
    """Small memory budgets force class groups (and, for the full kernel, recomputed group pairs)."""
    import continual_blr.curvature.kernels as K

    model, x = case["model"], case["x"]
    _, variants = sigma_variants(model)
    sig, dense = variants["diag"]
    j = oracle(case, "jac", lambda: O.jacobians(model, x, head=case["ohead"]))
    monkeypatch.setattr(K, "BUDGET", 64)
    close(kernel(model, x, sig, head=case["head"], blockwise=True), O.kernel(j, dense, True))
    close(kernel(model, x, sig, head=case["head"], blockwise=False), O.kernel(j, dense, False))


def test_kernel_sigma_validation():
    model = make_mlp()
    x = torch.randn(3, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="shape"):
        kernel(model, x, {"heads.0.bias": torch.ones(4, dtype=torch.float64)})
    with pytest.raises(ValueError, match="dense covariance"):
        kernel(model, x, torch.eye(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="sigma"):
        kernel(model, x, 1.0)
    with pytest.raises(ValueError, match="method"):
        kernel(model, x, {"heads.0.bias": torch.ones(3, dtype=torch.float64)}, method="magic")


# ------------------------------------------------------------------------------------------ memory


class PeakMemory:
    """Peak bytes of tensor storage allocated and alive at once inside the block (CPU), tracked with a
    TorchDispatchMode that sees every ATen output (also the physical tensors under vmap) and weak
    references to their storages."""

    def __enter__(self):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self
        self.live, self.cur, self.peak = {}, 0, 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                # storages of the inputs that were allocated before the block (views of them are not new)
                external = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0]
                            if isinstance(t, torch.Tensor)} - set(tracker.live)
                out = func(*args, **(kwargs or {}))
                for key in [k for k, (ref, _) in tracker.live.items() if ref.expired()]:
                    tracker.cur -= tracker.live.pop(key)[1]
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        st = t.untyped_storage()
                        if st._cdata not in tracker.live and st._cdata not in external:
                            tracker.live[st._cdata] = (StorageWeakRef(st), st.nbytes())
                            tracker.cur += st.nbytes()
                tracker.peak = max(tracker.peak, tracker.cur)
                return out

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                 nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 16, 10))

    def forward(self, x, head=0):
        return self.net(x)


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_diag_ggn_memory_is_bounded_by_chunk(arch):
    """Chunk size 8, K = 10 outputs: the peak of live tensor memory during the diag GGN over N examples
    stays below chunk·K·P numbers and does not grow with N."""
    torch.manual_seed(0)
    if arch == "mlp":
        model, shape = MLP(20, (50, 50), 10), (20,)
    else:
        model, shape = SmallCNN(), (3, 8, 8)
    chunk, k = 8, 10
    p = sum(t.numel() for t in model.parameters())
    bound = chunk * k * p * 4
    peaks = {}
    for n in (64, 256):
        x = torch.randn(n, *shape)
        with PeakMemory() as pm:
            curvature(model, x, chunk_size=chunk)
        peaks[n] = pm.peak
        assert pm.peak <= bound, (arch, n, pm.peak, bound)
    assert peaks[256] <= 1.1 * peaks[64] + 4096
    # the instrument does see per-example arrays: the Jacobians of 64 examples are 64·K·P numbers
    with PeakMemory() as pm:
        per_example_jacobians(model, torch.randn(64, *shape), chunk_size=chunk)
    assert pm.peak >= 64 * k * p * 4


# ------------------------------------------------------------------------------- reduced ResNet-18


def test_reduced_resnet18_diag_and_full_ggn_equal_brute_force():
    """van de Ven's split-CIFAR network (BatchNorm on running statistics, 1×1 shortcuts, global pooling), made
    narrow (nf = 2) and small (8×8 inputs): the engine's GGN equals the dense brute-force J Λ Jᵀ in float64 (full:
    over the parameters of ≤ 300 numbers, shortcuts, BatchNorms and the head included; diagonal: all of them)."""
    from continual_blr.models import ReducedResNet18

    g = torch.Generator().manual_seed(4)
    model = ReducedResNet18(3, n_outputs=3, n_heads=2, nf=2).double()
    with torch.no_grad():  # non-trivial running statistics and affine parameters
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(0.1 * torch.randn(m.num_features, generator=g, dtype=torch.float64))
                m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=g, dtype=torch.float64))
                m.weight.copy_(1 + 0.2 * torch.randn(m.num_features, generator=g, dtype=torch.float64))
                m.bias.copy_(0.1 * torch.randn(m.num_features, generator=g, dtype=torch.float64))
    model.train()  # the engine must switch to eval mode itself
    x = torch.randn(5, 3, 8, 8, generator=g, dtype=torch.float64)
    # the full GGN over every layer kind but not the widest convolutions (all 11,352 weights would make the
    # dense float64 oracle 1 GB, and the suite's peak memory 6.4 GB); the diagonal over every weight
    sub = [n for n, p in model.named_parameters() if p.numel() <= 300 or n.startswith("heads.1.")]
    assert any("shortcut" in n for n in sub) and any("bn" in n for n in sub) and any("conv" in n for n in sub)
    dense = O.ggn(model.eval(), x, head=1, param_names=sub)
    j = O.jacobians(model, x, head=1)  # [N, K, P], every weight
    lam = O.output_hessians(model, x, head=1)
    diag_oracle = torch.einsum("nkp,nkl,nlp->p", j, lam, j)
    model.train()
    full = curvature(model, x, kind="ggn", structure="full", head=1, chunk_size=2, param_names=sub)
    diag = curvature(model, x, kind="ggn", structure="diag", head=1, chunk_size=2)
    close(full, dense)
    close(flatten(diag), diag_oracle)
    assert all(m.training for m in model.modules())
    assert model(x, head=0).shape == (5, 3)


# ------------------------------------------------------------------------------- Gram compression


@pytest.mark.parametrize("k", [2, 3, 10])
def test_gram_factor_keeps_the_gram_with_k_minus_one_softmax_cotangents(k):
    from continual_blr.curvature.jacobians import gram_factor
    from continual_blr.curvature.likelihoods import hessian_sqrt

    f = 3 * torch.randn(7, k, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
    v = hessian_sqrt(f, "classification")  # [B, K, K], Σ_c v_c v_cᵀ = Λ = diag(p) − ppᵀ
    w = gram_factor(v)
    assert w.shape == (7, k - 1, k)
    p = f.softmax(-1)
    close(w.transpose(1, 2) @ w, torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1))
    thin = torch.randn(4, 2, 5, dtype=torch.float64)  # fewer cotangents than outputs: unchanged
    assert gram_factor(thin) is thin


def test_gram_factor_of_well_behaved_grams_is_the_plain_eigendecomposition_bit_for_bit():
    """The rescue of failing Grams (rescaling, flushing) applies only after a plain eigh fails: on Grams where eigh
    converges the factors are exactly diag(√λ) Qᵀ from ``torch.linalg.eigh`` of the Gram itself (a rescaled
    decomposition differs in the last bits and in the signs of eigenvectors, and changes sampled curvatures)."""
    from continual_blr.curvature.jacobians import gram_factor
    from continual_blr.curvature.likelihoods import hessian_sqrt

    f = 3 * torch.randn(64, 10, generator=torch.Generator().manual_seed(1))
    v = hessian_sqrt(f, "classification")
    m = v.transpose(1, 2) @ v
    lam, q = torch.linalg.eigh(m)
    w = gram_factor(v)
    keep = w.shape[1]
    want = (q[:, :, -keep:] * lam[:, -keep:].clamp_min(0).sqrt().unsqueeze(1)).transpose(1, 2)
    assert torch.equal(w, want)


def test_gram_factor_of_a_saturated_softmax_with_subnormal_entries():
    """A 10-way softmax saturated at one class (p₁ ≈ e⁻²⁶, p₂..₉ ≈ e⁻⁹⁹: Gram entries ~1e-11 and subnormal ~1e-43
    in float32) — seen in a BLR run on class-incremental split MNIST, where LAPACK's float32 eigh did not
    converge and the run stopped. gram_factor must still return factors with the same Gram (to float32 rounding
    of the largest entry) in float32."""
    from continual_blr.curvature.jacobians import gram_factor
    from continual_blr.curvature.likelihoods import hessian_sqrt

    g = torch.Generator().manual_seed(0)
    f = torch.zeros(64, 10)
    f[:, 1] = -26 + torch.randn(64, generator=g)
    f[:, 2:] = -99 + 3 * torch.randn(64, 8, generator=g)
    v = hessian_sqrt(f, "classification")
    m = v.transpose(1, 2) @ v
    with pytest.raises(torch.linalg.LinAlgError):  # the failure this guards against (LAPACK, float32)
        torch.linalg.eigh(m)
    w = gram_factor(v)
    assert w.dtype == torch.float32 and w.shape[1] < 10
    scale = m.abs().amax()
    assert float((w.transpose(1, 2) @ w - m).abs().max()) <= 1e-5 * float(scale)
    # harder: logits spread over 200 (entries that stay subnormal even relative to each Gram's largest one)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        f = -200 * torch.rand(512, 10, generator=g)
        f[:, 0] = 0
        v = hessian_sqrt(f, "classification")
        m = v.transpose(1, 2) @ v
        w = gram_factor(v)
        assert bool(torch.isfinite(w).all()), seed
        err = (w.transpose(1, 2) @ w - m).abs().amax((1, 2)) / m.abs().amax((1, 2)).clamp_min(1e-38)
        assert float(err.max()) <= 1e-5, (seed, float(err.max()))


@pytest.mark.parametrize("n_out", [2, 10])
def test_gram_only_passes_give_the_same_diag_kron_and_full_ggn(n_out):
    from contextlib import closing

    from continual_blr.curvature import likelihoods as lk
    from continual_blr.curvature.estimates import diag_curvature, full_curvature, kron_curvature
    from continual_blr.curvature.jacobians import passes

    g = torch.Generator().manual_seed(n_out)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, n_out)).double()
    x = torch.randn(6, 2, 6, 6, generator=g, dtype=torch.float64)
    sel = params_of(model)

    def cot(f, yc, sl, st):
        return lk.hessian_sqrt(f, "classification")

    for reducer in (diag_curvature, full_curvature, kron_curvature):
        out = []
        for gram_only in (False, True):
            with closing(passes(model, x, None, sel, cot, head=None, chunk_size=4, gram_only=gram_only)) as run:
                out.append(reducer(run, sel))
        a, b = out
        if reducer is diag_curvature:
            close(flatten(b), flatten(a))
            close(flatten(b), torch.diagonal(O.ggn(model, x)))  # and the brute force
        elif reducer is full_curvature:
            close(b, a)
        else:
            for ba, bb in zip(a.blocks, b.blocks):
                close(bb.A, ba.A)
                close(bb.G, ba.G)
