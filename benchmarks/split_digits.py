"""Every continual-learning method on split digits, task and class scenarios: one table.

Run (CPU, 1 torch thread; finished runs are stored under benchmarks/runs/split_digits/ and reused):

    python benchmarks/split_digits.py                                       # 5 seeds, task + class, writes the table
    python benchmarks/split_digits.py --seeds 0 --methods none fromp ewc --scenarios task --no-write   # quick look
    python benchmarks/split_digits.py --validation 0.1 --methods ewc none    # on held-out training data, not test

Rows: no regulariser, the weight-space methods (L2, EWC, online EWC, Laplace, VCL, BLR, IVON), FROMP
and its ablations (FRORP, FROMP-L2, fromp-full, fromp-kron, ``classes: all``), and joint training as
the upper bound. Each row is data (``ROWS``): a label, a YAML of ``configs/split_digits/`` whose
``methods[0]`` gives the registry name and params, an optional params override, the scenarios it runs
in and, for the FROMP variants, the registry name that replaces the config's (they share
``fromp.yaml``'s params).

Every row runs through the one training loop (``runner.run_config``) with the *same* model and
budget: the ``model`` and ``train`` of ``configs/split_digits/none.yaml`` (MLP 64-100-100, 10 epochs
per task, batch 32, Adam lr 1e-3 for the non-BLR optimisers, no gradient clipping). Only the scenario
and the seed change: ``task`` (multi-head, one 2-way head per task) and ``class`` (single 10-way
head). A finished (row, scenario, seed) is stored as JSON under
``<runs-dir>/<scenario>/<label>_seed<seed>.json`` and reused while its method config (name + params)
is unchanged. The table in ``benchmarks/results/split_digits.md`` gives the final average accuracy
(mean ± sample std over seeds), the paired difference to "none" on the same seeds, forgetting, and
the CPU time per run.

``--validation F`` runs every row on the *validation stream* instead (``F`` of each task's training
data held out and evaluated on, the test set unused; ``stream.validation``): its runs are stored under
``<runs-dir>/validation<F>/`` and its table goes to ``benchmarks/results/split_digits_validation.md``
and says "validation" in its title. Hyper-parameters are chosen there (``benchmarks/search.py``).
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from continual_blr.config import MethodConfig, RunConfig, from_dict, yaml_load
from continual_blr.runner import run_config

ROOT = Path(__file__).resolve().parent.parent


sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts (benchmarks/ is not a package)
import strength  # noqa: E402
CONFIGS = ROOT / "configs" / "split_digits"
SCENARIOS = ("task", "class")
BASE_CONFIG = "none"  # its model and train are every row's budget


class Row(NamedTuple):
    """One row of the table.

    Attributes:
        label: the row's name in the table (and, made file-safe, in the stored runs' file names).
        config: stem of the YAML under ``configs/split_digits/`` whose ``methods[0]`` is used.
        override: params merged over the config's params (None: none).
        scenarios: the scenarios this row runs in.
        name: registry name replacing the config's (the FROMP variants on ``fromp.yaml``); None keeps it.
        class_config: stem of the YAML used in the class scenario instead of ``config`` (a method whose
            strength was tuned per scenario, e.g. the Laplace temperature); None: ``config`` in both.
    """

    label: str
    config: str
    override: dict[str, Any] | None = None
    scenarios: tuple[str, ...] = SCENARIOS
    name: str | None = None
    class_config: str | None = None

    def config_for(self, scenario: str) -> str:
        """The YAML stem this row runs in ``scenario``."""
        return self.class_config if scenario == "class" and self.class_config else self.config


ROWS: list[Row] = [
    Row("none", "none"),
    # weight-space rows with a strength chosen per scenario on validation (benchmarks/results/search_split_digits_*.md)
    Row("l2", "l2", class_config="l2_class"),
    Row("ewc", "ewc", class_config="ewc_class"),
    Row("ewc (online)", "ewc_online", class_config="ewc_online_class"),
    Row("laplace (kron)", "laplace", class_config="laplace_class"),
    Row("laplace (diag)", "laplace_diag", class_config="laplace_diag_class"),
    Row("vcl (vogn)", "vcl"),
    Row("vcl (bbb)", "vcl_bbb"),
    Row("vcl (vogn) + k-center coreset", "vcl_coreset"),
    Row("blr (diag, GGN; library defaults)", "blr"),
    # ablations of blr.yaml (the library defaults): VOGN's curvature, the plain precision
    # rate, no step clip, and the earlier VOGN recipe (EF, α 0.2, δ 1, ess 1, T 1, no debias, no clip)
    Row("blr, empirical Fisher ĥ", "blr", {"curvature": "empirical_fisher"}),
    Row("blr, no precision debias", "blr", {"precision_debias": False}),
    Row("blr, no step clip", "blr", {"clip_radius": None}),
    Row("blr, VOGN recipe (EF, α 0.2, T 1)", "blr",
        {"curvature": "empirical_fisher", "precision_debias": False, "lr": 0.2, "temperature": 1.0,
         "clip_radius": None, "ess_factor": 1.0, "prior_precision": 1.0, "init_precision": 400.0}),
    Row("ivon", "ivon"),
    Row("fromp", "fromp"),
    Row("frorp", "fromp", name="frorp"),
    Row("fromp-l2", "fromp", name="fromp-l2"),
    Row("fromp-full", "fromp", name="fromp-full"),
    Row("fromp-kron", "fromp", name="fromp-kron"),
    Row("fromp (classes: all)", "fromp", {"classes": "all"}, ("class",)),
    Row("joint", "joint"),
]

Records = dict[tuple[str, str], list[dict[str, Any]]]


def _load(config: str) -> RunConfig:
    """The run config of ``configs/split_digits/<config>.yaml``."""
    return from_dict(RunConfig, yaml_load((CONFIGS / f"{config}.yaml").read_text()))


def method_config(row: Row, scenario: str = "task") -> MethodConfig:
    """The row's method in ``scenario``: its config's ``methods[0]`` with the name replaced and params
    overridden.

    The method-level ``train`` overrides of the YAML are dropped: every row shares one budget.
    """
    mc = _load(row.config_for(scenario)).methods[0]
    return MethodConfig(row.name or mc.name, dict(mc.params) | dict(row.override or {}))


def safe_label(label: str) -> str:
    """``label`` as a file name: runs of other characters than ``[A-Za-z0-9.-]`` become ``_``."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", label).strip("_")


def select_rows(methods: list[str] | None) -> list[Row]:
    """The rows named by ``methods``, in table order.

    Each name selects the row with that label; a name that is no label selects the rows of that
    config stem (``laplace`` → "laplace (kron)", ``fromp`` → only the "fromp" row).

    Raises:
        SystemExit: a name that is neither a label nor a config stem.
    """
    if not methods:
        return list(ROWS)
    labels = {r.label for r in ROWS}
    stems = {r.config for r in ROWS} | {r.class_config for r in ROWS if r.class_config}
    unknown = [m for m in methods if m not in labels and m not in stems]
    if unknown:
        raise SystemExit(f"unknown --methods {unknown}; labels: {sorted(labels)}; configs: {sorted(stems)}")
    wanted_labels = {m for m in methods if m in labels}
    wanted_stems = {m for m in methods if m not in labels}
    return [r for r in ROWS if r.label in wanted_labels or r.config in wanted_stems or r.class_config in wanted_stems]


def runs_folder(runs_dir: Path, validation: float = 0.0) -> Path:
    """Where runs are stored: ``runs_dir`` for test runs, ``runs_dir/validation<F>`` for validation runs."""
    return Path(runs_dir) / f"validation{validation:g}" if validation else Path(runs_dir)


def run_one(row: Row, scenario: str, seed: int, runs_dir: Path, force: bool = False,
            validation: float = 0.0) -> dict[str, Any]:
    """Run (or reload) one (row, scenario, seed).

    Args:
        row: the table row.
        scenario: ``"task"`` or ``"class"``.
        seed: the run's seed.
        runs_dir: where finished runs are stored (``<runs_dir>/<scenario>/<label>_seed<seed>.json``;
            validation runs under ``<runs_dir>/validation<F>/``).
        force: rerun even if a stored run with the same method config exists.
        validation: 0 evaluates on the test set; otherwise this fraction of each task's training data
            is held out and evaluated on (``stream.validation``).

    Returns:
        The run's ``StreamResult.to_dict()`` plus ``wall_s``, ``cpu_s``, ``label``, ``method_config``
        and ``validation``.
    """
    mc = method_config(row, scenario)
    key = {"name": mc.name, "params": mc.params}
    path = runs_folder(runs_dir, validation) / scenario / f"{safe_label(row.label)}_seed{seed}.json"
    if path.is_file() and not force:
        rec = json.loads(path.read_text())
        if rec.get("method_config") == key and rec.get("validation", 0.0) == validation:
            return rec
    cfg = copy.deepcopy(_load(BASE_CONFIG))  # the shared model and budget
    cfg.stream.scenario = scenario
    cfg.stream.validation = validation
    cfg.seed = seed
    cfg.progress = False
    cfg.methods = [mc]
    t0, c0 = time.perf_counter(), time.process_time()
    res = run_config(cfg, save=False)[0]
    rec = res.to_dict() | {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                           "label": row.label, "config": row.config, "method_config": key, "validation": validation}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(rec, indent=2))
    tmp.replace(path)
    return rec


def _ms(xs: list[float], scale: float = 100.0) -> str:
    """``mean ± sample std`` of ``xs`` × ``scale``, one decimal (``continual_blr.sweep``, as ``run --seeds``)."""
    from continual_blr.sweep import format_mean_std

    return format_mean_std(xs, scale, digits=1)


def _config_cell(row: Row) -> str:
    """The config column: the YAML(s), the replaced registry name and the override."""
    cell = f"`{row.config}.yaml`"
    if row.class_config:
        cell += f" (class: `{row.class_config}.yaml`)"
    if row.name:
        cell += f" as `{row.name}`"
    if row.override:
        cell += f" + `{json.dumps(row.override)}`"
    return cell


def _fromp_note() -> list[str]:
    """The FROMP paragraph, its numbers read from ``fromp.yaml``."""
    p = _load("fromp").methods[0].params
    n = int(p.get("n_points", 40))
    return [
        f"FROMP: τ = {p.get('tau', 10.0):g}, {n} memorable points per task ({n // 2} per class, top tr Λ), "
        f"δ = {p.get('prior_precision', 1e-3):g}, ε = {p.get('jitter', 1e-6):g} (the reference code's split-MNIST "
        "values, not tuned here). FRORP: random points. FROMP-L2: K = I. fromp-full: full multi-output kernel. "
        "fromp-kron: Kronecker-factored Σ. In the class scenario FROMP compares a past task's own classes "
        "(`classes: task`); `classes: all` is the ablation that compares all 10 outputs.",
    ]


def _lam_cell(row: Row) -> str:
    """The λ-equivalent column: EWC's λ, 1/T of the Bayesian methods (``strength.py``); task / class
    when the row runs another config in the class scenario."""
    cells = [strength.format_lam(strength.lam_equivalent(mc.name, mc.params))
             for mc in (method_config(row, s) for s in row.scenarios)]
    return " / ".join(dict.fromkeys(cells))


def report(records: Records, seeds: list[int], wall: float, command: str, threads: int,
           runs_dir: Path | None = None, validation: float = 0.0) -> str:
    """The markdown table and its notes.

    Args:
        records: ``(label, scenario)`` → the runs, one per seed.
        seeds: the seeds asked for.
        wall: this invocation's wall time (s).
        command: the command line that produced the table.
        threads: torch threads used.
        runs_dir: where the runs are stored (named in the header; default the standard folder).
        validation: the held-out fraction the runs were evaluated on (0: the test set).
    """
    base = _load(BASE_CONFIG)
    t = base.train
    clip = "no gradient clipping" if t.grad_clip is None else f"gradient norm clipped at {t.grad_clip:g}"
    rows = [r for r in ROWS if any((r.label, s) in records for s in SCENARIOS)]
    runs_dir = runs_folder(Path(runs_dir or ROOT / "benchmarks" / "runs" / "split_digits"), validation).resolve()
    runs_shown = runs_dir.relative_to(ROOT) if runs_dir.is_relative_to(ROOT) else runs_dir
    evaluated = "test" if not validation else f"VALIDATION: {validation:g} of each task's training data held out"
    lines = [
        f"# Split digits: all methods (final average accuracy, %; {evaluated})",
        "",
    ]
    if validation:
        lines += [f"**VALIDATION**: every run trained on {1 - validation:g} of each task's training data and was "
                  f"evaluated on the held-out {validation:g} (drawn per seed), not on the test set. For choosing "
                  "hyper-parameters; not comparable to the test table `split_digits.md`.", ""]
    lines += [
        f"Produced by (runs stored under `{runs_shown}/`, not committed):",
        "",
        "```",
        command,
        "```",
        "",
        f"Seeds {', '.join(map(str, seeds))}; mean ± sample std over seeds. Same model and budget for every "
        f"row (`{BASE_CONFIG}.yaml`'s): MLP 64-{'-'.join(map(str, base.model.hidden))}, {t.epochs} epochs per "
        f"task, batch {t.batch_size}, {t.optimizer.capitalize()} lr {t.lr:g} (BLR, VCL-vogn and IVON use their own "
        f"optimiser over the same minibatches), {clip}. Task: one 2-way head per task (multi-head); class: one "
        "10-way head (single-head). Δ none: mean ± std over seeds of (row − none) on the same seed.",
        "",
        "| method | config | λ-equiv. | task-incremental | Δ none | forgetting | class-incremental | Δ none "
        "| forgetting | CPU / run (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells: list[str] = []
        cpu: list[float] = []
        for scen in SCENARIOS:
            recs = records.get((row.label, scen))
            if not recs:
                cells += ["-", "-", "-"]
                continue
            none = {r["seed"]: r["avg_acc"] for r in records.get(("none", scen), [])}
            diffs = [r["avg_acc"] - none[r["seed"]] for r in recs if r["seed"] in none]
            cells += [_ms([r["avg_acc"] for r in recs]),
                      _ms(diffs) if diffs and row.label != "none" else "-",
                      _ms([r["forgetting"] for r in recs])]
            cpu += [r.get("cpu_s", r["wall_s"]) for r in recs]
        lines.append(f"| {row.label} | {_config_cell(row)} | {_lam_cell(row)} | {' | '.join(cells)} "
                     f"| {statistics.fmean(cpu):.1f} |")
    n_runs = sum(len(v) for v in records.values())
    lines += [
        "",
        f"{n_runs} runs, {threads} torch thread(s) each, on a shared 2-core CPU; their wall times sum to "
        f"{sum(r['wall_s'] for v in records.values() for r in v):.0f} s. This invocation took {wall:.0f} s "
        "(stored runs are reused at no cost).",
        "",
        "How the params were chosen. l2, ewc, ewc (online), laplace (kron), laplace (diag): the strength (λ or the "
        "temperature T) per scenario on *validation* data — 0.1 of each task's training data held out, seeds 0-4, "
        "never the test set (`python benchmarks/search.py split_digits <config> --scenario <s> --grid ...`; grids, "
        "scores and choices in `benchmarks/results/search_split_digits_<config>[_class].md`); each has a class config "
        "because one head per task needs a plastic trunk and one 10-way head needs the old classes held hard. "
        "blr and ivon: the library defaults, chosen on validation runs (`benchmarks/results/search_blr.md`); the blr "
        "rows after the first are ablations of `blr.yaml`, not tuned on their own. The vcl rows: see each YAML's "
        "first line. FROMP rows are not tuned (the reference code's values).",
        "",
        "λ-equiv.: the strength on EWC's scale (task / class where the two configs differ). EWC adds "
        "(λ/2) Σ_k F̄_k (θ − θ*_k)² to the mean loss, F̄_k the per-example-mean Fisher of past task k, so λ = N_k/N_t "
        "≈ 1 is the Bayesian weight of a past task; Laplace's and the BLR's temperature T divide the summed "
        "curvature N_k F̄_k, which is λ = 1/T for tasks of equal size (here 283-291 training images each); IVON's "
        "temperature maps the same way; VCL carries its posterior at T = 1; l2 and FROMP have no equivalent "
        "(`benchmarks/strength.py`, docs/benchmarks.md).",
        "",
        "Caveats: (1) Five seeds rank rows only where the paired Δ none is large against its spread; several "
        "task-scenario rows are within noise of each other. (2) vcl (vogn) without a coreset does not beat none in "
        "the task scenario; with the paper's k-center coreset it does in both. (3) A validation split of 0.1 is "
        "about 29 images per task here: one image moves a task's validation accuracy by ~3.4 points and the "
        "5-task average by ~0.7; the searches' choices are the best means over 5 seeds, often within one std of the "
        "runner-up (see the search tables).",
        "",
        "Method parameters (registry name and params, as run):",
        "",
    ]
    for row in rows:
        for scen in ([s for s in SCENARIOS if s in row.scenarios] if row.class_config else [row.scenarios[0]]):
            mc = method_config(row, scen)
            where = f" ({scen})" if row.class_config else ""
            lines.append(f"- **{row.label}**{where}: `{mc.name}` {json.dumps(mc.params) if mc.params else '(defaults)'}")
    if any(r.config == "fromp" for r in rows):
        lines += [""] + _fromp_note()
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the selected rows × scenarios × seeds, print the table and (unless ``--no-write``) write it."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--methods", nargs="+", default=None,
                    help="rows to run: a row label, or else a config stem (its rows); default: every row")
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument("--runs-dir", default=str(ROOT / "benchmarks" / "runs" / "split_digits"))
    ap.add_argument("--out", default=None,
                    help="table file (default benchmarks/results/split_digits.md, or split_digits_validation.md "
                         "with --validation)")
    ap.add_argument("--validation", type=float, default=0.0, metavar="FRACTION",
                    help="evaluate on this held-out fraction of each task's training data instead of the test set")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads, intra- and inter-op (default 1: faster on a shared machine; docs/runs.md)")
    ap.add_argument("--force", action="store_true", help="rerun stored runs")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    args = ap.parse_args(argv)
    from continual_blr.data.builders import check_validation

    try:
        check_validation(args.validation)
    except ValueError as err:
        ap.error(f"--{err}")
    if args.out is None:
        name = "split_digits_validation.md" if args.validation else "split_digits.md"
        args.out = str(ROOT / "benchmarks" / "results" / name)
    command = ("python benchmarks/split_digits.py " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    from continual_blr.runner import set_threads

    try:
        set_threads(args.threads)
    except ValueError as err:
        ap.error(str(err))
    t0 = time.perf_counter()
    records: Records = {}
    for row in select_rows(args.methods):
        for scen in args.scenarios:
            if scen not in row.scenarios:
                continue
            for seed in args.seeds:
                rec = run_one(row, scen, seed, Path(args.runs_dir), args.force, args.validation)
                records.setdefault((row.label, scen), []).append(rec)
                print(f"{row.label:32s} {scen:5s} seed {seed}: {100 * rec['avg_acc']:5.1f}%  "
                      f"({rec['wall_s']:.1f} s wall, {rec.get('cpu_s', 0):.1f} s CPU)", flush=True)
    text = report(records, args.seeds, time.perf_counter() - t0, command, args.threads, Path(args.runs_dir),
                  args.validation)
    print(text)
    if not args.no_write:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(out)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
