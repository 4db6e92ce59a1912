"""The curvature engine on ``torch.func``: per-example Jacobians and gradients, GGN / empirical Fisher /
MC Fisher (and the exact Hessian for small models) in diagonal, Kronecker (K-FAC) and full structure,
and DNN2GP / FROMP kernels J Σ Jᵀ with their kernel-vector products.

All curvatures are **sums** over examples. Every function runs the model in eval mode (BatchNorm on
its running statistics, dropout off) and restores each module's ``training`` flag in a ``finally``.
Equations and scalings: ``docs/curvature.md``.
"""

from ._engine import eval_mode
from .estimates import curvature
from .jacobians import per_example_grads, per_example_jacobians
from .kernels import kernel, kernel_vector_product
from .likelihoods import hessian_sqrt, loss_gradient, mc_cotangents, nll, output_hessian

__all__ = [
    "per_example_jacobians",
    "per_example_grads",
    "curvature",
    "kernel",
    "kernel_vector_product",
    "eval_mode",
    "nll",
    "loss_gradient",
    "hessian_sqrt",
    "output_hessian",
    "mc_cotangents",
]
