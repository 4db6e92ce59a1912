"""The fused diagonal BLR update on CPU as one C loop, written in place, compiled once per machine.

:func:`~continual_blr.optim.diag_state.diag_update` (the algorithm of :mod:`continual_blr.optim.diag_state`)
does one line of the update per tensor operation; compiled by inductor (``fused_diag_update``) it is one loop,
but inductor's import and compile cost about 4 s of CPU in every fresh process (a split-MNIST BLR run is
about 50 s) and its outputs are new tensors, so the optimiser's per-parameter views of D, D̄ and u are rebuilt
every step. :func:`native_update` is the same update as a plain C loop (``native_update.c``) that writes m, D,
D̄, u and the next sample's scale r = (S₀ + D)^{-1/2} into the given buffers:

* built with the system C compiler (``$CC``, else ``cc``; ``-O3 -march=native``, no fast-math: IEEE division
  and square root, no contraction into FMAs) into ``$CONTINUAL_BLR_CACHE`` (default ``~/.cache/continual_blr``),
  one shared library per (source, dtype, flags, compiler, CPU), written under a temporary name and renamed, so
  concurrent processes (``torchrun``) never load a half-written file; loaded with ``ctypes``;
* float32 and float64 contiguous CPU vectors; anything else, no compiler, a failed build, or
  ``CONTINUAL_BLR_NATIVE=0`` gives None and the caller keeps the inductor path.

It agrees with :func:`diag_update` to rounding (each line's operations are rounded as the C source writes them;
``tests/test_blr_native.py`` checks every flag combination against ``diag_update`` in float64), not to the bit:
the per-element operations are the same, but inductor's and ATen's vector kernels contract some of them into
fused multiply-adds.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

__all__ = ["native_update", "FLAGS"]

FLAGS = ("positivity", "h_from_sample", "momentum", "clip", "damping", "fresh", "separate")
_SOURCE = Path(__file__).with_name("native_update.c")
_CFLAGS = ["-O3", "-march=native", "-fno-fast-math", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]
_LOADED: dict[tuple, Callable | None] = {}
_WARNED: list[str] = []


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags (Linux), else the platform."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(dict.fromkeys(lines))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _compiler() -> list[str] | None:
    cc = os.environ.get("CC", "cc")
    path = shutil.which(cc)
    return [path] if path else None


def _cache_dir() -> Path:
    root = os.environ.get("CONTINUAL_BLR_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "continual_blr")
    return Path(root) / "native"


def _build(dtype: torch.dtype, flags: dict[str, bool]) -> Path | None:
    """The shared library for one dtype and flag setting: from the cache, else compiled into it."""
    cc = _compiler()
    if cc is None:
        return _fail("no C compiler ($CC or cc) on PATH")
    defines = [f"-D{k.upper()}" for k in FLAGS if flags[k]] + (["-DT_DOUBLE"] if dtype == torch.float64 else [])
    try:
        version = subprocess.run(cc + ["--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return _fail(f"{cc[0]} --version failed ({e})")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(_CFLAGS + defines).encode(), cc[0].encode(),
                                     version.encode(), _cpu_id().encode()])).hexdigest()[:24]
    out = _cache_dir() / f"blr_diag_update_{key}.so"
    if out.is_file():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        result = subprocess.run(cc + _CFLAGS + defines + [str(_SOURCE), "-o", tmp, "-lm"], capture_output=True,
                                text=True, timeout=300)
        if result.returncode != 0:
            os.unlink(tmp)
            return _fail(f"compiling {_SOURCE.name} failed: {result.stderr.strip().splitlines()[-1:]}")
        os.replace(tmp, out)  # atomic: a concurrent process sees no file or the whole one
    except (OSError, subprocess.SubprocessError) as e:
        return _fail(f"building {_SOURCE.name} in {out.parent} failed ({e})")
    return out


def _fail(why: str) -> None:
    if why not in _WARNED:
        _WARNED.append(why)
        warnings.warn(f"the native BLR update is unavailable ({why}); using the inductor-compiled update",
                      RuntimeWarning, stacklevel=3)
    return None


def _load(dtype: torch.dtype, flags: dict[str, bool]) -> Callable | None:
    key = (dtype, tuple(flags[k] for k in FLAGS))
    if key not in _LOADED:
        path = _build(dtype, flags)
        fn = None
        if path is not None:
            try:
                fn = ctypes.CDLL(str(path)).blr_diag_update
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 13
            except OSError as e:
                fn = _fail(f"loading {path} failed ({e})")
        _LOADED[key] = fn
    return _LOADED[key]


def native_update(dtype: torch.dtype, device: torch.device, **flags: bool) -> Callable | None:
    """The in-place update for ``dtype`` on ``device`` and the flags of :func:`diag_update` (keyword ``FLAGS``),
    or None where it is unavailable (not CPU, not float32 / float64, no compiler, ``CONTINUAL_BLR_NATIVE=0``).

    The returned ``update(g, h, mean_in, mean_out, m0, s0, data, avg, mom, eps, r, scalars) -> (ok, n_clip)``
    takes contiguous vectors of one length and dtype (``h``, ``avg``, ``mom``, ``eps`` may be any such vector
    where their flag leaves them unused) and ``scalars`` = (1 − β₁, ρ_t, ρ̄_t, 1/(1 − β₁ᵗ), α, radius, Nγ) as
    floats. It reads ĝ, ĥ, m (``mean_in``), m₀, S₀, D, D̄, u, ε and r, and writes the new m into ``mean_out``,
    D into ``data`` (when ``fresh``), D̄ into ``avg`` (``fresh`` and ``separate``), u into ``mom``
    (``momentum``) and (S₀ + D)^{-1/2} into ``r``. When a ĝ (or a separate ĥ) is not finite it writes nothing
    and returns ``(False, 0)``; else ``(True, number of clipped coordinates)``.
    """
    if (os.environ.get("CONTINUAL_BLR_NATIVE", "1") == "0" or device.type != "cpu"
            or dtype not in (torch.float32, torch.float64)):
        return None
    key = (dtype, tuple(flags.get(k) for k in FLAGS))
    update = _UPDATES.get(key)
    if update is None and key not in _UPDATES:
        if sorted(flags) != sorted(FLAGS):
            raise ValueError(f"native_update: flags must be exactly {FLAGS}; got {sorted(flags)}")
        fn = _load(dtype, flags)
        update = _UPDATES[key] = None if fn is None else _wrap(fn, dtype)
    return update


_UPDATES: dict[tuple, Callable | None] = {}


def _wrap(fn: Callable, dtype: torch.dtype) -> Callable:
    """The Python face of one loaded loop: checks the vectors, passes their addresses."""

    def update(g: Tensor, h: Tensor, mean_in: Tensor, mean_out: Tensor, m0: Tensor, s0: Tensor, data: Tensor,
               avg: Tensor, mom: Tensor, eps: Tensor, r: Tensor, scalars: tuple[float, ...]) -> tuple[bool, int]:
        vectors = (g, h, mean_in, mean_out, m0, s0, data, avg, mom, eps, r)
        n = g.numel()
        for v in vectors:
            if v.dtype != dtype or v.device.type != "cpu" or not v.is_contiguous() or v.numel() != n:
                raise ValueError(f"native_update: every vector must be a contiguous {dtype} CPU vector of length "
                                 f"{n}; got {v.dtype}, {v.device}, contiguous {v.is_contiguous()}, length {v.numel()}")
        counts, values = (ctypes.c_int64 * 2)(), (ctypes.c_double * 7)(*scalars)  # alive through the call
        bad = fn(n, *(v.data_ptr() for v in vectors), ctypes.addressof(values), ctypes.addressof(counts))
        return bad == 0, int(counts[1])

    return update
