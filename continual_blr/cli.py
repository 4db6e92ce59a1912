"""Command line: ``continual-blr run [CONFIG.yaml] [options]`` and ``continual-blr methods`` (``inspect`` and
``predict``, which read a finished run, are in ``cli_saved``; what both share is in ``cli_common``).

With no arguments ``run`` trains the embedded default — split-digits (scikit-learn's bundled 8×8
digits, no download) with the BLR method, FROMP and the no-prior baseline — prints a table and writes a
new run folder ``runs/<stream>-<methods>-<YYYYmmdd-HHMMSS>/`` (``runs/latest`` points at it). Run
folders, resuming, interrupts, ``--threads``, ``--seeds`` and the logs are described in ``docs/runs.md``.

Bad input (unknown method or parameter, unknown config key, wrong type, missing or empty file, bad
device / seed / threads, an existing run as ``--out``) is reported in one line on stderr with exit
status 2. Ctrl-C or SIGTERM ends a run with one line naming what finished and the command that resumes
it, exit status 130.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from pathlib import Path
from typing import Any, Iterator

from .cli_common import EXIT_INTERRUPTED, EXIT_USAGE, as_flag
from .cli_common import fail as _fail
from .cli_common import read_yaml as _read_yaml
from .cli_common import threads as _threads

__all__ = ["main", "build_parser", "version"]


def _did_you_mean(name: str, allowed) -> str:
    """``" (did you mean 'fromp'?)"`` for a misspelt name close to one of ``allowed``, else ``""``."""
    import difflib

    close = difflib.get_close_matches(str(name), list(allowed), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def version() -> str:
    """The package version (``continual_blr.__version__``, else the installed distribution's)."""
    import continual_blr

    found = getattr(continual_blr, "__version__", None)
    if found:
        return str(found)
    from importlib import metadata

    try:
        return metadata.version("continual_blr")
    except metadata.PackageNotFoundError:
        return "unknown"


def _format_table(results) -> str:
    from .runner import format_table

    return format_table(results)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in the main thread (as SIGINT does) for the block."""
    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


_RESUME_KEEPS = ("device", "data_dir", "threads", "no_progress", "tensorboard", "log_loo", "checkpoint_every")
_RESUME_REFUSES = {"config": "CONFIG", "method": "--method", "seed": "--seed", "seeds": "--seeds", "out": "--out",
                   "epochs": "--epochs", "validation": "--validation", "quick": "--quick", "overwrite": "--overwrite",
                   "scenario": "--scenario",
                   "imports": "--import", "precision": "--precision", "channels_last": "--channels-last",
                   "sets": "--set"}


def _import_path(name: object, base: Path) -> object:
    """An ``imports`` entry as the run records it: a ``.py`` path made absolute (relative to the config's
    folder), a module name that is a file in the config's folder as that file's path (so that ``--resume`` and
    ``predict`` find it from anywhere), any other module name as given."""
    if not isinstance(name, str):
        return name
    if name.endswith(".py"):
        return str((base / name).resolve()) if not Path(name).is_absolute() else name
    local = base / (name.replace(".", "/") + ".py")
    return str(local.resolve()) if local.is_file() else name


def _catalog(imports: list[str]) -> dict:
    """The methods as ``continual-blr methods`` shows them: read from the source without importing torch
    (:mod:`continual_blr.cli_catalog`) unless ``--import`` modules or installed entry points add methods."""
    from . import cli_catalog

    if not imports and not cli_catalog.entry_points_declared():
        try:
            return cli_catalog.static_methods()
        except cli_catalog.Unsupported:
            pass
    from .methods import DESCRIPTIONS, available_methods
    from .methods.plugins import import_modules

    import_modules([_import_path(m, Path.cwd()) for m in imports])
    return cli_catalog.imported(available_methods(), DESCRIPTIONS)


def _cmd_methods(args: argparse.Namespace) -> int:
    """``continual-blr methods [NAME]``: the registered methods (with a one-line description each), or one
    method's parameters with their types, defaults and one-line docs."""
    from .cli_catalog import plain

    try:
        methods = _catalog(list(args.imports or []))
    except ValueError as err:
        return _fail(str(err))
    if args.name is None:
        width = max(map(len, methods))
        for name in sorted(methods):
            print(f"{name:<{width}}  {plain(methods[name].description)}")
        return 0
    if args.name not in methods:
        return _fail(f"methods: unknown method {args.name!r}{_did_you_mean(args.name, methods)}; "
                     f"allowed: {', '.join(sorted(methods))}")
    m = methods[args.name]
    print(f"{args.name}: {plain(m.description)}")
    if m.params is None:
        print("  (no parameters)")
        return 0
    print(f"parameters ({m.params}; give them under params: in a config, or as "
          f"--set {args.name}.PARAM=VALUE):")
    for f in m.fields:
        print(f"  {f.name}: {f.kind} = {f.default!r}  {plain(f.doc)}")
    return 0


_SET_EXAMPLE = "e.g. --set fromp.tau=1 or --set train.epochs=2"


def _parse_sets(items: list[str] | None) -> list[tuple[str, list[str], Any]] | str:
    """``--set KEY=VALUE`` items as ``(item, dotted key split, value parsed as YAML)``, or a string error."""
    from .config import yaml_load

    out = []
    for item in items or []:
        key, eq, text = item.partition("=")
        parts = key.strip().split(".")
        if not eq or not all(parts):
            return f"--set: got {item!r}; allowed: KEY=VALUE with KEY a config key or METHOD.PARAM ({_SET_EXAMPLE})"
        try:
            value = yaml_load(text) if text.strip() else None
        except Exception:  # yaml.YAMLError, kept lazy
            return f"--set {key}: value {text!r} is not a YAML value (a number, true/false, a string, [a, b])"
        out.append((item, parts, value))
    return out


def _set_config_keys(data: dict[str, Any], sets, config_keys: list[str]) -> str | None:
    """Apply the ``--set`` items whose first key is a config key (``train.epochs``, ``seed``,
    ``stream.options.n_tasks``) to the parsed YAML ``data``, which :func:`from_dict` then checks as a file's."""
    for item, parts, value in sets:
        if parts[0] not in config_keys:
            continue
        node = data
        for i, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {}) if isinstance(node, dict) else None
            if not isinstance(node, dict):
                return f"--set {item}: {'.'.join(parts[:i + 1])} is not a mapping, so it has no key {parts[i + 1]!r}"
        node[parts[-1]] = value
    return None


def _set_method_params(cfg, sets, config_keys: list[str]) -> str | None:
    """Apply the ``--set`` items ``METHOD.PARAM=V`` (``METHOD.train.KEY=V`` for a method's train settings; a
    bare ``PARAM=V`` when the run has one method) to ``cfg.methods``, and check each method's params."""
    from .methods import build_method

    names = [m.name for m in cfg.methods]
    touched = []
    for item, parts, value in sets:
        if parts[0] in config_keys:
            continue
        if len(parts) == 1 and len(cfg.methods) == 1:
            parts = [names[0]] + parts
        key = ".".join(parts)  # a label may hold a dot (fromp#tau0.1): the longest method name that starts it
        owner = max((n for n in names if key.startswith(n + ".")), key=len, default=None)
        if owner is not None:
            parts = [owner] + key[len(owner) + 1:].split(".")
        if parts[0] not in names:
            what = (f"unknown key {parts[0]!r}" if len(parts) == 1 else f"{parts[0]!r} is neither a config key nor "
                    "a method of this run")
            return (f"--set {item}: {what}; allowed: a config key ({', '.join(config_keys)}) or METHOD.PARAM with "
                    f"METHOD one of this run's methods ({', '.join(names)})")
        mc = cfg.methods[names.index(parts[0])]
        if len(parts) == 3 and parts[1] == "train":
            mc.train[parts[2]] = value
        elif len(parts) == 2:
            mc.params[parts[1]] = value
        else:
            return (f"--set {item}: allowed: {parts[0]}.PARAM=VALUE or {parts[0]}.train.KEY=VALUE "
                    f"(parameters: continual-blr methods {parts[0].partition('#')[0]})")
        touched.append((item, mc))
    for item, mc in touched:
        try:
            build_method(mc.name, mc.params, seed=cfg.seed)
        except (ValueError, TypeError) as err:
            msg = str(err).splitlines()[0].removeprefix(f"method {mc.name!r}: ")
            return f"--set {item}: {mc.name}: {msg}"
    return None


def _build_config(args: argparse.Namespace):
    """The RunConfig of ``args`` (config file + flags), or a string error for :func:`_fail`."""
    from .config import MethodConfig, RunConfig, check_seed, from_dict, label_methods
    from .data.stream import SCENARIOS
    from .methods import METHODS, registry_name

    import dataclasses

    data = _read_yaml(args.config) if args.config else {}
    sets = _parse_sets(args.sets)
    if isinstance(sets, str):
        return sets
    config_keys = [f.name for f in dataclasses.fields(RunConfig)]
    bad = _set_config_keys(data, sets, config_keys)
    if bad:
        return bad
    base = Path(args.config).resolve().parent if args.config else Path.cwd()
    imports = data.get("imports") or []
    if not isinstance(imports, list):
        return f"imports: got {imports!r}; allowed: a list of module names or .py paths"
    data = dict(data, imports=[_import_path(m, base) for m in imports + list(args.imports or [])])
    cfg = from_dict(RunConfig, data)
    if args.method:
        unknown = [m for m in args.method if m not in METHODS]
        if unknown:
            return (f"--method: unknown method {unknown[0]!r}{_did_you_mean(unknown[0], METHODS)}; "
                    f"allowed: {', '.join(sorted(METHODS))}")
        by_name = {m.name: m for m in cfg.methods}
        cfg.methods = label_methods([by_name.get(m, MethodConfig(m)) for m in args.method], "--method")
    for i, m in enumerate(cfg.methods):
        if registry_name(m.name) not in METHODS:
            return (f"methods[{i}]: unknown method {m.name!r}{_did_you_mean(registry_name(m.name), METHODS)}; "
                    f"allowed: {', '.join(sorted(METHODS))}")
    if args.config:  # the embedded default's stream and methods serve only a run without a config file
        for key, example in (("stream", "stream: {name: split_digits}"), ("methods", "methods: [blr, none]")):
            if key not in data and not (key == "methods" and args.method):
                alt = ", or --method NAME" if key == "methods" else ""
                return f"config {args.config}: no '{key}:' key; give one (e.g. {example}{alt})"
    if args.seed is not None:
        cfg.seed = check_seed(args.seed)
    bad = _set_method_params(cfg, sets, config_keys)
    if bad:
        return bad
    if args.out is not None:
        cfg.out = args.out
    if args.scenario is not None:
        if args.scenario not in SCENARIOS:
            return f"--scenario: got {args.scenario!r}; allowed: {', '.join(SCENARIOS)}"
        cfg.stream.scenario = args.scenario
    if args.validation is not None:
        from .data.builders import check_validation

        cfg.stream.validation = check_validation(args.validation)
    if args.epochs is not None:
        if args.epochs < 1:
            return f"--epochs: got {args.epochs}; allowed: an integer >= 1"
        cfg.train.epochs = args.epochs
    if args.quick:
        cfg.quick = True
    if args.precision is not None or args.channels_last is not None:
        from .mixed_precision import check_precision

        if args.precision is not None:
            try:
                cfg.train.precision = check_precision(args.precision, "--precision")
            except ValueError as err:
                return str(err)
        if args.channels_last is not None:
            cfg.train.channels_last = args.channels_last
        for m in cfg.methods:  # the flags apply to every method, also one with train: overrides of its own
            for key in ("precision", "channels_last"):
                if getattr(args, key) is not None:
                    m.train.pop(key, None)
    return cfg


def _apply_machine_flags(cfg, args: argparse.Namespace) -> str | None:
    """Flags that change where and how a run executes, not its results (allowed with --resume too)."""
    from .config import check_device

    if args.device is not None:
        cfg.device = check_device(args.device)
    if args.data_dir is not None:
        from .data.registry import _BUILDERS  # name -> (builder, whether it reads files, default scenario)

        reads_files = _BUILDERS.get(cfg.stream.name, (None, True, None))[1]
        if reads_files and not Path(args.data_dir).is_dir():  # a data-free stream (synthetic, digits) ignores it
            return f"--data-dir: folder not found: {args.data_dir} (stream {cfg.stream.name} reads its files there)"
        cfg.stream.data_dir = args.data_dir
    if args.no_progress:
        cfg.progress = False
    return None


def _check_flags(args: argparse.Namespace) -> str | None:
    if args.threads is not None and args.threads < 1:
        return f"--threads: got {args.threads}; allowed: an integer >= 1"
    if args.device is not None:
        from .config import check_device

        try:
            check_device(args.device)
        except ValueError as err:
            return f"--{err}"
    if args.seed is not None and args.seed < 0:
        return f"--seed: got {args.seed}; allowed: an integer >= 0"
    if args.seeds is not None:
        from .sweep import check_seeds

        try:
            check_seeds(args.seeds)
        except ValueError as err:
            return str(err)
        if args.seed is not None:
            return "--seed: give either --seed or --seeds"
    if args.ray is not None and args.seeds is None and args.resume is None:
        return "--ray: runs the seeds of --seeds as Ray tasks; give --seeds S [S ...]"
    if args.overwrite and args.out is None:
        return "--overwrite: needs --out DIR (runs without --out always get a new folder)"
    if args.log_loo and args.seeds is not None:
        return "--log-loo: logs a single run; drop --seeds (or run each seed with --seed S --log-loo)"
    if args.checkpoint_every is not None and not args.checkpoint_every >= 0:
        return f"--checkpoint-every: got {args.checkpoint_every:g}; allowed: seconds >= 0 (0: after every epoch)"
    if args.checkpoint_every is not None and args.seeds is not None:
        return ("--checkpoint-every: sets a single run's mid-task checkpoints; drop --seeds (or run each seed with "
                "--seed S)")
    if args.tensorboard:
        from .run_logs import tensorboard_available

        why = tensorboard_available()
        if why is not None:
            return f"--tensorboard: torch.utils.tensorboard does not import ({why}); pip install tensorboard"
    if args.resume is not None:
        given = [flag for key, flag in _RESUME_REFUSES.items()
                 if getattr(args, key) or (key == "channels_last" and args.channels_last is not None)]
        if given:
            return (f"--resume: continues the run as it was configured; drop {given[0]} (allowed with --resume: "
                    "--device, --data-dir, --threads, --no-progress, --tensorboard, --log-loo, --checkpoint-every)")
    return None


def _finished(path: Path, cfg) -> bool:
    """Whether the run in ``path`` has finished every method of ``cfg`` (its ``results.json`` says so)."""
    from .run_folder import RunFolder

    progress = (RunFolder(path).read_results() or {}).get("progress", {})
    return all(progress.get(m.name, {}).get("complete") and (path / m.name / "model.pt").is_file()
               for m in cfg.methods)


def _sweep_cfg(path: Path):
    """(config, seeds) of a multi-seed folder (its ``sweep.json``), or None."""
    from .config import RunConfig, from_dict
    from .run_folder import read_json

    p = path / "sweep.json"
    if not p.is_file():
        return None
    payload = read_json(p)
    return from_dict(RunConfig, payload["config"]), list(payload["seeds"])


def _cmd_run(args: argparse.Namespace) -> int:
    from .config import ConfigError
    from .data.paths import DataNotFoundError
    from .run_folder import run_lock
    from .runner import RunInterrupted, load_run_config, run_config

    bad = _check_flags(args)
    if bad:
        return _fail(bad)
    seeds = args.seeds
    try:
        if args.resume is not None:
            sweep = _sweep_cfg(Path(args.resume))
            if sweep is not None:
                cfg, seeds = sweep
                cfg.out = args.resume
            else:
                cfg = load_run_config(args.resume)
        else:
            cfg = _build_config(args)
            if isinstance(cfg, str):
                return _fail(cfg)
        bad = _apply_machine_flags(cfg, args)
        if bad:
            return _fail(bad)
        from .runner import check_runnable

        check_runnable(cfg)
        if args.resume is not None and seeds is None and _finished(Path(args.resume), cfg):
            print(f"continual-blr: --resume: every method of {args.resume} has finished; nothing to run (its "
                  "results follow)", file=sys.stderr)
        with _threads(args.threads), _sigterm_as_interrupt():
            # one writer per folder: a second `run --out X` / `--resume X` while X runs is refused, not interleaved
            lock = (run_lock(cfg.out, "--resume" if args.resume is not None else "--out") if cfg.out is not None
                    else contextlib.nullcontext())
            if seeds is not None:
                with lock:
                    return _run_sweep(cfg, seeds, args)
            with lock:
                every = {} if args.checkpoint_every is None else {"checkpoint_every": args.checkpoint_every}
                results = run_config(cfg, overwrite=args.overwrite, resume=args.resume is not None,
                                     tensorboard=args.tensorboard, log_loo=args.log_loo, **every)
    except RunInterrupted as stop:
        print(f"continual-blr: interrupted: {stop.summary()}; kept in {stop.out}; resume with: "
              f"continual-blr run --resume {stop.out}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # before the run folder existed (loading data, building methods)
        print("continual-blr: interrupted before any task finished; nothing was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ConfigError, DataNotFoundError, FileNotFoundError, ValueError, TypeError) as err:
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        return _fail(as_flag(msg, {"resume": "--resume", "threads": "--threads"}))  # not config keys
    from .distributed import is_main_process

    if not is_main_process():  # under torchrun only rank 0 reports (and writes)
        return 0
    from .runner import format_heading

    print(f"\n{format_heading(results, cfg)}")
    print(_format_table(results))
    out = Path(cfg.out) if cfg.out is not None else Path(results[0].config.get("out") or ".")  # a copied run: here
    print(f"\nwrote {out / 'results.json'}, {out / 'results.md'} and {out / 'accuracy_matrix.png'}"
          + (" (runs/latest points here)" if cfg.out is None else ""))
    return 0


def _run_sweep(cfg, seeds: list[int], args: argparse.Namespace) -> int:
    """``run --seeds``: every seed into ``<out>/seed-<s>/``, the summary printed and in ``<out>/summary.md``."""
    from .run_folder import RunExistsError, RunFolder, new_run_dir
    from .runner import RUNS_ROOT, RunInterrupted
    from .sweep import run_seeds, same_run

    if cfg.out is None:
        cfg.out = str(new_run_dir(RUNS_ROOT, f"{cfg.stream.name}-seeds", [m.name for m in cfg.methods]))
    out = Path(cfg.out)
    stored = _sweep_cfg(out)
    if stored is not None and args.resume is None and not same_run(stored[0].to_dict(), cfg.to_dict()):
        if not args.overwrite:
            raise RunExistsError(f"--out: {out} holds a multi-seed run of another config; pass --overwrite to "
                                 "replace it or choose another --out")
        for s in stored[1]:
            RunFolder(out).remove(f"seed-{s}")
    if stored is None and (out / "results.json").is_file():
        raise RunExistsError(f"--out: {out} holds a single run; choose another --out for --seeds")
    RunFolder(out).write_json("sweep.json", {"config": {k: v for k, v in cfg.to_dict().items() if k != "seed"},
                                             "seeds": seeds})
    executor = None
    if args.ray is not None:
        from .sweep_ray import ray_executor

        from .sweep_ray import ray_available

        if not ray_available():
            print("continual-blr: --ray: ray is not installed; the seeds run one after another here "
                  "(pip install 'continual_blr[ray]')", file=sys.stderr)
        executor = ray_executor(None if args.ray == "local" else args.ray, num_cpus=args.threads or 1)
    try:
        results = run_seeds(cfg, seeds, out, executor=executor, tensorboard=args.tensorboard)
    except RunInterrupted as stop:
        print(f"continual-blr: interrupted: seed {Path(stop.out).name.removeprefix('seed-')}: {stop.summary()}; "
              f"finished seeds kept in {out}; resume with: continual-blr run --resume {out}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # between seeds, or while a seed's data loaded
        print(f"continual-blr: interrupted; finished seeds kept in {out}; resume with: continual-blr run --resume {out}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    from .distributed import is_main_process

    if not is_main_process():
        return 0
    print((out / "summary.md").read_text() if (out / "summary.md").is_file() else "")
    print(f"wrote {out / 'summary.md'} and {len(results)} seed folders {out}/seed-<s>/")
    return 0


def _epilog() -> str:
    from . import cli_catalog

    try:  # read from the source: --help answers without importing torch
        methods, streams = list(_catalog([])), cli_catalog.static_streams()
    except cli_catalog.Unsupported:
        from .data import STREAMS
        from .methods import available_methods

        methods, streams = list(available_methods()), STREAMS
    return (f"methods: {', '.join(sorted(methods))}\n"
            f"streams: {', '.join(sorted(streams))}\n"
            "run folders, --resume, --seeds, --threads, logs: docs/runs.md\n"
            "a method's parameters: continual-blr methods NAME; your own methods: docs/own_method.md\n"
            "several processes: torchrun --nproc-per-node N -m continual_blr run CONFIG (docs/distributed.md)")


class _OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (exit 2), as every other bad input."""

    def error(self, message: str):  # type: ignore[override]
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    epilog = _epilog()
    parser = _OneLineParser(prog="continual-blr", description="Continual learning with the Bayesian learning rule: "
                            "train methods over a task stream (run), list them (methods), read a finished run "
                            "(inspect, predict).", epilog=epilog,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"continual-blr {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train methods over a task stream and save the results", epilog=epilog,
                         description="Train methods over a task stream; results go to a run folder (docs/runs.md).",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("config", nargs="?", help="YAML config (default: the embedded split-digits run)")
    run.add_argument("--method", action="append", help="method name (repeatable); overrides the config's methods")
    run.add_argument("--set", dest="sets", action="append", metavar="KEY=VALUE",
                     help="set a method parameter (METHOD.PARAM=VALUE, e.g. fromp.tau=1; METHOD.train.KEY=VALUE; "
                          "a bare PARAM=VALUE when the run has one method) or a config key (train.epochs=2, "
                          "stream.options.n_tasks=3); VALUE is read as YAML, checked as in a config file and "
                          "recorded with the run (repeatable)")
    run.add_argument("--seed", type=int, help="random seed (an integer >= 0)")
    run.add_argument("--seeds", type=int, nargs="+", metavar="S",
                     help="run each seed into OUT/seed-<s>/ and print mean ± std per method (OUT/summary.md)")
    run.add_argument("--device", help="cpu, cuda or cuda:N")
    run.add_argument("--out", help="run folder (default: a new runs/<stream>-<methods>-<time>/, runs/latest points at it)")
    run.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    run.add_argument("--resume", metavar="DIR", help="continue the interrupted run in DIR (finished methods are kept)")
    run.add_argument("--data-dir", help="data root (default: $CONTINUAL_BLR_DATA or ~/.cache/continual_blr/data)")
    run.add_argument("--epochs", type=int, help="override train.epochs")
    run.add_argument("--scenario", metavar="{task,class,domain}",
                     help="override stream.scenario: task (a head per task), class (one head over all classes) or "
                          "domain (one head, the same labels in every task); each stream allows some of them")
    run.add_argument("--validation", type=float, metavar="FRACTION",
                     help="evaluate on this held-out fraction of each task's training data instead of the test set "
                          "(stream.validation; for choosing hyper-parameters)")
    run.add_argument("--quick", action="store_true", help="fewer epochs (epochs / 5) for smoke runs; labelled in outputs")
    run.add_argument("--precision", metavar="{fp32,bf16}",
                     help="override train.precision: bf16 runs the training forward and loss under bf16 autocast; "
                          "weights, gradients, curvature and posteriors stay fp32 (docs/runs.md)")
    run.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                     help="override train.channels_last: convolution weights and image inputs in channels_last "
                          "memory format (default: on with bf16)")
    run.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                     help="with --seeds: each seed as a Ray task (a local Ray, or the cluster at ADDRESS, e.g. auto "
                          "or ray://host:10001); without Ray installed the seeds run one after another")
    run.add_argument("--threads", type=int, metavar="N",
                     help="torch threads (intra- and inter-op; default: torch's). 1 is often faster on a shared or "
                          "busy machine (docs/runs.md)")
    run.add_argument("--tensorboard", action="store_true",
                     help="also write TensorBoard events to RUN/tensorboard/ (needs the tensorboard package)")
    run.add_argument("--log-loo", action="store_true",
                     help="at every task end also log the leave-one-out estimate of each seen task's test NLL and "
                          "accuracy from its training data, beside the measured ones, to RUN/<method>/"
                          "generalisation.csv (one covariance and one scoring pass per task end; docs/inspect.md)")
    run.add_argument("--checkpoint-every", type=float, metavar="SECONDS",
                     help="write a mid-task checkpoint after an epoch once SECONDS have passed since the method's "
                          "last checkpoint (default 300; 0: after every epoch), so that a killed run resumes inside "
                          "its task; it changes no result (docs/runs.md)")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    run.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                     help="a module (name or .py path) that registers methods of your own (repeatable; recorded "
                          "with the run: docs/own_method.md)")
    run.set_defaults(func=_cmd_run)
    meth = sub.add_parser("methods", help="list the methods, or one method's parameters",
                          description="The registered methods (those of --import modules and installed "
                                      "packages' entry points included), or NAME's parameters with defaults.")
    meth.add_argument("name", nargs="?", help="a method's name: list its parameters")
    meth.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                      help="a module (name or .py path) that registers methods of your own (repeatable)")
    meth.set_defaults(func=_cmd_methods)
    from .cli_saved import add_saved_run_parsers

    add_saved_run_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:
        return int(stop.code) if stop.code is not None else 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
