"""Every continual-learning method on split digits, task and class scenarios: one table.

Run (CPU, 1 torch thread; every finished run leaves a record under benchmarks/records/split_digits/, committed,
reused while it is current):

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
head). A finished (row, scenario, seed) is a run record (``benchmarks/records.py``: result, cost, commit, library
hash, versions, resolved params) at ``<records>/split_digits/<scenario>/table/<label>_seed<seed>.json``, reused
while its method config (name + params) is unchanged and it ran on the current library; a record that is
replaced moves to ``table/superseded/`` and stays listed under the table. The table in
``benchmarks/results/tables/split_digits.md`` is generated from the records alone (``table_from_records``; also by
``python benchmarks/tables.py``, whose ``--check`` CI runs): the final average accuracy (mean ± sample std over
seeds), the paired difference to "none" on the same seeds, forgetting, the CPU time per run, and per row the
library versions and commits of its records.

``--validation F`` runs every row on the *validation stream* instead (``F`` of each task's training
data held out and evaluated on, the test set unused; ``stream.validation``): its records are stored under
``<records>/split_digits/<scenario>/table_validation<F>/`` and its table goes to
``benchmarks/results/tables/split_digits_validation.md``
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
import records as run_records  # noqa: E402
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
    # the library defaults (README quickstart form), chosen on validation (search_defaults_split_digits.md)
    Row("laplace (library defaults)", "laplace_defaults"),
    Row("vcl (library defaults: vogn + k-center coreset)", "vcl"),
    Row("vcl (vogn), no coreset", "vcl_no_coreset"),
    Row("vcl (bbb), no coreset", "vcl_bbb"),
    Row("vcl (vogn, α 0.05) + k-center coreset", "vcl_coreset"),
    Row("blr (diag, GGN; library defaults)", "blr"),
    # ablations of blr.yaml (the library defaults): VOGN's curvature, the plain precision
    # rate, no step clip, and the earlier VOGN recipe (EF, α 0.2, δ 1, ess 1, T 1, no debias, no clip)
    Row("blr, empirical Fisher ĥ", "blr", {"curvature": "empirical_fisher"}),
    Row("blr, no precision debias", "blr", {"precision_debias": False}),
    Row("blr, no step clip", "blr", {"clip_radius": None}),
    Row("blr, VOGN recipe (EF, α 0.2, T 1)", "blr",
        {"curvature": "empirical_fisher", "precision_debias": False, "lr": 0.2, "temperature": 1.0,
         "clip_radius": None, "ess_factor": 1.0, "prior_precision": 1.0, "init_precision": 400.0}),
    Row("ivon (library defaults: GGN carry)", "ivon"),
    Row("ivon, carried Price average (the earlier default)", "ivon", {"carry": "average", "temperature": 0.1}),
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


def runs_folder(records_dir: Path, validation: float = 0.0, scenario: str = "task") -> Path:
    """Where the records of one scenario are: ``<records>/split_digits/<scenario>/table[_validation<F>]``."""
    return Path(records_dir) / "split_digits" / scenario / ("table" + (f"_validation{validation:g}" if validation else ""))


def run_one(row: Row, scenario: str, seed: int, records_dir: Path, force: bool = False,
            validation: float = 0.0) -> dict[str, Any]:
    """Run (or reload) one (row, scenario, seed).

    Args:
        row: the table row.
        scenario: ``"task"`` or ``"class"``.
        seed: the run's seed.
        records_dir: the records root (``runs_folder``); a stored record is reused while its method config is
            the row's and it is current (``records.is_current``); otherwise it is moved to ``superseded/`` and
            the run is made again.
        force: rerun even if a current record with the same method config exists.
        validation: 0 evaluates on the test set; otherwise this fraction of each task's training data
            is held out and evaluated on (``stream.validation``).

    Returns:
        The record: ``StreamResult.to_dict()`` plus ``wall_s``, ``cpu_s``, ``label``, ``method_config``,
        ``validation``, ``resolved_params``, the provenance of ``records.run_provenance`` and ``records.TracedRun.fields``.
    """
    import dataclasses

    from continual_blr.methods import build_method

    mc = method_config(row, scenario)
    key = {"name": mc.name, "params": mc.params}
    folder = runs_folder(records_dir, validation, scenario)
    path = folder / f"{safe_label(row.label)}_seed{seed}.json"
    if path.is_file():
        rec = json.loads(path.read_text())
        if not force and rec.get("method_config") == key and rec.get("validation", 0.0) == validation \
                and run_records.currency(rec, folder.relative_to(records_dir).as_posix(), records_dir)[0]:
            return rec
        old = folder / "superseded" / f"{path.stem}__{(rec.get('library_hash') or 'unknown')[:8]}.json"
        old.parent.mkdir(parents=True, exist_ok=True)
        path.replace(old)
    run_records.process_library_hash()
    cfg = copy.deepcopy(_load(BASE_CONFIG))  # the shared model and budget
    cfg.stream.scenario = scenario
    cfg.stream.validation = validation
    cfg.seed = seed
    cfg.progress = False
    cfg.methods = [mc]
    resolved = getattr(build_method(mc.name, mc.params), "params", None)
    origin = run_records.run_provenance(cfg.device)
    traced = run_records.TracedRun(cfg)  # the code this run executes (records.currency)
    t0, c0 = time.perf_counter(), time.process_time()
    with traced:
        res = run_config(cfg, save=False, on_epoch=traced.on_epoch)[0]
    rec = res.to_dict() | {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                           **traced.fields(),
                           "threads": torch.get_num_threads(),
                           "label": row.label, "config": row.config, "method_config": key, "validation": validation,
                           "resolved_params": dataclasses.asdict(resolved) if dataclasses.is_dataclass(resolved)
                           else None} | origin
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(rec, indent=2))
    tmp.replace(path)
    return rec


def collect(records_dir: Path, validation: float = 0.0) -> tuple[Records, dict[tuple[str, str], list[dict]]]:
    """The stored records ``(label, scenario)`` → records (seeds ascending), and the superseded ones."""
    current: Records = {}
    superseded: dict[tuple[str, str], list[dict]] = {}
    labels = {safe_label(r.label): r.label for r in ROWS}
    for scen in SCENARIOS:
        folder = runs_folder(records_dir, validation, scen)
        for where, sub in ((current, folder), (superseded, folder / "superseded")):
            for p in sorted(sub.glob("*_seed*.json")):
                rec = json.loads(p.read_text())
                label = rec.get("label") or labels.get(p.stem.split("_seed")[0], p.stem)
                where.setdefault((label, scen), []).append(rec)
    for v in (*current.values(), *superseded.values()):
        v.sort(key=lambda r: (r["seed"], r.get("commit") or ""))
    return current, superseded


def table_path(results_dir: Path, validation: float = 0.0) -> Path:
    return Path(results_dir) / ("split_digits_validation.md" if validation else "split_digits.md")


def table_from_records(records_dir: Path, results_dir: Path, validation: float = 0.0) -> Path | None:
    """Write the table of the stored records (None: no records); the text depends on the records alone."""
    records, superseded = collect(records_dir, validation)
    if not records:
        return None
    seeds = sorted({r["seed"] for v in records.values() for r in v})
    text = report(records, seeds, validation=validation, superseded=superseded)
    out = table_path(results_dir, validation)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    return out


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
    cells = [strength.format_lam(strength.lam_equivalent(mc.name, mc.params, s))
             for s, mc in ((s, method_config(row, s)) for s in row.scenarios)]
    return " / ".join(dict.fromkeys(cells))


def _evaluations(superseded: dict[tuple[str, str], list[dict]], label: str) -> list[str]:
    """The earlier test evaluations of a row: its superseded records grouped by the library they ran on (one
    evaluation of all seeds and scenarios per library)."""
    return sorted({(r.get("library_hash") or "?")[:8] for scen in SCENARIOS for r in superseded.get((label, scen), [])})


def report(records: Records, seeds: list[int], validation: float = 0.0,
           superseded: dict[tuple[str, str], list[dict]] | None = None) -> str:
    """The markdown table and its notes, a function of the records alone.

    Args:
        records: ``(label, scenario)`` → the runs, one per seed.
        seeds: the seeds the records hold.
        validation: the held-out fraction the runs were evaluated on (0: the test set).
        superseded: ``(label, scenario)`` → earlier evaluations of the row that were replaced (listed).
    """
    base = _load(BASE_CONFIG)
    t = base.train
    clip = "no gradient clipping" if t.grad_clip is None else f"gradient norm clipped at {t.grad_clip:g}"
    rows = [r for r in ROWS if any((r.label, s) in records for s in SCENARIOS)]
    folder = "table" + (f"_validation{validation:g}" if validation else "")
    command = "python benchmarks/split_digits.py" + (f" --validation {validation:g}" if validation else "")
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
        f"Produced by (run records under `benchmarks/records/split_digits/<scenario>/{folder}/`, committed; the table "
        "is generated from them alone, also by `python benchmarks/tables.py`):",
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
        "| forgetting | CPU / run (s) | current | test evals | library | commits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    records_dir = run_records.RECORDS_DIR
    for row in rows:
        cells: list[str] = []
        cpu: list[float] = []
        mine: list[dict] = []
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
            mine += recs
        libs = ", ".join(sorted({(r.get("library_hash") or "?")[:8] for r in mine}))
        commits = ", ".join(sorted({(r.get("commit") or "?")[:8] + ("+dirty" if r.get("dirty") else "") for r in mine}))
        stale = sum(not run_records.currency(r, f"split_digits/{r['scenario']}/{folder}", records_dir)[0] for r in mine)
        current = "yes" if not stale else f"**stale** ({stale}/{len(mine)})"
        evals = "-" if validation else str(1 + len(_evaluations(superseded or {}, row.label)))
        lines.append(f"| {row.label} | {_config_cell(row)} | {_lam_cell(row)} | {' | '.join(cells)} "
                     f"| {statistics.fmean(cpu):.1f} | {current} | {evals} | {libs} | {commits} |")
    below = []
    for row in rows:
        for scen in SCENARIOS:
            none = {r["seed"]: r["avg_acc"] for r in records.get(("none", scen), [])}
            diffs = [r["avg_acc"] - none[r["seed"]] for r in records.get((row.label, scen), []) if r["seed"] in none]
            if row.label != "none" and diffs and statistics.fmean(diffs) <= 0:
                below.append(f"{row.label} ({scen}, Δ {_ms(diffs)})")
    lines += ["", "Rows not above none (mean paired Δ ≤ 0): " + ("; ".join(below) + "." if below else "none.")]
    n_runs = sum(len(v) for v in records.values())
    threads = sorted({r.get("threads", 1) for v in records.values() for r in v})
    lines += [
        "",
        f"{n_runs} runs, {'/'.join(map(str, threads))} torch thread(s) each, on a shared 2-core CPU; CPU / run is the "
        "process's own CPU time. library: the hash of `continual_blr/` a row's records ran on (`benchmarks/records.py`; "
        "a record is reused while its config and every library function it executed are unchanged); commits: the "
        "checkouts they ran in.",
        "",
        "How the params were chosen. l2, ewc, ewc (online), laplace (kron), laplace (diag): the strength (λ or the "
        "temperature T) per scenario on *validation* data — 0.1 of each task's training data held out, seeds 0-4, "
        "never the test set (`python benchmarks/search.py split_digits <config> --scenario <s> --grid ...`; grids, "
        "scores and choices in `benchmarks/results/search_split_digits_<config>[_class].md`); each has a class config "
        "because one head per task needs a plastic trunk and one 10-way head needs the old classes held hard. "
        "blr: the library defaults, chosen on validation runs (`benchmarks/results/search/search_blr.md`); the blr "
        "rows after the first are ablations of `blr.yaml`, not tuned on their own. The library-default rows of "
        "laplace, vcl and ivon: the defaults chosen on validation in the README quickstart's form "
        "(`benchmarks/results/search/search_defaults_split_digits.md`). The other vcl rows: see each YAML's first line. FROMP rows are not tuned (the reference code's values).",
        "",
        "λ-equiv.: the strength on EWC's scale (task / class where the two configs differ). EWC adds "
        "(λ/2) Σ_k F̄_k (θ − θ*_k)² to the mean loss, F̄_k the per-example-mean Fisher of past task k, so λ = N_k/N_t "
        "≈ 1 is the Bayesian weight of a past task; Laplace's and the BLR's temperature T divide the summed "
        "curvature N_k F̄_k, which is λ = 1/T for tasks of equal size (here 283-291 training images each); IVON's "
        "temperature maps the same way; VCL carries its posterior at T = 1; l2 and FROMP have no equivalent "
        "(`benchmarks/strength.py`, docs/benchmarks.md).",
        "",
        "Caveats: (1) Five seeds rank rows only where the paired Δ none is large against its spread; several "
        "task-scenario rows are within noise of each other. (2) vcl without a coreset does not beat none in "
        "the task scenario; with the paper's k-center coreset (the library default) it does in both. (3) A validation split of 0.1 is "
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
    old = {k: v for k, v in (superseded or {}).items() if v}
    lines += ["", "Superseded evaluations (records replaced by a rerun, kept under `superseded/`): "
              + ("none." if not old else "")]
    for (label, scen), recs in sorted(old.items()):
        accs = ", ".join(f"seed {r['seed']} {100 * r['avg_acc']:.1f} ({(r.get('library_hash') or '?')[:8]})" for r in recs)
        lines.append(f"- **{label}** ({scen}): {accs}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the selected rows × scenarios × seeds, print the table and (unless ``--no-write``) write it."""
    run_records.process_start()  # commit and dirty flag as they are when the command starts
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--methods", nargs="+", default=None,
                    help="rows to run: a row label, or else a config stem (its rows); default: every row")
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument("--records-dir", default=str(run_records.RECORDS_DIR),
                    help="records root (default benchmarks/records/, committed)")
    ap.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results" / "tables"),
                    help="where split_digits.md (split_digits_validation.md with --validation) is written")
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
    from continual_blr.runner import set_threads

    try:
        set_threads(args.threads)
    except ValueError as err:
        ap.error(str(err))
    for row in select_rows(args.methods):
        for scen in args.scenarios:
            if scen not in row.scenarios:
                continue
            for seed in args.seeds:
                rec = run_one(row, scen, seed, Path(args.records_dir), args.force, args.validation)
                print(f"{row.label:32s} {scen:5s} seed {seed}: {100 * rec['avg_acc']:5.1f}%  "
                      f"({rec['wall_s']:.1f} s wall, {rec.get('cpu_s', 0):.1f} s CPU)", flush=True)
    if args.no_write:
        records, superseded = collect(Path(args.records_dir), args.validation)
        print(report(records, sorted({r["seed"] for v in records.values() for r in v}), args.validation, superseded))
        return 0
    out = table_from_records(Path(args.records_dir), Path(args.results_dir), args.validation)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
