"""How much do TF32 convolutions move FROMP's kernels on a memorised CifarNet? (issue 43, CPU emulation)

On a lent GPU, FROMP on FROMP's CifarNet protocol blew up in task 2 or 3 in 5 of 13 runs
(``benchmarks/device/LOG.md``); in the run whose log kept them, the Cholesky factorisation of a kernel needed
jitters of 10⁻³, 10⁻² and 10⁻¹ instead of 10⁻⁶, so the kernel it factorised had eigenvalues ≤ −10⁻² — impossible for
the exact K = J Σ Jᵀ, which is positive semi-definite. PyTorch runs fp32 convolutions in TF32 on such GPUs by default
(operands rounded to 11 significant bits, unit roundoff u = 2⁻¹¹); the CPU never does, and no CPU run diverged.

This script trains task 1 of the protocol on the CPU (fp32, ``--epochs`` of the config's 80, on 90 % of the task's
training images: the test set is never read), lets FROMP choose its memorable points and curvature at the task's end,
and computes each class kernel of those points three ways, at the same weights:

* ``fp64``: network, Σ and points in float64 (the reference);
* ``fp32``: as the library computes it on a CPU (or, since this change, on a GPU);
* ``tf32 (emulated)``: fp32 with every convolution's weights and inputs rounded to 11 significant bits in the
  forward pass (gradients pass the rounding unchanged) — a lower bound on TF32's error, whose backward
  convolutions round as well.

Printed per variant: the relative error ‖K − K₆₄‖_F / ‖K₆₄‖_F, the smallest and largest eigenvalue, the jitter the
library's Cholesky needs (from ε = 10⁻⁶ up, ×10), and the largest eigenvalue of τ (K + εI)⁻¹ (the penalty's
stiffness in Δp). It is a diagnosis, not a benchmark row.

Run (about 20 CPU-seconds per epoch of task 1 on an AMD EPYC, 1 thread: 792 s for 40 epochs):
``python benchmarks/diagnose/diagnose_fromp_tf32.py --data-dir $CONTINUAL_BLR_DATA --epochs 20 --out DIR``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # protocol.py beside this file


def round_tf32(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to 11 significant bits (TF32's 10 stored mantissa bits), round half to even."""
    m, e = torch.frexp(t)
    return torch.ldexp(torch.round(m * 2048.0) / 2048.0, e)


def _ste(t: torch.Tensor) -> torch.Tensor:
    return t + (round_tf32(t) - t).detach()


def _tf32_conv(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)`` with its weight and input rounded to TF32 (straight-through gradients)."""
    return nn.functional.conv2d(_ste(x), _ste(conv.weight), conv.bias, conv.stride, conv.padding, conv.dilation,
                                conv.groups)


def emulate_tf32(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose convolutions compute as :func:`_tf32_conv`; only each Conv2d's forward is replaced,
    so the module tree and the parameter names stay those of ``model``."""
    out = copy.deepcopy(model)
    for mod in out.modules():
        if isinstance(mod, nn.Conv2d):
            mod.forward = functools.partial(_tf32_conv, mod)  # type: ignore[method-assign]
    return out


def _jitter_needed(k: torch.Tensor, eps: float = 1e-6) -> float:
    eye = torch.eye(k.shape[-1], dtype=torch.float64)
    while eps < 1e3:
        if int(torch.linalg.cholesky_ex(k + eps * eye).info) == 0:
            return eps
        eps *= 10.0
    return float("inf")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", required=True, help="folder holding cifar10/cifar10.npz")
    ap.add_argument("--config", default=str(ROOT / "configs/split_cifar10/fromp.yaml"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=20, help="epochs of task 1 (the protocol's: 80)")
    ap.add_argument("--validation", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True, help="folder for result.json (written at the end)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from continual_blr.curvature import kernel
    from continual_blr.loop import run_stream
    from continual_blr.regularizers.functional import _prob_fn
    from protocol import first_method_run

    stream, train, method, model, _ = first_method_run(args.config, args.data_dir, seed=args.seed,
                                                       validation=args.validation, tasks=1, precision="fp32",
                                                       epochs=args.epochs)
    t0 = time.process_time()
    losses: list[float] = []
    run_stream(model, stream, method, train, seed=args.seed, device="cpu", progress=True,
               on_epoch=lambda i, epoch, loss: losses.append(loss))
    train_cpu = time.process_time() - t0
    reg = method.regularizer
    entry = reg.memory.entries[0]
    sigma = reg.sigma(model)
    fn = _prob_fn(entry.columns, reg._drop_last(entry), reg.output)
    model.eval()

    def k_of(net: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        net = net.to(dtype).eval()
        sig = {n: s.to(dtype) for n, s in sigma.items()}
        return kernel(net, entry.x.to(dtype), sig, head=entry.head, output_fn=fn, blockwise=True).detach().double()

    ref = k_of(copy.deepcopy(model), torch.float64)
    variants = {"fp64": ref, "fp32": k_of(copy.deepcopy(model), torch.float32),
                "tf32 (emulated)": k_of(emulate_tf32(model), torch.float32)}
    tau = float(reg.tau)
    rows = []
    for name, k in variants.items():
        k = 0.5 * (k + k.mT)
        for c in range(k.shape[0]):
            ev = torch.linalg.eigvalsh(k[c])
            eps = _jitter_needed(k[c])
            stiff = tau / float(torch.linalg.eigvalsh(k[c] + eps * torch.eye(k.shape[-1], dtype=torch.float64))[0])
            rows.append({"variant": name, "class": c, "rel_err": float((k[c] - ref[c]).norm() / ref[c].norm()),
                         "eig_min": float(ev[0]), "eig_max": float(ev[-1]), "jitter": eps, "stiffness": stiff,
                         "diag_min": float(k[c].diagonal().min())})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"config": args.config, "seed": args.seed, "epochs": args.epochs, "train_cpu_s": train_cpu,
              "last_epoch_loss": losses[-1] if losses else None, "points": len(entry), "tau": tau, "rows": rows}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(f"task 1: {args.epochs} epochs, last epoch's train loss {result['last_epoch_loss']:.4g}, "
          f"{train_cpu:.0f} CPU-s; {len(entry)} memorable points, tau {tau:g}")
    print("| kernel | class | ‖K − K64‖/‖K64‖ | smallest eigenvalue | largest | jitter needed | τ/λ_min(K + εI) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['class']} | {r['rel_err']:.2e} | {r['eig_min']:.3g} | {r['eig_max']:.4g} | "
              f"{r['jitter']:g} | {r['stiffness']:.3g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
