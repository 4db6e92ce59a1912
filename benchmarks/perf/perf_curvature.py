"""Speed of the curvature engine against a naive loop and a hook-based per-layer construction.

Run (CPU, the thread count torch picks; a few minutes on 2 idle cores):

    python benchmarks/perf/perf_curvature.py --out benchmarks/results/perf/perf_curvature.md
    python benchmarks/perf/perf_curvature.py --quick          # smoke run, subsampled everywhere

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

ROOT = Path(__file__).resolve().parents[2]
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


def clock(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def race(entries: dict, repeats: int) -> tuple[dict, dict]:
    """Run the contestants in turn, ``repeats`` rounds (interleaved, so a load spike on the shared
    machine hits all of them); keep each one's fastest round. ``entries[name]()`` → (seconds, result)."""
    best = {n: math.inf for n in entries}
    out = {}
    for _ in range(repeats):
        for name, fn in entries.items():
            t, res = fn()
            best[name] = min(best[name], t)
            out[name] = res
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
    ap.add_argument("--naive-cnn", type=int, default=5, help="examples/points the naive loop runs on (CNN)")
    ap.add_argument("--hooks-cnn", type=int, default=250, help="examples the hook baseline runs on (CNN diag)")
    ap.add_argument("--ours-cnn", type=int, default=1000, help="examples ours runs on (CNN diag)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the fastest round counts")
    ap.add_argument("--chunk-mlp", type=int, default=2048)
    ap.add_argument("--chunk-cnn", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="subsample everything (smoke run)")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    args = ap.parse_args(argv)
    if args.quick:
        args.n_diag, args.naive_mlp, args.naive_cnn, args.hooks_cnn, args.ours_cnn = 1000, 50, 2, 32, 64
        args.repeats = 1
    n_ours_cnn = min(args.ours_cnn, args.n_diag)

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
            x = torch.rand(max(n_ours_cnn, args.hooks_cnn, args.m_kernel), 3, 32, 32, generator=gen)
            n_naive, n_hooks, n_ours, chunk = args.naive_cnn, args.hooks_cnn, n_ours_cnn, args.chunk_cnn
            label = "CifarNet (4 conv + fc512)"
        n_par = sum(p.numel() for p in model.parameters())
        n = args.n_diag

        # ---- diag GGN over N examples (linear in N: subsample runs are scaled by N / n_timed)
        task = f"{label}: diag GGN, N={n}"
        curvature(model, x[:8], chunk_size=chunk)  # warm-up
        best, res = race({
            "ours": lambda: clock(lambda: curvature(model, x[:n_ours], chunk_size=chunk)),
            "hooks": lambda: clock(lambda: hooks_diag_ggn(model, x[:n_hooks], chunk)),
            "naive loop": lambda: clock(lambda: naive_diag_ggn(model, x[:n_naive])),
        }, args.repeats)
        t_ours = best["ours"] * n / n_ours

        def note(k: int) -> str:
            return "full run" if k == n else f"timed on {k}, extrapolated ×{n / k:.3g}"

        add(task, "ours", t_ours, t_ours, f"P={n_par:,}, chunk {chunk}; " + note(n_ours))
        add(task, "hooks", best["hooks"] * n / n_hooks, t_ours, note(n_hooks))
        add(task, "naive loop", best["naive loop"] * n / n_naive, t_ours, note(n_naive))
        d_small = curvature(model, x[:n_naive], chunk_size=chunk)
        d_hk = res["ours"] if n_hooks == n_ours else curvature(model, x[:n_hooks], chunk_size=chunk)
        checks.append(f"{label} diag GGN: max rel. diff naive vs ours {rel_diff(res['naive loop'], d_small):.1e} "
                      f"(N={n_naive}); hooks vs ours {rel_diff(res['hooks'], d_hk):.1e} (N={n_hooks})")
        del res, d_small, d_hk

        # ---- FROMP kernel on M points × 10 classes
        m = args.m_kernel
        xm = x[:m]
        task = f"{label}: FROMP kernel, M={m}×10"
        sigma = {k: torch.rand(v.shape, generator=gen) * 1e-3 + 1e-4 for k, v in params_of(model).items()}
        flat = torch.cat([s.reshape(-1) for s in sigma.values()])
        m_naive = min(m, args.naive_mlp if arch == "mlp" else args.naive_cnn)

        def naive_kernel():  # loop timed on m_naive points (×M/m_naive), product ×(M/m_naive)²
            t_loop, j = clock(lambda: naive_jacobian_rows(model, xm[:m_naive]))
            t_prod, k = clock(lambda: naive_kernel_product(j, flat))
            return t_loop * m / m_naive + t_prod * (m / m_naive) ** 2, k

        kernel(model, xm[:8], sigma, output_fn=softmax)  # warm-up
        entries = {"ours": lambda: clock(lambda: kernel(model, xm, sigma, output_fn=softmax))}
        if arch == "mlp":
            entries["ours, jvp method"] = lambda: clock(
                lambda: kernel(model, xm, sigma, output_fn=softmax, method="jvp", chunk_size=100))
        entries["hooks"] = lambda: clock(lambda: hooks_kernel(model, xm, sigma))
        entries["naive loop"] = naive_kernel
        best, res = race(entries, args.repeats)
        t_k = best["ours"]
        add(task, "ours", t_k, t_k, "structured (T shared by classes for Linear, dense rows for Conv2d)")
        if "ours, jvp method" in best:
            add(task, "ours, jvp method", best["ours, jvp method"], t_k,
                "columns J Σ Jᵀ e via vmap(jvp ∘ Σ ∘ vjp), 100 at a time")
            checks.append(f"{label} kernel: jvp vs structured max rel. diff "
                          f"{rel_diff(res['ours, jvp method'], res['ours']):.1e}")
        add(task, "hooks", best["hooks"], t_k, "full run")
        add(task, "naive loop", best["naive loop"], t_k, "full run" if m_naive == m else (
            f"timed on {m_naive} points; loop ×{m / m_naive:.3g}, product ×{(m / m_naive) ** 2:.3g}"))
        checks.append(f"{label} kernel: hooks vs ours max rel. diff {rel_diff(res['hooks'], res['ours']):.1e}")
        k_small = res["ours"] if m_naive == m else kernel(model, xm[:m_naive], sigma, output_fn=softmax)
        checks.append(f"{label} kernel: naive vs ours max rel. diff {rel_diff(res['naive loop'], k_small):.1e} "
                      f"(M={m_naive})")
        del res, k_small

    load1 = os.getloadavg()
    header = [
        "# Curvature engine: speed against a naive loop and a hook-based construction",
        "",
        "Command: `python benchmarks/perf/perf_curvature.py " + " ".join(argv if argv is not None else sys.argv[1:]) + "`",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, float32, CPU. Load average at start / end: "
        f"{load0[0]:.2f} / {load1[0]:.2f} (the machine is shared with other jobs; every time is the fastest of "
        f"{args.repeats} interleaved rounds).",
        "",
        "Ratio = contestant time / ours (higher = ours faster). Rows timed on a subsample are scaled to the "
        "full size and say so (the diag GGN is linear in N: chunks are independent).",
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
