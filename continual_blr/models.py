"""Networks used by the benchmarks, all with the call convention ``model(x, head=0) -> logits``.

``head`` picks the output head of a multi-head (task-incremental) network; single-head networks
accept and ignore it, so the training loop, the curvature engine and the regularisers call every
model the same way (``functional_call(model, params, (x,), {"head": h})``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = ["MLP", "CifarNet", "ReducedResNet18", "MultiHeadNet", "build_model", "MODE_FREE_CONTAINERS"]


class MultiHeadNet(nn.Module):
    """A shared body followed by ``n_heads`` linear heads of ``n_outputs`` each.

    With ``n_heads == 1`` this is an ordinary classifier and ``head`` is ignored.
    """

    def __init__(self, body: nn.Module, feature_dim: int, n_outputs: int, n_heads: int = 1) -> None:
        super().__init__()
        self.body = body
        self.heads = nn.ModuleList(nn.Linear(feature_dim, n_outputs) for _ in range(n_heads))

    @property
    def n_heads(self) -> int:
        return len(self.heads)

    def forward(self, x: Tensor, head: int = 0) -> Tensor:
        h = self.body(x)
        if self.n_heads == 1:
            return self.heads[0](h)
        return self.heads[int(head)](h)

    def forward_heads(self, x: Tensor, parts: Sequence[tuple[int, int]]) -> list[Tensor]:
        """One pass of the shared body over ``x``, then each block of rows through its own head.

        ``parts`` lists (head, rows) for consecutive row blocks of ``x`` (their rows summing to ``len(x)``); block i
        gets ``forward(x_i, head=h_i)``, computed as one body pass over all rows instead of one per block (what
        FROMP's ``fused_forward`` uses: the minibatch and the memorable points of every head in one pass). When all
        blocks use one head (always in a single-head net) that head runs once over all rows; otherwise once per block.
        """
        sizes = [int(n) for _, n in parts]
        if sum(sizes) != x.shape[0]:
            raise ValueError(f"forward_heads: the parts cover {sum(sizes)} rows, x has {x.shape[0]}")
        h = self.body(x)
        heads = [0 if self.n_heads == 1 else int(k) for k, _ in parts]
        if len(set(heads)) == 1:
            return list(torch.split(self.heads[heads[0]](h), sizes))
        return [self.heads[k](f) for k, f in zip(heads, torch.split(h, sizes))]


def _mlp_body(in_features: int, hidden: tuple[int, ...]) -> tuple[nn.Module, int]:
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    return nn.Sequential(*layers), width


class MLP(MultiHeadNet):
    """Fully connected ReLU network ``in → hidden… → heads`` (FROMP / VCL MNIST nets)."""

    def __init__(
        self, in_features: int, hidden: tuple[int, ...], n_outputs: int, n_heads: int = 1
    ) -> None:
        body, width = _mlp_body(in_features, tuple(hidden))
        super().__init__(body, width, n_outputs, n_heads)


class CifarNet(MultiHeadNet):
    """FROMP's split-CIFAR network: 4 conv layers (32, 32, 64, 64), two max-pools, fc 512, dropout.

    Args:
        in_channels: input channels (3 for CIFAR).
        n_outputs: outputs per head.
        n_heads: number of heads (6 in FROMP's CIFAR-10/100 protocol).
        dropout: dropout probability before and after the fc layer (0 turns it off).
    """

    def __init__(self, in_channels: int = 3, n_outputs: int = 10, n_heads: int = 1, dropout: float = 0.5,
                 image_size: int = 32) -> None:
        s = image_size // 4  # two 2x2 max-pools
        body = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(dropout * 0.5),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.Conv2d(64, 64, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(dropout * 0.5),
            nn.Flatten(),
        )
        with torch.no_grad():
            width = body(torch.zeros(1, in_channels, image_size, image_size)).shape[1]
        fc = nn.Sequential(body, nn.Linear(width, 512), nn.ReLU(), nn.Dropout(dropout))
        del s
        super().__init__(fc, 512, n_outputs, n_heads)


class _BasicBlock(nn.Module):
    """ResNet basic block: y = relu(bn(conv(relu(bn(conv(x))))) + shortcut(x)), shortcut a 1×1 conv + BN
    when the shape changes, else the identity."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(planes))

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class _ResNetBody(nn.Module):
    def __init__(self, in_channels: int, nf: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, nf, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(nf)
        blocks: list[nn.Module] = []
        in_planes = nf
        for mult, stride in ((1, 1), (2, 2), (4, 2), (8, 2)):
            for s in (stride, 1):
                blocks.append(_BasicBlock(in_planes, nf * mult, s))
                in_planes = nf * mult
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: Tensor) -> Tensor:
        out = self.layers(torch.relu(self.bn1(self.conv1(x))))
        return self.pool(out).flatten(1)


class ReducedResNet18(MultiHeadNet):
    """The reduced ResNet-18 of Lopez-Paz & Ranzato (2017), used by van de Ven (2025) on split CIFAR-10.

    ResNet-18's layout (a 3×3 stem without max-pool, then 4 stages of 2 basic blocks with strides 1, 2, 2, 2)
    with ``nf = 20`` base filters instead of 64 (widths 20, 40, 80, 160), BatchNorm, global average pooling
    to 8·nf = 160 features, and one linear head per task. About 1.1 M parameters with 5 heads of 2.

    Args:
        in_channels: input channels (3 for CIFAR).
        n_outputs: outputs per head.
        n_heads: number of heads (one per task in the task-incremental protocol).
        nf: base width (20 in the reduced network, 64 in ResNet-18).
    """

    def __init__(self, in_channels: int = 3, n_outputs: int = 10, n_heads: int = 1, nf: int = 20) -> None:
        super().__init__(_ResNetBody(in_channels, nf), 8 * nf, n_outputs, n_heads)


MODE_FREE_CONTAINERS: tuple[type[nn.Module], ...] = (_BasicBlock, _ResNetBody)
"""This module's containers whose own forward reads no ``training`` flag and treats rows independently (their
submodules are checked on their own): FROMP's one-pass forward (:func:`continual_blr.memory.row_split_refusal`)
accepts them."""


def build_model(arch: str, input_shape: tuple[int, ...], n_outputs: int, n_heads: int,
                hidden: tuple[int, ...] = (100, 100), generator: torch.Generator | None = None) -> nn.Module:
    """Build a network by name (``"mlp"``, ``"linear"``, ``"cifarnet"`` or ``"reduced_resnet18"``), initialised
    from ``generator``.

    ``"linear"`` is the MLP without hidden layers (``hidden`` ignored): f(x) = W_h x + b_h on the
    flattened input, one Linear head per task — Bayesian linear regression's model.

    Initialisation draws from ``generator`` (PyTorch's default schemes) so that no global RNG state
    is read or changed.
    """
    if arch in ("mlp", "linear"):
        n_in = 1
        for d in input_shape:
            n_in *= d
        model: nn.Module = MLP(n_in, tuple(hidden) if arch == "mlp" else (), n_outputs, n_heads)
    elif arch == "cifarnet":
        model = CifarNet(input_shape[0], n_outputs, n_heads, image_size=input_shape[-1])
    elif arch == "reduced_resnet18":
        model = ReducedResNet18(input_shape[0], n_outputs, n_heads)
    else:
        raise ValueError(f"arch: got {arch!r}; allowed: 'mlp', 'linear', 'cifarnet', 'reduced_resnet18'")
    if generator is not None:
        _reinit(model, generator)
    return model


def _reinit(model: nn.Module, generator: torch.Generator) -> None:
    """Re-draw every Linear / Conv weight with PyTorch's default (Kaiming-uniform) bounds from ``generator``."""
    import math

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                fan_in = m.weight[0].numel()
                bound = 1.0 / math.sqrt(fan_in)
                m.weight.uniform_(-bound, bound, generator=generator)
                if m.bias is not None:
                    m.bias.uniform_(-bound, bound, generator=generator)
