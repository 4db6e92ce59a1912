"""The native in-place diagonal update (``continual_blr/optim/native.py``) and the step that uses it.

Oracle: :func:`continual_blr.optim.diag_state.diag_update` (one tensor operation per line of the algorithm) in
float64 on the same inputs, for every flag combination and both of ``torch.lerp``'s forms; the native loop makes
the same operations, so in float64 the two agree to ``F64_RTOL`` (relative to the inputs' scale, O(1) here) and a
wrong line moves an output by O(1). IVON's Algorithm 1 with a prior checks the whole native step
(``tests/test_blr_fixed_points.py``, ``test_the_diagonal_update_is_ivons_algorithm_with_a_prior[compiled]``).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from continual_blr.models import MLP
from continual_blr.optim import native
from continual_blr.optim.blr import BayesianLearningRule
from continual_blr.optim.closures import BatchClosure
from continual_blr.optim.diag_state import diag_update
from continual_blr.posteriors import DiagPosterior
from continual_blr.types import DivergenceError

F64_RTOL = F64_ATOL = 1e-12  # float64: the same operations, differently contracted (FMA) at most
F32_RTOL, F32_ATOL = 1e-5, 1e-6  # float32: a few ulps of O(1) values
CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(native.native_update(torch.float64, CPU, **dict.fromkeys(native.FLAGS, True)) is None,
                                reason="no C compiler for the native update on this machine")

# (1 − β₁, ρ_t, ρ̄_t, 1/(1 − β₁ᵗ), α, radius, Nγ): torch.lerp's a + w(b − a) form (|w| < ½) and its b − (b − a)(1 − w)
SMALL = (0.1, 0.05, 0.3, 1.7, 0.01, 0.5, 2.0)
LARGE = (0.9, 0.6, 1.0, 1.1, 0.02, 0.3, 0.5)


def _inputs(n: int, dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    r = lambda scale=1.0, shift=0.0: torch.rand(n, generator=g, dtype=dtype) * scale + shift  # noqa: E731
    z = lambda scale=1.0: torch.randn(n, generator=g, dtype=dtype) * scale  # noqa: E731
    s0, data = r(1.0, 0.5), r(3.0)
    # ĝ, ĥ and ε positive, so that ĥ (also g ε / r) > 0 and S₀ + D stays >= 1/2 without the positivity correction:
    # the outputs are then well conditioned and the tolerances are rounding's
    return dict(g=z(10.0).abs(), h=z(5.0).abs(), mean=z(), m0=z(), s0=s0, data=data, avg=r(), mom=z(),
                eps=z().abs(), r=torch.rsqrt(s0 + data))


def _native(x: dict, scalars: tuple, **flags: bool) -> tuple:
    """(new mean, u, D, D̄, r, ok, n_clip) from the native loop on copies of ``x``."""
    update = native.native_update(x["g"].dtype, CPU, **flags)
    assert update is not None
    out = {k: x[k].clone() for k in ("mean", "data", "avg", "mom", "r")}
    ok, n_clip = update(x["g"], x["h"], x["mean"], out["mean"], x["m0"], x["s0"], out["data"], out["avg"], out["mom"],
                        x["eps"], out["r"], scalars)
    return out["mean"], out["mom"], out["data"], out["avg"], out["r"], ok, n_clip


@pytest.mark.parametrize("scalars", [SMALL, LARGE], ids=["lerp-small-w", "lerp-large-w"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_native_update_is_diag_update_for_every_setting(dtype, scalars):
    """All 128 flag combinations in float64 (in float32 the Price step's 8, momentum × clip × damping: each setting
    is a library built on first use, about a quarter of a second): m, u, D, D̄ written in place and
    r = (S₀ + D)^{-1/2} equal ``diag_update``'s new tensors, and the clip counts are equal."""
    rtol, atol = (F64_RTOL, F64_ATOL) if dtype == torch.float64 else (F32_RTOL, F32_ATOL)
    x = _inputs(1003, dtype)  # not a multiple of any vector width: the loop's tail runs too
    combos = [dict(zip(native.FLAGS, c)) for c in itertools.product([False, True], repeat=len(native.FLAGS))]
    if dtype == torch.float32:
        combos = [f for f in combos if f["positivity"] and f["h_from_sample"] and f["fresh"] and f["separate"]]
    for flags in combos:
        m, u, d, a, r, ok, n_clip = _native(x, scalars, **flags)
        ref = diag_update(x["g"], x["h"], x["mean"], x["m0"], x["s0"], x["data"], x["avg"], x["mom"], x["eps"], x["r"],
                          *scalars, **flags)
        assert ok
        assert n_clip == int(ref[6]), flags
        pairs = [("mean", m, ref[0]), ("D", d, ref[2]), ("r", r, torch.rsqrt(ref[4]))]
        pairs += [("u", u, ref[1])] if flags["momentum"] else [("u untouched", u, x["mom"])]
        pairs += [("avg", a, ref[3])] if flags["separate"] and flags["fresh"] else [("avg untouched", a, x["avg"])]
        for name, got, want in pairs:
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True,  # r of an S < 0 (no positivity)
                                       msg=lambda s, n=name, f=flags: f"{n} {f}: {s}")


def test_a_non_finite_gradient_writes_nothing():
    """A NaN or inf in ĝ (or in a separate ĥ): (False, 0) and every buffer as it was, bit for bit."""
    x = _inputs(257, torch.float32)
    flags = dict.fromkeys(native.FLAGS, True) | {"h_from_sample": False}
    for key, value in (("g", float("nan")), ("g", float("inf")), ("h", float("-inf"))):
        bad = dict(x)
        bad[key] = x[key].clone()
        bad[key][200] = value
        m, u, d, a, r, ok, n_clip = _native(bad, SMALL, **flags)
        assert (ok, n_clip) == (False, 0)
        for got, want in ((m, x["mean"]), (u, x["mom"]), (d, x["data"]), (a, x["avg"]), (r, x["r"])):
            assert torch.equal(got, want)


def test_unusable_inputs_give_none_or_a_one_line_error(monkeypatch):
    flags = dict.fromkeys(native.FLAGS, False)
    assert native.native_update(torch.float16, CPU, **flags) is None
    assert native.native_update(torch.float32, torch.device("cuda"), **flags) is None
    monkeypatch.setenv("CONTINUAL_BLR_NATIVE", "0")
    assert native.native_update(torch.float32, CPU, **flags) is None
    monkeypatch.delenv("CONTINUAL_BLR_NATIVE")
    with pytest.raises(ValueError, match="flags must be exactly"):
        native.native_update(torch.float32, CPU, clip=True)
    update = native.native_update(torch.float32, CPU, **flags)
    x = _inputs(8, torch.float32)
    with pytest.raises(ValueError, match="contiguous torch.float32 CPU vector of length 8; got torch.float64"):
        update(x["g"].double(), *(x[k] for k in ("h", "mean", "mean", "m0", "s0", "data", "avg", "mom", "eps", "r")),
               SMALL)


def test_the_library_is_built_once_into_the_cache_and_reused(tmp_path, monkeypatch):
    """A fresh cache directory gets one shared library per setting (no temporary file left); a second load of the
    same setting compiles nothing."""
    monkeypatch.setenv("CONTINUAL_BLR_CACHE", str(tmp_path))
    flags = dict.fromkeys(native.FLAGS, False) | {"clip": True}
    first = native._build(torch.float32, flags)
    assert first is not None and first.parent == tmp_path / "native"
    assert [p.name for p in (tmp_path / "native").iterdir()] == [first.name]
    mtime = first.stat().st_mtime_ns
    assert native._build(torch.float32, flags) == first and first.stat().st_mtime_ns == mtime
    assert native._build(torch.float64, flags) != first  # another dtype: another library


def test_a_library_being_built_is_never_visible_half_written(tmp_path, monkeypatch):
    """Concurrent processes (torchrun) may build the same library: the cache's file name appears only when the
    whole library is there. The compiler here writes its output in two halves a second apart; a poller of the
    cache name must only ever see the complete file, which then loads."""
    import ctypes
    import shutil
    import stat
    import sys
    import threading
    import time

    real_cc = shutil.which("cc")
    if real_cc is None:
        pytest.skip("no C compiler")
    slow = tmp_path / "slow-cc"
    slow.write_text(f"""#!{sys.executable}
import subprocess, sys, time
args = sys.argv[1:]
if args == ["--version"]:
    sys.exit(subprocess.call(["{real_cc}", "--version"]))
out = args[args.index("-o") + 1]
args[args.index("-o") + 1] = out + ".whole"
subprocess.check_call(["{real_cc}", *args])
data = open(out + ".whole", "rb").read()
with open(out, "wb") as f:
    f.write(data[: len(data) // 2]); f.flush()
    time.sleep(1.0)
    f.write(data[len(data) // 2:])
""")
    slow.chmod(slow.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(slow))
    monkeypatch.setenv("CONTINUAL_BLR_CACHE", str(tmp_path / "cache"))
    flags = dict.fromkeys(native.FLAGS, False)
    built: list = []
    thread = threading.Thread(target=lambda: built.append(native._build(torch.float32, flags)))
    thread.start()
    seen: list[int] = []
    while thread.is_alive():
        seen += [p.stat().st_size for p in (tmp_path / "cache" / "native").glob("blr_diag_update_*.so")
                 if p.is_file()]
        time.sleep(0.01)
    thread.join()
    (path,) = built
    assert path is not None and path.name.startswith("blr_diag_update_")
    assert set(seen) <= {path.stat().st_size}, seen  # never a partial file under the cache's name
    ctypes.CDLL(str(path)).blr_diag_update  # noqa: B018 - the whole library loads


def _opt(model: nn.Module, prior: DiagPosterior, fused: bool, **kw) -> BayesianLearningRule:
    return BayesianLearningRule(model, prior, n_data=200, lr=0.1, rho=0.2, mc_samples=1, curvature="price",
                                generator=torch.Generator().manual_seed(3), fused=fused, init_hess=0.5,
                                clip_radius=0.05, beta1=0.9, debias=True, **kw)


def _problem(gen):
    base = MLP(5, (6,), 3, 3)
    x = torch.randn(16, 5, generator=gen)
    y = torch.randint(0, 3, (16,), generator=gen)
    prior = DiagPosterior({k: 0.1 * torch.randn(p.shape, generator=gen) for k, p in base.named_parameters()}, 2.0)
    return base, x, y, prior


def test_the_native_step_follows_weights_written_or_rebound_between_steps(gen):
    """The native step keeps the parameters as views of one flat vector and reads the mean from it each step. A
    ``load_state_dict`` between steps (written into the views) and one with ``assign=True`` (new tensors: the step
    links anew) are followed as the per-parameter (eager) step follows them: after 3 + 3 + 3 steps the two
    posteriors agree to float32 rounding. The state a ``state_dict`` returned does not follow later steps."""
    base, x, y, prior = _problem(gen)
    restart = {k: 0.5 * v for k, v in base.state_dict().items()}
    results = []
    for fused in (False, True):
        model = copy.deepcopy(base)
        opt = _opt(model, prior, fused)
        for reload in (None, "copy", "assign"):
            if reload is not None:
                model.load_state_dict({k: v.clone() for k, v in restart.items()}, assign=reload == "assign")
            for h in (0, 1, 0):
                opt.step(BatchClosure(model, x, y, head=h))
            if reload is None:
                saved = opt.state_dict()
                frozen = {k: v.clone() for k, v in saved["data"].items()}
        assert (opt._flat_weights is not None) == fused  # the native path ran (and only with fused)
        assert all(torch.equal(saved["data"][k], frozen[k]) for k in frozen)
        post = opt.posterior()
        results.append((post.mean, post.precision))
    (m_e, p_e), (m_n, p_n) = results
    for k in m_e:
        torch.testing.assert_close(m_n[k], m_e[k], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(p_n[k], p_e[k], rtol=1e-4, atol=1e-6)
    assert max(float((m_n[k] - restart[k]).abs().max()) for k in m_n) > 1e-3  # the last steps moved the mean


def test_a_native_step_that_fails_leaves_the_mean_and_the_state_as_they_were(gen):
    """A non-finite loss stops the native step before anything is written: DivergenceError, the weights back at
    the mean, D, D̄ and u unchanged to the bit."""
    base, x, y, prior = _problem(gen)
    opt = _opt(base, prior, True)
    opt.step(BatchClosure(base, x, y, head=0))
    before = {k: p.detach().clone() for k, p in base.named_parameters()}
    state = opt.state_dict()
    bad_x = x.clone()
    bad_x[3, 2] = float("nan")
    with pytest.raises(DivergenceError, match="not finite"):
        opt.step(BatchClosure(base, bad_x, y, head=1))
    after = opt.state_dict()
    for k, p in base.named_parameters():
        assert torch.equal(p.detach(), before[k]), k
    for part in ("data", "average", "momentum"):
        assert all(torch.equal(after[part][k], state[part][k]) for k in state[part]), part
    assert opt._t == state["t"]


@pytest.mark.parametrize("every", [1, 3])
def test_the_native_step_adds_a_structured_priors_coupling_as_the_eager_step_does(gen, every):
    """With a coupling (``set_prior``'s R(m − m₀), e.g. the ``"kfac"`` carry) the fused Price step runs the native
    loop with the pull added to the direction and ĥ from the data gradient alone, as the eager step: after 9 steps
    (recomputed every step, or every 3rd) the two posteriors agree to float32 rounding, and both differ from the
    same steps without the coupling. Planted once: a native step that drops the coupling fails."""
    base, x, y, prior = _problem(gen)
    pull = {k: 0.3 * torch.randn(v.shape, generator=gen) for k, v in prior.mean.items()}

    def coupling(v):  # a fixed linear map v ↦ diag(c) v + its row sums: off-diagonal mixing within each tensor
        return {k: pull[k] * v[k] + 0.05 * v[k].sum() for k in v}

    results = {}
    for fused, coupled in ((False, True), (True, True), (True, False)):
        model = copy.deepcopy(base)
        opt = _opt(model, prior, fused, coupling_every=every)
        opt.set_prior(DiagPosterior({k: v + 0.2 for k, v in prior.mean.items()}, prior.precision),
                      coupling if coupled else None)
        for h in (0, 1, 2) * 3:
            opt.step(BatchClosure(model, x, y, head=h))
        assert (opt._flat_weights is not None) == fused  # the native path ran (and only with fused)
        post = opt.posterior()
        results[fused, coupled] = (post.mean, post.precision)
    (m_e, p_e), (m_n, p_n), (m_free, _) = results[False, True], results[True, True], results[True, False]
    for k in m_e:
        torch.testing.assert_close(m_n[k], m_e[k], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(p_n[k], p_e[k], rtol=1e-4, atol=1e-6)
    assert max(float((m_n[k] - m_free[k]).abs().max()) for k in m_n) > 1e-3  # the pull moved the mean
