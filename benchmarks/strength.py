"""How strongly a method holds the past, on one scale: EWC's λ.

EWC (``continual_blr.methods.ewc``) adds ``(λ/2) Σ_k F̄_k (θ − θ*_k)²`` to the *mean* loss of task t,
``F̄_k`` the per-example-*mean* Fisher of past task k. Online Laplace adds
``(1/(2 N_t)) (θ − m)ᵀ (δI + Σ_k C_k / T) (θ − m)`` with ``C_k = N_k F̄_k`` the *summed* curvature of
task k, i.e. ``(1/2) Σ_k (N_k / (N_t T)) F̄_k (θ − m)²``: the same weight on a past task as EWC with
``λ = N_k / (N_t T)``, which is ``1/T`` for equal-sized tasks. λ = 1 (T = 1) is sequential Bayes;
λ > 1 (T < 1) over-counts the past. The BLR's temperature divides the precision a task added before it
becomes the next prior (its ``ess_factor`` scales the new likelihood and the carried precision alike),
so it maps the same way, and so does IVON's (the IVON-form BLR); VCL carries its posterior at T = 1.
L2 (an isotropic pull, no Fisher) and the functional methods (FROMP's τ) have no such equivalent.
"""

from __future__ import annotations

from typing import Any

__all__ = ["lam_equivalent", "format_lam"]

def lam_equivalent(name: str, params: dict[str, Any] | None = None, scenario: str = "task") -> float | None:
    """EWC's λ that gives a past task of the same size the same weight as method ``name`` with
    ``params`` (defaults filled in from the method's params class); None where there is no equivalent.

    EWC: its λ; a method whose params have a ``temperature`` T (Laplace, BLR, IVON): 1/T; VCL: 1; none: 0.
    ``scenario``: the stream's, for a temperature whose default depends on the head layout (Laplace's).
    """
    from continual_blr.methods import build_method

    if name == "none":
        return 0.0
    if name == "vcl":
        return 1.0
    p = getattr(build_method(name, params or {}), "params", None)
    if name == "ewc":
        return float(p.lam)
    if p is not None and hasattr(p, "temperature_for"):
        return 1.0 / p.temperature_for(scenario)
    if p is not None and hasattr(p, "temperature"):
        return 1.0 / float(p.temperature)
    return None


def format_lam(value: float | None) -> str:
    """``"-"`` for no equivalent, else 3 significant digits without exponents (``33.3``, ``1000``, ``0.1``)."""
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 1000 else f"{value:.3g}" if value >= 1e-3 else f"{value:g}"
