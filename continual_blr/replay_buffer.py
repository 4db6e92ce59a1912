"""A fixed-size store of past training examples for replay: which examples enter it, and how a replay
minibatch is drawn from it.

The buffer holds at most ``memory_size`` = M examples in all (over every task seen), each with its input,
label, output head, task id and, optionally, a stored target vector (DER's logits). It sees the training
stream one minibatch at a time (:meth:`ReplayBuffer.add`) and decides which examples to keep:

* ``"reservoir"`` — reservoir sampling (Vitter 1985, Algorithm R). The n-th example seen (n counted from 1
  over the whole stream) is stored outright while n ≤ M; afterwards it replaces the slot j drawn uniformly
  from {1, …, n} when j ≤ M, and is dropped otherwise. Then after n examples every one of them is in the
  buffer with probability exactly M / n, independently of the order they came in — the rule of ER and
  DER(++) (Chaudhry et al. 2019; Buzzega et al. 2020).
* ``"class_balanced"`` — class-balanced reservoir sampling (Chrysakis & Moens 2020, Algorithm 1, "CBRS").
  While the buffer is not full, every example is stored. When it is full, an example of class c

  - whose class is not among the *largest* classes in the buffer (those with the most stored examples)
    replaces an example drawn uniformly from one of the largest classes (ties between largest classes
    are broken by the lowest class id, so the rule is deterministic given the generator);
  - whose class is among the largest is stored with probability m_c / n_c (m_c stored, n_c seen of class c),
    replacing an example of its own class drawn uniformly — reservoir sampling within the class.

  Every class seen thus ends with ⌊M / C⌋ or ⌈M / C⌉ examples once it has that many, where a plain
  reservoir gives each class a share proportional to its frequency in the stream.

* ``"task_end"`` — the buffer sees no minibatch; its owner writes its whole content at each task's end
  (:meth:`ReplayBuffer.assign`): the task-end selection rules of ``er`` / ``derpp`` (``lambda``, ``random``,
  ``sensitivity``, ``stratified`` per class; :mod:`continual_blr.memory`).

Randomness comes from a ``torch.Generator`` held by the buffer (its state is part of ``state_dict``), so
two buffers with the same seed that see the same minibatches hold the same examples — in a data-parallel
run every rank sees the global minibatch and keeps an identical buffer.

Replay: :meth:`ReplayBuffer.sample` draws k stored examples uniformly without replacement (as ER and DER
do), returned grouped by head (one forward per head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["BUFFER_SELECTIONS", "BUFFER_POLICIES", "ReplayBuffer", "ReplaySample"]

BUFFER_SELECTIONS = ("reservoir", "class_balanced")
"""The rules that choose examples from the training stream, minibatch by minibatch."""
BUFFER_POLICIES = BUFFER_SELECTIONS + ("task_end",)
"""Every policy a buffer takes: the stream rules and ``"task_end"`` (written whole by its owner)."""


@dataclass
class ReplaySample:
    """Stored examples drawn for replay, all on one head.

    Attributes:
        x: inputs [k, ...].
        y: labels [k].
        head: the output head they are evaluated on.
        targets: their stored target vectors [k, K] (DER's logits), or None when the buffer keeps none.
    """

    x: Tensor
    y: Tensor
    head: int
    targets: Tensor | None = None


class ReplayBuffer:
    """At most ``memory_size`` past examples, chosen by reservoir or class-balanced reservoir sampling.

    Args:
        memory_size: M, the number of examples stored in all (over every task).
        selection: ``"reservoir"`` | ``"class_balanced"`` | ``"task_end"`` (see the module docstring).
        seed: seeds the buffer's own ``torch.Generator`` (which examples are kept, which are replayed).

    Attributes:
        n_seen: examples offered to the buffer so far (the n of reservoir sampling).
        size: examples stored now (≤ M).
    """

    def __init__(self, memory_size: int, selection: str = "reservoir", seed: int = 0) -> None:
        if isinstance(memory_size, bool) or not isinstance(memory_size, int) or memory_size < 1:
            raise ValueError(f"memory_size: must be an int >= 1, got {memory_size!r}")
        if selection not in BUFFER_POLICIES:
            raise ValueError(f"selection: got {selection!r}; allowed: {', '.join(map(repr, BUFFER_POLICIES))}")
        self.memory_size = int(memory_size)
        self.selection = selection
        self.generator = torch.Generator().manual_seed(int(seed))
        self.n_seen = 0
        self.size = 0
        self.x: Tensor | None = None
        self.y: Tensor | None = None
        self.head: Tensor | None = None
        self.task_id: Tensor | None = None
        self.targets: Tensor | None = None
        self._seen_per_class: dict[int, int] = {}

    # ------------------------------------------------------------------------------------ filling

    def _allocate(self, x: Tensor, y: Tensor, targets: Tensor | None) -> None:
        m = self.memory_size
        self.x = x.new_zeros((m, *x.shape[1:]))
        self.y = y.new_zeros((m, *y.shape[1:]))
        self.head = torch.zeros(m, dtype=torch.long, device=y.device)
        self.task_id = torch.zeros(m, dtype=torch.long, device=y.device)
        self.targets = None if targets is None else targets.new_zeros((m, *targets.shape[1:]))

    def slots(self, y: Tensor) -> list[tuple[int, int]]:
        """Decide where a minibatch with labels ``y`` goes, advancing the counters and the generator.

        Returns:
            ``(i, slot)`` pairs in arrival order: example ``i`` of the minibatch is written to ``slot``
            (a later pair may overwrite an earlier one's slot, as the sequential rule would).
        """
        if self.selection == "task_end":
            raise RuntimeError("slots: a 'task_end' buffer takes no minibatches; write it with assign()")
        b = int(y.shape[0])
        u = torch.rand(b, generator=self.generator, dtype=torch.float64).tolist()
        if self.selection == "reservoir":
            return self._reservoir_slots(u)
        return self._class_balanced_slots(y.reshape(b, -1)[:, 0].tolist(), u)

    def _reservoir_slots(self, u: list[float]) -> list[tuple[int, int]]:
        out = []
        for i, ui in enumerate(u):
            self.n_seen += 1
            if self.size < self.memory_size:
                out.append((i, self.size))
                self.size += 1
                continue
            j = int(ui * self.n_seen)  # uniform on {0, …, n − 1}
            if j < self.memory_size:
                out.append((i, j))
        return out

    def _class_balanced_slots(self, labels: list[int], u: list[float]) -> list[tuple[int, int]]:
        out = []
        stored = self._stored_labels()
        counts: dict[int, int] = {}
        for s in stored:
            counts[s] = counts.get(s, 0) + 1
        for i, (c, ui) in enumerate(zip(labels, u)):
            c = int(c)
            self.n_seen += 1
            self._seen_per_class[c] = self._seen_per_class.get(c, 0) + 1
            if self.size < self.memory_size:
                out.append((i, self.size))
                stored.append(c)
                counts[c] = counts.get(c, 0) + 1
                self.size += 1
                continue
            top = max(counts.values())
            if counts.get(c, 0) < top:  # c is not a largest class: evict from the (lowest-id) largest class
                victim = min(k for k, v in counts.items() if v == top)
            else:  # reservoir sampling within class c: keep with probability m_c / n_c
                if ui * self._seen_per_class[c] >= counts[c]:
                    continue
                victim = c
                ui = ui * self._seen_per_class[c] / counts[c]  # uniform on [0, 1) again, given it was kept
            members = [k for k, s in enumerate(stored) if s == victim]
            slot = members[min(int(ui * len(members)), len(members) - 1)]
            stored[slot] = c
            counts[victim] -= 1
            counts[c] = counts.get(c, 0) + 1
            out.append((i, slot))
        return out

    def _stored_labels(self) -> list[int]:
        if self.y is None or self.size == 0:
            return []
        return self.y[: self.size].reshape(self.size, -1)[:, 0].tolist()

    def add(self, x: Tensor, y: Tensor, head: int, task_id: int, targets: Tensor | None = None) -> list[int]:
        """Offer a minibatch (inputs ``x``, labels ``y`` on ``head`` of task ``task_id``) to the buffer.

        Args:
            targets: per-example vectors to store with the examples (DER's logits) — computed only for the
                examples kept if a callable is passed instead: ``targets(indices) -> Tensor``.

        Returns:
            The indices of the minibatch's examples written into the buffer.
        """
        placed = self.slots(y)
        if not placed:
            return []
        # the last write to a slot wins (sequential semantics), so drop earlier writes to the same slot
        last: dict[int, int] = {}
        for i, slot in placed:
            last[slot] = i
        slots = torch.tensor(list(last.keys()), dtype=torch.long)
        idx = torch.tensor(list(last.values()), dtype=torch.long)
        chosen = targets(idx.to(x.device)) if callable(targets) else (None if targets is None else targets[idx])
        if self.x is None:
            self._allocate(x, y, chosen)
        assert self.x is not None and self.y is not None and self.head is not None and self.task_id is not None
        if (self.targets is None) != (chosen is None):
            raise ValueError("targets: pass them with every add or with none (the buffer keeps them or not)")
        dev = self.x.device
        s = slots.to(dev)
        self.x[s] = x[idx.to(x.device)].detach().to(dev, self.x.dtype)
        self.y[s] = y[idx.to(y.device)].to(dev)
        self.head[s] = int(head)
        self.task_id[s] = int(task_id)
        if self.targets is not None and chosen is not None:
            self.targets[s] = chosen.detach().to(dev, self.targets.dtype)
        return idx.tolist()

    def assign(self, x: Tensor, y: Tensor, head: Tensor, task_id: Tensor, targets: Tensor | None = None) -> None:
        """Replace the whole content by n ≤ M examples (a ``"task_end"`` buffer, written at each task's end).

        Args:
            x: inputs [n, ...]; y: labels [n]; head, task_id: int64 [n]; targets: stored vectors [n, K] or None.
        """
        n = int(y.shape[0])
        if n > self.memory_size:
            raise ValueError(f"x: {n} examples do not fit a buffer of memory_size {self.memory_size}")
        if n == 0:
            return
        self._allocate(x, y, targets)
        assert self.x is not None and self.y is not None and self.head is not None and self.task_id is not None
        self.x[:n] = x.detach()
        self.y[:n] = y
        self.head[:n] = head.to(self.head.device)
        self.task_id[:n] = task_id.to(self.task_id.device)
        if self.targets is not None and targets is not None:
            self.targets[:n] = targets.detach()
        self.size = n

    def stored(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None] | None:
        """The stored examples in slot order: ``(x, y, head, task_id, targets)`` (None while empty)."""
        if self.size == 0 or self.x is None:
            return None
        assert self.y is not None and self.head is not None and self.task_id is not None
        n = self.size
        return (self.x[:n], self.y[:n], self.head[:n], self.task_id[:n],
                None if self.targets is None else self.targets[:n])

    # ------------------------------------------------------------------------------------ replay

    def sample(self, k: int) -> list[ReplaySample]:
        """k stored examples drawn uniformly without replacement (all of them if fewer are stored), grouped
        by head in increasing head order; an empty list while the buffer is empty."""
        if self.size == 0 or k < 1:
            return []
        assert self.x is not None and self.y is not None and self.head is not None
        pick = torch.randperm(self.size, generator=self.generator)[: min(int(k), self.size)].to(self.x.device)
        heads = self.head[pick]
        out = []
        for h in torch.unique(heads).tolist():
            sel = pick[heads == h]
            out.append(ReplaySample(self.x[sel], self.y[sel], int(h),
                                    None if self.targets is None else self.targets[sel]))
        return out

    # ------------------------------------------------------------------------------------ accounting

    def class_counts(self) -> dict[int, int]:
        """Stored examples per label."""
        counts: dict[int, int] = {}
        for c in self._stored_labels():
            counts[int(c)] = counts.get(int(c), 0) + 1
        return counts

    def nbytes(self) -> int:
        """Bytes of the stored tensors (inputs, labels, heads, task ids, targets) for the ``size`` examples
        held now."""
        if self.x is None:
            return 0
        per = sum(t[:1].numel() * t.element_size() for t in (self.x, self.y, self.head, self.task_id, self.targets)
                  if t is not None)
        return int(per * self.size)

    def to(self, device: torch.device | str) -> "ReplayBuffer":
        """Move the stored tensors to ``device`` (in place; the generator stays on the CPU)."""
        for name in ("x", "y", "head", "task_id", "targets"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        return self

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and Python values only (``torch.load(weights_only=True)`` reads it back)."""
        return {"memory_size": self.memory_size, "selection": self.selection, "n_seen": self.n_seen,
                "size": self.size, "generator": self.generator.get_state(), "x": self.x, "y": self.y,
                "head": self.head, "task_id": self.task_id, "targets": self.targets,
                "seen_per_class": {int(k): int(v) for k, v in self._seen_per_class.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["memory_size"]) != self.memory_size or state["selection"] != self.selection:
            raise ValueError(f"state: saved for memory_size {state['memory_size']} and selection "
                             f"{state['selection']!r}, this buffer has {self.memory_size} and {self.selection!r}")
        self.n_seen, self.size = int(state["n_seen"]), int(state["size"])
        self.generator.set_state(state["generator"])
        for name in ("x", "y", "head", "task_id", "targets"):
            setattr(self, name, state[name])
        self._seen_per_class = {int(k): int(v) for k, v in state.get("seen_per_class", {}).items()}
