"""Command line for finished runs: ``continual-blr inspect RUN``.

Registered on the main parser by :func:`add_saved_run_parsers` (see ``continual_blr.cli``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .cli import _fail, _read_yaml

__all__ = ["add_saved_run_parsers"]


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .inspect import inspect_path

    if args.top is not None and args.top < 1:
        return _fail("--top: must be a positive integer")
    path, note = Path(args.run), ""
    try:
        if path.is_file() and path.suffix in (".yaml", ".yml"):
            from .config import RunConfig, from_dict

            path = Path(from_dict(RunConfig, _read_yaml(str(path))).out)
            note = f" ({path} is the out of {args.run}; for a run written with --out DIR, pass DIR)"
        tasks = [args.task] if args.task is not None else None
        index, _ = inspect_path(path, out=args.out, method=args.method, tasks=tasks, top=args.top)
    except FileNotFoundError as err:
        return _fail((str(err).splitlines()[0] if str(err) else type(err).__name__) + note)
    except (ValueError, TypeError, KeyError, IndexError) as err:
        return _fail(str(err).splitlines()[0] if str(err) else type(err).__name__)
    print(f"wrote {index}")
    return 0


def add_saved_run_parsers(sub) -> None:
    """Add the subcommands that read a finished run folder to ``sub`` (an argparse subparsers object)."""
    ins = sub.add_parser("inspect", help="per-example scores and an HTML report for a finished run (no retraining)")
    ins.add_argument("run", help="run folder (holding results.json) or the YAML config that wrote it")
    ins.add_argument("--task", type=int, help="inspect only this task, 0-based index (task_id in scores.csv; default: all tasks)")
    ins.add_argument("--top", type=int, help="memorable points per task (default: the run's stored memory or 40)")
    ins.add_argument("--method", help="which method's saved model (default: the first method in the run's config)")
    ins.add_argument("--out", help="report folder (default: RUN_DIR/inspect)")
    ins.set_defaults(func=_cmd_inspect)
