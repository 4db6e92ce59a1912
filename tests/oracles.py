"""Brute-force float64 references for curvature, Jacobians and kernels (reusable by any test).

Everything here loops over examples and over outputs with one ``torch.autograd.grad`` call each and
builds dense matrices in the order of ``continual_blr.types.flatten``. Slow on purpose: no vmap, no
torch.func, no factorisation — an independent check of ``continual_blr.curvature``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from continual_blr.types import KronCurvature, ParamDict


def _call(model: nn.Module, x: Tensor, head: int | None) -> Tensor:
    return model(x) if head is None else model(x, head=head)


def _params(model: nn.Module, names: list[str] | None) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad and (names is None or n in names)}


def _flat_grad(out: Tensor, params: dict[str, nn.Parameter]) -> Tensor:
    gs = torch.autograd.grad(out, list(params.values()), retain_graph=True, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(gs, params.values())])


def jacobians(model: nn.Module, x: Tensor, *, head: int | None = None, param_names: list[str] | None = None,
              output_fn: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """J [N, K, P]: for each example one forward, for each output one backward. Eval mode assumed."""
    params = _params(model, param_names)
    rows = []
    for i in range(x.shape[0]):
        out = _call(model, x[i:i + 1], head)
        if output_fn is not None:
            out = output_fn(out)
        out = out[0]
        rows.append(torch.stack([_flat_grad(out[k], params) for k in range(out.shape[0])]))
    return torch.stack(rows)


def output_hessians(model: nn.Module, x: Tensor, *, head: int | None = None, likelihood: str = "classification",
                    sigma: float = 1.0) -> Tensor:
    """Λ_i = ∂²ℓ/∂f² [N, K, K] by autograd (torch.autograd.functional.hessian) — not the closed form."""
    with torch.no_grad():
        f = _call(model, x, head)
    out = []
    for i in range(f.shape[0]):
        if likelihood == "classification":
            def loss(z: Tensor) -> Tensor:  # CE Hessian does not depend on the label
                return -torch.log_softmax(z, -1)[0]
        else:
            def loss(z: Tensor) -> Tensor:
                return 0.5 * ((z - 0.3) ** 2).sum() / sigma**2
        out.append(torch.autograd.functional.hessian(loss, f[i]))
    return torch.stack(out)


def ggn(model: nn.Module, x: Tensor, *, head=None, param_names=None, likelihood="classification",
        sigma=1.0) -> Tensor:
    """Σ_i J_iᵀ Λ_i J_i, dense [P, P]."""
    j = jacobians(model, x, head=head, param_names=param_names)
    lam = output_hessians(model, x, head=head, likelihood=likelihood, sigma=sigma)
    n, k, p = j.shape
    lj = torch.einsum("nkl,nlq->nkq", lam, j)  # two steps: no [N, P, P] intermediate
    return j.reshape(n * k, p).T @ lj.reshape(n * k, p)


def per_example_losses(f: Tensor, y: Tensor, likelihood: str, sigma: float) -> Tensor:
    if likelihood == "classification":
        return nn.functional.cross_entropy(f, y, reduction="none")
    y = y.reshape(f.shape)
    return 0.5 * ((f - y) ** 2).sum(-1) / sigma**2


def per_example_grads(model: nn.Module, x: Tensor, y: Tensor, *, head=None, param_names=None,
                      likelihood="classification", sigma=1.0,
                      loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Per-example losses [N] and gradients [N, P], one forward and one backward per example."""
    params = _params(model, param_names)
    losses, grads = [], []
    for i in range(x.shape[0]):
        f = _call(model, x[i:i + 1], head)
        loss = (loss_fn(f, y[i:i + 1]) if loss_fn is not None
                else per_example_losses(f, y[i:i + 1], likelihood, sigma))[0]
        losses.append(loss.detach())
        grads.append(_flat_grad(loss, params))
    return torch.stack(losses), torch.stack(grads)


def empirical_fisher(model, x, y, **kw) -> Tensor:
    """Σ_i g_i g_iᵀ from per-example gradients at the given labels (dense [P, P])."""
    _, g = per_example_grads(model, x, y, **kw)
    return g.T @ g


def mc_fisher(model, x, labels: Tensor, **kw) -> Tensor:
    """Σ_i (1/S) Σ_s g_{i,s} g_{i,s}ᵀ at given sampled labels [N, S] (classification) or targets [N, S, K]."""
    s = labels.shape[1]
    out = 0
    for j in range(s):
        out = out + empirical_fisher(model, x, labels[:, j], **kw) / s
    return out


def hessian(model: nn.Module, x: Tensor, y: Tensor, *, head=None, param_names=None,
            likelihood="classification", sigma=1.0) -> Tensor:
    """Exact Hessian of Σ_i ℓ_i by double backward (row by row)."""
    params = _params(model, param_names)
    f = _call(model, x, head)
    loss = per_example_losses(f, y, likelihood, sigma).sum()
    gs = torch.autograd.grad(loss, list(params.values()), create_graph=True, allow_unused=True)
    g = torch.cat([(torch.zeros_like(p) if t is None else t).reshape(-1) for t, p in zip(gs, params.values())])
    rows = [_flat_grad(g[i], params) if g[i].requires_grad else torch.zeros_like(g) for i in range(g.numel())]
    return torch.stack(rows)


def kfac_factors(model: nn.Module, layer: nn.Module, x: Tensor, *, y: Tensor | None = None, head=None,
                 bias: bool = True, mode: str = "ggn", likelihood: str = "classification",
                 sigma: float = 1.0) -> tuple[Tensor, Tensor]:
    """K-FAC-expand factors of one Linear/Conv2d layer by their definitions, one example at a time:

        A = (1/(N R)) Σ_i Σ_r ã_{i,r} ã_{i,r}ᵀ
        G = Σ_i Σ_r J_{i,r}ᵀ Λ_i J_{i,r}          (mode "ggn"; J_{i,r} = ∂f_i/∂y_{i,r}, Λ_i by autograd)
        G = Σ_i Σ_r ∂ℓ_i/∂y_{i,r} (∂ℓ_i/∂y_{i,r})ᵀ  (mode "grad"; labels y)

    with ã = [a; 1] the (bias-augmented) input patch at output position r and y the layer output.
    """
    store = {}

    def hook(mod, inp, out):
        store["a"], store["y"] = inp[0], out

    def by_position(gy: Tensor) -> Tensor:  # layer-output gradient of one example → [d_out, R]
        return gy[0].reshape(gy.shape[1], -1) if isinstance(layer, nn.Conv2d) else gy[0].reshape(-1, gy.shape[-1]).T

    h = layer.register_forward_hook(hook)
    try:
        a_sum, g_sum, count = 0, 0, 0
        for i in range(x.shape[0]):
            f = _call(model, x[i:i + 1], head)
            a, yout = store["a"], store["y"]
            if isinstance(layer, nn.Conv2d):
                patches = nn.functional.unfold(a, layer.kernel_size, dilation=layer.dilation,
                                               padding=layer.padding, stride=layer.stride)[0].T  # [R, d_in]
            else:
                patches = a.reshape(-1, a.shape[-1])
            if bias:
                patches = torch.cat([patches, torch.ones(patches.shape[0], 1, dtype=a.dtype)], 1)
            a_sum = a_sum + patches.T @ patches
            count += patches.shape[0]
            if mode == "ggn":
                lam = output_hessians(model, x[i:i + 1], head=head, likelihood=likelihood, sigma=sigma)[0]
                jy = torch.stack([by_position(torch.autograd.grad(f[0, k], yout, retain_graph=True)[0])
                                  for k in range(f.shape[1])])  # [K, d_out, R]
                g_sum = g_sum + torch.einsum("kor,kl,lpr->op", jy, lam, jy)
            else:
                loss = per_example_losses(f, y[i:i + 1], likelihood, sigma)[0]
                gy = by_position(torch.autograd.grad(loss, yout)[0])
                g_sum = g_sum + gy @ gy.T
        return (a_sum / count).detach(), g_sum.detach()
    finally:
        h.remove()


def kron_to_dense(kc: KronCurvature, params: ParamDict) -> Tensor:
    """Densify a KronCurvature into [P, P] in ``types.flatten`` order (Θ = [W | b] row-major, G ⊗ A)."""
    names = list(params)
    offs, start = {}, 0
    for n in names:
        offs[n] = start
        start += params[n].numel()
    out = torch.zeros(start, start, dtype=next(iter(params.values())).dtype)
    for blk in kc.blocks:
        d_out = params[blk.weight].shape[0]
        d_w = params[blk.weight][0].numel()
        full = torch.kron(blk.G, blk.A)  # row-major vec(Θ), Θ ∈ R^{d_out × d_in'}
        d_in = blk.A.shape[0]
        idx = []
        for o in range(d_out):
            for i in range(d_in):
                if i < d_w:
                    idx.append(offs[blk.weight] + o * d_w + i)
                else:
                    idx.append(offs[blk.bias] + o)
        idx_t = torch.tensor(idx)
        out[idx_t[:, None], idx_t[None, :]] += full.to(out.dtype)
    for n, d in kc.diag.items():
        s = slice(offs[n], offs[n] + d.numel())
        out[s, s] += torch.diag(d.reshape(-1)).to(out.dtype)
    return out


def kernel(j: Tensor, sigma: Tensor, blockwise: bool) -> Tensor:
    """J Σ Jᵀ from dense J [M, K, P] and Σ [P, P]: [K, M, M] class blocks or [M·K, M·K]."""
    m, k, p = j.shape
    full = j.reshape(m * k, p) @ sigma @ j.reshape(m * k, p).T
    if not blockwise:
        return full
    f4 = full.reshape(m, k, m, k)
    return torch.stack([f4[:, c, :, c] for c in range(k)])


class Linear(nn.Module):
    """f(x) = x·w with w ∈ ℝᵈ (float64, starting at 0): Bayesian linear regression's model."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(d, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.w


def quadratic_closure(model: nn.Module, x: Tensor, y: Tensor, sigma: float):
    """The BLR closure of Gaussian regression: params ↦ per-example ½ (y − f(x))² / σ²."""

    def closure(params):
        return 0.5 * (y - torch.func.functional_call(model, params, (x,))) ** 2 / sigma**2

    return closure
