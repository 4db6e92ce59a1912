"""Contracts of the BLR optimiser and of resumed runs that the rest of the suite did not pin down.

Only public API is used (``BayesianLearningRule(...)``, ``.step(closure)``, ``.posterior()``,
``BatchClosure``, the CLI and its run folders), so the tests survive rewrites of the optimiser's
internals.

1. The ``(losses, penalty)`` closure, one process: one Newton-like step (ρ = α = 1, β₁ = 0, delta
   method) against the closed form derived by hand for a linear-Gaussian model, where the penalty's
   gradient enters ĝ with weight N and the penalty enters neither ĥ nor the precision.
2. The same closure data parallel (2 gloo processes, uneven shards) equals one process.
3. ``rank_samples``: the two ranks evaluate their closures at different weight samples, and without it
   at the same one.
4. An interrupted-and-resumed run of a network with dropout (``CifarNet``) is bit-identical to the
   uninterrupted one (the checkpoint restores torch's global CPU generator, which draws the masks).

This file is also the worker script of tests 2-3 (``python tests/test_blr_contracts.py worker OUT CASE...``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import continual_blr
from continual_blr.models import build_model
from continual_blr.optim.blr import BatchClosure, BayesianLearningRule
from continual_blr.posteriors import DiagPosterior, FullPosterior

DT = torch.float64

# Tolerances (named; float64 throughout).
#: One step on 4 parameters against a closed form solved with torch.linalg: ~1e-15 relative rounding.
ORACLE = dict(rtol=1e-10, atol=1e-12)
#: 2 processes vs 1 process over 3 steps: only the order of floating-point additions differs (a sum over a
#: shard, then over ranks), ≈ 1e-16 relative per sum; the ill-conditioning of 3 steps keeps it ≲ 1e-12.
DATA_PARALLEL = dict(rtol=1e-9, atol=1e-11)
#: A penalty, or a different weight sample, moves the result by far more than this (non-vacuity checks).
MATERIAL = 1e-3

LIB_ROOT = Path(continual_blr.__file__).resolve().parents[1]  # the library the workers must import too


# ------------------------------------------------------------------------------------------------------
# 1. the (losses, penalty) closure in one process: closed form of one step
# ------------------------------------------------------------------------------------------------------
N_DATA, SIGMA, PEN_C = 40, 0.5, 0.3


def _linear_problem(structure: str):
    """A float64 linear-Gaussian model f(x) = w·x + b (3 inputs, 1 output), a minibatch of B = 5, a prior,
    and the penalty ½ c ‖θ − a‖² (a ParamDict a)."""
    g = torch.Generator().manual_seed(7)
    model = build_model("linear", (3,), 1, 1, generator=torch.Generator().manual_seed(1)).double()
    names = [n for n, _ in model.named_parameters()]
    assert names == ["heads.0.weight", "heads.0.bias"], names  # θ = [w (3), b (1)]: x̃ = [x, 1]
    x = torch.randn(5, 3, generator=g, dtype=DT)
    y = torch.randn(5, generator=g, dtype=DT)
    mean0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    m0 = {k: v + 0.4 * torch.randn(v.shape, generator=g, dtype=DT) for k, v in mean0.items()}
    a = {k: torch.randn(v.shape, generator=g, dtype=DT) for k, v in mean0.items()}
    if structure == "diag":
        s0 = {k: 0.5 + torch.rand(v.shape, generator=g, dtype=DT) for k, v in mean0.items()}
        prior = DiagPosterior(m0, s0)
        s0_mat = torch.diag(torch.cat([s0[k].reshape(-1) for k in names]))
    else:
        r = torch.randn(4, 4, generator=g, dtype=DT)
        s0_mat = r @ r.T + 0.5 * torch.eye(4, dtype=DT)
        prior = FullPosterior(m0, s0_mat.clone())
    return model, x, y, prior, s0_mat, a


def _penalty(a):
    def penalty(params):
        return 0.5 * PEN_C * sum(((params[k] - a[k]) ** 2).sum() for k in a)
    return penalty


def _flat(d, names):
    return torch.cat([d[k].reshape(-1) for k in names])


@pytest.mark.parametrize("structure", ["diag", "full"])
@pytest.mark.parametrize("curvature", ["hessian", "gauss_newton", "ggn"])
def test_penalty_closure_one_step_closed_form(structure, curvature):
    """Guards the penalty's weight in ĝ (N × ∇penalty, the penalty being relative to the *mean* loss), that
    its gradient is not dropped, and that it enters neither ĥ (the new precision) nor the precondition.

    Oracle (by hand, θ = [w, b], x̃ = [x, 1], r_i = x̃_iᵀm − y_i, ℓ_i = r_i²/(2σ²)): with ρ = α = 1, β₁ = 0,
    the delta method and D = 0 at the start,

        ĝ = (N/B) Σ_i r_i x̃_i / σ² + N c (m − a)
        ĥ = (N/B) Σ_i x̃_i x̃_iᵀ / σ²      (hessian, ggn: exact for a linear model)
          = (N/B) Σ_i r_i² x̃_i x̃_iᵀ / σ⁴  (gauss_newton: outer products of per-example gradients)
        S = S₀ + ĥ (full) or S₀ + diag(ĥ) (diag),   m' = m − S⁻¹ (ĝ + S₀ (m − m₀)),

    and the returned loss is mean_i ℓ_i(m) + penalty(m). The curvatures reach the penalty through two
    code paths (per-example Jacobians for hessian / gauss_newton, one backward pass for the engine's ggn).
    """
    model, x, y, prior, s0_mat, a = _linear_problem(structure)
    names = list(prior.mean)
    m = _flat({k: v.detach() for k, v in model.named_parameters()}, names)
    m0 = _flat(prior.mean, names)
    a_vec = _flat(a, names)
    xt = torch.cat([x, torch.ones(5, 1, dtype=DT)], 1)
    r = xt @ m - y
    b = x.shape[0]
    g_hat = (N_DATA / b) * (xt.T @ r) / SIGMA**2 + N_DATA * PEN_C * (m - a_vec)
    if curvature == "gauss_newton":
        h_hat = (N_DATA / b) * (xt.T * r**2) @ xt / SIGMA**4
    else:
        h_hat = (N_DATA / b) * xt.T @ xt / SIGMA**2
    s_new = s0_mat + (h_hat if structure == "full" else torch.diag(torch.diagonal(h_hat)))
    m_new = m - torch.linalg.solve(s_new, g_hat + s0_mat @ (m - m0))
    loss_ref = (0.5 * r**2 / SIGMA**2).mean() + 0.5 * PEN_C * ((m - a_vec) ** 2).sum()

    opt = BayesianLearningRule(model, prior, n_data=N_DATA, lr=1.0, rho=1.0, beta1=0.0, mc_samples=0,
                               curvature=curvature)
    closure = BatchClosure(model, x, y, penalty=_penalty(a), likelihood="regression", sigma=SIGMA)
    loss = opt.step(closure)

    torch.testing.assert_close(_flat(dict(model.named_parameters()), names).detach(), m_new, **ORACLE)
    post = opt.posterior()
    torch.testing.assert_close(_flat(post.mean, names), m_new, **ORACLE)
    prec = torch.diag(_flat(post.precision, names)) if structure == "diag" else post.precision
    torch.testing.assert_close(prec, s_new, **ORACLE)
    torch.testing.assert_close(torch.as_tensor(loss, dtype=DT), loss_ref, **ORACLE)
    # non-vacuity: the penalty's gradient moves this step by much more than the tolerance
    no_pen = m - torch.linalg.solve(s_new, g_hat - N_DATA * PEN_C * (m - a_vec) + s0_mat @ (m - m0))
    assert (no_pen - m_new).abs().max() > MATERIAL


# ------------------------------------------------------------------------------------------------------
# 2 and 3. data parallel (2 gloo processes) against one process
# ------------------------------------------------------------------------------------------------------
DP_N, DP_BATCHES = 60, (7, 5, 9)  # global batches of 7, 5, 9: shards 4/3, 3/2, 5/4 (uneven)
DP_CASES: dict[str, dict] = {
    "diag_gauss_newton": dict(structure="diag", curvature="gauss_newton", mc_samples=0),
    "full_gauss_newton": dict(structure="full", curvature="gauss_newton", mc_samples=0),
    "diag_ggn_sampled": dict(structure="diag", curvature="ggn", mc_samples=1),
    "full_ggn_sampled": dict(structure="full", curvature="ggn", mc_samples=1),
    "diag_price": dict(structure="diag", curvature="price", mc_samples=1, init_hess=0.1),
}
# rank_samples off / on (diag, ggn, one weight sample per step); the closure records the θ it is called at
RANK_CASES: dict[str, bool] = {"rank_samples_off": False, "rank_samples_on": True}


class _RecordingClosure(BatchClosure):
    """A BatchClosure that records every θ it is evaluated at (the weight sample of the step)."""

    def __init__(self, *args, log: list, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log = log

    def __call__(self, params):
        self.log.append({k: v.detach().clone() for k, v in params.items()})
        return super().__call__(params)


def _dp_penalty(a):
    """A smooth nonlinear penalty, the same on every rank."""
    def penalty(params):
        return sum(0.5 * 0.05 * ((params[k] - a[k]) ** 2).sum() + 0.02 * torch.sin(3 * params[k]).sum()
                   for k in a)
    return penalty


def _dp_run(case: str, with_penalty: bool = True) -> dict:
    """Three BLR steps of a float64 MLP (classification) through data-parallel BatchClosures with a penalty;
    in a process group each rank evaluates its shard of the same global batches. Returns the means after
    each step, the losses, the final precision and the θ the closure was evaluated at."""
    g = torch.Generator().manual_seed(5)
    x_all = torch.randn(DP_N, 4, generator=g, dtype=DT)
    y_all = torch.randint(0, 3, (DP_N,), generator=g)
    model = build_model("mlp", (4,), 3, 1, hidden=(5,), generator=torch.Generator().manual_seed(0)).double()
    mean0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    a = {k: torch.randn(v.shape, generator=g, dtype=DT) for k, v in mean0.items()}
    if case in RANK_CASES:
        cfg = dict(structure="diag", curvature="ggn", mc_samples=1)
    else:
        cfg = dict(DP_CASES[case])
    structure = cfg.pop("structure")
    prior = DiagPosterior(mean0, 1.0) if structure == "diag" else FullPosterior(mean0, 1.0)
    opt = BayesianLearningRule(model, prior, n_data=DP_N, lr=0.3, rho=0.7, beta1=0.5, debias=True,
                               generator=torch.Generator().manual_seed(11), **cfg)
    if case in RANK_CASES:
        opt.rank_samples = RANK_CASES[case]
    log: list = []
    means, losses, thetas = [], [], []
    start = 0
    for b in DP_BATCHES:
        xb, yb = x_all[start:start + b], y_all[start:start + b]
        start += b
        n_before = len(log)
        closure = _RecordingClosure(model, xb, yb, penalty=_dp_penalty(a) if with_penalty else None,
                                    data_parallel=True, log=log)
        losses.append(float(opt.step(closure)))
        thetas.append(log[n_before])  # the first evaluation of the step: its weight sample
        means.append({k: v.detach().clone() for k, v in model.named_parameters()})
    post = opt.posterior()
    return {"means": means, "losses": torch.tensor(losses, dtype=DT), "thetas": thetas,
            "precision": post.precision}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory) -> Path:
    """Runs every data-parallel case once in 2 gloo processes (torchrun's variables); rank r writes
    ``<case>.rank<r>.pt`` into the returned folder."""
    out = tmp_path_factory.mktemp("dp")
    port = _free_port()
    pythonpath = os.pathsep.join([str(LIB_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    procs = []
    for r in range(2):
        env = dict(os.environ, WORLD_SIZE="2", RANK=str(r), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "worker", str(out),
                                       *DP_CASES, *RANK_CASES], env=env, cwd=LIB_ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    return out


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("case", list(DP_CASES))
def test_penalty_closure_two_processes_equal_one_process(two_process_results, case):
    """Guards the penalty's share on each rank, N (b_r/B) ∇penalty, which the all-reduce sums to N ∇penalty:
    two gloo processes over uneven shards give one process's means after every step, final precision and
    losses (DATA_PARALLEL tolerances). A penalty weighted 1 on every rank would count it W = 2 times.
    Covers the per-example-Jacobian path (gauss_newton), the one-backward path (ggn, price) and
    both structures; sampled cases draw the same weight sample on every rank."""
    ref = _dp_run(case)
    for r in range(2):
        got = _load(two_process_results / f"{case}.rank{r}.pt")
        for step, (gm, rm) in enumerate(zip(got["means"], ref["means"])):
            for k in rm:
                torch.testing.assert_close(gm[k], rm[k], **DATA_PARALLEL,
                                           msg=lambda m: f"{case} rank {r} step {step + 1} {k}: {m}")
        torch.testing.assert_close(got["losses"], ref["losses"], **DATA_PARALLEL)
        if isinstance(ref["precision"], dict):
            for k in ref["precision"]:
                torch.testing.assert_close(got["precision"][k], ref["precision"][k], **DATA_PARALLEL)
        else:
            torch.testing.assert_close(got["precision"], ref["precision"], **DATA_PARALLEL)
    # non-vacuity: the penalty changes the run by much more than the tolerance
    bare = _dp_run(case, with_penalty=False)
    diff = max(float((bare["means"][-1][k] - ref["means"][-1][k]).abs().max()) for k in ref["means"][-1])
    assert diff > MATERIAL, (case, diff)


def test_rank_samples_draw_a_weight_sample_per_rank(two_process_results):
    """Guards the per-rank seeds of ``rank_samples`` (``base · W + rank``, so that the reduced ĝ, ĥ average W
    different samples): with it the two ranks evaluate their closures at different θ at every step; without
    it at bitwise the same θ (one shared generator state). In both, the ranks end with the same means."""
    for case, own in RANK_CASES.items():
        r0, r1 = (_load(two_process_results / f"{case}.rank{r}.pt") for r in range(2))
        for step, (t0, t1) in enumerate(zip(r0["thetas"], r1["thetas"])):
            if own:
                diff = max(float((t0[k] - t1[k]).abs().max()) for k in t0)
                assert diff > MATERIAL, f"{case} step {step + 1}: both ranks drew the same weight sample"
            else:
                for k in t0:
                    assert torch.equal(t0[k], t1[k]), f"{case} step {step + 1} {k}: ranks drew different samples"
        for m0, m1 in zip(r0["means"], r1["means"]):  # the same reduced update on every rank
            for k in m0:
                assert torch.equal(m0[k], m1[k]), (case, k)
        assert len(r0["thetas"]) == len(DP_BATCHES)


# ------------------------------------------------------------------------------------------------------
# 4. resume of a dropout network
# ------------------------------------------------------------------------------------------------------
DROPOUT_CONFIG = """\
stream: {{name: split_cifar10, data_dir: "{root}", options: {{download: false, max_per_task: 8, max_test_per_task: 4}}}}
model: {{arch: cifarnet}}
train: {{epochs: 1, batch_size: 4}}
seed: 3
methods: [none]
"""


def _fake_cifar10(root: Path) -> None:
    """A tiny CIFAR-10 in the library's npz layout: uint8 HWC images 32×32×3, 8 train and 4 test per class."""
    rs = np.random.RandomState(0)
    arrays = {}
    for split, per in (("train", 8), ("test", 4)):
        arrays[f"x_{split}"] = rs.randint(0, 256, size=(10 * per, 32, 32, 3)).astype(np.uint8)
        arrays[f"y_{split}"] = np.repeat(np.arange(10), per).astype(np.int64)
    (root / "cifar10").mkdir(parents=True)
    np.savez(root / "cifar10" / "cifar10.npz", **arrays)


def test_resume_of_a_dropout_network_is_bit_identical(tmp_path, monkeypatch, capsys):
    """Guards the checkpoint's global CPU RNG state (``torch.get_rng_state``, which draws dropout masks): a
    ``cifarnet`` run (dropout 0.5 / 0.25, trained with Adam in train mode) interrupted at the start of its
    3rd task and resumed equals the uninterrupted run bit for bit — accuracy matrix, saved weights, method
    state and logs. Without restoring the state the resumed tasks draw other masks and the weights part."""
    from test_resume import _interrupt_after, _matrices, _same  # the suite's resume helpers
    from test_resume import _load as load_saved

    from continual_blr.cli import main

    model = build_model("cifarnet", (3, 32, 32), 2, 5)
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())  # dropout is on

    data = tmp_path / "data"
    _fake_cifar10(data)
    cfg = tmp_path / "dropout.yaml"
    cfg.write_text(DROPOUT_CONFIG.format(root=data))
    ref, out = tmp_path / "ref", tmp_path / "run"
    common = ["--no-progress", "--threads", "1"]
    assert main(["run", str(cfg), "--out", str(ref), *common]) == 0
    with monkeypatch.context() as patch:
        _interrupt_after(patch, "fit_task", 3)  # tasks 1-2 finished and checkpointed
        assert main(["run", str(cfg), "--out", str(out), *common]) == 130
    capsys.readouterr()
    assert main(["run", "--resume", str(out), *common]) == 0
    assert _matrices(ref) == _matrices(out)
    _same(load_saved(ref / "none" / "model.pt"), load_saved(out / "none" / "model.pt"), "none/model")
    _same(load_saved(ref / "none" / "method.pt"), load_saved(out / "none" / "method.pt"), "none/method")
    for log in ("train_log.csv", "accuracy.csv"):
        assert (ref / "none" / log).read_text() == (out / "none" / log).read_text(), log


# ------------------------------------------------------------------------------------------- worker side


def _worker(argv: list[str]) -> None:
    from continual_blr import distributed

    out = Path(argv[1])
    distributed.init_from_env(timeout_s=120.0)
    with distributed.fail_fast("worker"):
        assert distributed.is_distributed()
        for case in argv[2:]:
            torch.save(_dp_run(case), out / f"{case}.rank{distributed.rank()}.pt")
        torch.distributed.barrier()  # both ranks done with every collective before the group goes
    distributed.shutdown()


if __name__ == "__main__":
    _worker(sys.argv[1:])
    # Leave without running C++ static destructors: gloo's teardown at interpreter exit intermittently aborted with
    # "terminate called without an active exception" (exit -6) after both ranks had written their results.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
