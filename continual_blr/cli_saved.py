"""Command line for finished runs: ``continual-blr inspect RUN`` and ``continual-blr predict RUN``.

Registered on the main parser by :func:`add_saved_run_parsers` (called by ``continual_blr.cli``; the helpers
both share are in ``continual_blr.cli_common``). Both read a
run folder through :mod:`continual_blr.saved_run`; bad input is one line on stderr and exit status 2.

* ``inspect RUN_OR_CONFIG [--method M] [--task T] [--top K] [--out DIR] [--device D] [--threads N]``: the memorable
  examples report (``docs/inspect.md``). Given a YAML config, the run is the config's ``out`` (or
  ``runs/latest`` when it names none) and must have been written by that config.
* ``predict RUN --inputs FILE.npy [--method M] [--head H] [--out preds.csv] [--device D] [--import MODULE]``: the
  method's predictive on new inputs, one CSV row per input (``index, pred, p_0 … p_{K-1}``; a task-incremental
  run, whose outputs are head-local, writes ``index, label, head, head_output, p_0 … p_{K-1}`` with ``label`` the
  global class; a regression run writes ``index, mean_0 … mean_{K-1}``).
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path

from .cli_common import EXIT_INTERRUPTED, as_flag
from .cli_common import fail as _fail
from .cli_common import read_yaml as _read_yaml
from .cli_common import threads as _threads

__all__ = ["add_saved_run_parsers"]

_ERRORS = (ValueError, TypeError, KeyError, IndexError)
_FLAGS = {"method": "--method", "device": "--device", "tasks": "--task", "top": "--top", "out": "--out",
          "head": "--head", "imports": "--import"}  # a library error's argument -> the flag that sets it


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _run_of_config(config_path: Path) -> Path:
    """The run folder a YAML config writes to, checked against the run's own config.

    Raises:
        FileNotFoundError: the config names no run that exists.
        ValueError: the run was written by a different config (one line naming the field).
    """
    from . import runner
    from .config import RunConfig, from_dict
    from .saved_run import check_config_matches

    cfg = from_dict(RunConfig, _read_yaml(str(config_path)))
    root = Path(getattr(runner, "RUNS_ROOT", "runs"))
    path = Path(cfg.out) if cfg.out else root / "latest"
    if not path.exists():
        how = f"its out {path}" if cfg.out else f"{path} (the config names no out)"
        raise FileNotFoundError(f"inspect: {config_path} has not been run: no run at {how}; "
                                f"run `continual-blr run {config_path}` first or pass the run folder")
    check_config_matches(cfg, path, str(config_path))
    return path


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .run_folder import check_writable
    from .saved_run import inspect_path

    if args.top is not None and args.top < 1:
        return _fail("--top: must be a positive integer")
    if args.threads is not None and args.threads < 1:
        return _fail(f"--threads: got {args.threads}; allowed: an integer >= 1")
    if args.validate is not None and args.validate < 1:
        return _fail(f"--validate: got {args.validate}; allowed: a number of examples >= 1")
    if args.validate_epochs is not None and args.validate_epochs < 1:
        return _fail(f"--validate-epochs: got {args.validate_epochs}; allowed: an integer >= 1")
    path = Path(args.run)
    try:
        if path.is_file() and path.suffix in (".yaml", ".yml"):
            path = _run_of_config(path)
        tasks = [args.task] if args.task is not None else None
        if args.out is not None:  # before minutes of scoring
            check_writable(args.out, "--out")
        with _threads(args.threads):
            index, insp = inspect_path(path, out=args.out, method=args.method, tasks=tasks, top=args.top,
                                       device=args.device, progress=not args.no_progress, imports=args.imports,
                                       validate=args.validate, validate_epochs=args.validate_epochs)
    except KeyboardInterrupt:  # the report is written aside and moved in only once complete: nothing partial is left
        print("continual-blr: inspect interrupted; no report written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (FileNotFoundError, *_ERRORS) as err:  # the Python API names its arguments, the CLI its flags
        return _fail(as_flag(_first_line(err), _FLAGS))
    if args.method is None:
        others = [m for m in insp.run.methods if m != insp.run.method_name]
        choose = f"; choose another with --method: {', '.join(others)}" if others else ""
        if insp.has_memory:
            print(f"inspected {insp.run.method_name} (the first method with a stored memory{choose})")
        else:
            print(f"inspected {insp.run.method_name}: no method of this run stores a memory, so 'memorable' is the "
                  f"top-k by tr Λ at the final weights{choose}")
    val = getattr(insp, "validation", None)
    if val is not None:
        s = val.summary()
        print(f"validated task {val.task_id} (0-based) against {len(val)} retrainings of {val.epochs} epochs "
              f"({s['seconds']:.0f} s): Spearman with the true deviation {s['spearman_sensitivity']:.2f} (sensitivity), "
              f"{s['spearman_linear']:.2f} (linearised), {s['spearman_plain']:.2f} (plain), "
              f"{s['spearman_leverage']:.2f} (leverage-corrected); median noise floor {s['median_noise_floor']:.2g}")
    print(f"wrote {index}")
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    import numpy as np

    from .run_folder import check_writable
    from .saved_run import load_run

    inputs = Path(args.inputs)
    if inputs.exists() and not inputs.is_file():
        return _fail(f"--inputs: {args.inputs} is not a regular file (allowed: a .npy array [N, *input_shape] or [N, D])")
    if not inputs.is_file():
        return _fail(f"--inputs: file not found: {args.inputs} (allowed: a .npy array [N, *input_shape] or [N, D])")
    with inputs.open("rb") as fh:
        magic = fh.read(6)
    if magic != b"\x93NUMPY" and not magic.startswith(b"PK"):  # neither .npy nor .npz (e.g. a CSV)
        return _fail(f"--inputs: {args.inputs} is not a .npy array (not written by numpy.save); allowed: a .npy array [N, *input_shape] or [N, D] "
                     "(from a CSV: numpy.save('x.npy', numpy.loadtxt('x.csv', delimiter=',', ndmin=2)))")
    try:
        x = np.load(inputs, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        return _fail(f"--inputs: {args.inputs} is not a .npy array ({_first_line(err)})")
    if not isinstance(x, np.ndarray):  # np.load of a .npz archive
        return _fail(f"--inputs: {args.inputs} is a .npz archive; allowed: one .npy array [N, *input_shape] or [N, D] "
                     "(save one with numpy.save)")
    if x.dtype.kind not in "fiu" or x.ndim < 1 or x.shape[0] == 0:
        return _fail(f"--inputs: need a non-empty numeric array, got dtype {x.dtype} shape {x.shape}")
    if x.ndim == 1:
        return _fail(f"--inputs: {args.inputs} is a 1-D array of {x.shape[0]} values; allowed: [N, *input_shape] or "
                     "[N, D] (one example: save x[None])")
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        return _fail(f"--inputs: {args.inputs} holds {int((~np.isfinite(x)).sum())} NaN or infinite values; "
                     "allowed: finite numbers")
    try:
        if args.out:
            check_writable(args.out, "--out", folder=False)
        run = load_run(args.run, args.method, device=args.device, imports=args.imports)
        lo, hi = (run.stream.meta or {}).get("input_range") or (None, None)  # stored by runs since 2026-11-25
        if hi is not None and hi <= 1.0 and float(x.max()) > 1.5:
            return _fail(f"--inputs: values up to {float(x.max()):g}, but the run was trained on inputs in "
                         f"[{lo:g}, {hi:g}] (pixels / 255?); scale them as the run's data were")
        if run.stream.likelihood == "classification":
            proba = run.predict_proba(x.astype(np.float32), head=args.head).cpu()
            pred = proba.argmax(dim=-1)
            probs = [[f"{float(v):.6g}" for v in row] for row in proba]
            header = ["index", "pred"] + [f"p_{k}" for k in range(proba.shape[1])]
            rows = [[i, int(pred[i])] + probs[i] for i in range(proba.shape[0])]
            if run.stream.scenario == "task":  # head-local outputs: say the global class and the head
                classes, head = run.head_classes(args.head), run._head(args.head)
                header = ["index", "label", "head", "head_output"] + header[2:]
                rows = [[i, classes[int(pred[i])], head, int(pred[i])] + probs[i] for i in range(proba.shape[0])]
        else:
            mean = run.predict(x.astype(np.float32), head=args.head).cpu()
            header = ["index"] + [f"mean_{k}" for k in range(mean.shape[1])]
            rows = [[i] + [f"{float(v):.6g}" for v in mean[i]] for i in range(mean.shape[0])]
    except (FileNotFoundError, *_ERRORS) as err:
        msg = _first_line(err)  # the Python API's "head:" / "pass head=" are the CLI's --head
        return _fail(as_flag(msg.replace("pass head=", "pass --head ") if msg.startswith("head:") else msg, _FLAGS))
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    if args.out:
        out = Path(args.out)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(buf.getvalue())
        except OSError as err:
            return _fail(f"--out: cannot write {out} ({err.strerror or err})")
        print(f"wrote {out} ({len(rows)} predictions of {run.method_name})", file=sys.stderr)
    else:
        sys.stdout.write(buf.getvalue())
    return 0


def add_saved_run_parsers(sub) -> None:
    """Add the subcommands that read a finished run folder to ``sub`` (an argparse subparsers object)."""
    ins = sub.add_parser("inspect", help="per-example scores and an HTML report for a finished run (no retraining)")
    ins.add_argument("run", help="run folder (holding results.json; runs/latest works) or the YAML config that wrote it")
    ins.add_argument("--task", type=int, help="inspect only this task, 0-based index (task_id in scores.csv; default: all tasks)")
    ins.add_argument("--top", type=int, help="memorable points per task (default: the run's stored memory or 40)")
    ins.add_argument("--method", help="which method's saved model (default: the first method with a stored memory, "
                                      "else the first finished one)")
    ins.add_argument("--out", help="report folder (default: RUN_DIR/inspect)")
    ins.add_argument("--device", default="cpu", help="where to score: cpu (default), cuda or cuda:N")
    ins.add_argument("--no-progress", action="store_true", help="no progress bar")
    ins.add_argument("--threads", type=int, metavar="N", help="torch threads (default: torch's; 1 is often faster on "
                                                              "a shared machine)")
    ins.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                     help="a module (name or .py path) that registers the run's own methods, in place of the one "
                          "the run recorded (e.g. after moving it; repeatable); built-in methods need none")
    ins.add_argument("--validate", type=int, metavar="N",
                     help="also retrain without each of N examples of one task (--task, default the last), drawn "
                          "across the sensitivity range, and compare the true deviation of each prediction with the "
                          "estimate (correlations, noise floor, scatter in the report; docs/inspect.md)")
    ins.add_argument("--validate-epochs", type=int, metavar="E",
                     help="epochs of each warm-started retraining of --validate (default 2)")
    ins.set_defaults(func=_cmd_inspect)

    pred = sub.add_parser("predict", help="predict on new inputs with a saved run's model and method")
    pred.add_argument("run", help="run folder (holding results.json; runs/latest works) or one of its <method>/ folders")
    pred.add_argument("--inputs", required=True, help=".npy array of inputs, [N, *input_shape] or flattened [N, D]")
    pred.add_argument("--method", help="which method (default: the first finished one)")
    pred.add_argument("--head", type=int, help="output head, 0-based (required when the network has one head per task)")
    pred.add_argument("--out", help="CSV file to write (default: print the CSV to stdout)")
    pred.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    pred.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                      help="a module (name or .py path) that registers the run's own methods, in place of the one "
                           "the run recorded (e.g. after moving it; repeatable); built-in methods need none")
    pred.set_defaults(func=_cmd_predict)
