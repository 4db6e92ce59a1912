"""A short deterministic probe of a run record's config: which library code it executes, and the numbers it gives.

Run (one process per probe; ``--root`` is the folder holding the ``continual_blr`` to import, e.g. a git worktree of
the record's commit):

    python benchmarks/probe.py --record benchmarks/records/split_mnist/task/full/ewc_seed0.json --out /tmp/p.json
    python benchmarks/probe.py --record REC --root /tmp/wt-89e245e7 --out /tmp/old.json   # the record's library

The probe is the record's config (its stream, model, method, seed, train settings) with every task cut to its
first ``--train`` training and ``--test`` test examples (at most ``--conv-examples`` of each for a conv net) and at
most ``--epochs`` epochs,
on the CPU with one thread, saved into a scratch run folder as the record's run was saved. Several records are probed one after the other in one process (torch is imported
once); module and class bodies, which run at import, count for each. It writes a JSON list, one item per record: the
fingerprint of the code it executed (``fingerprint.py``, hashed in
the sources under ``--root``), the accuracy matrix and the per-task training losses (floats, exact in JSON). Two
libraries that give the same probe numbers bit for bit, under each CPU kernel path asked for, ran the same
arithmetic on this input (``check_equivalence.py --side-by-side``); the probe's fingerprint says which code it
reached. ``backfill`` (``check_equivalence.py --backfill``) uses the fingerprint for records made before
fingerprints existed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROBE_TRAIN, PROBE_TEST, PROBE_EPOCHS = 256, 128, 2
CONV_EXAMPLES = 64  # conv nets (CifarNet, ResNet): at most this many training and test examples per task in a probe


def run_config_of(record: dict, root: Path, from_dict, run_config_cls):
    """The run config a record ran: its stored config, or, for a split-digits table record (``split_digits.py``
    stores only the YAML's stem and the method), the table's shared budget (``configs/split_digits/none.yaml``
    under ``root``) with the record's method, scenario and seed, as ``split_digits.run_one`` builds it."""
    from continual_blr.config import yaml_load

    if isinstance(record.get("config"), dict):
        raw = {k: v for k, v in record["config"].items() if k not in ("method", "train_used")}
        return from_dict(run_config_cls, raw)
    base = yaml_load((root / "configs" / "split_digits" / "none.yaml").read_text()) or {}
    cfg = from_dict(run_config_cls, base)
    cfg.stream.scenario = record["scenario"]
    cfg.stream.validation = record.get("validation", 0.0) or 0.0
    cfg.seed = record["seed"]
    cfg.methods = [from_dict(type(cfg.methods[0]), dict(record["method_config"]))]
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--record", required=True, nargs="+", help="run records (JSON) whose configs are probed, in order")
    ap.add_argument("--root", default=str(HERE.parent), help="the folder holding the continual_blr to import")
    ap.add_argument("--out", required=True)
    ap.add_argument("--train", type=int, default=PROBE_TRAIN)
    ap.add_argument("--test", type=int, default=PROBE_TEST)
    ap.add_argument("--epochs", type=int, default=PROBE_EPOCHS)
    ap.add_argument("--conv-examples", type=int, default=CONV_EXAMPLES,
                    help="at most this many training and test examples per task for a conv net")
    ap.add_argument("--data-dir", default=os.environ.get("CONTINUAL_BLR_DATA"))
    args = ap.parse_args(argv)
    root = Path(args.root).resolve()
    sys.path.insert(0, str(root))
    sys.path.insert(0, str(HERE))
    import dataclasses

    import torch

    torch.set_num_threads(1)
    import continual_blr
    import continual_blr.runner as runner
    from continual_blr.config import RunConfig, from_dict

    import fingerprint
    from fingerprint import ExecutedCode

    pkg = Path(continual_blr.__file__).resolve().parent
    if pkg.parent != root:
        raise SystemExit(f"probe: imported continual_blr from {pkg}, not from --root {root}")
    build = runner.build_stream

    def small_stream(c):  # every task cut to its first examples (the same examples in both libraries)
        stream = build(c)
        conv = c.model.arch != "mlp"  # a conv net's step costs 100x an MLP's on a CPU: fewer examples
        n_train = min(args.train, args.conv_examples) if conv else args.train
        n_test = min(args.test, args.conv_examples) if conv else args.test
        for t in stream.tasks:
            t.x_train, t.y_train = t.x_train[:n_train], t.y_train[:n_train]
            t.x_test, t.y_test = t.x_test[:n_test], t.y_test[:n_test]
        return stream

    runner.build_stream = small_stream
    tracers, outs = [], []
    for record_path in args.record:
        record = json.loads(Path(record_path).read_text())
        cfg = run_config_of(record, root, from_dict, RunConfig)
        epochs = min(args.epochs, (cfg.methods[0].train or {}).get("epochs", cfg.train.epochs))
        cfg.train = dataclasses.replace(cfg.train, epochs=min(args.epochs, cfg.train.epochs))
        if "epochs" in (cfg.methods[0].train or {}):
            cfg.methods[0].train = dict(cfg.methods[0].train, epochs=epochs)
        cfg.stream.data_dir = args.data_dir or cfg.stream.data_dir
        cfg.device, cfg.progress = "cpu", False
        # saved into a scratch run folder, as a record's run saves (reproduce.py --work-dir: a checkpoint at every
        # task boundary), so the code that writes it (the methods' and optimisers' state_dicts) is reached too
        with tempfile.TemporaryDirectory() as scratch, ExecutedCode(pkg) as executed:
            cfg.out = str(Path(scratch) / "run")
            result = runner.run_config(cfg, save=True)[0]  # traced in every epoch: the probe is short
        tracers.append(executed)
        outs.append({"record": str(record_path), "epochs": epochs, "acc_matrix": result.acc_matrix,
                     "train_loss": result.train_loss, "entries": executed.entries()})
    # module and class bodies run once per process, at import: they count for every probe of the process
    definitions = set().union(*(t.entries(definitions_only=True) for t in tracers))
    for o in outs:
        o["fingerprint"] = fingerprint.source_hashes(o.pop("entries") | definitions, root)
    meta = {"root": str(root), "train": args.train, "test": args.test,
            "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY", "")}
    Path(args.out).write_text(json.dumps([meta | o for o in outs], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
