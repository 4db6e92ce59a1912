"""Reproduce the published continual-learning tables: methods × seeds on one benchmark.

Run (real MNIST under ``--data-dir``; CPU):

    python benchmarks/reproduce.py split_mnist --methods fromp ewc none --seeds 0 1 2 3 4 --data-dir DATA
    python benchmarks/reproduce.py permuted_mnist --methods fromp ewc vcl none --seeds 0 1 2 --data-dir DATA
    python benchmarks/reproduce.py split_mnist --scenario class --methods fromp none --seeds 0
    python benchmarks/reproduce.py split_digits --methods blr none --seeds 0 1 --quick   # smoke run
    python benchmarks/reproduce.py split_mnist --methods ewc --seeds 0 1 --validation 0.1 --data-dir DATA
    python benchmarks/reproduce.py permuted_mnist/paper_budget --methods vcl --seeds 0 --work-dir ~/cl-runs  # resumable

Each (benchmark, scenario, method, seed) run reads ``configs/<benchmark>/<scenario>/<method>.yaml`` when the
command names a scenario and that file exists, else ``configs/<benchmark>/<method>.yaml``, runs the one training
loop, and stores a **run record** (``benchmarks/records.py``: the StreamResult, cost, commit, dirty flag, library
hash, versions, device, resolved parameters) under ``--runs-dir`` (default ``benchmarks/records/``, committed:
kilobytes per run). A record is reused when the command is repeated only while it is current (the library's hash
is the one it ran on) and made with the config's method settings; otherwise the run is redone. Every record is
written as soon as its run finishes, so an interrupted command loses at most the run in progress.

The summary goes to ``benchmarks/results/tables/<benchmark>[_<scenario>][_quick].md``: final average accuracy
mean ± std over seeds, the number of seeds, scenario, what each method stored of past examples, wall and CPU time
per run, the published reference number beside ours, how many of the row's records are current and their
commits; plus ``..._curves.png``, the average accuracy after each task per method. The table covers every record
of that (benchmark, scenario, mode), not only this command's, and nothing else: it is generated from records
alone (``--tables-only`` rewrites it without running; ``benchmarks/tables.py`` rewrites every table that has
records, and its ``--check`` is what CI runs). Text below the ``<!-- notes -->`` line of an existing report (the
hand-written closing note) is kept when the report is rewritten. ``--keep`` (for a runs folder that is not the
committed records) keeps rows of the existing report whose runs are not stored there, labelled as kept.

``--work-dir DIR`` is for runs longer than a session: each run's folder is kept under ``DIR`` (outside the
repository) with a checkpoint after every task, and the same command continues an unfinished run there,
bit-identically, from its last finished task (SIGTERM or Ctrl-C stop it with exit status 130). The record's CPU
and wall times are the sums over the processes that ran it, each listed under ``attempts``
(:func:`run_resumable`).

``--validation F`` evaluates on ``F`` of each task's training data held out (``stream.validation``)
instead of the test set: runs go to ``.../<full|quick>_validation<F>/``, the table to
``..._validation.md``, titled VALIDATION and without published (test) numbers beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts (benchmarks/ is not a package)
import ledger  # noqa: E402
import records as run_records  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# Published numbers (final average test accuracy, %), from docs/anchors.md: (value, source).
REFERENCES: dict[tuple[str, str, str], tuple[float, str]] = {
    ("split_mnist", "task", "fromp"): (99.3, "FROMP paper / reference code README"),
    ("split_mnist", "task", "fromp_sampled"): (99.3, "FROMP paper (every past task per step; ours: one per step)"),
    ("split_mnist", "task", "frorp"): (99.07, "reference code run here (FRORP)"),
    ("split_mnist", "task", "vcl"): (98.4, "VCL + k-center coreset (VCL w/o coreset ≈ 95.5)"),
    ("split_mnist", "task", "vcl_vogn"): (95.5, "VCL without a coreset (VCL paper)"),
    ("split_mnist", "task", "vcl_vogn_coreset"): (98.4, "VCL + k-center coreset (VCL paper)"),
    ("permuted_mnist", "domain", "blr"): (94.0, "VOGN, Eschenhagen et al. 2019, Table 1"),
    ("permuted_mnist", "domain", "fromp"): (94.8, "FROMP paper / reference code README"),
    ("permuted_mnist", "domain", "vcl"): (94.6, "improved VCL + random coreset of 200 per task, FROMP paper Table 1 (93.0 without)"),
    ("permuted_mnist/paper_budget", "domain", "vcl"): (94.6, "improved VCL + random coreset of 200 per task, FROMP paper Table 1 (93.0 without)"),
    ("permuted_mnist/paper_budget", "domain", "vcl_reinit"): (94.6, "improved VCL + random coreset of 200 per task, FROMP paper Table 1 (93.0 without)"),
    ("permuted_mnist/paper_budget", "domain", "vcl_reinit_no_coreset"): (93.0, "improved VCL without a coreset (Swaroop et al. 2019; FROMP paper Table 1)"),
    ("permuted_mnist", "domain", "ewc"): (84.0, "EWC, Eschenhagen 2019 Table 1 (same network)"),
    ("split_cifar", "task", "fromp"): (76.2, "FROMP paper / reference code README"),
    ("split_mnist", "class", "fromp-classes-all"): (33.4, "FROMP code run by others, class-incremental"),
    ("split_cifar10/resnet18", "task", "none"): (69.53, "fine-tuning, van de Ven 2025 (30 seeds, ± 1.34 s.e.)"),
    ("split_cifar10/resnet18", "task", "ewc"): (84.91, "EWC exact Fisher, van de Ven 2025 (30 seeds, ± 0.65 s.e.)"),
    ("split_cifar10/resnet18/bf16", "task", "none_warmup40"): (69.53, "fine-tuning, van de Ven 2025, without the warm-up (30 seeds, ± 1.34 s.e.)"),
    ("split_cifar10/resnet18/bf16", "task", "ewc_warmup40"): (84.91, "EWC exact Fisher, van de Ven 2025, without the warm-up (30 seeds, ± 0.65 s.e.)"),
    ("split_cifar10/resnet18/bf16", "class", "derpp"): (64.88, "DER++ at M = 200, Buzzega et al. 2020 Table 2 (full ResNet-18, 50 SGD epochs, crop + flip; not our network or budget)"),
    ("split_cifar10/resnet18/bf16", "class", "er"): (44.79, "ER at M = 200, Buzzega et al. 2020 Table 2 (full ResNet-18, 50 SGD epochs, crop + flip; not our network or budget)"),
}
# Canonical row order of the tables; methods not listed follow in alphabetical order.
METHOD_ORDER = ["fromp-replay", "fromp-replay_m500", "derpp", "derpp_m500", "er", "er_m500", "fromp", "frorp", "fromp-l2", "fromp-full", "fromp-kron", "fromp-classes-all", "ewc", "laplace", "vcl", "vcl_no_coreset", "vcl_vogn", "vcl_vogn_coreset", "blr", "blr_price", "ivon",
                "l2", "none", "joint"]
NOTES_MARKER = "<!-- notes -->"

HIGHER_ANCHORS: dict[tuple[str, str], tuple[float, str]] = {
    ("split_mnist", "task"): (99.54, "S-FSVI"),
    ("permuted_mnist", "domain"): (95.76, "S-FSVI"),
    ("split_cifar", "task"): (77.57, "S-FSVI"),
    ("split_mnist", "class"): (92.87, "S-FSVI with coreset"),
}


def _config_path(benchmark: str, method: str, args: argparse.Namespace) -> Path:
    """``configs/<benchmark>/<scenario>/<method>.yaml`` when the command names a scenario and it exists, else
    ``configs/<benchmark>/<method>.yaml``."""
    folder = Path(args.configs_dir) / benchmark
    scenario = getattr(args, "scenario", None)
    if scenario and (folder / scenario / f"{method}.yaml").is_file():
        return (folder / scenario / f"{method}.yaml").resolve()
    return (folder / f"{method}.yaml").resolve()


def _load_config(benchmark: str, method: str, args: argparse.Namespace, prog: str = "reproduce"):
    """The run config ``configs/<benchmark>/<scenario>/<method>.yaml`` if the command names a scenario and that file
    exists, else ``configs/<benchmark>/<method>.yaml``, with the command's scenario, data root, validation,
    device and mode (``args``: configs_dir, scenario, data_dir, validation, device, quick, no_progress)."""
    from continual_blr.config import RunConfig, from_dict, yaml_load

    folder = Path(args.configs_dir) / benchmark
    path = _config_path(benchmark, method, args)  # a scenario's own protocol first (configs/split_mnist/class/)
    if not path.is_file():
        available = sorted(p.stem for p in folder.glob("*.yaml"))
        raise SystemExit(f"{prog}: no config {path}; available for {benchmark}: {', '.join(available) or 'none'}")
    cfg = from_dict(RunConfig, yaml_load(path.read_text()) or {})
    if args.scenario:
        cfg.stream.scenario = args.scenario
    if args.data_dir:
        cfg.stream.data_dir = args.data_dir
    cfg.stream.validation = getattr(args, "validation", 0.0) or 0.0
    cfg.device = args.device
    if getattr(args, "compile", None):
        cfg.train.compile = args.compile  # an execution setting (records.COMMAND_TRAIN_FIELDS)
    cfg.quick = args.quick
    cfg.progress = not args.no_progress
    return cfg


def _memory_size(cfg) -> str:
    params = cfg.methods[0].params
    for key in ("n_points", "memory_size", "coreset_size"):
        if key in params:
            return str(params[key])
    return "-"


def _runs_folder(runs_dir: Path, benchmark: str, scenario: str, quick: bool, validation: float = 0.0) -> Path:
    mode = ("quick" if quick else "full") + (f"_validation{validation:g}" if validation else "")
    return runs_dir / benchmark / scenario / mode


def _same_method(record: dict, cfg) -> bool:
    """Whether a stored record was made with ``cfg``'s method (name, params, train overrides)."""
    import dataclasses

    return (record.get("config") or {}).get("method") == dataclasses.asdict(cfg.methods[0])


def run_one(benchmark: str, method: str, seed: int, args: argparse.Namespace, runs_dir: Path, command: str = "") -> dict:
    """Run (or reload) one (method, seed); returns the stored record."""
    cfg = _load_config(benchmark, method, args)
    cfg.seed = seed
    scenario = cfg.stream.scenario or "default"
    validation = cfg.stream.validation
    path = _runs_folder(runs_dir, benchmark, scenario, args.quick, validation) / f"{method}_seed{seed}.json"
    if path.is_file() and not args.force:
        stored = json.loads(path.read_text())
        current, why = run_records.currency(stored, path.parent.relative_to(runs_dir).as_posix(), runs_dir)
        if not _same_method(stored, cfg):
            tqdm.write(f"{method} seed {seed}: stored run has other method settings than {method}.yaml; rerunning")
        elif not current:
            tqdm.write(f"{method} seed {seed}: stored run is stale ({why[:200]}); rerunning")
        else:
            return stored
    import dataclasses

    import torch

    run_records.process_library_hash()  # the library this process imports now (see records.process_library_hash)
    from continual_blr.methods import build_method
    from continual_blr.runner import run_config

    mc = cfg.methods[0]
    resolved = getattr(build_method(mc.name, mc.params), "params", None)  # every default filled in
    config_file = _config_path(benchmark, method, args)
    origin = run_records.run_provenance(cfg.device)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    traced = run_records.TracedRun(cfg)  # the code this run executes (records.currency)
    t0, c0 = time.perf_counter(), time.process_time()
    attempts = None
    if getattr(args, "work_dir", None):
        work = _runs_folder(Path(args.work_dir), benchmark, scenario, args.quick, validation) / f"{method}_seed{seed}"
        with traced:
            result, attempts = run_resumable(cfg, work, force=args.force, on_epoch=traced.on_epoch,
                                             executed=traced.executed)
        wall_s, cpu_s = (sum(a[k] for a in attempts["attempts"]) for k in ("wall_s", "cpu_s"))
        entries = set(attempts.get("executed", []))
    else:
        with traced:
            result = run_config(cfg, save=False, on_epoch=traced.on_epoch)[0]
        wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        entries = None
    record = result.to_dict() | {"wall_s": wall_s, "cpu_s": cpu_s,
                                 "memory_per_task": _memory_size(cfg), "quick": args.quick,
                                 "validation": validation,
                                 "method_name": method, "command": command, "load_at_start": load,
                                 "threads": torch.get_num_threads(),
                                 "resolved_params": dataclasses.asdict(resolved)
                                 if dataclasses.is_dataclass(resolved) else None,
                                 "config_file": str(config_file.relative_to(ROOT))
                                 if config_file.is_relative_to(ROOT) else None} | origin | traced.fields(
        entries, None if attempts is None else attempts["attempts"][0]["started"])
    if attempts is not None:  # a run continued over several processes: each one's share, times summed above
        record["attempts"] = attempts["attempts"]
        record["config"]["out"] = None  # the work folder is this machine's, not part of the run's settings
    path.parent.mkdir(parents=True, exist_ok=True)
    ledger.supersede(path)  # a replaced test evaluation stays a record (benchmarks/ledger.py)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(path)  # atomic: a killed run never leaves a half-written record behind
    return record


HEARTBEAT_S = 30.0  # how often a resumable run writes its attempt's CPU and wall time so far


def run_resumable(cfg, work: Path, force: bool = False, on_epoch=None, executed=None) -> tuple:
    """Run ``cfg`` in the run folder ``work`` (outside the repository), continuing it if a process before this
    one was stopped: the runner checkpoints after every task and ``resume`` continues from the last one,
    bit-identically (tests/test_resume.py). ``on_epoch`` goes to ``run_config``; ``executed`` (an
    ``ExecutedCode`` tracing this attempt) adds the code the attempt ran to ``executed`` in the attempts file.
    Beside the folder, ``<work>.attempts.json`` keeps the library hash
    the run began on and each process's CPU and wall seconds (written every ``HEARTBEAT_S`` and at the end, so
    a killed process loses at most that much of its count); the record's times are their sums.

    Raises:
        SystemExit: one line, if ``work`` holds a run begun on another version of the library (``force``
            starts it over), or if another process is running it now (``<work>.lock``, ``run_folder.hold_lock``).
    """
    from continual_blr.run_folder import RunInUseError, hold_lock

    try:
        with hold_lock(work.with_name(work.name + ".lock"), "--work-dir", folder=work):
            return _run_resumable(cfg, work, force, on_epoch, executed)
    except RunInUseError as err:
        raise SystemExit(str(err)) from None


def _run_resumable(cfg, work: Path, force: bool, on_epoch, executed) -> tuple:
    """:func:`run_resumable` while its lock is held."""
    import dataclasses
    import shutil
    import threading
    from datetime import datetime, timezone

    from continual_blr.runner import run_config

    library = run_records.process_library_hash()
    meta_path = work.with_name(work.name + ".attempts.json")
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    if meta is not None and meta.get("library_hash") != library:
        if not force:
            raise SystemExit(f"--work-dir: {work} holds a run begun on library {meta.get('library_hash')}, this is "
                             f"{library}; add --force to start it over")
        meta = None
    if meta is None:
        shutil.rmtree(work, ignore_errors=True)
        meta = {"library_hash": library, "attempts": []}
    resume = (work / "results.json").is_file()
    attempt = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "resumed": resume,
               "cpu_s": 0.0, "wall_s": 0.0, "ended": None}
    meta["attempts"].append(attempt)
    work.parent.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()
    t0, c0 = time.perf_counter(), time.process_time()

    def save(ended: str | None = None) -> None:
        with lock:
            attempt.update(cpu_s=time.process_time() - c0, wall_s=time.perf_counter() - t0)
            if ended is not None:
                attempt["ended"] = ended
            tmp = meta_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(meta, indent=2))
            tmp.replace(meta_path)

    save()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            save()

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    ended = "interrupted"
    try:
        result = run_config(dataclasses.replace(cfg, out=str(work)), save=True, resume=resume, on_epoch=on_epoch)[0]
        ended = "finished"
    finally:
        stop.set()
        thread.join()
        if executed is not None:  # the code every attempt executed, for the record's fingerprint
            meta["executed"] = sorted(set(meta.get("executed", [])) | executed.entries())
        save(ended)
    return result, meta


def collect_records(runs_dir: Path, benchmark: str, scenario: str, quick: bool,
                    validation: float = 0.0) -> dict[str, list[dict]]:
    """Every finished run stored for (benchmark, scenario, mode), by method, seeds ascending."""
    found: dict[str, list[dict]] = {}
    folder = _runs_folder(runs_dir, benchmark, scenario, quick, validation)
    for p in sorted(folder.glob("*_seed*.json")):
        method, _, _ = p.stem.rpartition("_seed")
        found.setdefault(method, []).append(json.loads(p.read_text()))
    for recs in found.values():
        recs.sort(key=lambda r: r["seed"])
    order = {m: i for i, m in enumerate(METHOD_ORDER)}
    return dict(sorted(found.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))


def _mean_std(xs: list[float]) -> tuple[float, float]:
    from continual_blr.sweep import mean_std  # the one mean ± sample std of every table (continual-blr run --seeds)

    return mean_std(xs)


def _bytes(n: int) -> str:
    """``"512 B"``, ``"157 KB"``, ``"1.5 MB"`` (1 KB = 1,024 bytes)."""
    if n < 1024:
        return f"{n} B"
    if n < 1024**2:
        return f"{n / 1024:.0f} KB"
    return f"{n / 1024**2:.1f} MB"


def _memory_cell(rec: dict) -> str:
    """What a run stored of past examples: ``"200 ex. in all, 157 KB"`` from its ``memory`` stats (results.json),
    the per-task count of its config for records made before the stats existed, ``-`` for none."""
    mem = rec.get("memory")
    if isinstance(mem, dict):
        n = int(mem.get("stored_examples", 0))
        if n == 0:
            return "-"
        return f"{n} ex. in all, {_bytes(int(mem.get('stored_bytes', 0)))}"
    per_task = rec.get("memory_per_task", mem)
    return f"{per_task} / task" if per_task not in (None, "-") else "-"


def report_path(results_dir: Path, benchmark: str, scenario: str, quick: bool, validation: float = 0.0) -> Path:
    """``<results_dir>/<benchmark>[_<scenario>][_quick][_validation].md`` (the benchmark's default scenario has
    no suffix; a nested benchmark such as ``split_cifar10/resnet18`` is written ``split_cifar10_resnet18``)."""
    suffix = ("" if scenario in ("task", "domain", "default") else f"_{scenario}") + ("_quick" if quick else "")
    return results_dir / f"{benchmark.replace('/', '_')}{suffix}{'_validation' if validation else ''}.md"


def _verdict(mean: float, std: float, ref: float) -> str:
    if mean >= ref:
        return f"{mean - ref:+.2f} (meets)"
    if mean + std >= ref:
        return f"{mean - ref:+.2f} (within 1 std)"
    return f"{mean - ref:+.2f} (**short**)"


def use_deterministic_kernels() -> None:
    """Make a CUDA run bit-reproducible where PyTorch can: deterministic algorithms (cuDNN's convolution backward
    among them), no cuDNN autotuning, and the cuBLAS workspace size that deterministic cuBLAS needs (set before cuBLAS
    starts). Ops without a deterministic kernel warn rather than stop the run (``warn_only``), so a run on a lent GPU
    is never lost to it; the warnings in its log say which ops stayed non-deterministic. CPU runs are deterministic
    already; this changes nothing for them but their speed, if any op has a slower deterministic path.
    """
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def shown_command(argv: list[str], data_dir: str | None) -> str:
    """The command line as recorded in tables: the data folder (machine-specific) shown as ``$CONTINUAL_BLR_DATA``."""
    shown = ["$CONTINUAL_BLR_DATA" if data_dir and a == data_dir else
             "--data-dir=$CONTINUAL_BLR_DATA" if data_dir and a == f"--data-dir={data_dir}" else a for a in argv]
    return " ".join(shown)


def previous_report(out: Path) -> tuple[list[str], dict[str, str], dict[str, list[str]]]:
    """The commands, table rows and accuracy-matrix blocks (by method) of an existing report."""
    if not out.is_file():
        return [], {}, {}
    lines = out.read_text().split(NOTES_MARKER, 1)[0].splitlines()
    commands, rows, matrices = [], {}, {}
    in_table = False
    for i, line in enumerate(lines):
        if line.startswith("python benchmarks/reproduce.py"):  # machine paths of older versions hidden too
            commands.append(re.sub(r"--data-dir[ =](?!\$CONTINUAL_BLR_DATA)\S+", "--data-dir $CONTINUAL_BLR_DATA", line))
        if line.startswith("| method |"):
            in_table = True
            continue
        if in_table and line.startswith("|") and not line.startswith("|---"):
            rows[line.split("|")[1].strip()] = line
        elif in_table and not line.startswith("|"):
            in_table = False
        head = re.match(r"^\*\*(.+)\*\* \(seed \d+\)$", line)
        if head:
            end = i + 1
            fences = 0
            while end < len(lines) and fences < 2:
                fences += lines[end].startswith("```")
                end += 1
            matrices[head.group(1)] = lines[i:end]
    return commands, rows, matrices


def write_report(benchmark: str, scenario: str, records: dict[str, list[dict]], args: argparse.Namespace,
                 command: str, results_dir: Path | None = None, draw: bool = True,
                 runs_dir: Path | None = None) -> Path:
    from continual_blr.plots import plot_average_accuracy

    validation = getattr(args, "validation", 0.0) or 0.0
    out = report_path(Path(results_dir or args.results_dir), benchmark, scenario, args.quick, validation)
    out.parent.mkdir(parents=True, exist_ok=True)
    notes = ""
    if out.is_file() and NOTES_MARKER in out.read_text():
        notes = out.read_text().split(NOTES_MARKER, 1)[1].strip("\n")
    quick = " — QUICK MODE (epochs / 5), not comparable to published numbers" if args.quick else ""
    held = f" — VALIDATION ({validation:g} of each task's training data held out), not test" if validation else ""
    lines = [f"# {benchmark} ({scenario}-incremental){quick}{held}", ""]
    if args.quick:
        lines += ["**QUICK MODE**: every method trained for epochs // 5 per task (a CPU smoke run); the numbers",
                  "below are not the protocol's and must not be compared with the published ones.", ""]
    if validation:
        lines += [f"**VALIDATION**: every run trained on {1 - validation:g} of each task's training data and was "
                  f"evaluated on the held-out {validation:g} (drawn per seed), never on the test set. For choosing "
                  "hyper-parameters; published (test) numbers are not shown.", ""]
    commands = sorted({r.get("command") or command for recs in records.values() for r in recs})
    old_commands, old_rows, old_matrices = previous_report(out) if getattr(args, "keep", False) else ([], {}, {})
    kept = [m for m in old_rows if m not in records]
    origin = "" if getattr(args, "keep", False) else (
        " Generated from the run records under `benchmarks/records/` alone (`python benchmarks/tables.py`). The "
        "last two columns name the library version(s) (hash of `continual_blr/`) and commit(s) a row's records "
        "ran on; a record is reused while its config and every library function it executed are unchanged, or "
        "were checked equal side by side (`benchmarks/records.py`; `python benchmarks/tables.py --status` lists "
        "stale records).")
    lines += [f"Produced by (runs stored as records, resumable):{origin}", "", "```", *commands, "```", ""]
    if kept:
        lines += [f"Rows kept from the previous version of this report (their runs are not stored where it was "
                  f"rewritten): {', '.join(kept)}. Commands of that version:", "", "```",
                  *sorted(set(old_commands) - set(commands)), "```", "",
                  "The curves figure was not redrawn (it needs every row's stored runs).", ""]
    runs_dir = Path(runs_dir or getattr(args, "runs_dir", None) or run_records.RECORDS_DIR)
    folder = _runs_folder(runs_dir, benchmark, scenario, args.quick, validation)
    rel = folder.relative_to(runs_dir).as_posix()
    lines += ["| method | final avg acc (%) | seeds | scenario | memory | wall / run (s) | CPU / run (s) | forgetting (%) | published | ours − published | current | test evals | library | commits |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    earlier: dict[str, list[dict]] = {}
    fixed = False
    order = {m: i for i, m in enumerate(METHOD_ORDER)}
    methods = sorted([*records, *kept], key=lambda m: (order.get(m, len(order)), m))
    for method in methods:
        if method in kept:
            lines.append(old_rows[method])
            continue
        recs = records[method]
        accs = [100 * r["avg_acc"] for r in recs]
        m, s = _mean_std(accs)
        fg, _ = _mean_std([100 * r["forgetting"] for r in recs])
        wall, _ = _mean_std([r["wall_s"] for r in recs])
        cpus = [r["cpu_s"] for r in recs if "cpu_s" in r]
        cpu = f"{_mean_std(cpus)[0]:.0f}" if cpus else "-"
        ref = None if validation else REFERENCES.get((benchmark, scenario, method))
        ref_s = f"{ref[0]:.2f} ({ref[1]})" if ref else "-"
        diff = _verdict(m, s, ref[0]) if ref else "-"
        seeds = ",".join(str(r["seed"]) for r in recs)
        libs = ", ".join(sorted({(r.get("library_hash") or "?")[:8] for r in recs}))
        commits = ", ".join(sorted({(r.get("commit") or "?")[:8] + ("+dirty" if r.get("dirty") else "")
                                    + ("†" if r.get("commit_fixed") else "") for r in recs}))
        fixed = fixed or any(r.get("commit_fixed") for r in recs)
        stale = [r["seed"] for r in recs if not run_records.currency(r, rel, runs_dir)[0]]
        current = "yes" if not stale else f"**stale** ({len(stale)}/{len(recs)})"
        earlier[method] = [] if validation else ledger.evaluations(folder, method, runs_dir)
        evals = "-" if validation else str(1 + len(earlier[method]))
        lines.append(f"| {method} | {m:.2f} ± {s:.2f} | {len(recs)} ({seeds}) | {scenario} | {_memory_cell(recs[0])} | "
                     f"{wall:.0f} | {cpu} | {fg:.2f} | {ref_s} | {diff} | {current} | {evals} | {libs} | {commits} |")
    gpu = sorted({f"{r.get('device')} (torch {r.get('versions', {}).get('torch')})" for recs in records.values()
                  for r in recs if str((r.get("config") or {}).get("device", "cpu")).startswith("cuda")})
    if gpu:
        lines += ["", f"Runs on a GPU ({', '.join(gpu)}), lent for one session, several runs side by side on the one "
                  "GPU: wall / run and CPU / run are those of a run sharing the GPU with the others, not of a run alone. "
                  "Std over seeds is the sample std (0 with one seed)."]
    loads = [r["load_at_start"] for recs in records.values() for r in recs if isinstance(r.get("load_at_start"), (int, float))
             and not str((r.get("config") or {}).get("device", "cpu")).startswith("cuda")]
    if loads:
        lines += ["", f"Wall times measured on a shared 2-core CPU (1-minute load average at run start "
                  f"{min(loads):.1f}–{max(loads):.1f}, our runs at nice 10), so wall time is inflated by other users' jobs; CPU / run is "
                  "the process's own CPU time (all its threads), the better measure of cost here. Std over seeds is the sample "
                  "std (0 with one seed)."]
    if fixed:
        lines += ["", "† the record named a commit that does not hold the library it ran (a commit typed by hand, or a "
                  "run on uncommitted changes); the commit shown is the one that does, the claimed one is kept in the "
                  "record's `commit_fixed` (`python benchmarks/ledger.py --fix-commits`)."]
    if any(earlier.values()):
        lines += ["", "Earlier test evaluations of these rows (generated from the superseded records and "
                  "`benchmarks/records/unrecorded_evaluations.json`; `benchmarks/ledger.py`), oldest first; "
                  "\"test evals\" counts them with the row's current records:", ""]
        for method in methods:
            for e in earlier.get(method, []):
                lines.append(f"- **{method}** {ledger.describe(e)}")
    if not validation:
        lines += ["", "\"current\": whether each record's config and every library function it executed are "
                  "unchanged, or were checked equal side by side (`benchmarks/records.py`, "
                  "`python benchmarks/side_by_side.py --status`)."]
    hi = None if validation else HIGHER_ANCHORS.get((benchmark, scenario))
    if hi:
        lines += ["", f"Higher anchor on the same protocol: {hi[1]} {hi[0]:.2f}."]
    lines += ["", "Accuracy matrices (seed of the first run, rows: after task i, columns: task j, %):", ""]
    for method in methods:
        if method in kept:
            if method in old_matrices:
                lines += [*old_matrices[method], ""]
            continue
        recs = records[method]
        lines.append(f"**{method}** (seed {recs[0]['seed']})")
        lines.append("")
        lines.append("```")
        for row in recs[0]["acc_matrix"]:
            lines.append(" ".join("   -  " if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:6.2f}" for v in row))
        lines.append("```")
        lines.append("")
    lines += [NOTES_MARKER, notes or "", ""]
    out.write_text("\n".join(lines))
    if not kept and draw:
        curves = {m: [r["avg_acc_per_step"] for r in recs] for m, recs in records.items()}
        plot_average_accuracy(curves, out.with_name(out.stem + "_curves.png"), title=f"{benchmark} ({scenario})")
    return out


def main(argv: list[str] | None = None) -> int:
    run_records.process_start()  # commit and dirty flag as they are when the command starts
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("benchmark", help="a folder of configs/ (split_mnist, permuted_mnist, split_cifar, split_digits, ...)")
    parser.add_argument("--methods", nargs="+", default=[])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--scenario", help="override the configs' scenario (task / class / domain)")
    parser.add_argument("--data-dir", help="data root (else $CONTINUAL_BLR_DATA)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="epochs / 5; labelled QUICK in the outputs")
    parser.add_argument("--validation", type=float, default=0.0, metavar="FRACTION",
                        help="evaluate on this held-out fraction of each task's training data, not the test set; "
                             "stored and reported apart (..._validation.md)")
    parser.add_argument("--force", action="store_true", help="rerun finished runs")
    parser.add_argument("--no-progress", action="store_true", help="no per-task / per-epoch bars inside a run")
    parser.add_argument("--work-dir", metavar="DIR",
                        help="keep each run's folder under DIR (outside the repository) with a checkpoint after every "
                             "task, and continue an unfinished one there: for runs longer than a session "
                             "(run_resumable)")
    parser.add_argument("--runs-dir", default=str(run_records.RECORDS_DIR),
                        help="where run records are stored (default: benchmarks/records/, committed)")
    parser.add_argument("--configs-dir", default=str(ROOT / "configs"))
    parser.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results" / "tables"))
    parser.add_argument("--threads", type=int, help="torch threads, intra- and inter-op (default: torch's); 1 is often "
                        "faster on a shared machine (docs/runs.md)")
    parser.add_argument("--only-this-command", action="store_true",
                        help="report only this command's runs (default: every stored run of the benchmark)")
    parser.add_argument("--keep", action="store_true",
                        help="keep rows of the existing report whose runs are not stored here (default: the table "
                             "holds the stored records only)")
    parser.add_argument("--compile", default=None, choices=("off", "default", "reduce-overhead", "aot_eager"),
                        help="train.compile for every run (the steps under torch.compile, for GPUs; "
                             "continual_blr.compiled); not part of the compared config")
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic CUDA kernels (torch.use_deterministic_algorithms, warn_only): GPU runs of "
                             "one seed repeat bit for bit where PyTorch allows; named in the record's command")
    parser.add_argument("--tables-only", action="store_true",
                        help="run nothing: rewrite the benchmark's table from its stored records alone")
    args = parser.parse_args(argv)
    if not args.methods and not args.tables_only:
        parser.error("--methods: give at least one method (or --tables-only)")
    from continual_blr.data.builders import check_validation

    try:
        check_validation(args.validation)
    except ValueError as err:
        parser.error(f"--{err}")
    if args.threads is not None:
        from continual_blr.runner import set_threads

        try:
            set_threads(args.threads)
        except ValueError as err:
            parser.error(str(err))
    if args.deterministic:
        use_deterministic_kernels()
    if args.only_this_command:
        args.keep = False
    command = "python benchmarks/reproduce.py " + shown_command(sys.argv[1:] if argv is None else argv, args.data_dir)
    runs_dir = Path(args.runs_dir)
    if args.tables_only:
        args.keep = False
        scenario = args.scenario or "task"
        out = write_report(args.benchmark, scenario, collect_records(runs_dir, args.benchmark, scenario, args.quick,
                                                                     args.validation), args, command)
        print(f"wrote {out}")
        return 0
    records: dict[str, list[dict]] = {}
    scenario = None
    jobs = [(m, s) for m in args.methods for s in args.seeds]
    from continual_blr.runner import RunInterrupted

    if args.work_dir:
        import signal

        def _interrupt(signum, frame):  # SIGTERM ends a resumable run as Ctrl-C does: its attempt is counted
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, _interrupt)
    for method, seed in (bar := tqdm(jobs, desc=args.benchmark)):
        bar.set_postfix_str(f"{method} seed {seed}")
        try:
            rec = run_one(args.benchmark, method, seed, args, runs_dir, command)
        except RunInterrupted:
            if not args.work_dir:
                raise
            print(f"{method} seed {seed}: interrupted; its finished tasks are kept under {args.work_dir}: rerun the "
                  "same command to continue it", file=sys.stderr)
            return 130
        scenario = rec["scenario"]
        records.setdefault(method, []).append(rec)
        tqdm.write(f"{method} seed {seed}: avg acc {100 * rec['avg_acc']:.2f}%  ({rec['wall_s']:.0f} s)")
        # rewrite the report after every run: an interrupted command still leaves a current table
        stored = records if args.only_this_command else collect_records(runs_dir, args.benchmark, scenario, args.quick,
                                                                        args.validation)
        out = write_report(args.benchmark, scenario, stored, args, command)
    print(out.read_text())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
