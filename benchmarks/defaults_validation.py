"""Library defaults in the README quickstart form, on a validation split of split digits (no test data).

Run (1 CPU thread; prints one line per row and writes a JSON of the accuracies):

    python benchmarks/defaults_validation.py OUT.json                      # the defaults, about 4 minutes
    python benchmarks/defaults_validation.py OUT.json --specs GRID.json    # candidate params (a search)
    python benchmarks/defaults_validation.py OUT.json --specs GRID.json --seeds 0 1 2 3 4 5 6 7 8 9

Each row is ``build_method(name, params)`` (``params`` empty: the library defaults) trained by ``run_stream`` with
``TrainConfig(epochs=10)`` on ``make_stream("split_digits", scenario)`` with 20 % of every task's training data
held out and evaluated on (``hold_out_validation``; the test set is never read), MLP 64-100-100, seeds 0-2 (``--seeds``), task
and class scenarios. ``--specs`` names a JSON list of ``[scenario, method, params]`` rows instead: the search the
defaults were chosen by (``benchmarks/results/search/search_defaults_split_digits.md``). A row whose run diverges scores
NaN for that seed.
"""

import argparse
import json
import math

import torch

from continual_blr.data import make_stream
from continual_blr.data.builders import hold_out_validation, validation_generator
from continual_blr.loop import run_stream
from continual_blr.methods import TrainConfig, build_method
from continual_blr.models import build_model
from continual_blr.types import DivergenceError

METHODS = ("none", "blr", "ivon", "vcl", "laplace")
SEEDS = (0, 1, 2)


def score(scenario: str, name: str, params: dict, seeds=SEEDS) -> list[float]:
    """Final average validation accuracy (%) per seed of one row (NaN where the run diverged)."""
    accs = []
    for seed in seeds:
        stream = hold_out_validation(make_stream("split_digits", scenario=scenario), 0.2, validation_generator(seed))
        model = build_model("mlp", stream.input_shape, stream.n_outputs, stream.n_heads, hidden=(100, 100),
                            generator=torch.Generator().manual_seed(seed))
        method = build_method(name, dict(params), seed=seed)
        try:
            r = run_stream(model, stream, method, TrainConfig(epochs=10), seed=seed, progress=False)
            accs.append(100 * r.avg_acc)
        except DivergenceError:
            accs.append(math.nan)
    return accs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="JSON file of the accuracies")
    ap.add_argument("--specs", help="JSON file: a list of [scenario, method, params] rows (default: the defaults)")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="seeds (default: 0 1 2)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.specs:
        with open(args.specs) as f:
            specs = json.load(f)
    else:
        specs = [[s, m, {}] for s in ("task", "class") for m in METHODS]
    out = []
    for scenario, name, params in specs:
        accs = score(scenario, name, params, seeds=args.seeds)
        out.append({"scenario": scenario, "method": name, "params": params, "seeds": args.seeds, "accs": accs})
        print(scenario, name, json.dumps(params), [round(a, 2) for a in accs], round(sum(accs) / len(accs), 2),
              flush=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
