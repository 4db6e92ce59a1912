"""Library defaults in the README quickstart form, on a validation split of split digits (no test data).

Run (1 CPU thread, about 4 minutes; prints one line per row and writes a JSON of the accuracies):

    python benchmarks/defaults_validation.py OUT.json

Each row is ``build_method(name, {})`` (the library defaults) trained by ``run_stream`` with
``TrainConfig(epochs=10)`` on ``make_stream("split_digits", scenario)`` with 20 % of every task's training
data held out and evaluated on (``hold_out_validation``; the test set is never read), MLP 64-100-100,
seeds 0-2, task and class scenarios. A diagnostic of the defaults, not a tuning run: nothing here is chosen
from its numbers.
"""

import json
import sys

import torch

from continual_blr.data import make_stream
from continual_blr.data.builders import hold_out_validation, validation_generator
from continual_blr.loop import run_stream
from continual_blr.methods import TrainConfig, build_method
from continual_blr.models import build_model

METHODS = ("none", "blr", "ivon", "vcl", "laplace")
SEEDS = (0, 1, 2)


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    out = {}
    for scenario in ("task", "class"):
        for name in METHODS:
            accs = []
            for seed in SEEDS:
                stream = hold_out_validation(make_stream("split_digits", scenario=scenario), 0.2,
                                             validation_generator(seed))
                model = build_model("mlp", stream.input_shape, stream.n_outputs, stream.n_heads, hidden=(100, 100),
                                    generator=torch.Generator().manual_seed(seed))
                method = build_method(name, {}, seed=seed)
                r = run_stream(model, stream, method, TrainConfig(epochs=10), seed=seed, progress=False)
                accs.append(100 * r.avg_acc)
            out[f"{scenario}/{name}"] = accs
            print(scenario, name, [round(a, 2) for a in accs], round(sum(accs) / len(accs), 2), flush=True)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/defaults_validation.py OUT.json")
    main(sys.argv[1])
