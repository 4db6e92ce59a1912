"""Speed of the curvature engine against a naive loop and a hook-based per-layer construction.

Run (CPU, the thread count torch picks; ≈ 6–10 min on 2 cores):

    python benchmarks/perf_curvature.py --out benchmarks/results/perf_curvature.md
    python benchmarks/perf_curvature.py --quick          # smoke run, subsampled everywhere

Two models, both from ``continual_blr.models`` in eval mode and float32: the MLP 784-100-100-10 of
permuted MNIST in FROMP, and FROMP's 4-conv CIFAR network (CifarNet, 32×32×3 inputs, ≈1.25 M weights).
Inputs are uniform [0, 1) noise from a fixed generator (speed does not depend on the data). Two tasks:

* **diag GGN** over N = 10,000 examples: diag(Σ_i J_iᵀ Λ_i J_i), Λ = diag(p) − ppᵀ (softmax CE);
* **FROMP kernel** on M = 200 points × 10 classes: class-wise blocks K_c = J_c Σ J_cᵀ of the softmax
  probabilities, diagonal Σ (the quantity FROMP rebuilds at every task boundary).

Contestants:

* **ours** — ``continual_blr.curvature.curvature(kind="ggn", structure="diag")`` and
  ``continual_blr.curvature.kernel(..., output_fn=softmax, blockwise=True)`` (structured path; the
  jvp(Σ ⊙ vjp(e)) column-by-column variant is timed as well);
* **naive** — one forward per example and one ``torch.autograd.grad`` per example and output, the
  dense Jacobian rows contracted per example (diag GGN: Σ_c (L_iᵀ J_i)²; kernel: J_c, then
  (J_c ⊙ σ) J_cᵀ per class);
* **hooks** — forward hooks save every Linear/Conv2d input, tensor hooks on the layer outputs catch
  the backpropagated gradients of one batched backward per output (cotangent column c of Λ^{1/2},
  resp. of the softmax Jacobian), and the per-layer per-example gradients are built from them
  (Linear: (g²)ᵀ(a²); Conv2d: unfold + one batched product for all c), the BackPACK / ASDL
  construction. Same per-layer algebra as ours; the difference is autograd + hooks versus
  ``torch.func`` taps, and (kernel) a dense product per class versus ours' T shared by all classes.

Where a contestant would run too long it is timed on a subsample and **extrapolated linearly in the
number of examples** (the kernel's dense product quadratically in M); the table says so on each row.
Every contestant's result is compared with ours on the common subsample (max relative difference).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from continual_blr.curvature import curvature, kernel  # noqa: E402
from continual_blr.curvature.likelihoods import hessian_sqrt  # noqa: E402
from continual_blr.models import MLP, CifarNet  # noqa: E402
from continual_blr.types import params_of  # noqa: E402


def softmax(f: Tensor) -> Tensor:
    return f.softmax(-1)


# ---------------------------------------------------------------------------------------------- naive


def naive_diag_ggn(model: nn.Module, x: Tensor) -> dict[str, Tensor]:
    """One forward per example, one backward per (example, output); Σ_i Σ_c ((L_iᵀ J_i)_c)²."""
    params = dict(model.named_parameters())
    acc = torch.zeros(sum(p.numel() for p in params.values()))
    for i in range(x.shape[0]):
        f = model(x[i:i + 1])[0]
        lt = hessian_sqrt(f.detach()[None], "classification")[0]  # rows c: columns of Λ^{1/2}
        j = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(f[k], list(params.values()),
                                                                                 retain_graph=True)])
                         for k in range(f.shape[0])])  # [K, P]
        acc += (lt @ j).square().sum(0)
    out, s = {}, 0
    for n, p in params.items():
        out[n] = acc[s:s + p.numel()].view_as(p)
        s += p.numel()
    return out


def naive_jacobian_rows(model: nn.Module, x: Tensor) -> Tensor:
    """J [K, M, P] of softmax(f) by one backward per (point, class)."""
    params = list(model.parameters())
    rows = []
    for i in range(x.shape[0]):
        p = softmax(model(x[i:i + 1]))[0]
        rows.append(torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(p[k], params, retain_graph=True)])
                                 for k in range(p.shape[0])]))
    return torch.stack(rows, 1)


def naive_kernel_product(j: Tensor, sigma_flat: Tensor) -> Tensor:
    """Per class (J_c ⊙ σ) J_cᵀ."""
    return torch.stack([(jc * sigma_flat) @ jc.T for jc in j])


# ---------------------------------------------------------------------------------------------- hooks


class LayerHooks:
    """Forward hooks store each Linear/Conv2d input a and register a tensor hook on its output that
    stores the backpropagated gradient g of the current backward pass."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
        self.a: dict[nn.Module, Tensor] = {}
        self.g: dict[nn.Module, Tensor] = {}
        self.handles = [m.register_forward_hook(self._fwd) for m in self.layers]

    def _fwd(self, mod: nn.Module, inp: tuple, out: Tensor) -> None:
        self.a[mod] = inp[0].detach()

        def save(g: Tensor, mod: nn.Module = mod) -> None:
            self.g[mod] = g

        out.register_hook(save)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    @staticmethod
    def patches(mod: nn.Module, a: Tensor) -> Tensor:  # [B, d_in, R]
        if isinstance(mod, nn.Conv2d):
            return F.unfold(a, mod.kernel_size, dilation=mod.dilation, padding=mod.padding, stride=mod.stride)
        return a.unsqueeze(-1)

    def per_example(self, mod: nn.Module) -> tuple[Tensor, Tensor]:
        """Per-example weight gradient [B, d_out, d_in] and bias gradient [B, d_out] of the last backward."""
        g = self.g[mod]
        b = g.shape[0]
        g = g.reshape(b, g.shape[1], -1) if isinstance(mod, nn.Conv2d) else g.unsqueeze(-1)
        return torch.bmm(g, self.patches(mod, self.a[mod]).transpose(1, 2)), g.sum(-1)


def hooks_diag_ggn(model: nn.Module, x: Tensor, chunk: int) -> dict[str, Tensor]:
    """K batched backward passes per chunk (cotangents: columns of Λ^{1/2}); hooks collect g per layer;
    Linear: Σ_c (g_c²)ᵀ(a²); Conv2d: per-example gradients for all c in one batched product, squared."""
    hk = LayerHooks(model)
    names = {m: n for n, m in model.named_modules()}
    acc = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    first = hk.layers[0].weight
    try:
        for s in range(0, x.shape[0], chunk):
            out = model(x[s:s + chunk])
            lt = hessian_sqrt(out.detach(), "classification")  # [B, C, K]
            gs: dict[nn.Module, list[Tensor]] = {mod: [] for mod in hk.layers}
            for c in range(lt.shape[1]):
                torch.autograd.grad(out, first, lt[:, c], retain_graph=True)  # fills hk.g
                for mod in hk.layers:
                    gs[mod].append(hk.g[mod])
            del out
            for mod in hk.layers:
                n = names[mod]
                g = torch.stack(gs.pop(mod), 1)  # [B, C, d_out, ...]
                if isinstance(mod, nn.Linear):  # Σ_b Σ_c g² a²ᵀ without per-example gradients
                    acc[f"{n}.weight"] += g.square().sum(1).T @ hk.a[mod].square()
                    acc[f"{n}.bias"] += g.square().sum((0, 1))
                else:
                    b, c, o = g.shape[:3]
                    g = g.reshape(b, c * o, -1)
                    gw = torch.bmm(g, hk.patches(mod, hk.a[mod]).transpose(1, 2))  # [B, C·O, d_in]
                    acc[f"{n}.weight"] += gw.square_().reshape(b, c, o, -1).sum((0, 1)).view_as(mod.weight)
                    acc[f"{n}.bias"] += g.sum(-1).square().reshape(b, c, o).sum((0, 1))
    finally:
        hk.remove()
    return acc


def hooks_kernel(model: nn.Module, x: Tensor, sigma: dict[str, Tensor]) -> Tensor:
    """Per class: one batched backward with the softmax-Jacobian row as cotangent, per-layer Jacobian
    rows J_c[layer] from hooks, K_c = Σ_layers (J_c ⊙ σ) J_cᵀ (Linear layers chunked over outputs)."""
    hk = LayerHooks(model)
    names = {m: n for n, m in model.named_modules()}
    first = hk.layers[0].weight
    try:
        out = model(x)
        p = softmax(out.detach())
        k, m = p.shape[1], p.shape[0]
        res = out.new_zeros(k, m, m)
        for c in range(k):
            v = p[:, c:c + 1] * (F.one_hot(torch.tensor(c), k).to(p) - p)  # ∂p_c/∂f
            torch.autograd.grad(out, first, v, retain_graph=True)
            for mod in hk.layers:
                n = names[mod]
                sw, sb = sigma[f"{n}.weight"].reshape(mod.weight.shape[0], -1), sigma[f"{n}.bias"]
                if isinstance(mod, nn.Linear):
                    g, a = hk.g[mod], hk.a[mod]
                    step = max(1, (1 << 25) // (m * a.shape[1]))
                    for o in range(0, g.shape[1], step):
                        j = (g[:, o:o + step, None] * a[:, None, :]).reshape(m, -1)
                        res[c] += (j * sw[o:o + step].reshape(-1)) @ j.T
                    res[c] += (g * sb) @ g.T
                else:
                    gw, gb = hk.per_example(mod)
                    j = gw.reshape(m, -1)
                    res[c] += (j * sw.reshape(-1)) @ j.T + (gb * sb) @ gb.T
        return res
    finally:
        hk.remove()


# ---------------------------------------------------------------------------------------------- timing


def timed(fn, repeats: int = 1):
    best, out = math.inf, None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def rel_diff(a, b) -> float:
    if isinstance(a, dict):
        a = torch.cat([t.reshape(-1) for t in a.values()])
        b = torch.cat([t.reshape(-1) for t in b.values()])
    return float((a - b).abs().max() / b.abs().max())


def fmt_s(t: float) -> str:
    return f"{t:.3g}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-diag", type=int, default=10_000, help="examples for the diag GGN")
    ap.add_argument("--m-kernel", type=int, default=200, help="points for the FROMP kernel")
    ap.add_argument("--naive-mlp", type=int, default=200, help="examples the naive loop runs on (MLP)")
    ap.add_argument("--naive-cnn", type=int, default=10, help="examples the naive loop runs on (CNN)")
    ap.add_argument("--hooks-cnn", type=int, default=2000, help="examples the hook baseline runs on (CNN diag)")
    ap.add_argument("--ours-cnn", type=int, default=None, help="examples ours runs on (CNN diag; default n-diag)")
    ap.add_argument("--chunk-mlp", type=int, default=2048)
    ap.add_argument("--chunk-cnn", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="subsample everything (smoke run)")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    args = ap.parse_args(argv)
    if args.quick:
        args.n_diag, args.naive_mlp, args.naive_cnn, args.hooks_cnn, args.ours_cnn = 1000, 50, 4, 64, 256
    ours_cnn = args.ours_cnn or args.n_diag

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    load0 = os.getloadavg()
    rows: list[tuple[str, str, str, str, str]] = []  # task, contestant, time, ratio, note
    checks: list[str] = []

    def add(task, who, t, ref_t, note):
        rows.append((task, who, fmt_s(t), f"{t / ref_t:.1f}×" if who != "ours" else "1×", note))
        print(f"{task:32s} {who:16s} {t:10.3f} s  {rows[-1][3]:>8s}  {note}", flush=True)

    for arch in ("mlp", "cnn"):
        if arch == "mlp":
            model = MLP(784, (100, 100), 10).eval()
            x = torch.rand(args.n_diag, 784, generator=gen)
            n_naive, n_hooks, n_ours, chunk = args.naive_mlp, args.n_diag, args.n_diag, args.chunk_mlp
            label = "MLP 784-100-100-10"
        else:
            model = CifarNet().eval()
            x = torch.rand(max(args.n_diag, args.m_kernel), 3, 32, 32, generator=gen)
            n_naive, n_hooks, n_ours, chunk = args.naive_cnn, args.hooks_cnn, ours_cnn, args.chunk_cnn
            label = "CifarNet (4 conv + fc512)"
        for p in model.parameters():
            p.requires_grad_(True)
        n_par = sum(p.numel() for p in model.parameters())
        n = args.n_diag
        task = f"{label}: diag GGN, N={n}"

        # ---- diag GGN
        curvature(model, x[:chunk], chunk_size=chunk)  # warm-up
        t_ours, d_ours = timed(lambda: curvature(model, x[:n_ours], chunk_size=chunk))
        t_ours *= n / n_ours
        add(task, "ours", t_ours, t_ours, f"P={n_par}, chunk {chunk}" + (
            f"; timed on {n_ours}, ×{n / n_ours:.3g}" if n_ours < n else ""))
        t_hooks, d_hooks = timed(lambda: hooks_diag_ggn(model, x[:n_hooks], chunk))
        add(task, "hooks", t_hooks * n / n_hooks, t_ours,
            "full run" if n_hooks == n else f"timed on {n_hooks}, extrapolated ×{n / n_hooks:.3g}")
        t_naive, d_naive = timed(lambda: naive_diag_ggn(model, x[:n_naive]))
        add(task, "naive loop", t_naive * n / n_naive, t_ours,
            f"timed on {n_naive}, extrapolated ×{n / n_naive:.3g}")
        d_sub = curvature(model, x[:n_naive], chunk_size=chunk)
        checks.append(f"{label} diag GGN: max rel. diff naive vs ours {rel_diff(d_naive, d_sub):.1e} "
                      f"(N={n_naive}); hooks vs ours {rel_diff(d_hooks, d_ours if n_hooks == n_ours else curvature(model, x[:n_hooks], chunk_size=chunk)):.1e} (N={n_hooks})")

        # ---- FROMP kernel
        m = args.m_kernel
        xm = x[:m]
        task = f"{label}: FROMP kernel, M={m}×10"
        sigma = {k: torch.rand(v.shape, generator=gen) * 1e-3 + 1e-4 for k, v in params_of(model).items()}
        kernel(model, xm[:8], sigma, output_fn=softmax)  # warm-up
        t_k, k_ours = timed(lambda: kernel(model, xm, sigma, output_fn=softmax), repeats=3 if arch == "mlp" else 1)
        add(task, "ours", t_k, t_k, "structured (T-trick for Linear, dense rows for Conv2d)")
        if arch == "mlp":
            t_j, k_jvp = timed(lambda: kernel(model, xm, sigma, output_fn=softmax, method="jvp", chunk_size=100))
            add(task, "ours, jvp method", t_j, t_k, "columns J Σ Jᵀ e via vmap(jvp ∘ Σ ∘ vjp), 100 at a time")
            checks.append(f"{label} kernel: jvp vs structured max rel. diff {rel_diff(k_jvp, k_ours):.1e}")
        t_h, k_h = timed(lambda: hooks_kernel(model, xm, sigma))
        add(task, "hooks", t_h, t_k, "full run")
        checks.append(f"{label} kernel: hooks vs ours max rel. diff {rel_diff(k_h, k_ours):.1e}")
        m_naive = m if arch == "mlp" else args.naive_cnn
        flat = torch.cat([s.reshape(-1) for s in sigma.values()])
        t_loop, j = timed(lambda: naive_jacobian_rows(model, xm[:m_naive]))
        t_prod, k_naive = timed(lambda: naive_kernel_product(j, flat))
        t_naive = t_loop * m / m_naive + t_prod * (m / m_naive) ** 2
        note = "full run" if m_naive == m else (f"timed on {m_naive} points; loop ×{m / m_naive:.3g}, "
                                                f"product ×{(m / m_naive) ** 2:.3g}")
        add(task, "naive loop", t_naive, t_k, note)
        k_sub = k_ours if m_naive == m else kernel(model, xm[:m_naive], sigma, output_fn=softmax)
        checks.append(f"{label} kernel: naive vs ours max rel. diff {rel_diff(k_naive, k_sub):.1e} (M={m_naive})")
        del j, k_naive

    load1 = os.getloadavg()
    header = [
        "# Curvature engine: speed against a naive loop and a hook-based construction",
        "",
        "Command: `python benchmarks/perf_curvature.py --out benchmarks/results/perf_curvature.md`"
        + (" --quick" if args.quick else ""),
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, float32, CPU. Load average at start / end: "
        f"{load0[0]:.2f} / {load1[0]:.2f} (the machine is shared; timings are single runs unless noted).",
        "",
        "Ratio = contestant time / ours (higher = ours faster). Extrapolated rows are labelled.",
        "",
        "| task | contestant | time (s) | ratio | note |",
        "|---|---|---|---|---|",
    ]
    table = header + [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    table += ["", "Agreement checks (same inputs):", ""] + [f"- {c}" for c in checks]
    text = "\n".join(table) + "\n"
    print()
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
