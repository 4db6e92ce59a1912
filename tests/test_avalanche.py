"""Avalanche plugins: the library's own objects inside Avalanche give run_stream's numbers.

Every stream here is built from tensors (the synthetic stream, or a few hundred generated MNIST-format
images in a temporary folder): no downloads. HOME is a temporary folder and wandb is disabled
(tests/conftest.py); every test runs with a temporary working directory, so loggers and Avalanche's
config cannot write into the repository. Avalanche is imported inside the tests (≈ 5–10 s, once).

Methods are parametrised over the registry at collection time plus the names the project plans, and
skipped while not registered, so new methods are picked up without editing this file.
"""

from __future__ import annotations

import copy
import math
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from continual_blr.data import make_stream
from continual_blr.loop import fit_task, run_stream
from continual_blr.methods import METHODS, Method, TrainConfig, build_method
from continual_blr.models import build_model
from continual_blr.optim.blr import BayesianLearningRule
from continual_blr.types import Batch

pytest.importorskip("avalanche", reason="Avalanche is the [avalanche] extra")

ROOT = Path(__file__).resolve().parents[1]
ALL = tuple(METHODS)  # every registered method is enrolled: a new one needs no edit here
RUNNABLE = tuple(n for n in ALL if n != "joint")  # joint trains on past data: refused by the plugin
FROMP_FAMILY = tuple(n for n in ALL if n.startswith(("fromp", "frorp")))
# small settings that keep every method fast on the synthetic stream (keys must exist in the params)
FAST = {**{name: {"n_points": 8} for name in FROMP_FAMILY}, "vcl": {"predict_samples": 3},
        "fromp-replay": {"memory_size": 16}, "er": {"memory_size": 20}, "derpp": {"memory_size": 20}}
EPOCHS, BATCH, LR = 2, 50, 0.01

# EvaluationPlugin(loggers=[]) says "No loggers specified" on purpose here
pytestmark = pytest.mark.filterwarnings("ignore:No loggers specified:UserWarning")


def _params(name: str) -> dict:
    return dict(FAST.get(name, {}))


def _require(name: str) -> None:
    if name not in METHODS:
        pytest.skip(f"method {name!r} is not registered yet")
    try:
        build_method(name, _params(name))
    except ImportError as err:  # an optional dependency (e.g. ivon-opt) is not installed
        pytest.skip(str(err))


@pytest.fixture(autouse=True)
def _cwd_in_tmp_one_thread(tmp_path, monkeypatch):
    """Loggers' default folders land in a temporary folder; one intra-op thread (these networks are
    tiny: on a shared 2-core machine two threads made each step ~30x slower)."""
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def av():
    """Import the integration (and Avalanche) after conftest isolated HOME; its import warnings
    (qpsolvers' missing solver, torch.jit FutureWarnings) are silenced, never raised."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from continual_blr.integrations import avalanche as integration
    return integration


# ----------------------------------------------------------------------------------------------
# helpers: the same model, data and minibatch order on both sides
# ----------------------------------------------------------------------------------------------
def _stream(n_train=100, n_test=50):
    return make_stream("synthetic", scenario="task", seed=0, n_train=n_train, n_test=n_test)


def _model(stream, seed=0):
    return build_model("mlp", stream.input_shape, stream.n_outputs, stream.n_heads, hidden=(16,),
                       generator=torch.Generator().manual_seed(seed))


def _train(**kw) -> TrainConfig:
    return TrainConfig(**{"epochs": EPOCHS, "batch_size": BATCH, "lr": LR, "optimizer": "adam", **kw})


def _in_library_order(seed: int):
    """Naive whose training minibatches are run_stream's: the same seeded permutation per epoch, cut into
    the same consecutive slices (``loop._batches`` with one task), from a generator that lives across
    experiences exactly like run_stream's."""
    from avalanche.training import Naive
    from torch.utils.data import DataLoader, Sampler

    generator = torch.Generator().manual_seed(seed)

    class LibraryBatches(Sampler):
        def __init__(self, n: int, batch_size: int) -> None:
            self.n, self.batch_size = n, batch_size

        def __iter__(self):
            perm = torch.randperm(self.n, generator=generator)
            return iter([perm[s : s + self.batch_size].tolist() for s in range(0, self.n, self.batch_size)])

        def __len__(self) -> int:
            return math.ceil(self.n / self.batch_size)

    class InLibraryOrder(Naive):
        def make_train_dataloader(self, **kwargs):
            ds = self.adapted_dataset
            self.dataloader = DataLoader(ds, batch_sampler=LibraryBatches(len(ds), self.train_mb_size),
                                         collate_fn=ds.collate_fn)

    return InLibraryOrder


def _run_library(name, stream, init, train, seed=0, params=None):
    model = _model(stream)
    model.load_state_dict(init)
    method = build_method(name, _params(name) if params is None else params, seed=seed)
    result = run_stream(model, stream, method, train, seed=seed, progress=False)
    return result.acc_matrix, model, method


def _run_avalanche(av, name, stream, init, train, seed=0, plugins=(), after=(), params=None):
    from avalanche.evaluation.metrics import accuracy_metrics
    from avalanche.training.plugins import EvaluationPlugin

    net = _model(stream)
    net.load_state_dict(init)
    model = av.TaskLabelModel(net)
    plugin = av.MethodPlugin(name, _params(name) if params is None else params, seed=seed, grad_clip=train.grad_clip)
    opt_cls = torch.optim.Adam if train.optimizer == "adam" else torch.optim.SGD
    strategy = _in_library_order(seed)(
        model=model, optimizer=opt_cls(model.parameters(), lr=train.lr), train_mb_size=train.batch_size,
        train_epochs=train.epochs, eval_mb_size=train.eval_batch_size, plugins=[*plugins, plugin, *after],
        evaluator=EvaluationPlugin(accuracy_metrics(experience=True), loggers=[]),
    )
    benchmark = av.stream_to_benchmark(stream)
    results = []
    for i, experience in enumerate(benchmark.train_stream):
        strategy.train(experience)
        results.append(strategy.eval(benchmark.test_stream[: i + 1]))
    return av.accuracy_matrix(results), net, plugin


_RUNS: dict = {}


def _paired_runs(av, name):
    """run_stream and Avalanche Naive + MethodPlugin on the same stream / weights / minibatches (cached:
    the equivalence and the FROMP-memory tests read the same pair of runs)."""
    if name not in _RUNS:
        stream = _stream()
        init = copy.deepcopy(_model(stream).state_dict())
        train = _train()
        _RUNS[name] = (stream, _run_library(name, stream, init, train), _run_avalanche(av, name, stream, init, train))
    return _RUNS[name]


def _assert_tree_close(a, b, path="state", rtol=1e-5, atol=1e-6):
    """Nested dicts / lists / tensors / numbers equal up to float tolerance."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            _assert_tree_close(a[k], b[k], f"{path}.{k}", rtol, atol)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_tree_close(x, y, f"{path}[{i}]", rtol, atol)
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and a.shape == b.shape, f"{path}: shapes {tuple(a.shape)} vs {tuple(b.shape)}"
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{path}: {m}")
        else:
            assert torch.equal(a, b), f"{path}: integer tensors differ"
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=rtol, abs=atol), f"{path}: {a} vs {b}"
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def _assert_matrices_agree(lib, ava, tol=1e-6):
    assert len(lib) == len(ava)
    for i, (r1, r2) in enumerate(zip(lib, ava)):
        for j, (u, v) in enumerate(zip(r1, r2)):
            if j > i:
                assert math.isnan(u) and math.isnan(v)
            else:
                assert abs(u - v) <= tol, f"R[{i}][{j}]: run_stream {u} vs Avalanche {v}"


# ----------------------------------------------------------------------------------------------
# adapters
# ----------------------------------------------------------------------------------------------
def test_model_adapters_follow_each_convention(av):
    from avalanche.models import MTSimpleMLP, SimpleMLP

    stream = _stream()
    net = _model(stream)
    x = torch.randn(6, 10)
    wrapped = av.TaskLabelModel(net)
    assert av.library_model(wrapped) is net  # unwrapped: same parameter names as in run_stream
    labels = torch.tensor([0, 2, 2, 1, 0, 1])
    mixed = wrapped(x, labels)
    for h in range(3):
        torch.testing.assert_close(wrapped(x, torch.full((6,), h)), net(x, head=h), rtol=0, atol=0)
        torch.testing.assert_close(mixed[labels == h], net(x[labels == h], head=h), rtol=0, atol=0)

    mt = MTSimpleMLP(input_size=10, hidden_size=8).eval()
    view = av.library_model(mt)
    assert isinstance(view, av.HeadModel)
    torch.testing.assert_close(view(x, head=0), mt(x, 0), rtol=0, atol=0)
    assert {n.removeprefix("model.") for n, _ in view.named_parameters()} == {n for n, _ in mt.named_parameters()}
    plain = SimpleMLP(num_classes=3, input_size=10, hidden_size=8, drop_rate=0).eval()
    torch.testing.assert_close(av.library_model(plain)(x, head=4), plain(x), rtol=0, atol=0)


def test_task_from_experience_matches_the_stream(av):
    stream = _stream()
    benchmark = av.stream_to_benchmark(stream)
    for task, exp in zip(stream.tasks, benchmark.train_stream):
        got = av.task_from_experience(exp)
        assert (got.task_id, got.head, got.classes, got.n_train) == (task.task_id, task.head, (0, 1), task.n_train)
        torch.testing.assert_close(got.x_train, task.x_train, rtol=0, atol=0)
        assert torch.equal(got.y_train, task.y_train) and got.y_train.dtype == torch.int64
        assert got.x_test.shape[0] == 0


def test_posteriors_grow_by_blocks(av):
    """_restrict / _join (how a BLR posterior takes in a new head): the dense precision of the joined
    Gaussian is block-diagonal in the two parts, for every structure."""
    from continual_blr.posteriors import DiagPosterior, FullPosterior, KronPosterior, kron_layers

    net = _model(_stream())
    mean = {k: torch.randn_like(v, dtype=torch.float64) for k, v in net.named_parameters()}
    names = list(mean)
    old, new = names[:2], names[2:4]  # body layer | head 0
    g = torch.Generator().manual_seed(0)
    posts = [
        DiagPosterior(mean, {k: torch.rand(v.shape, generator=g, dtype=torch.float64) + 0.5 for k, v in mean.items()}),
        KronPosterior.isotropic(mean, 2.0, kron_layers(net)),
        FullPosterior({k: mean[k] for k in old + new}, 3.0),
    ]
    for post in posts:
        a, b = av._restrict(post, old), av._restrict(post, new)
        if isinstance(post, KronPosterior):  # a carried posterior whose isotropic δ has moved
            eye = lambda n: torch.eye(n, dtype=torch.float64)  # noqa: E731
            a = KronPosterior(a.mean, [(w, bias, [(eye(11), 0.3 * eye(16))]) for w, bias, _ in a.blocks], a.diag, 0.7)
        joined = av._join(a, b)
        assert list(joined.mean) == old + new
        ma, pa = a.to_dense()
        mb, pb = b.to_dense()
        mj, pj = joined.to_dense()
        torch.testing.assert_close(mj, torch.cat([ma, mb]))
        torch.testing.assert_close(pj, torch.block_diag(pa, pb))
        with pytest.raises(ValueError, match="overlapping"):
            av._join(a, a)


def test_plugin_argument_errors(av):
    with pytest.raises(ValueError, match="allowed: .*none"):
        av.MethodPlugin("nope")
    with pytest.raises(ValueError, match="grad_clip"):
        av.MethodPlugin("none", train=_train(), grad_clip=1.0)
    with pytest.raises(ValueError, match="grad_clip"):
        av.MethodPlugin("none", grad_clip=0.0)
    with pytest.raises(ValueError, match="scenario"):
        av.MethodPlugin("none", scenario="banana")
    with pytest.raises(ValueError, match="train.augment.*transforms"):  # the library loop's option, not a plugin's
        av.MethodPlugin("derpp", train=TrainConfig(epochs=1, batch_size=4, augment="crop_flip"))
    with pytest.raises(ValueError, match="params"):
        av.MethodPlugin(build_method("none"), {"lr": 1.0})
    with pytest.raises(ValueError, match="not in this family"):
        av.BLRPlugin("none")
    plugin = av.BLRPlugin(params={"mc_samples": 2})
    assert plugin.method.name == "blr" and plugin.method.params.mc_samples == 2
    for cls, name in ((av.WeightPriorPlugin, "ewc"), (av.FROMPPlugin, "frorp"), (av.VCLPlugin, "vcl")):
        if name in METHODS:
            assert cls(name).method.name == name
            with pytest.raises(ValueError, match="not in this family"):
                cls("blr")


# ----------------------------------------------------------------------------------------------
# equivalence with run_stream
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", RUNNABLE)
def test_same_accuracy_matrix_and_state_as_run_stream(av, name):
    """Same initial weights, data, minibatches (Adam, 2 epochs of 2 minibatches) and seeds: Avalanche
    Naive + plugin reproduces run_stream — the accuracy matrix (to 1e-6), and bit for bit the final
    weights and the method's whole state (posteriors, FROMP's memory, old predictions and kernels)."""
    _require(name)
    _, (acc_lib, model_lib, method_lib), (acc_av, model_av, plugin) = _paired_runs(av, name)
    _assert_matrices_agree(acc_lib, acc_av)
    # on one machine the two runs are the same floating-point computation: bit-identical
    _assert_tree_close(model_lib.state_dict(), model_av.state_dict(), "weights", rtol=0, atol=0)
    _assert_tree_close(method_lib.state_dict(), plugin.method.state_dict(), f"{name}.state_dict()", rtol=0, atol=0)


def test_split_digits_blr_recipe_same_as_run_stream(av):
    """The embedded split-digits BLR (GGN ĥ from the minibatch's BatchClosure, the debiased precision
    rate counted from each task's start, a tempered carried prior) trains the same through the plugin:
    bit-identical weights and posterior after two experiences."""
    from continual_blr.config import SPLIT_DIGITS_BLR

    stream = _stream()
    init = copy.deepcopy(_model(stream).state_dict())
    train = _train()
    params = dict(SPLIT_DIGITS_BLR)
    acc_lib, model_lib, method_lib = _run_library("blr", stream, init, train, params=params)
    acc_av, model_av, plugin = _run_avalanche(av, "blr", stream, init, train, params=params)
    assert plugin.method.optimizer.debias and plugin.method.optimizer.curvature == "ggn"
    _assert_matrices_agree(acc_lib, acc_av)
    _assert_tree_close(model_lib.state_dict(), model_av.state_dict(), "weights", rtol=0, atol=0)
    _assert_tree_close(method_lib.state_dict(), plugin.method.state_dict(), "blr.state_dict()", rtol=0, atol=0)


@pytest.mark.parametrize("params", [
    {"curvature": "price", "init_hess": 0.1, "mc_samples": 1},  # IVON's estimator, a data-scale start
    {"structure": "kron", "temperature": 0.1},  # a tempered Kronecker prior S₀ + D/T
    {"damping": 0.1, "clip_radius": None, "init_hess": 0.05},  # a damped step, D restarted at N h₀
], ids=["price", "kron-tempered", "damped"])
def test_blr_engine_options_same_as_run_stream(av, params):
    """The BLR engine's options (S = S₀ + D: the Price estimator, a tempered Kronecker prior, damping and
    init_hess) train the same through the plugin as through run_stream: bit-identical weights and state."""
    stream = _stream()
    init = copy.deepcopy(_model(stream).state_dict())
    train = _train()
    acc_lib, model_lib, method_lib = _run_library("blr", stream, init, train, params=params)
    acc_av, model_av, plugin = _run_avalanche(av, "blr", stream, init, train, params=params)
    _assert_matrices_agree(acc_lib, acc_av)
    _assert_tree_close(model_lib.state_dict(), model_av.state_dict(), "weights", rtol=0, atol=0)
    _assert_tree_close(method_lib.state_dict(), plugin.method.state_dict(), "blr.state_dict()", rtol=0, atol=0)
    assert not torch.equal(model_lib.state_dict()["body.1.weight"], init["body.1.weight"])  # it trained


@pytest.mark.parametrize("name", FROMP_FAMILY or ("fromp",))
def test_fromp_memory_and_kernels_equal_run_stream(av, name):
    """The memorable points (indices into the task's training set), the old predictions and the kernels
    (with their Cholesky factors) built inside Avalanche equal run_stream's on the same data."""
    _require(name)
    stream, (_, _, method_lib), (_, _, plugin) = _paired_runs(av, name)
    mem_lib, mem_av = method_lib.regularizer.memory, plugin.method.regularizer.memory
    assert len(mem_lib) == len(mem_av) == len(stream)
    built = 0
    for e_lib, e_av in zip(mem_lib, mem_av):
        assert (e_lib.task_id, e_lib.head) == (e_av.task_id, e_av.head)
        assert torch.equal(e_lib.indices, e_av.indices)
        torch.testing.assert_close(e_lib.x, e_av.x, rtol=0, atol=0)
        assert set(e_lib.extras) == set(e_av.extras)
        for key in e_lib.extras:  # p_old, kernel, chol, kinv (rebuilt at the last task's start)
            torch.testing.assert_close(e_lib.extras[key], e_av.extras[key], rtol=0, atol=0)
        built += "kernel" in e_lib.extras or "p_old" in e_lib.extras
    assert built == len(stream) - 1  # every past task's kernel was rebuilt at the last task's start


def _loss_spy(record: dict, key: str):
    """A plugin that records ``strategy.loss`` in before_backward (and, as ``"before"``, the model state
    and the minibatch); placed before and after the method's plugin it reads the plugin's increment."""
    from avalanche.core import SupervisedPlugin

    class LossSpy(SupervisedPlugin):
        def before_backward(self, strategy, **kwargs):
            record.setdefault(key, []).append(float(strategy.loss.detach().double().sum()))
            if key == "before":
                record.setdefault("state", []).append(copy.deepcopy(strategy.model.model.state_dict()))
                record.setdefault("batch", []).append((strategy.mb_x.clone(), strategy.mb_y.clone(),
                                                       int(strategy.mb_task_id[0])))

    return LossSpy()


@pytest.mark.parametrize("name", tuple(n for n in RUNNABLE if n not in ("none", "blr")))
def test_plugin_penalty_equals_the_library_regularizer(av, name):
    """At every minibatch of the second task, for the same model state, the term the plugin adds to
    Avalanche's loss equals the regulariser of a method trained on task 1 by the library's fit_task."""
    _require(name)
    if _overrides_make_optimizer(name):
        pytest.skip(f"method {name!r} trains with its own optimiser (no penalty in before_backward)")
    if build_method(name, _params(name)).regularizer is None:
        pytest.skip(f"method {name!r} has no regulariser (its replay terms: test_same_accuracy_matrix_and_state_...)")
    stream = _stream()
    stream.tasks = stream.tasks[:2]
    init = copy.deepcopy(_model(stream).state_dict())
    train = _train(epochs=1)
    record: dict = {}
    _run_avalanche(av, name, stream, init, train, plugins=[_loss_spy(record, "before")],
                   after=[_loss_spy(record, "after")])

    # library side: task 1 with fit_task, then task 2's on_task_start (FROMP rebuilds kernels there)
    model = _model(stream)
    model.load_state_dict(init)
    method = build_method(name, _params(name), seed=0)
    method.setup(model, stream, train)
    fit_task(model, stream.tasks[0], method, train, seen=stream.tasks[:1],
             generator=torch.Generator().manual_seed(0), progress=False)
    method.on_task_start(model, stream.tasks[1])
    assert method.regularizer is not None
    probe = _model(stream)
    n_first = math.ceil(stream.tasks[0].n_train / train.batch_size)
    steps = list(zip(record["state"], record["batch"], record["before"], record["after"]))[n_first:]
    assert len(steps) == math.ceil(stream.tasks[1].n_train / train.batch_size)
    nonzero = 0
    for state, (x, y, head), before, after in steps:
        probe.load_state_dict(state)
        batch = Batch(x, y, head)
        with torch.no_grad():
            if type(method).loss is Method.loss:
                expected = float(method.regularizer.penalty(probe, batch, stream.tasks[1]))
            else:
                expected = float(method.loss(probe, batch, stream.tasks[1]) - F.cross_entropy(probe(x, head=head), y))
        assert after - before == pytest.approx(expected, rel=1e-5, abs=1e-6)
        nonzero += expected != 0.0
    assert nonzero > 0, "the penalty was zero at every step: the test would not see a difference"


def _overrides_make_optimizer(name: str) -> bool:
    return METHODS[name][0].make_optimizer is not Method.make_optimizer


def test_vcl_coreset_trains_on_the_methods_own_selection(av):
    """VCL holds a coreset out of each task (train_tasks): the plugin trains Avalanche on that selection,
    and the run still equals run_stream's."""
    _require("vcl")
    params = {"coreset_size": 10, "predict_samples": 2, "coreset_epochs": 1}
    stream = _stream()
    init = copy.deepcopy(_model(stream).state_dict())
    train = _train()
    acc_lib, model_lib, method_lib = _run_library("vcl", stream, init, train, params=params)
    acc_av, model_av, plugin = _run_avalanche(av, "vcl", stream, init, train, params=params)
    assert plugin.train_task.n_train == stream.tasks[-1].n_train - 10
    _assert_matrices_agree(acc_lib, acc_av)
    _assert_tree_close(model_lib.state_dict(), model_av.state_dict(), "weights", rtol=0, atol=0)
    _assert_tree_close(method_lib.state_dict(), plugin.method.state_dict(), "vcl.state_dict()", rtol=0, atol=0)


def test_joint_is_refused_at_its_second_experience(av):
    stream = _stream()
    with pytest.raises(ValueError, match="several tasks"):
        _run_avalanche(av, "joint", stream, _model(stream).state_dict(), _train(epochs=1))


# ----------------------------------------------------------------------------------------------
# Avalanche-native models: heads added mid-stream; BLR optimisers across experiences
# ----------------------------------------------------------------------------------------------
MULTIHEAD_JUST_TRAINED_MIN = 0.8


@pytest.mark.parametrize("name", RUNNABLE)
def test_multihead_heads_added_mid_stream(av, name, tmp_path):
    """MTSimpleMLP (MultiHeadClassifier) on a task-labelled stream: Avalanche adds head t at experience t.
    Every plugin trains end to end, every new head is trained and learns its experience, and
    EvaluationPlugin's accuracy / forgetting metrics and a text logger work alongside."""
    _require(name)
    from avalanche.core import SupervisedPlugin
    from avalanche.evaluation.metrics import accuracy_metrics, forgetting_metrics
    from avalanche.logging import TextLogger
    from avalanche.models import MTSimpleMLP
    from avalanche.training import Naive
    from avalanche.training.plugins import EvaluationPlugin

    heads_seen, moved = [], []

    class HeadSpy(SupervisedPlugin):
        def before_training_exp(self, strategy, **kwargs):
            heads_seen.append(sorted(strategy.model.classifier.classifiers))
            t = str(strategy.experience.task_label)
            self.w = strategy.model.classifier.classifiers[t].classifier.weight.detach().clone()

        def after_training_exp(self, strategy, **kwargs):
            t = str(strategy.experience.task_label)
            moved.append(not torch.equal(self.w, strategy.model.classifier.classifiers[t].classifier.weight))

    stream = _stream()
    benchmark = av.stream_to_benchmark(stream)
    # VCL: the mean network's accuracy. After 10 steps on 100 examples its carried posterior is honestly wide
    # (precision 3-60 against the 400 of its start, which no longer leaks into q), and 3 predictive samples
    # of it score near chance; what this test checks is that every head added mid-stream learns.
    params = {**_params(name), "predict_samples": 0} if name == "vcl" else _params(name)
    plugin = av.MethodPlugin(name, params, seed=0)
    log = open(tmp_path / "log.txt", "w")
    with torch.random.fork_rng():  # Avalanche draws new heads, dropout and shuffling from the global RNG
        torch.manual_seed(0)
        model = MTSimpleMLP(input_size=10, hidden_size=16)
        strategy = Naive(
            model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01), train_mb_size=50, train_epochs=5,
            plugins=[plugin, HeadSpy()],
            evaluator=EvaluationPlugin(accuracy_metrics(experience=True, stream=True),
                                       forgetting_metrics(experience=True, stream=True), loggers=[TextLogger(log)]),
        )
        results = []
        try:
            for i, experience in enumerate(benchmark.train_stream):
                strategy.train(experience)
                results.append(strategy.eval(benchmark.test_stream[: i + 1]))
        finally:
            log.close()
    assert heads_seen == [["0"], ["0", "1"], ["0", "1", "2"]]
    assert moved == [True, True, True]
    acc = av.accuracy_matrix(results)
    # each experience is two blobs with a balanced test set on its own 2-way head: an input-blind
    # predictor scores 0.5 there; measured at 5 epochs, every method's just-trained accuracy is 1.0
    assert min(acc[i][i] for i in range(3)) >= MULTIHEAD_JUST_TRAINED_MIN, acc
    assert "StreamForgetting/eval_phase/test_stream" in results[-1]
    assert "Top1_Acc_Exp/eval_phase/test_stream/Task002/Exp002" in (tmp_path / "log.txt").read_text()
    if isinstance(plugin.optimizer, BayesianLearningRule):  # the BLR now covers every head, old ones unchanged
        assert {n for n, _ in plugin.view.named_parameters()} == set(plugin.optimizer.names)


@pytest.mark.parametrize("kernel", ["classwise", "full"])
def test_fromp_curvature_of_a_head_added_after_the_first_task(kernel):
    """FunctionalRegularizer._accumulate_curvature on a model that gains a head after task 0 (what
    Avalanche's MultiHeadClassifier does): the new head gets a curvature entry, equal to task 1's GGN
    diagonal alone (task 0 never reached it); the old head keeps task 0's (task 1 does not reach it); the
    shared layer holds the sum. Before the new head's task ends, Σ there is the prior variance 1/δ.
    Oracle: the dense float64 GGN by one backward per example and output (tests/oracles.py).
    (The old code indexed ``self.fisher[k]`` with the new head's names: KeyError.)"""
    import oracles as O
    from continual_blr.data.stream import Task
    from continual_blr.regularizers.functional import FunctionalRegularizer
    from continual_blr.types import params_of

    dt, delta = torch.float64, 0.3
    g = torch.Generator().manual_seed(0)
    model = build_model("mlp", (3,), 2, 1, hidden=(4,), generator=g).to(dt).eval()

    def task(t):
        x = torch.randn(6, 3, generator=g, dtype=dt)
        y = torch.arange(6) % 2
        return Task(t, x, y, x, y, (0, 1), head=t, name=f"t{t}")

    def ggn_diag(t):
        d = torch.diagonal(O.ggn(model, t.x_train, head=t.head))
        return dict(zip(params_of(model), d.split([p.numel() for p in params_of(model).values()])))

    def perturb():  # "training" moves every weight
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5 * torch.randn(p.shape, generator=g, dtype=dt))

    reg = FunctionalRegularizer(n_points=2, prior_precision=delta, kernel=kernel)
    t0, t1 = task(0), task(1)
    perturb()
    f0 = ggn_diag(t0)
    reg.on_task_end(model, t0)
    model.heads.append(torch.nn.Linear(4, 2).to(dt))
    new = ("heads.1.weight", "heads.1.bias")
    sigma = reg.sigma(model)
    for k in new:  # no task has reached the new head yet: zero curvature, the prior variance
        torch.testing.assert_close(sigma[k], torch.full_like(sigma[k], 1.0 / delta), rtol=1e-12, atol=0)
    perturb()
    f1 = ggn_diag(t1)
    reg.on_task_end(model, t1)
    assert set(reg.fisher) == set(params_of(model))
    for k, p in params_of(model).items():
        want = f1[k] + (f0[k] if k in f0 else 0.0)
        torch.testing.assert_close(reg.fisher[k], want.reshape(p.shape), rtol=1e-10, atol=1e-12, msg=k)
    assert float(reg.fisher["heads.1.weight"].abs().sum()) > 0 and float(reg.fisher["heads.0.weight"].abs().sum()) > 0


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_blr_optimizer_survives_avalanche_resets(av, structure):
    """The BLR optimiser is the method's, not the strategy's: the same object across experiences, its
    posterior carried (not reset), a new head entered with the initial prior N(0, 1/δ) and the initial
    posterior precision in the posterior's structure; the strategy's own optimiser never moves a covered parameter."""
    from avalanche.models import MTSimpleMLP
    from avalanche.training import Naive
    from avalanche.training.plugins import EvaluationPlugin

    from avalanche.core import SupervisedPlugin

    seen = []

    class AtFirstStep(SupervisedPlugin):  # the BLR's state when an experience's first step starts
        def before_training_iteration(self, strategy, **kwargs):
            if strategy.clock.train_exp_iterations == 0:
                opt = plugin.optimizer
                seen.append((opt, opt.prior, opt.preconditioner().covariance_diag()))

    stream = _stream()
    benchmark = av.stream_to_benchmark(stream)
    plugin = av.BLRPlugin("blr", {"prior_precision": 2.0, "init_precision": 4.0, "structure": structure,
                                  "precision_debias": True, "clip_radius": 50.0, "damping": 0.05,
                                  "init_hess": 0.01}, seed=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = MTSimpleMLP(input_size=10, hidden_size=16)
        sgd = torch.optim.SGD(model.parameters(), lr=10.0)  # would wreck the weights if it ever stepped
        strategy = Naive(model=model, optimizer=sgd, train_mb_size=50, train_epochs=1,
                         plugins=[plugin, AtFirstStep()], evaluator=EvaluationPlugin(loggers=[]))
        ends = []
        for experience in benchmark.train_stream[:2]:
            strategy.train(experience)
            ends.append(plugin.optimizer.posterior())
    (opt0, _, _), (opt1, prior1, start1) = seen
    assert opt0 is opt1 is plugin.method.optimizer
    # the settings survive the rebuild for the new head
    assert opt1.debias and opt1.clip_radius == 50.0 and opt1.damping == 0.05 and opt1.init_hess == 0.01
    body, head1 = "model.features.0.weight", "model.classifier.classifiers.1.classifier.weight"
    end0 = ends[0].covariance_diag()
    assert head1 not in end0 and head1 in ends[1].mean
    assert not torch.allclose(end0[body], torch.full_like(end0[body], 0.25))  # learnt in experience 0
    torch.testing.assert_close(start1[body], end0[body])  # carried, not reset by Avalanche
    # posterior of experience 0 = prior of 1 on the body; the new head's prior is the initial N(0, 1/2).
    # Compared through S v: a Kronecker prior joined from parts with different isotropic δ holds
    # several terms per layer, exact in products but without a closed-form diagonal.
    v = {k: torch.randn(t.shape, generator=torch.Generator().manual_seed(1)) for k, t in prior1.mean.items()}
    sv = prior1.precision_matvec(v)
    torch.testing.assert_close(sv[body], ends[0].precision_matvec({k: v[k] for k in ends[0].mean})[body])
    torch.testing.assert_close(sv[head1], 2.0 * v[head1])
    # ... and the new head's step starts at the initial precision 4 (its carried posterior holds no start)
    torch.testing.assert_close(start1[head1], torch.full_like(start1[head1], 0.25))
    assert all(float(p.detach().abs().max()) < 10 for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())


# ----------------------------------------------------------------------------------------------
# Avalanche's classic benchmarks on generated MNIST-format files; the example script
# ----------------------------------------------------------------------------------------------
def _write_fake_mnist(root: Path, n_train: int = 200, n_test: int = 100) -> Path:
    """A few hundred 28×28 images in torchvision's raw MNIST layout (class prototypes plus noise)."""
    rng = np.random.default_rng(0)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    protos = rng.integers(0, 256, size=(10, 28, 28))
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        y = (np.arange(n) % 10).astype(np.uint8)
        x = np.clip(protos[y] // 2 + rng.integers(0, 64, size=(n, 28, 28)), 0, 255).astype(np.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, n, 28, 28) + x.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) + y.tobytes())
    return root


def test_permuted_mnist_with_a_plain_model(av, tmp_path):
    """PermutedMNIST (one head, no MultiTaskModule) with a weight-space prior: the Task the regulariser
    sees is the permuted experience."""
    name = "ewc" if "ewc" in METHODS else "none"
    from avalanche.benchmarks.classic import PermutedMNIST
    from avalanche.models import SimpleMLP
    from avalanche.training import Naive
    from avalanche.training.plugins import EvaluationPlugin

    root = _write_fake_mnist(tmp_path / "data")
    benchmark = PermutedMNIST(2, seed=0, dataset_root=root, train_transform=None, eval_transform=None)
    plugin = av.MethodPlugin(name)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = SimpleMLP(num_classes=10, hidden_size=16, drop_rate=0)
        strategy = Naive(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), train_mb_size=64,
                         plugins=[plugin], evaluator=EvaluationPlugin(loggers=[]))
        tasks = []
        for experience in benchmark.train_stream:
            strategy.train(experience)
            tasks.append(plugin.task)
    assert plugin._stream.scenario == "domain" and tasks[1].head == 0 and tasks[1].n_train == 200
    assert not torch.equal(tasks[0].x_train, tasks[1].x_train)  # each experience permutes the pixels
    pixels = [torch.sort(t.x_train.flatten(1), 1).values for t in tasks]
    assert torch.equal(pixels[0], pixels[1])  # … the same images


def test_example_script_runs_on_generated_mnist(av, tmp_path):
    """examples/avalanche_split_mnist.py end to end (SplitMNIST with task labels, TaskLabelModel, text and
    CSV loggers) on generated files: no network, every write inside tmp_path."""
    import runpy

    root = _write_fake_mnist(tmp_path / "data")
    name = "fromp" if "fromp" in METHODS else "none"
    params = '{"n_points": 4}' if name == "fromp" else "{}"
    main = runpy.run_path(str(ROOT / "examples" / "avalanche_split_mnist.py"))["main"]
    acc = main(["--data-dir", str(root), "--method", name, "--params", params, "--epochs", "3", "--lr", "0.01", "--hidden", "16",
                "--batch-size", "16", "--device", "cpu", "--log-dir", str(tmp_path / "logs")])
    # each experience: two digit prototypes plus noise, 10 + 10 test images on its own 2-way head (an
    # input-blind predictor: 0.5). Measured (fromp, 3 epochs, Adam 0.01): every R[i][i] 1.0, final average 0.9
    assert len(acc) == 5 and min(acc[i][i] for i in range(5)) >= 0.8, acc
    assert sum(acc[4]) / 5 >= 0.7, acc
    assert {"log.txt", "training_results.csv", "eval_results.csv"} <= {p.name for p in (tmp_path / "logs").iterdir()}
