"""Training-time image augmentation for the loop's minibatches and replayed examples (``train.augment``).

``"crop_flip"`` is the augmentation of the DER paper's CIFAR protocol (Buzzega et al., NeurIPS 2020, Sec. 5 and
its code): each image of a minibatch, independently,

    x̃ = flip_b( crop_{(r, c)}( pad_p(x) ) ),   r, c ~ U{0, …, 2p},  b ~ Bernoulli(1/2),

where ``pad_p`` adds p = 4 zero pixels on every side of the H × W image, ``crop_{(r, c)}`` keeps the H × W window
whose top-left corner is (r, c), and ``flip_b`` mirrors the columns when b = 1 (torchvision's
``RandomCrop(32, padding=4)`` then ``RandomHorizontalFlip()``). The draws come from a ``torch.Generator`` on the
CPU (three tensors per call: rows, columns, flips), so a seeded run augments identically on every device and
resumes bit for bit. The inputs are whatever the stream holds (already normalised): padding is with zeros of
that tensor, as in the DER code, which pads before normalising only up to that constant.

Nothing else is augmented: evaluation, FROMP's memorable points and kernels, and a task's end see the stored
images.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["AUGMENTS", "ReplayAugment", "augment", "check_augment", "check_images", "crop_flip"]

AUGMENTS = ("off", "crop_flip")
"""The values of ``train.augment``."""

PADDING = 4
"""p of ``"crop_flip"``: the DER protocol's ``RandomCrop(32, padding=4)``."""


def check_augment(mode: str, field: str = "train.augment") -> None:
    """Raise a one-line ``ValueError`` naming ``field`` unless ``mode`` is one of :data:`AUGMENTS`."""
    if mode not in AUGMENTS:
        raise ValueError(f"{field}: got {mode!r}; allowed: {', '.join(map(repr, AUGMENTS))}")


def check_images(mode: str, shape: tuple[int, ...], what: str, field: str = "train.augment") -> None:
    """Raise a one-line ``ValueError`` when ``mode`` augments and ``shape`` (one example's) is not C × H × W."""
    if mode != "off" and len(tuple(shape)) != 3:
        raise ValueError(f"{field}: {mode!r} needs images (C × H × W inputs), but {what} has inputs of shape "
                         f"{tuple(shape)}; allowed here: 'off'")


def crop_flip(x: Tensor, generator: torch.Generator, padding: int = PADDING) -> Tensor:
    """Each image of ``x`` [B, C, H, W] cropped at a random offset from its zero-padded copy and mirrored with
    probability 1/2 (module docstring). Returns a new tensor of ``x``'s shape, dtype, device and memory format."""
    if x.dim() != 4:
        raise ValueError(f"crop_flip: needs a batch of images [B, C, H, W], got shape {tuple(x.shape)}")
    b, _, h, w = x.shape
    rows0 = torch.randint(0, 2 * padding + 1, (b,), generator=generator)
    cols0 = torch.randint(0, 2 * padding + 1, (b,), generator=generator)
    flip = torch.rand(b, generator=generator) < 0.5
    cols_in = torch.arange(w)
    cols_in = torch.where(flip[:, None], cols_in.flip(0)[None, :], cols_in[None, :])  # [B, W]: mirrored or not
    rows = (rows0[:, None] + torch.arange(h)[None, :]).to(x.device)  # [B, H] rows of the padded image
    cols = (cols0[:, None] + cols_in).to(x.device)  # [B, W]
    padded = torch.nn.functional.pad(x, (padding, padding, padding, padding))
    idx = torch.arange(b, device=x.device)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[idx, rows[:, :, None], cols[:, None, :]]  # [B, H, W, C]
    out = out.permute(0, 3, 1, 2)
    fmt = torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous() \
        else torch.contiguous_format
    return out.contiguous(memory_format=fmt)


def augment(x: Tensor, mode: str, generator: torch.Generator) -> Tensor:
    """``x`` augmented by ``mode`` (one of :data:`AUGMENTS`; ``"off"`` returns ``x`` itself and draws nothing)."""
    if mode == "off":
        return x
    check_augment(mode)
    return crop_flip(x, generator)


class ReplayAugment:
    """``train.augment`` for a replay term: the replayed inputs augmented afresh at every draw, from a generator of
    the method's own, seeded by it. The generator is an attribute, so a checkpoint saves and restores it with the
    method's other generators (``run_folder.find_generators``) and a resumed run replays the same augmented images. ``mode`` is set by the method's ``setup`` from ``train.augment``; ``"off"`` draws nothing."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self.mode = "off"
        self.generator = torch.Generator().manual_seed(self.seed)

    def reset(self, mode: str) -> None:
        """Start a run: the mode of ``train.augment`` and the generator at its seed."""
        check_augment(mode)
        self.mode = mode
        self.generator.manual_seed(self.seed)

    def __call__(self, x: Tensor) -> Tensor:
        return augment(x, self.mode, self.generator)
