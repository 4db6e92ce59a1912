"""Data parallel on torch.distributed (gloo, CPU): 2 processes = 1 process with the same global batch.

The test launches this file as a worker script (``python tests/test_distributed.py worker ...``) in two
processes with torchrun's environment variables, joins them with
:func:`continual_blr.distributed.init_from_env`, runs the stream for several methods and saves what
each run carried (accuracy matrix, model weights, the method's state: posterior mean and precision,
FROMP's memory, its kernels and their Cholesky factors). The same runs in the test process (no process
group) are the reference.

Tolerances (float64 models and data): the accuracy matrices must be **equal**; every carried tensor
must agree to rtol = 1e-7, atol = 1e-9. The only difference between the runs is the order of
floating-point additions (a sum over a shard, then over ranks), ≈ 1e-16 relative per step, which
~100 Adam / BLR steps amplify to ≲ 1e-12 here. For the BLR with weight samples (mc_samples = 1) the
ranks draw the *same* sample from the optimiser's generator (its state is the same on every rank), so
the 2-process run is compared with the 1-process run as is; the delta method (mc_samples = 0) is
checked as well.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RTOL, ATOL = 1e-7, 1e-9

# name -> (registry name, params); the settings keep the default run fast (a few seconds per method)
CASES: dict[str, tuple[str, dict]] = {
    "none": ("none", {}),
    "ewc": ("ewc", {"lam": 100.0, "fisher": "mc_fisher"}),
    "laplace_kron": ("laplace", {"structure": "kron"}),
    "fromp": ("fromp", {"n_points": 10, "tau": 10.0}),
    "blr_delta": ("blr", {"mc_samples": 0, "lr": 0.1}),
    "blr_mc": ("blr", {"mc_samples": 1, "lr": 0.1}),
    "blr_kron": ("blr", {"structure": "kron", "mc_samples": 0, "lr": 0.1, "curvature": "mc_fisher"}),
    "blr_price": ("blr", {"curvature": "price", "init_hess": 0.1, "mc_samples": 1, "lr": 0.1}),
    # replay: every rank offers the global minibatch to its buffer and draws the same replay examples
    "er": ("er", {"memory_size": 30, "selection": "class_balanced"}),
    "derpp": ("derpp", {"memory_size": 30}),
    "fromp_replay": ("fromp-replay", {"memory_size": 12, "replay_batch_size": 5}),
}
# Kronecker BLR *with weight samples*: a sample is U_G (ε ⊙ D^{-1/2}) U_Aᵀ from eigendecompositions of the
# factors, whose eigenvectors inside a degenerate eigenspace (the isotropic start, unused heads) jump
# under a 1e-16 change of the matrix. The 2-process run's summed factors differ from one process's in the
# last bit, so it draws a different (equally distributed) sample and the runs part. The ranks hold
# bitwise the same reduced factors, so they agree with EACH OTHER exactly: that is what is checked.
RANKS_ONLY: dict[str, tuple[str, dict]] = {
    "blr_kron_sampled": ("blr", {"structure": "kron", "mc_samples": 1, "lr": 0.1, "curvature": "ggn"}),
    # IVON's pattern: a weight sample per rank (seeds base·W + rank); the reduced update is the same everywhere
    "blr_rank_samples": ("blr", {"mc_samples": 1, "lr": 0.1}),  # + optimizer.rank_samples = True (run_case)
}


def run_case(name: str) -> dict:
    """One method over the synthetic stream: what it carried, as plain tensors."""
    from continual_blr.data.synthetic import synthetic_stream
    from continual_blr.loop import run_stream
    from continual_blr.methods import TrainConfig, build_method
    from continual_blr.models import build_model

    stream = synthetic_stream(n_tasks=3, n_features=6, n_train=93, n_test=61, seed=3)
    for t in stream.tasks:  # float64 data, so that the model runs in float64
        t.x_train, t.x_test = t.x_train.double(), t.x_test.double()
    model = build_model("mlp", stream.input_shape, stream.n_outputs, stream.n_heads, hidden=(12,),
                        generator=torch.Generator().manual_seed(0)).double()
    reg_name, params = {**CASES, **RANKS_ONLY}[name]
    method = build_method(reg_name, dict(params), seed=0)
    if name == "blr_rank_samples":  # the optimiser's switch (not a BLRParams field yet)
        setup = method.setup

        def setup_rank_samples(*args):
            setup(*args)
            method.optimizer.rank_samples = True

        method.setup = setup_rank_samples
    # batch 20 over 93 examples: shards of 10/10 and a last batch of 13 split 7/6 (uneven)
    train = TrainConfig(epochs=2, batch_size=20, lr=1e-2, eval_batch_size=25)
    res = run_stream(model, stream, method, train, seed=0, progress=False)
    out = {"acc": torch.tensor(res.acc_matrix), "loss": torch.tensor(res.train_loss),
           "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
           "state": method.state_dict()}
    if reg_name.startswith("fromp"):  # the kernels of every stored task at the final weights (identical on every rank)
        method.regularizer.rebuild(model)
        out["kernels"] = [{k: v for k, v in e.extras.items()} for e in method.regularizer.memory]
    return out


def _leaves(obj, prefix: str = ""):
    """(path, tensor or plain value) pairs of a nested dict / list / tuple."""
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _leaves(obj[k], f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{prefix}[{i}]")
    else:
        yield prefix, obj


def _assert_same(got: dict, ref: dict, case: str) -> None:
    assert torch.equal(got["acc"].nan_to_num(-1), ref["acc"].nan_to_num(-1)), (case, got["acc"], ref["acc"])
    a, b = list(_leaves(got)), list(_leaves(ref))
    assert [p for p, _ in a] == [p for p, _ in b], case
    for (path, x), (_, y) in zip(a, b):
        if isinstance(x, torch.Tensor):
            if x.is_floating_point():
                torch.testing.assert_close(x, y, rtol=RTOL, atol=ATOL, equal_nan=True, msg=lambda m: f"{case}{path}: {m}")
            else:
                assert torch.equal(x, y), (case, path)
        else:
            assert x == y or (x != x and y != y), (case, path, x, y)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: list[str], world: int = 2, timeout_s: float = 20.0,
            extra_env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Start ``world`` worker processes with torchrun's variables (what ``torchrun`` would set)."""
    port = _free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, WORLD_SIZE=str(world), RANK=str(r), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", CBLR_TEST_TIMEOUT=str(timeout_s), **(extra_env or {}))
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _wait(procs: list[subprocess.Popen], limit_s: float) -> list[tuple[int, str]]:
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=limit_s)
            out.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


def test_two_processes_equal_one_process(tmp_path):
    """none / EWC (MC Fisher) / Laplace (K-FAC) / FROMP / BLR (delta method, a weight sample, Kronecker with
    MC-Fisher labels, IVON's Price estimate) / ER, DER++ and FROMP with replay (the buffers and the memory, stored
    logits included): the accuracy matrix is equal and every carried tensor agrees
    (tolerances in the module docstring); the sampled Kronecker BLR: the two ranks agree bitwise."""
    procs = _launch(["worker", str(tmp_path), *CASES, *RANKS_ONLY])
    results = _wait(procs, limit_s=600)
    for code, err in results:
        assert code == 0, err[-3000:]
    for case in CASES:
        ref = run_case(case)
        for r in range(2):
            got = torch.load(tmp_path / f"{case}.rank{r}.pt", weights_only=False)
            _assert_same(got, ref, f"{case} rank {r}")
    for case in RANKS_ONLY:  # see RANKS_ONLY: the ranks agree bitwise
        r0, r1 = (torch.load(tmp_path / f"{case}.rank{r}.pt", weights_only=False) for r in range(2))
        for (path, x), (_, y) in zip(_leaves(r0), _leaves(r1)):
            assert (torch.equal(x.nan_to_num(-1), y.nan_to_num(-1)) if isinstance(x, torch.Tensor) else x == y), (case, path)
    # per-rank samples do change the run (else the check above would be vacuous for rank_samples)
    shared, own = (torch.load(tmp_path / f"{c}.rank0.pt", weights_only=False) for c in ("blr_mc", "blr_rank_samples"))
    assert not torch.allclose(shared["weights"]["heads.0.weight"], own["weights"]["heads.0.weight"], atol=1e-6)


def _launch_cli(args: list[str], world: int = 2) -> list[subprocess.Popen]:
    """``continual-blr`` in ``world`` processes with torchrun's variables (what ``torchrun --nproc-per-node`` sets)."""
    port = _free_port()
    return [subprocess.Popen([sys.executable, "-m", "continual_blr", *args], cwd=ROOT, text=True,
                             env=dict(os.environ, WORLD_SIZE=str(world), RANK=str(r), LOCAL_RANK=str(r),
                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(world)]


def test_out_under_two_processes_never_refuses_its_own_run(tmp_path):
    """``--out DIR`` in a 2-process run, three times in a row (issue 24: rank 1 found the results.json rank 0 had
    just begun and refused the run, about half the time): every run exits 0 and writes its folder. Only rank 0
    looks at the folder; the ranks share its verdict, so an existing run is still refused on both, in one line."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("stream: {name: synthetic, options: {n_tasks: 2, n_train: 40}}\nmodel: {hidden: [8]}\n"
                   "train: {epochs: 1, batch_size: 20}\nmethods: [none]\n")
    for i in range(3):
        out = tmp_path / f"run{i}"
        results = _wait(_launch_cli(["run", str(cfg), "--out", str(out), "--no-progress"]), limit_s=120)
        assert [code for code, _ in results] == [0, 0], results
        assert (out / "results.json").is_file()
    results = _wait(_launch_cli(["run", str(cfg), "--out", str(tmp_path / "run0"), "--no-progress"]), limit_s=120)
    assert [code for code, _ in results] == [2, 2], results
    assert "already holds a run" in results[0][1] and len(results[0][1].strip().splitlines()) == 1


def test_exception_on_one_rank_ends_the_run(tmp_path):
    """Rank 1 raises in the middle of a run: both processes end (exit 1) within a bounded time, and the
    failing rank says why in one line (no traceback)."""
    t0 = time.perf_counter()
    results = _wait(_launch(["fail", str(tmp_path)], timeout_s=20.0), limit_s=120)
    elapsed = time.perf_counter() - t0
    assert elapsed < 90, elapsed
    assert [code for code, _ in results] == [1, 1], results
    err1 = results[1][1].strip().splitlines()
    assert len(err1) == 1 and "error (rank 1 of 2)" in err1[0] and "boom on rank 1" in err1[0], err1
    assert "Traceback" not in results[0][1] + results[1][1]


def test_helpers_in_one_process():
    """Without a process group the helpers are identities; shard bounds follow torch.tensor_split."""
    from continual_blr import distributed as d

    assert not d.is_distributed() and d.rank() == 0 and d.world_size() == 1
    for n in range(0, 12):
        for w in (1, 2, 3, 5):
            lengths = [len(p) for p in torch.arange(n).tensor_split(w)]
            ends = [sum(lengths[: r + 1]) for r in range(w)]
            assert [d.shard_bounds(n, r, w) for r in range(w)] == [(e - k, e) for e, k in zip(ends, lengths)]
    t = torch.randn(5, 3)
    assert d.shard(t) is t and d.all_gather_cat(t) is t
    assert d.all_reduce_float(2.5) == 2.5
    assert d.rank_seed(7) == 7
    assert d.init_from_env({}) is False and d.init_from_env({"WORLD_SIZE": "1"}) is False


def test_init_from_env_rejects_bad_variables():
    import pytest

    from continual_blr import distributed as d

    with pytest.raises(ValueError, match="MASTER_ADDR"):
        d.init_from_env({"WORLD_SIZE": "2", "RANK": "0"})
    with pytest.raises(ValueError, match="RANK=5"):
        d.init_from_env({"WORLD_SIZE": "2", "RANK": "5", "MASTER_ADDR": "x", "MASTER_PORT": "1"})
    with pytest.raises(ValueError, match="integers"):
        d.init_from_env({"WORLD_SIZE": "two"})


@pytest.mark.slow  # ≈ 50 s: Avalanche's import in three processes
def test_avalanche_weight_prior_plugin_under_distributed_helper(tmp_path):
    """EWC's plugin (declares supports_distributed) under Avalanche's DistributedHelper, 2 gloo processes,
    each with its DistributedSampler part of every experience: the ranks end with the same weights and the
    same carried Gaussian, and the last task's Fisher equals the one computed in one process on the whole
    experience at the same weights (the task-end curvature is sharded and all-reduced; float32, rtol 1e-5)."""
    import pytest

    pytest.importorskip("avalanche")
    home = tmp_path / "home"
    home.mkdir()
    procs = _launch(["avalanche", str(tmp_path), "ewc"], extra_env={"HOME": str(home), "WANDB_MODE": "disabled"})
    for code, err in _wait(procs, limit_s=300):
        assert code == 0, err[-3000:]
    r0, r1 = (torch.load(tmp_path / f"avalanche.rank{r}.pt", weights_only=False) for r in range(2))
    assert r0["supports"] and r1["supports"]
    for (path, x), (_, y) in zip(_leaves({k: r0[k] for k in ("weights", "state")}),
                                 _leaves({k: r1[k] for k in ("weights", "state")})):
        assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), path
    last = r0["state"]["regularizer"]["terms"][-1]["precision"]
    for k, v in r0["alone"].items():
        torch.testing.assert_close(last[k], v, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # ≈ 50 s: Avalanche's import in three processes
def test_avalanche_buffer_replay_plugin_under_distributed_helper(tmp_path):
    """ER's plugin (declares supports_distributed) under Avalanche's DistributedHelper, 2 gloo processes each with
    its own part of every minibatch: the ranks gather the minibatches before the buffer sees them, so they end with
    the same buffer (examples, labels, heads) and, replaying the same examples, the same weights."""
    import pytest

    pytest.importorskip("avalanche")
    home = tmp_path / "home"
    home.mkdir()
    procs = _launch(["avalanche", str(tmp_path), "er"], extra_env={"HOME": str(home), "WANDB_MODE": "disabled"})
    for code, err in _wait(procs, limit_s=300):
        assert code == 0, err[-3000:]
    r0, r1 = (torch.load(tmp_path / f"avalanche.rank{r}.pt", weights_only=False) for r in range(2))
    assert r0["supports"] and r1["supports"]
    buf = r0["state"]["buffer"]
    assert buf["size"] == 30 and buf["n_seen"] == 2 * 2 * 120  # 2 tasks × 2 epochs × 120: every example offered
    for (path, x), (_, y) in zip(_leaves({k: r0[k] for k in ("weights", "state")}),
                                 _leaves({k: r1[k] for k in ("weights", "state")})):
        assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), path


def test_avalanche_plugins_declare_distributed_support():
    """The weight-prior and buffer-replay plugins declare it; every other plugin says why not in its docstring."""
    import pytest

    pytest.importorskip("avalanche")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from continual_blr.integrations import avalanche as av
    assert av.WeightPriorPlugin.supports_distributed is True and av.BufferReplayPlugin.supports_distributed is True
    for cls in (av.MethodPlugin, av.VCLPlugin, av.FROMPPlugin, av.BLRPlugin):
        assert cls.supports_distributed is False
        assert "Not declared supports_distributed" in cls.__doc__, cls


# ------------------------------------------------------------------------------------------- Ray sweeps

SWEEP = {"stream": {"name": "split_digits"}, "model": {"hidden": [16]}, "train": {"epochs": 1, "batch_size": 32},
         "methods": ["none", "l2"], "progress": False}


def _sweep_twice(tmp_path, executor) -> None:
    """2 methods × 2 seeds on split digits write the table; a second invocation reruns nothing."""
    from continual_blr.config import RunConfig, from_dict
    from continual_blr.sweep import run_seeds

    cfg = from_dict(RunConfig, SWEEP)
    first = run_seeds(cfg, [0, 1], tmp_path / "sw", executor=executor)
    summary = (tmp_path / "sw" / "summary.md").read_text()
    assert "| none | 2 |" in summary and "| l2 | 2 |" in summary
    assert len(list((tmp_path / "sw").glob("seed-*/results.json"))) == 2
    again = run_seeds(cfg, [0, 1], tmp_path / "sw", executor=executor)
    # reloaded, not retrained: a rerun would measure other task wall times (task_times is in to_dict)
    assert [[r.to_dict() for r in per] for per in again] == [[r.to_dict() for r in per] for per in first]


def test_sweep_without_ray_runs_locally(tmp_path, monkeypatch):
    """Without Ray the same call runs the sweep in this process (the sequential executor)."""
    import continual_blr.sweep_ray as sr
    from continual_blr.sweep import sequential_executor

    monkeypatch.setattr(sr, "ray_available", lambda: False)
    assert sr.ray_executor() is sequential_executor
    import pytest

    with pytest.raises(ImportError, match="continual_blr\\[ray\\]"):
        sr.ray_executor(require=True)
    with pytest.raises(ValueError, match="num_cpus"):
        sr.ray_executor(num_cpus=0)
    _sweep_twice(tmp_path, sr.ray_executor())


@pytest.mark.slow  # starting a local Ray takes ~10-20 s
def test_local_ray_sweep(tmp_path):
    """A local Ray (2 CPUs) runs each seed's run as a task; the second invocation reruns nothing."""
    import pytest

    ray = pytest.importorskip("ray")
    from continual_blr.sweep_ray import ray_executor

    try:
        _sweep_twice(tmp_path, ray_executor(num_cpus=1, init_kwargs={"num_cpus": 2}, require=True))
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------------------------- worker side


def _worker(argv: list[str]) -> None:
    from continual_blr import distributed

    mode, out = argv[0], Path(argv[1])
    if mode == "avalanche":
        _avalanche_run(out, argv[2])
        return
    distributed.init_from_env(timeout_s=float(os.environ.get("CBLR_TEST_TIMEOUT", "60")))
    with distributed.fail_fast("worker"):
        if mode == "worker":
            for case in argv[2:]:
                torch.save(run_case(case), out / f"{case}.rank{distributed.rank()}.pt")
        elif mode == "fail":
            _failing_run()
    distributed.shutdown()


def _failing_run() -> None:
    """A run whose method raises on rank 1 at the end of the first task while rank 0 goes on."""
    from continual_blr import distributed
    from continual_blr.data.synthetic import synthetic_stream
    from continual_blr.loop import run_stream
    from continual_blr.methods import Method, TrainConfig
    from continual_blr.models import build_model

    class Failing(Method):
        def on_task_end(self, model, task, optimizer=None):
            if distributed.rank() == 1:
                raise RuntimeError("boom on rank 1\nsecond line that must not be printed")

    stream = synthetic_stream(n_tasks=3, n_features=6, n_train=60, n_test=20, seed=0)
    model = build_model("mlp", stream.input_shape, stream.n_outputs, stream.n_heads, hidden=(8,),
                        generator=torch.Generator().manual_seed(0))
    run_stream(model, stream, Failing(), TrainConfig(epochs=50, batch_size=10), progress=False)


def _avalanche_run(out: Path, name: str) -> None:
    """A plugin under Avalanche's DistributedHelper (gloo, a DistributedSampler per rank); saves
    the weights, the carried Gaussian and the last task's curvature recomputed in this process alone."""
    import warnings

    warnings.simplefilter("ignore")
    from avalanche.distributed import DistributedHelper
    from avalanche.models import MTSimpleMLP
    from avalanche.training import Naive
    from avalanche.training.plugins import EvaluationPlugin

    from continual_blr import distributed
    from continual_blr.curvature import curvature
    from continual_blr.data.synthetic import synthetic_stream
    from continual_blr.integrations import avalanche as av

    DistributedHelper.init_distributed(random_seed=0, backend="gloo", use_cuda=False)
    with distributed.fail_fast("avalanche worker"):
        stream = synthetic_stream(n_tasks=2, n_features=10, n_train=120, n_test=40, seed=0)
        benchmark = av.stream_to_benchmark(stream)
        torch.manual_seed(0)
        model = MTSimpleMLP(input_size=10, hidden_size=16)  # not wrapped: the plugin all-reduces the gradient
        if name in av.BufferReplayPlugin.family:
            plugin = av.BufferReplayPlugin(name, {"memory_size": 30}, seed=0)
        else:
            plugin = av.WeightPriorPlugin(name, {"lam": 10.0} if name == "ewc" else {}, seed=0)
        strategy = Naive(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01), train_mb_size=20,
                         train_epochs=2, plugins=[plugin], evaluator=EvaluationPlugin(loggers=[]))
        for exp in benchmark.train_stream:
            strategy.train(exp, num_workers=0)
        task = av.task_from_experience(exp)
        view = plugin.view
        reg = plugin.method.regularizer
        alone = {} if reg is None else curvature(view, task.x_train, task.y_train, kind="ggn", structure="diag",
                                                 head=task.head, param_names=reg.names(view), shard=False)
        torch.save({"weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "state": plugin.method.state_dict(),
                    "alone": {k: v / task.n_train for k, v in alone.items()},
                    "supports": bool(getattr(plugin, "supports_distributed", False))},
                   out / f"avalanche.rank{distributed.rank()}.pt")
    distributed.shutdown()


if __name__ == "__main__":
    _worker(sys.argv[1:])
