"""Choose a method's hyper-parameters on validation data: a grid search, recorded as a table.

Run (CPU, one torch thread per run; every run leaves a record under ``benchmarks/records/search/`` (committed;
``benchmarks/records.py``), reused while it is current):

    python benchmarks/search.py split_digits ewc --grid lam=1,10,100,1000 --seeds 0 1 2 3 4
    python benchmarks/search.py split_digits laplace --scenario class --grid temperature=0.001,0.01,0.1
    python benchmarks/search.py split_mnist ewc --grid lam=1,10,100 --seeds 0 1 --data-dir $CONTINUAL_BLR_DATA \\
        --then-test 0 1 2 3 4

The base is ``configs/<benchmark>/<config>.yaml`` (its stream, model, train budget and
``methods[0]``); every grid point overrides the method's params with one combination of the
``--grid`` values (``KEY=V1,V2,...``, several keys give their cartesian product, a single value
fixes a param). Each (point, seed) runs on the *validation stream*: ``--validation`` (default 0.1)
of each task's training data is held out, per seed, and evaluated on instead of the test set
(``make_stream(..., validation=...)``), so the test set is never used to choose. The choice is the
point with the best mean final average validation accuracy over the seeds (ties: the first in grid
order). ``--then-test SEED ...`` then runs the chosen point on the test stream for those seeds.

The table goes to ``benchmarks/results/search_<benchmark>_<config>[_<scenario>][_quick].md`` (the
scenario suffix when it is not the benchmark's default): the base config, the grid, per point the
mean ± sample std of the validation accuracy (and per seed), forgetting, the λ-equivalent strength
(``strength.py``), the choice with its paired margin over the runner-up, the test numbers of
``--then-test`` and the exact command (the data folder shown as ``$CONTINUAL_BLR_DATA``). It is
rewritten after every point. A stored run is reused while its stream, model, train budget, method and
mode are the same and it ran on the current library (its hash, ``benchmarks/records.py``); ``--force`` reruns.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import hashlib
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SCENARIOS = ("task", "domain")


sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts (benchmarks/ is not a package)
import records as run_records, reproduce, strength  # noqa: E402


# ----------------------------------------------------------------------------- the grid


def _coerce(text: str, like: Any) -> Any:
    """``text`` as the type of ``like`` (a param's current value): numbers, bools, None or strings."""
    low = text.strip().lower()
    if low in ("none", "null"):
        return None
    if isinstance(like, bool) or low in ("true", "false"):
        if low not in ("true", "false"):
            raise ValueError(f"not a bool: {text!r}")
        return low == "true"
    if (isinstance(like, int) or like is None) and re.fullmatch(r"[+-]?\d+", low):  # None: an optional int
        return int(low)
    try:
        return float(low)
    except ValueError:
        if isinstance(like, (int, float)):
            raise ValueError(f"not a number: {text!r}") from None
        return text.strip()


def parse_grid(specs: list[str], method: str, base_params: dict[str, Any]) -> dict[str, list[Any]]:
    """``["lam=1,10", "mode=separate"]`` → ``{"lam": [1.0, 10.0], "mode": ["separate"]}``.

    Values take the type of the method's param (its default filled in), checked against the method's
    params class. A key ``train.<field>`` (e.g. ``train.epochs=5,15``) overrides that field of the run's
    train settings for this method (``methods[0].train``) instead of a param.

    Raises:
        SystemExit: a malformed spec, an unknown param or a value of the wrong type (one line).
    """
    from continual_blr.methods import TrainConfig, build_method

    defaults = dataclasses.asdict(build_method(method, base_params).params)
    defaults |= {f"train.{k}": v for k, v in dataclasses.asdict(TrainConfig()).items()}
    grid: dict[str, list[Any]] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise SystemExit(f"search: --grid: got {spec!r}; expected KEY=V1,V2,...")
        if key not in defaults:
            raise SystemExit(f"search: --grid: {method} has no param {key!r}; allowed: {', '.join(defaults)}")
        if key in grid:
            raise SystemExit(f"search: --grid: {key!r} given twice")
        try:
            grid[key] = [_coerce(v, defaults[key]) for v in values.split(",")]
        except ValueError as err:
            raise SystemExit(f"search: --grid: {key}: {err}") from None
    return grid


def split_point(point: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A grid point as (the method's params, its train overrides): ``train.<field>`` keys go to the second,
    without the prefix."""
    params = {k: v for k, v in point.items() if not k.startswith("train.")}
    return params, {k.removeprefix("train."): v for k, v in point.items() if k.startswith("train.")}


def grid_points(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """The cartesian product of the grid, the first key varying slowest."""
    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def point_label(point: dict[str, Any], grid: dict[str, list[Any]]) -> str:
    """``"lam=100"``: the keys with more than one value (all keys if none varies)."""
    keys = [k for k in grid if len(grid[k]) > 1] or list(grid)
    return ", ".join(f"{k}={_fmt(point[k])}" for k in keys)


def _safe(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", label).strip("_")


# ----------------------------------------------------------------------------- runs


def load_base(benchmark: str, config: str, args: argparse.Namespace):
    """The run config ``configs/<benchmark>/<config>.yaml`` with the command's scenario, data root and mode
    (reproduce.py's loader; CPU, no progress bars; the validation fraction is set per run)."""
    opts = argparse.Namespace(configs_dir=args.configs_dir, scenario=args.scenario, data_dir=args.data_dir,
                              validation=0.0, device="cpu", quick=args.quick, no_progress=True)
    return reproduce._load_config(benchmark, config, opts, prog="search")


def run_key(cfg) -> dict[str, Any]:
    """What makes two runs the same run: stream (without the data folder), model, budget, method, mode, seed."""
    stream = dataclasses.asdict(cfg.stream)
    stream.pop("data_dir")
    return {"stream": stream, "model": dataclasses.asdict(cfg.model), "train": dataclasses.asdict(cfg.train),
            "method": dataclasses.asdict(cfg.methods[0]), "quick": cfg.quick, "seed": cfg.seed}


def _mode(quick: bool, validation: float) -> str:
    return ("quick" if quick else "full") + (f"_validation{validation:g}" if validation else "_test")


def _record_path(folder: Path, label: str, seed: int, key: dict[str, Any]) -> Path:
    """Where a point's run is stored: ``<label>_seed<seed>.json``, named by the varied keys, unless that file holds
    another run (another search varied the same keys on another base): then ``<label>_<digest of the run key>_seed<seed>.json``,
    so that no search's record overwrites another's."""
    plain = folder / f"{_safe(label)}_seed{seed}.json"
    if not plain.is_file() or json.loads(plain.read_text()).get("key") == key:
        return plain
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return folder / f"{_safe(label)}_{digest}_seed{seed}.json"


def run_point(base, params: dict[str, Any], label: str, seed: int, validation: float, runs_dir: Path,
              force: bool = False) -> dict[str, Any]:
    """Run (or reload) the base config with ``params`` as its method's params on one seed.

    Args:
        base: the base run config (not modified).
        params: the method's full params for this point.
        label: the point's label (names the stored file).
        seed: the run's seed (model init, stream draws and the validation hold-out).
        validation: the held-out fraction evaluated on; 0 evaluates on the test set.
        runs_dir: the folder of this search's runs.
        force: rerun a stored run.

    Returns:
        The run's ``StreamResult.to_dict()`` plus ``wall_s``, ``cpu_s``, ``params``, ``validation``, ``key``.
    """
    from continual_blr.config import MethodConfig
    from continual_blr.runner import run_config

    cfg = copy.deepcopy(base)
    mc = cfg.methods[0]
    method_params, train = split_point(params)
    cfg.methods = [MethodConfig(mc.name, method_params, dict(mc.train) | train)]
    cfg.seed = seed
    cfg.stream.validation = validation
    key = run_key(cfg)
    scenario = cfg.stream.scenario or "default"
    path = _record_path(runs_dir / scenario / _mode(cfg.quick, validation), label, seed, key)
    if path.is_file() and not force:
        stored = json.loads(path.read_text())
        if stored.get("key") == key and run_records.currency(stored)[0]:
            return stored
    origin = run_records.run_provenance(cfg.device)
    traced = run_records.TracedRun(cfg)  # the code this run executes (records.currency)
    t0, c0 = time.perf_counter(), time.process_time()
    with traced:
        result = run_config(cfg, save=False, on_epoch=traced.on_epoch)[0]
    record = result.to_dict() | {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                                 "params": dict(params), "validation": validation, "key": key} | origin | traced.fields()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(path)
    return record


# ----------------------------------------------------------------------------- choice and report


def _ms(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def choose(scores: list[list[float]]) -> int:
    """Index of the best mean score (ties: the first)."""
    means = [statistics.fmean(s) for s in scores]
    return max(range(len(means)), key=lambda i: (means[i], -i))


def report_path(results_dir: Path, benchmark: str, config: str, scenario: str, quick: bool) -> Path:
    """``search_<benchmark>_<config>[_<scenario>][_quick].md``; no scenario suffix for the benchmark's
    default scenario or when the config's name already ends with it (``laplace_class``)."""
    suffix = "" if scenario in DEFAULT_SCENARIOS + ("default",) or config.endswith(f"_{scenario}") else f"_{scenario}"
    return Path(results_dir) / f"search_{benchmark}_{config}{suffix}{'_quick' if quick else ''}.md"


def write_report(out: Path, *, benchmark: str, config: str, base, grid: dict[str, list[Any]],
                 points: list[dict[str, Any]], labels: list[str], records: list[list[dict]], seeds: list[int],
                 validation: float, command: str, test_records: list[dict] | None = None,
                 complete: bool = True) -> None:
    """Write the search table (see the module docstring) to ``out``."""
    mc = base.methods[0]
    t = base.train
    scenario = base.stream.scenario or "default"
    done = [i for i, recs in enumerate(records) if len(recs) == len(seeds)]
    quick = " — QUICK MODE (epochs / 5)" if base.quick else ""
    lines = [
        f"# Search: `{config}` ({mc.name}) on {benchmark}, {scenario} scenario — VALIDATION {validation:g}{quick}",
        "",
        f"Every point was trained on {1 - validation:g} of each task's training data and scored on the held-out "
        f"{validation:g} (drawn per seed from the training data; the test set was not used to choose). Score: final "
        "average validation accuracy (%) over all tasks, mean ± sample std over the seeds.",
        "",
        "Produced by (each run's record under `benchmarks/records/search/`, committed; rerunning skips current ones):",
        "",
        "```",
        command,
        "```",
        "",
        f"- base: `configs/{benchmark}/{config}.yaml` — `{mc.name}` {json.dumps(mc.params)}"
        + (f", method train overrides {json.dumps(mc.train)}" if mc.train else ""),
        f"- budget: model {base.model.arch} {list(base.model.hidden)}, {t.epochs} epochs per task"
        f"{' // 5 (quick)' if base.quick else ''}, batch {t.batch_size}, {t.optimizer} lr {t.lr:g}",
        "- grid: " + "; ".join(f"`{k}` ∈ {{{', '.join(_fmt(v) for v in vs)}}}" for k, vs in grid.items()),
        f"- seeds: {', '.join(map(str, seeds))} (each seed: its own model init and its own validation hold-out)",
        "- λ-equiv.: the EWC λ that weights a past task of the same size as this point does (EWC: λ; "
        "Laplace / BLR: 1/T; `benchmarks/strength.py`, docs/benchmarks.md)",
        "",
        "| point | λ-equiv. | validation acc (%) | per seed | forgetting (%) | CPU / run (s) |",
        "|---|---|---|---|---|---|",
    ]
    best = None
    if done:
        best = done[choose([[r["avg_acc"] for r in records[i]] for i in done])]
    for i, (point, label) in enumerate(zip(points, labels)):
        recs = records[i]
        lam = strength.format_lam(strength.lam_equivalent(mc.name, dict(mc.params) | split_point(point)[0],
                                                          base.stream.scenario or "task"))
        if not recs:
            lines.append(f"| {label} | {lam} | (not run yet) | | | |")
            continue
        m, s = _ms([100 * r["avg_acc"] for r in recs])
        per_seed = " ".join(f"{100 * r['avg_acc']:.1f}" for r in recs)
        fg, _ = _ms([100 * r["forgetting"] for r in recs])
        cpu, _ = _ms([r["cpu_s"] for r in recs])
        cell = f"{m:.2f} ± {s:.2f}" + ("" if len(recs) == len(seeds) else f" ({len(recs)} of {len(seeds)} seeds)")
        if i == best:
            label, cell = f"**{label}**", f"**{cell}**"
        lines.append(f"| {label} | {lam} | {cell} | {per_seed} | {fg:.1f} | {cpu:.1f} |")
    lines.append("")
    if best is not None:
        chosen = points[best]
        lines.append(f"**Choice{'' if complete else ' so far (search incomplete)'}: {labels[best]}** "
                     f"(best mean validation accuracy; ties go to the first in grid order) → params "
                     f"`{json.dumps(dict(mc.params) | chosen)}`.")
        others = [i for i in done if i != best]
        if others:
            runner = max(others, key=lambda i: statistics.fmean(r["avg_acc"] for r in records[i]))
            diffs = [100 * (a["avg_acc"] - b["avg_acc"]) for a, b in zip(records[best], records[runner])]
            dm, ds = _ms(diffs)
            if len(diffs) < 2:
                verdict = "one seed: no seed-to-seed spread to compare it with"
            else:
                verdict = ("larger than" if dm > ds else "within") + " its seed-to-seed spread"
            lines += ["", f"Runner-up: {labels[runner]}; paired difference (chosen − runner-up, same seeds) "
                      f"{dm:+.2f} ± {ds:.2f} points, {verdict}."]
    if test_records:
        m, s = _ms([100 * r["avg_acc"] for r in test_records])
        fg, _ = _ms([100 * r["forgetting"] for r in test_records])
        per_seed = " ".join(f"{100 * r['avg_acc']:.2f}" for r in test_records)
        seeds_s = ",".join(str(r["seed"]) for r in test_records)
        lines += ["", "## The choice on the test set (`--then-test`)", "",
                  "| point | test acc (%) | seeds | per seed | forgetting (%) |", "|---|---|---|---|---|",
                  f"| {labels[best]} | {m:.2f} ± {s:.2f} | {len(test_records)} ({seeds_s}) | {per_seed} | {fg:.2f} |"]
    lines.append("")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text("\n".join(lines))
    tmp.replace(out)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Run the grid × seeds on the validation stream, write the table, optionally test the choice."""
    run_records.process_start()  # commit and dirty flag as they are when the command starts
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("benchmark", help="a folder of configs/ (split_digits, split_mnist, permuted_mnist, ...)")
    ap.add_argument("config", help="the base config's name in that folder (ewc, laplace, laplace_diag, l2, ...)")
    ap.add_argument("--grid", nargs="+", required=True, metavar="KEY=V1,V2", help="params to search")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--validation", type=float, default=0.1, metavar="FRACTION",
                    help="held-out fraction of each task's training data scored on (default 0.1); must be > 0")
    ap.add_argument("--scenario", help="override the config's scenario (task / class / domain)")
    ap.add_argument("--then-test", nargs="+", type=int, metavar="SEED",
                    help="run the chosen point on the test stream for these seeds")
    ap.add_argument("--data-dir", help="data root (else $CONTINUAL_BLR_DATA)")
    ap.add_argument("--quick", action="store_true", help="epochs / 5; labelled QUICK in the table")
    ap.add_argument("--force", action="store_true", help="rerun stored runs")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    ap.add_argument("--runs-dir", default=str(run_records.RECORDS_DIR / "search"),
                    help="where the runs' records are stored (default: benchmarks/records/search/, committed)")
    ap.add_argument("--configs-dir", default=str(ROOT / "configs"))
    ap.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results" / "search"))
    ap.add_argument("--out", help="table file (default: see the module docstring)")
    args = ap.parse_args(argv)
    from continual_blr.data.builders import check_validation

    try:
        if check_validation(args.validation) == 0.0:
            raise ValueError("validation: got 0; allowed: a fraction in (0, 1) (a search never scores on test data)")
    except ValueError as err:
        ap.error(f"--{err}")
    import torch

    torch.set_num_threads(args.threads)
    command = "python benchmarks/search.py " + reproduce.shown_command(
        sys.argv[1:] if argv is None else argv, args.data_dir)
    base = load_base(args.benchmark, args.config, args)
    mc = base.methods[0]
    grid = parse_grid(args.grid, mc.name, mc.params)
    points = grid_points(grid)
    labels = [point_label(p, grid) for p in points]
    scenario = base.stream.scenario or "default"
    runs_dir = Path(args.runs_dir) / args.benchmark / args.config
    out = Path(args.out) if args.out else report_path(Path(args.results_dir), args.benchmark, args.config,
                                                      scenario, args.quick)
    records: list[list[dict]] = [[] for _ in points]
    report = dict(out=out, benchmark=args.benchmark, config=args.config, base=base, grid=grid, points=points,
                  labels=labels, records=records, seeds=args.seeds, validation=args.validation, command=command)
    for i, (point, label) in enumerate(zip(points, labels)):
        for seed in args.seeds:
            rec = run_point(base, dict(mc.params) | point, label, seed, args.validation, runs_dir, args.force)
            records[i].append(rec)
            print(f"{args.config} {scenario} {label:28s} seed {seed}: validation {100 * rec['avg_acc']:6.2f}%  "
                  f"({rec['cpu_s']:.1f} s CPU)", flush=True)
        write_report(**report, complete=i == len(points) - 1)
    best = choose([[r["avg_acc"] for r in recs] for recs in records])
    print(f"choice: {labels[best]} (validation {100 * statistics.fmean(r['avg_acc'] for r in records[best]):.2f}%)")
    if args.then_test:
        tests = []
        for seed in args.then_test:
            rec = run_point(base, dict(mc.params) | points[best], labels[best], seed, 0.0, runs_dir, args.force)
            tests.append(rec)
            print(f"{args.config} {scenario} {labels[best]} seed {seed}: TEST {100 * rec['avg_acc']:6.2f}%", flush=True)
        write_report(**report, test_records=tests)
    print(out.read_text())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
