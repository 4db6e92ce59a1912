"""Carry CIFAR-10 to a GPU machine that receives at most 64 MiB per call: pack here, unpack there.

The arrays of ``cifar10.npz`` (184 MB of uint8 pixels) are cut into mosaics of 1,000 images (20 × 50 tiles of
32 × 32) and stored as **lossless** WebP (about 0.48 of the raw bytes), in three parts that travel in three calls
to the same warm machine: part ``a`` holds training images 0-29,999 (47 MB), part ``b`` the rest of the training
images and the labels (34 MB), part ``c`` the test images (17 MB). Two parts were once enough; a call's 64 MiB
counts the repository's ``.git`` too, and a + b no longer fit beside it (2026-11-27). ``unpack`` rebuilds ``cifar10/cifar10.npz`` and checks every array's SHA-256
against the one recorded at packing time, so a lossy round trip cannot pass unnoticed.

    python benchmarks/device/cifar10_webp.py pack --npz DATA/cifar10/cifar10.npz --out .devdata_a --part a
    python benchmarks/device/cifar10_webp.py pack --npz DATA/cifar10/cifar10.npz --out .devdata_b --part b
    python benchmarks/device/cifar10_webp.py pack --npz DATA/cifar10/cifar10.npz --out .devdata_c --part c
    python benchmarks/device/cifar10_webp.py unpack --parts .devdata_a .devdata_b .devdata_c --root /tmp/data
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

TILE, ROWS, COLS = 32, 20, 50
PER = ROWS * COLS
KEYS = ("x_train", "y_train", "x_test", "y_test")


def _chunks(part: str) -> list[tuple[str, int]]:
    if part == "a":
        return [("train", i) for i in range(30)]
    if part == "b":
        return [("train", i) for i in range(30, 50)]
    return [("test", i) for i in range(10)]


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def pack(npz: Path, out: Path, part: str) -> None:
    """Write part ``part`` of ``npz`` as lossless WebP mosaics (and, in part b, the labels and the hashes)."""
    from PIL import Image

    d = np.load(npz)
    out.mkdir(parents=True, exist_ok=True)
    for split, i in _chunks(part):
        name = out / f"{split}_{i:02d}.webp"
        if name.is_file():
            continue
        x = d[f"x_{split}"][i * PER:(i + 1) * PER]
        m = x.reshape(ROWS, COLS, TILE, TILE, 3).transpose(0, 2, 1, 3, 4).reshape(ROWS * TILE, COLS * TILE, 3)
        Image.fromarray(m).save(name, format="WEBP", lossless=True, quality=100, method=5)
    if part == "b":
        np.savez(out / "meta.npz", y_train=d["y_train"], y_test=d["y_test"], class_names=d["class_names"])
        (out / "sha256.json").write_text(json.dumps({k: _sha(d[k]) for k in KEYS}, indent=1))


def unpack(parts: list[Path], root: Path) -> Path:
    """Rebuild ``root/cifar10/cifar10.npz`` from the parts; raises if any array's hash differs."""
    from PIL import Image

    tiles: dict[str, list[tuple[int, np.ndarray]]] = {"train": [], "test": []}
    meta = sha = None
    for folder in parts:
        for f in sorted(folder.glob("*.webp")):
            split, i = f.stem.split("_")
            m = np.asarray(Image.open(f).convert("RGB"))
            x = m.reshape(ROWS, TILE, COLS, TILE, 3).transpose(0, 2, 1, 3, 4).reshape(PER, TILE, TILE, 3)
            tiles[split].append((int(i), x))
        if (folder / "meta.npz").is_file():
            meta = np.load(folder / "meta.npz")
            sha = json.loads((folder / "sha256.json").read_text())
    if meta is None or sha is None:
        raise SystemExit("unpack: no part holds meta.npz and sha256.json (part b)")
    arrays = {"x_train": np.concatenate([x for _, x in sorted(tiles["train"], key=lambda t: t[0])]),
              "x_test": np.concatenate([x for _, x in sorted(tiles["test"], key=lambda t: t[0])]),
              "y_train": meta["y_train"], "y_test": meta["y_test"]}
    bad = [k for k in KEYS if _sha(arrays[k]) != sha[k]]
    if bad:
        raise SystemExit(f"unpack: {', '.join(bad)} differ from the packed arrays (shapes "
                         f"{[arrays[k].shape for k in bad]})")
    target = root / "cifar10" / "cifar10.npz"
    target.parent.mkdir(parents=True, exist_ok=True)
    np.savez(target, class_names=meta["class_names"], **arrays)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--npz", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--part", choices=("a", "b", "c"), required=True)
    u = sub.add_parser("unpack")
    u.add_argument("--parts", type=Path, nargs="+", required=True)
    u.add_argument("--root", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        pack(args.npz, args.out, args.part)
    else:
        print(f"unpacked and checked: {unpack(args.parts, args.root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
