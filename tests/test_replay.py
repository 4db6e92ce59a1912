"""Replay: the buffer's selection rules against their exact probabilities, DER++'s stored logits, FROMP's shared
memory budget, and er / derpp / fromp-replay on class-incremental split digits above fine-tuning.

Tolerances. Inclusion frequencies over R independent buffers are binomial: an item kept with probability p has
frequency p ± sqrt(p(1−p)/R); the bound is 5 such standard deviations (a false alarm about once in 10⁶ per item).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from continual_blr.data import make_stream
from continual_blr.data.stream import Task
from continual_blr.loop import run_stream
from continual_blr.memory import MemoryEntry
from continual_blr.methods import TrainConfig, build_method
from continual_blr.models import build_model
from continual_blr.regularizers.functional import FunctionalRegularizer
from continual_blr.replay_buffer import ReplayBuffer
from continual_blr.types import Batch

SIGMAS = 5.0


def _inclusion(n: int, m: int, trials: int, selection: str, labels: torch.Tensor | None = None,
               batch: int = 3) -> torch.Tensor:
    """Frequency with which each of n examples (offered in minibatches of ``batch``) ends in the buffer."""
    x = torch.arange(n, dtype=torch.float32)[:, None]
    y = torch.zeros(n, dtype=torch.long) if labels is None else labels
    hits = torch.zeros(n)
    for r in range(trials):
        buf = ReplayBuffer(m, selection, seed=r)
        for s in range(0, n, batch):
            buf.add(x[s : s + batch], y[s : s + batch], head=0, task_id=0)
        hits[buf.x[: buf.size, 0].long()] += 1
    return hits / trials


def test_reservoir_keeps_every_example_with_probability_m_over_n():
    """Algorithm R: after n offers each example is stored with probability exactly M/n, whatever its position,
    also when a minibatch writes the same slot twice (the later write wins)."""
    n, m, trials = 12, 4, 3000
    freq = _inclusion(n, m, trials, "reservoir", batch=5)
    p = m / n
    tol = SIGMAS * math.sqrt(p * (1 - p) / trials)
    assert torch.all((freq - p).abs() < tol), freq


def test_a_minibatch_equals_its_examples_one_by_one():
    """``add`` of a minibatch is the sequential rule: the same generator seed gives the same buffer as offering
    the examples one at a time (this exercises two writes to one slot within a minibatch)."""
    x = torch.randn(64, 3)
    y = torch.randint(0, 4, (64,))
    for selection in ("reservoir", "class_balanced"):
        a, b = ReplayBuffer(7, selection, seed=5), ReplayBuffer(7, selection, seed=5)
        a.add(x, y, head=0, task_id=0)
        for i in range(64):
            b.add(x[i : i + 1], y[i : i + 1], head=0, task_id=0)
        assert torch.equal(a.x[: a.size], b.x[: b.size]) and torch.equal(a.y[: a.size], b.y[: b.size]), selection


def test_class_balanced_buffer_balances_classes_and_is_a_reservoir_within_each():
    """CBRS: classes arriving one after another (200 of class 0, then 40 of class 1, then 40 of class 2) end with
    M/3 each — a plain reservoir would keep class 0 in proportion 200/280 — and within a class every example
    is stored with the same probability, (M/3) / n_c."""
    m = 30
    labels = torch.cat([torch.zeros(200), torch.ones(40), torch.full((40,), 2)]).long()
    x = torch.arange(280, dtype=torch.float32)[:, None]
    buf = ReplayBuffer(m, "class_balanced", seed=0)
    for s in range(0, 280, 16):
        buf.add(x[s : s + 16], labels[s : s + 16], head=0, task_id=0)
    assert buf.class_counts() == {0: 10, 1: 10, 2: 10}
    plain = ReplayBuffer(m, "reservoir", seed=0)
    for s in range(0, 280, 16):
        plain.add(x[s : s + 16], labels[s : s + 16], head=0, task_id=0)
    assert plain.class_counts().get(0, 0) > 15  # the contrast: a reservoir follows the stream's frequencies
    trials = 1500
    freq = _inclusion(280, m, trials, "class_balanced", labels=labels, batch=16)
    for c, n_c in ((0, 200), (1, 40), (2, 40)):
        p = 10 / n_c
        tol = SIGMAS * math.sqrt(p * (1 - p) / trials)
        f = freq[labels == c]
        assert torch.all((f - p).abs() < tol), (c, f.min(), f.max(), p)


def test_buffer_state_round_trip_continues_identically():
    """A buffer rebuilt from its state_dict halfway keeps and replays what the uninterrupted one does."""
    x, y = torch.randn(90, 2), torch.randint(0, 3, (90,))
    for selection in ("reservoir", "class_balanced"):
        a = ReplayBuffer(10, selection, seed=1)
        a.add(x[:45], y[:45], head=1, task_id=0)
        b = ReplayBuffer(10, selection, seed=99)
        b.load_state_dict(a.state_dict())
        for buf in (a, b):
            buf.add(x[45:], y[45:], head=2, task_id=1)
        assert torch.equal(a.x, b.x) and torch.equal(a.head, b.head)
        sa, sb = a.sample(6), b.sample(6)
        assert [s.head for s in sa] == [s.head for s in sb]
        assert all(torch.equal(p.x, q.x) for p, q in zip(sa, sb))


def test_buffer_argument_errors():
    with pytest.raises(ValueError, match="memory_size"):
        ReplayBuffer(0)
    with pytest.raises(ValueError, match="selection: got 'fifo'; allowed: 'reservoir', 'class_balanced'"):
        ReplayBuffer(5, "fifo")
    with pytest.raises(Exception, match="params.memory_size"):
        build_method("er", {"memory_size": 0})
    with pytest.raises(Exception, match="params.beta"):
        build_method("derpp", {"beta": -1.0})
    with pytest.raises(Exception, match="unknown key 'n_points'"):
        build_method("fromp-replay", {"n_points": 40})


def test_derpp_stores_the_logits_of_the_network_that_stored_them():
    """DER++'s buffer keeps, with each stored example, f_θ(x) at the weights of the step that stored it."""
    torch.manual_seed(0)
    model = build_model("mlp", (5,), 3, 2, hidden=(8,), generator=torch.Generator().manual_seed(0))
    method = build_method("derpp", {"memory_size": 6}, seed=0)
    task = Task(0, torch.randn(20, 5), torch.randint(0, 3, (20,)), torch.randn(4, 5), torch.zeros(4, dtype=torch.long),
                (0, 1, 2), head=1)
    batch = Batch(task.x_train, task.y_train, 1)
    method.after_step(model, batch, task)
    with torch.no_grad():
        want = model(method.buffer.x[: method.buffer.size], head=1)
    torch.testing.assert_close(method.buffer.targets[: method.buffer.size], want, rtol=0, atol=0)
    assert torch.all(method.buffer.head[: method.buffer.size] == 1)


def _share(memory_size: int, n_tasks: int) -> tuple[FunctionalRegularizer, list[Task]]:
    stream = make_stream("synthetic", scenario="class", n_tasks=n_tasks, n_classes_per_task=2, n_features=4,
                         n_train=60, seed=0)
    model = build_model("mlp", stream.input_shape, stream.n_outputs, stream.n_heads, hidden=(6,),
                        generator=torch.Generator().manual_seed(0))
    reg = FunctionalRegularizer(tau=1.0, n_points=memory_size, memory_size=memory_size, class_incremental=True)
    counts = []
    for i, task in enumerate(stream.tasks):
        reg.on_task_start(model, task)
        reg.on_task_end(model, task)
        counts.append({int(c): int((e.y == c).sum()) for e in reg.memory for c in torch.unique(e.y)})
    return reg, counts


def test_fromp_memory_budget_is_shared_over_the_classes_seen():
    """memory_size 10 over the (task, class) groups seen: 5 + 5; then q = ⌊10/4⌋ = 2 with the r = 2 left over to
    the newest groups (task 1: 3 + 3, old classes 2 + 2); then q = 1, r = 4: task 2 gets 2 + 2 and the two
    newest old groups (task 1's) keep 2 — never more than 10 points."""
    _, counts = _share(10, 3)
    assert counts[0] == {0: 5, 1: 5}
    assert counts[1] == {0: 2, 1: 2, 2: 3, 3: 3}
    assert counts[2] == {0: 1, 1: 1, 2: 2, 3: 2, 4: 2, 5: 2}


def test_fromp_shrunk_memory_keeps_its_top_scores_and_kernels_match_a_rebuild():
    """After the store is cut to its share, each old class holds the top-λ points it held before, and the cut
    kernels and factors equal those that a rebuild computes from the kept points at the same weights."""
    stream = make_stream("synthetic", scenario="class", n_tasks=2, n_classes_per_task=2, n_features=4, n_train=60,
                         seed=1)
    model = build_model("mlp", stream.input_shape, stream.n_outputs, stream.n_heads, hidden=(6,),
                        generator=torch.Generator().manual_seed(0)).double()
    for t in stream.tasks:
        t.x_train, t.x_test = t.x_train.double(), t.x_test.double()
    reg = FunctionalRegularizer(tau=1.0, n_points=12, memory_size=12, class_incremental=True)
    reg.on_task_end(model, stream.tasks[0])
    reg.rebuild(model)
    before = reg.memory[0]
    state0 = copy.deepcopy(reg.state_dict())  # Σ of task 0: what the entry's kernels were built with
    reg.on_task_end(model, stream.tasks[1])  # the old entry is cut from 6 to 3 points per class
    after = reg.memory[0]
    for c in torch.unique(before.y):
        old = before.scores[before.y == c]
        assert torch.equal(after.scores[after.y == c], torch.sort(old, descending=True).values[:3])
    # oracle: the same Σ, a store holding only the kept points, kernels built from scratch
    fresh = FunctionalRegularizer(tau=1.0, n_points=12, memory_size=12, class_incremental=True)
    fresh.load_state_dict(state0)
    fresh.memory.entries = [MemoryEntry(after.task_id, after.head, after.x, after.y, after.indices, after.scores,
                                        after.selection, after.columns)]
    fresh.rebuild(model)
    for key in ("p_old", "kernel", "chol"):
        torch.testing.assert_close(after.extras[key], fresh.memory[0].extras[key], rtol=1e-10, atol=1e-12)


@pytest.fixture(scope="module")
def digits_class_runs():
    """Class-incremental split digits (one 10-way head), MLP 100-100, 10 epochs, batch 32, Adam 1e-3, seed 0."""
    torch.set_num_threads(1)
    stream = make_stream("split_digits", scenario="class")
    out = {}
    for name, params in (("none", {}), ("er", {"memory_size": 100}), ("derpp", {"memory_size": 100}),
                         ("fromp-replay", {"memory_size": 100})):
        model = build_model("mlp", stream.input_shape, stream.n_outputs, stream.n_heads, hidden=(100, 100),
                            generator=torch.Generator().manual_seed(0))
        method = build_method(name, params, seed=0)
        out[name] = run_stream(model, stream, method, TrainConfig(epochs=10), seed=0, progress=False)
    return out


@pytest.mark.parametrize("name", ["er", "derpp", "fromp-replay"])
def test_replay_methods_learn_class_incremental_split_digits(digits_class_runs, name):
    """With 100 stored examples in all, each replay method ends well above fine-tuning (which keeps only the last
    task: ≤ 0.2 + ε) and far above chance (0.1): final average accuracy ≥ 0.6 and ≥ none + 0.35; its memory
    is stated (100 examples, their bytes)."""
    none, res = digits_class_runs["none"], digits_class_runs[name]
    assert none.avg_acc <= 0.25
    assert res.avg_acc >= 0.6 and res.avg_acc >= none.avg_acc + 0.35, (name, res.avg_acc, none.avg_acc)
    assert res.memory["stored_examples"] == 100
    assert res.memory["stored_bytes"] >= 100 * 64 * 4  # 64 float32 pixels per example at least
