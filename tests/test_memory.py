"""Memorable-example selection and the memory store (continual_blr.memory).

Known-score case: a linear "network" whose logits are its 2-D input, so softmax is known in closed
form and λ(x) = 2 p (1 − p) with p = σ(x₀ − x₁) — the selection must return the per-class top-k of
that formula, the lowest-k for "lowest", and a seeded random subset for "random".
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import oracles as O
from conftest import EXACT
from continual_blr.memory import (
    MemoryEntry,
    MemoryStore,
    hessian_trace_scores,
    select_memorable,
    select_per_class,
)
from continual_blr.models import MLP

DT = torch.float64


class Identity2(nn.Module):
    """logits = x (a head-less module: exercises the no-``head`` call path)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones((), dtype=DT))

    def forward(self, x):
        return self.scale * x


def _known_case(gen):
    n = 30
    margin = torch.randn(n, generator=gen, dtype=DT) * 3
    x = torch.stack([margin / 2, -margin / 2], 1)  # logits difference = margin
    y = torch.arange(n) % 3  # three classes (the model's outputs need not match the labels)
    p = torch.sigmoid(margin)
    lam = 2 * p * (1 - p)
    return x, y, lam


def test_scores_equal_trace_of_output_hessian(gen):
    model = MLP(5, (7,), 4, n_heads=2).to(DT)
    x = torch.randn(9, 5, generator=gen, dtype=DT)
    scores = hessian_trace_scores(model, x, head=1, batch_size=4)
    lam = O.output_hessians(model, x, head=1)  # autograd Hessians of the cross-entropy
    torch.testing.assert_close(scores, torch.diagonal(lam, dim1=-2, dim2=-1).sum(-1), **EXACT)


def test_lambda_selection_is_per_class_top_k_of_known_scores(gen):
    x, y, lam = _known_case(gen)
    idx, scores = select_memorable(Identity2(), x, y, n_points=6, selection="lambda")
    torch.testing.assert_close(scores, lam, **EXACT)
    expect = []
    for c in range(3):
        members = [i for i in range(len(y)) if y[i] == c]
        expect += sorted(members, key=lambda i: -lam[i].item())[:2]
    assert idx.tolist() == expect


def test_lowest_selection_is_per_class_bottom_k(gen):
    x, y, lam = _known_case(gen)
    idx, _ = select_memorable(Identity2(), x, y, n_points=6, selection="lowest")
    expect = []
    for c in range(3):
        members = [i for i in range(len(y)) if y[i] == c]
        expect += sorted(members, key=lambda i: lam[i].item())[:2]
    assert idx.tolist() == expect


def test_random_selection_is_seeded_and_per_class(gen):
    x, y, lam = _known_case(gen)
    pick = lambda seed: select_per_class(lam, y, 9, selection="random",  # noqa: E731
                                         generator=torch.Generator().manual_seed(seed))
    a, b, c = pick(0), pick(0), pick(1)
    assert a.tolist() == b.tolist()
    assert a.tolist() != c.tolist()
    assert [int((y[a] == k).sum()) for k in range(3)] == [3, 3, 3]
    assert len(set(a.tolist())) == 9
    with pytest.raises(ValueError, match="generator"):
        select_per_class(lam, y, 9, selection="random")


def test_allocation_remainder_small_classes_and_ties():
    scores = torch.tensor([0.5, 0.5, 0.5, 0.1, 0.9, 0.2, 0.3])
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    # 5 points over 3 classes: 2, 2, 1; ties broken by the lower index
    assert select_per_class(scores, labels, 5).tolist() == [0, 1, 4, 3, 6]
    # more than a class holds: all of it
    assert select_per_class(scores, labels, 12).tolist() == [0, 1, 2, 4, 3, 6, 5]
    with pytest.raises(ValueError, match="selection"):
        select_per_class(scores, labels, 5, selection="top")
    with pytest.raises(ValueError, match="n_points"):
        select_per_class(scores, labels, 0)


def test_scores_restore_training_mode(gen):
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2)).to(DT)
    model.train()
    x = torch.randn(6, 3, generator=gen, dtype=DT)
    a = hessian_trace_scores(model, x)
    b = hessian_trace_scores(model, x)
    torch.testing.assert_close(a, b, **EXACT)  # dropout off while scoring
    assert model.training and model[1].training


def test_store_state_dict_round_trip(gen):
    store = MemoryStore()
    for t in range(2):
        store.add(MemoryEntry(t, t, torch.randn(4, 3, generator=gen), torch.tensor([0, 0, 1, 1]),
                              torch.arange(4) + 10 * t, torch.rand(4, generator=gen), "lambda",
                              columns=(2 * t, 2 * t + 1), extras={"p_old": torch.rand(4, 2, generator=gen)}))
    with pytest.raises(ValueError, match="task_id"):
        store.add(store[0])
    buf = io.BytesIO()
    torch.save(store.state_dict(), buf)
    buf.seek(0)
    loaded = MemoryStore()
    loaded.load_state_dict(torch.load(buf, weights_only=True))
    assert len(loaded) == 2 and loaded.n_points == 8
    for a, b in zip(store, loaded):
        assert (a.task_id, a.head, a.selection, a.columns) == (b.task_id, b.head, b.selection, b.columns)
        for name in ("x", "y", "indices", "scores"):
            assert torch.equal(getattr(a, name), getattr(b, name))
        assert torch.equal(a.extras["p_old"], b.extras["p_old"])
