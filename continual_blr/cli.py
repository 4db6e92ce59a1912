"""Command line: ``continual-blr run [CONFIG.yaml] [--method NAME] [--seed N] [--device D] [--out DIR] [--validation F]``.

With no arguments ``run`` trains the embedded default — split-digits (scikit-learn's bundled 8×8
digits, no download) with the BLR method, FROMP and the no-prior baseline — prints a table and writes
``results.json`` and ``accuracy_matrix.png``. Bad input (unknown method, unknown config key, wrong
type, missing file or data folder) is reported in one line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _fail(msg: str) -> int:
    print(f"continual-blr: error: {msg}", file=sys.stderr)
    return 2


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ValueError(f"config file {path} is not valid YAML{where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping at the top level")
    return data


def _format_table(results) -> str:
    t = len(results[0].acc_matrix)
    head = f"{'method':<10}" + "".join(f"{'T' + str(j + 1):>8}" for j in range(t)) + f"{'avg':>8}{'forget':>8}{'time s':>8}"
    lines = [head, "-" * len(head)]
    for r in results:
        last = r.acc_matrix[-1]
        cells = "".join(f"{100 * v:>8.2f}" if not math.isnan(v) else f"{'-':>8}" for v in last)
        lines.append(f"{r.method:<10}{cells}{100 * r.avg_acc:>8.2f}{100 * r.forgetting:>8.2f}{sum(r.task_times):>8.1f}")
    return "\n".join(lines)


def _cmd_run(args: argparse.Namespace) -> int:
    from .config import ConfigError, MethodConfig, RunConfig, from_dict
    from .data.paths import DataNotFoundError
    from .methods import METHODS
    from .runner import run_config

    try:
        data = _read_yaml(args.config) if args.config else {}
        cfg = from_dict(RunConfig, data)
        if args.method:
            unknown = [m for m in args.method if m not in METHODS]
            if unknown:
                return _fail(f"--method: unknown method {unknown[0]!r}; allowed: {', '.join(sorted(METHODS))}")
            by_name = {m.name: m for m in cfg.methods}
            cfg.methods = [by_name.get(m, MethodConfig(m)) for m in args.method]
        for m in cfg.methods:
            if m.name not in METHODS:
                return _fail(f"methods: unknown method {m.name!r}; allowed: {', '.join(sorted(METHODS))}")
        if args.seed is not None:
            cfg.seed = args.seed
        if args.device is not None:
            cfg.device = args.device
        if args.out is not None:
            cfg.out = args.out
        data_dir = args.data_dir or os.environ.get("CONTINUAL_BLR_DATA")
        if args.data_dir is not None:
            cfg.stream.data_dir = args.data_dir
        if args.data_dir is not None and not Path(data_dir).is_dir():
            return _fail(f"--data-dir: folder not found: {data_dir}")
        if args.validation is not None:
            from .data.builders import check_validation

            cfg.stream.validation = check_validation(args.validation)
        if args.epochs is not None:
            cfg.train.epochs = args.epochs
        if args.quick:
            cfg.quick = True
        if args.no_progress:
            cfg.progress = False
        results = run_config(cfg)
    except (ConfigError, DataNotFoundError, FileNotFoundError, ValueError, TypeError) as err:
        return _fail(str(err).splitlines()[0] if str(err) else type(err).__name__)
    label = " [QUICK MODE: epochs / 5]" if cfg.quick else ""
    print(f"\n{results[0].stream} ({results[0].scenario}-incremental), seed {cfg.seed}{label}")
    evaluated_on = (f"validation (held-out {cfg.stream.validation:g} of each task's training data, not test)"
                    if cfg.stream.validation else "test")
    print(f"final {evaluated_on} accuracy (%) per task after the last task:")
    print(_format_table(results))
    print(f"\nwrote {Path(cfg.out) / 'results.json'} and {Path(cfg.out) / 'accuracy_matrix.png'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="continual-blr", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train methods over a task stream and save the results")
    run.add_argument("config", nargs="?", help="YAML config (default: the embedded split-digits run)")
    run.add_argument("--method", action="append", help="method name (repeatable); overrides the config's methods")
    run.add_argument("--seed", type=int, help="random seed")
    run.add_argument("--device", help="cpu or cuda")
    run.add_argument("--out", help="output folder")
    run.add_argument("--data-dir", help="data root (default: $CONTINUAL_BLR_DATA or ~/.cache/continual_blr/data)")
    run.add_argument("--epochs", type=int, help="override train.epochs")
    run.add_argument("--validation", type=float, metavar="FRACTION",
                     help="evaluate on this held-out fraction of each task's training data instead of the test set "
                          "(stream.validation; for choosing hyper-parameters)")
    run.add_argument("--quick", action="store_true", help="fewer epochs (epochs / 5) for smoke runs; labelled in outputs")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    run.set_defaults(func=_cmd_run)
    from .cli_saved import add_saved_run_parsers

    add_saved_run_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
