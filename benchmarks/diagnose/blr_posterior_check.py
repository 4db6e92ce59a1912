"""Does the BLR carry the posterior it claims? Bayesian linear regression through the public API.

Run (one thread, about a minute):

    python benchmarks/diagnose/blr_posterior_check.py
    python benchmarks/diagnose/blr_posterior_check.py --epochs 20 --batch 32 --seeds 0 1 2

Setting (issue 22): ``linear_regression_stream`` with one task of 2,000 examples (σ 0.5, 4 features and a
bias), ``build_model("linear")``, ``build_method(name, params)`` with T 1, ess_factor 1 and no clip, trained by
``run_stream`` for 20 epochs of batch 32. The oracle is the mean-field optimum of the exact posterior:
precision diag(δI + ZᵀZ/σ²) and the exact posterior mean (Z = [X, 1]); for a quadratic loss the
mean-field mean equals the full posterior's. Rows: ``blr`` with the exact GGN, ``blr`` with the Price
estimator, ``ivon`` (its library settings except T, ess and the clip), and the unused second head of a
2-task stream after task 1 (it must carry exactly the prior). Printed: the largest relative error of the
mean, the range of precision / optimum, and the unused head's precision / prior.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from continual_blr.data.synthetic import linear_regression_stream
from continual_blr.loop import run_stream
from continual_blr.methods import TrainConfig, build_method
from continual_blr.models import build_model

ROWS = {
    "blr (ggn)": ("blr", {"curvature": "ggn"}),
    "blr (price)": ("blr", {"curvature": "price", "init_hess": 0.01, "rho": 0.002}),
    "ivon": ("ivon", {}),
}
COMMON = {"temperature": 1.0, "ess_factor": 1.0, "clip_radius": None, "prior_precision": 100.0}  # both methods


def oracle(task, delta: float, sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, diagonal precision) of the mean-field optimum for prior N(0, δ⁻¹ I), in (w, b) order."""
    x = task.x_train.double()
    z = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)
    prec = z.T @ z / sigma**2 + delta * torch.eye(z.shape[1], dtype=x.dtype)
    mean = torch.linalg.solve(prec, z.T @ task.y_train.double() / sigma**2)
    return mean, torch.diagonal(prec)


def check(row: str, seed: int, epochs: int, batch: int, n_train: int, overrides: dict | None = None) -> dict[str, float]:
    name, params = ROWS[row]
    params = {**COMMON, **params, **(overrides or {})}
    stream = linear_regression_stream(n_tasks=2, n_features=4, n_train=n_train, n_test=50, scenario="task", seed=seed)
    first = dataclasses.replace(stream, tasks=stream.tasks[:1])  # train task 1; head 2 sees no data
    model = build_model("linear", stream.input_shape, stream.n_outputs, stream.n_heads,
                        generator=torch.Generator().manual_seed(seed))
    method = build_method(name, params, seed=seed)
    run_stream(model, first, method, TrainConfig(epochs=epochs, batch_size=batch), seed=seed, progress=False)
    post = method.posterior(model)
    mean_o, prec_o = oracle(stream.tasks[0], params["prior_precision"], stream.sigma)
    mean = torch.cat([post.mean["heads.0.weight"].reshape(-1), post.mean["heads.0.bias"].reshape(-1)]).double()
    prec = torch.cat([post.precision["heads.0.weight"].reshape(-1), post.precision["heads.0.bias"].reshape(-1)]).double()
    unused = torch.cat([post.precision["heads.1.weight"].reshape(-1), post.precision["heads.1.bias"].reshape(-1)]).double()
    ratio = prec / prec_o
    return {"mean_err": float((mean - mean_o).abs().max() / mean_o.abs().max()),
            "prec_lo": float(ratio.min()), "prec_hi": float(ratio.max()),
            "unused": float((unused / params["prior_precision"] - 1).abs().max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="override a method parameter in every row (e.g. hess_init=1.0, clip_radius=0.3)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    overrides = {}
    for kv in args.set:
        k, v = kv.split("=", 1)
        overrides[k] = None if v in ("none", "null") else float(v)
    print("| row | seed | max error of the mean / max |m*| | precision / optimum | unused head: max |prec/prior − 1| |")
    print("|---|---|---|---|---|")
    for row in args.rows:
        for seed in args.seeds:
            r = check(row, seed, args.epochs, args.batch, args.n_train, overrides)
            print(f"| {row} | {seed} | {100 * r['mean_err']:.2f} % | {r['prec_lo']:.3f} – {r['prec_hi']:.3f} | "
                  f"{r['unused']:.2e} |", flush=True)


if __name__ == "__main__":
    main()
