"""Forgetting, predicted, and generalisation from training data alone: none, EWC, FROMP and BLR on split MNIST and
split digits (issue 40, parts 2 and 3).

Run (CPU, 1 torch thread, one process at a time; run folders go OUTSIDE the work tree):

    CONTINUAL_BLR_DATA=/path/to/data python benchmarks/forgetting.py --runs /tmp/forgetting_runs
    python benchmarks/forgetting.py --streams split_digits --seeds-digits 0 --no-write   # a quick look
    python benchmarks/forgetting.py --log-loo-cost --runs /tmp/forgetting_runs  # the cost of run --log-loo (MNIST FROMP)
    python benchmarks/forgetting.py --table           # rebuild the table from the committed records only

For every (stream, method, seed) it runs ``continual-blr run configs/<stream>/<method>.yaml --seed S --threads 1``
into ``<runs>/<stream>/<method>-seed<S>/`` (a finished folder with its task boundaries is reused), then, on the run
folder alone:

* ``continual_blr.inspect.score_forgetting``: every training example of tasks 1..T−1 scored at its own task's end
  (the run's ``<method>/tasks/after_task<t>.pt``, Σ of that boundary) and at the stream's end; Spearman's ρ of each
  score (relevance tr Λ, variance tr V, sensitivity ‖V e‖₁, in the memory, the task-end loss) with the loss increase,
  and its AUROC for "forgotten" (correct at its task's end, wrong at the stream's);
* the leave-one-out estimate of each task's test NLL / accuracy from its training data, at its task's end and at the
  stream's end (Σ of the final run), beside the measured ones (``continual_blr.inspect.generalisation``).

One JSON record per (stream, method, seed) goes to ``benchmarks/records/forgetting/<stream>/<method>-seed<S>.json``
(the run command, the run's and the analysis's commit and library hash, the config, costs, the tables); the table
``benchmarks/results/tables/forgetting_prediction.md`` is generated from the records alone (``--table``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts (benchmarks/ is not a package)
import records as run_records  # noqa: E402

RECORDS = ROOT / "benchmarks" / "records" / "forgetting"
TABLE = ROOT / "benchmarks" / "results" / "tables" / "forgetting_prediction.md"
STREAMS = ("split_mnist", "split_digits")
METHODS = ("none", "ewc", "fromp", "blr")
PREDICTORS = ("relevance", "variance", "sensitivity", "memory", "loss")
LABELS = {"relevance": "tr Λ", "variance": "tr V", "sensitivity": "‖Ve‖₁", "memory": "memory", "loss": "loss"}
METHOD_LABELS = {"none": "none", "ewc": "EWC", "fromp": "FROMP", "blr": "BLR"}


def _folder(runs: Path, stream: str, method: str, seed: int, suffix: str = "") -> Path:
    return runs / stream / f"{method}-seed{seed}{suffix}"


def _complete(folder: Path, method: str) -> bool:
    return (folder / method / "model.pt").is_file() and (folder / method / "tasks" / "after_task0.pt").is_file()


def run_one(stream: str, method: str, seed: int, folder: Path, threads: int, extra: list[str] | None = None) -> dict:
    """Run the config into ``folder`` (a subprocess, so its cost is its own); the run's provenance and cost go to
    ``folder/provenance.json`` and are returned. A complete folder with that file is reused."""
    prov = folder / "provenance.json"
    if _complete(folder, method) and prov.is_file():
        return json.loads(prov.read_text())
    cmd = ["continual-blr", "run", f"configs/{stream}/{method}.yaml", "--out", str(folder), "--seed", str(seed),
           "--threads", str(threads), "--no-progress", "--overwrite", *(extra or [])]
    start = run_records.process_start()
    prov_start = run_records.provenance() | {"library_hash": run_records.library_hash()}  # the tree the run imports
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    print(f"forgetting: {' '.join(cmd)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env=os.environ | {"OMP_NUM_THREADS": str(threads)})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    info = {"command": " ".join(cmd), "wall_s": wall,
            "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "start": start, "provenance": prov_start}
    prov.write_text(json.dumps(info, indent=2))
    return info


def analyse(folder: Path, method: str) -> dict[str, Any]:
    """The forgetting table and the generalisation rows of one run folder (module docstring)."""
    import torch

    from continual_blr.inspect import generalisation, run_covariance, score_examples, score_forgetting
    from continual_blr.saved_run import load_run

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    run = load_run(folder, method, data=True)
    t_load = time.perf_counter() - t0
    a = score_forgetting(run)
    table = a.table()
    t1 = time.perf_counter()
    sigma, source = run_covariance(run)
    final = []
    for task in run.stream.tasks:
        s = score_examples(run.model, task.x_train, task.y_train, sigma, head=task.head, task_id=task.task_id)
        final.append(generalisation(run.model, task, s).to_dict())
    t_final = time.perf_counter() - t1
    return {
        "forgetting": table,
        "generalisation": {"at_task_end": [g.to_dict() for g in a.at_task_end], "at_stream_end": final,
                           "sigma_task_end": a.sigma_sources, "sigma_stream_end": source},
        "acc_matrix": run.result.get("acc_matrix"),
        "avg_acc": run.result.get("avg_acc"),
        "forgetting_metric": run.result.get("forgetting"),
        "config": run.payload.get("config"),
        "analysis_s": {"load": t_load, **a.timings, "stream_end_generalisation": t_final},
    }


def _clean(x: Any) -> Any:
    """NaN → None for JSON."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def record(stream: str, method: str, seed: int, folder: Path, run_info: dict, result: dict, argv: list[str],
           analysis_provenance: dict) -> Path:
    rec = {"benchmark": "forgetting", "stream": stream, "method": method, "seed": seed,
           "config_file": f"configs/{stream}/{method}.yaml", "run_folder": str(folder),
           "run": run_info, "analysis": {"command": "python benchmarks/forgetting.py " + " ".join(argv),
                                         "provenance": analysis_provenance, "date": run_records.now_utc()},
           **result}
    path = RECORDS / stream / f"{method}-seed{seed}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(rec), indent=1) + "\n")
    return path


# ------------------------------------------------------------------------------------------------ the table


def _load_records() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(RECORDS.glob("*/*-seed*.json"))]


def _ms(values: list[float | None], digits: int = 2) -> str:
    """mean ± sample std of the defined values; "(k of n)" when only k of the n seeds define one (e.g. an AUROC
    with no forgotten example)."""
    v = [x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not v:
        return "–"
    part = f" ({len(v)} of {len(values)})" if len(v) < len(values) else ""
    if len(v) == 1:
        return f"{v[0]:.{digits}f}{part}"
    return f"{statistics.mean(v):.{digits}f} ± {statistics.stdev(v):.{digits}f}{part}"


def table_from_records() -> str:
    recs = _load_records()
    lines = ["# Forgetting, predicted: does an example's score at its task's end predict its forgetting?", "",
             "<!-- generated by benchmarks/forgetting.py --table from benchmarks/records/forgetting/; do not edit -->",
             "",
             "Task-incremental split MNIST and split digits (the library configs `configs/<stream>/<method>.yaml`), "
             "CPU, 1 thread. Every training example of tasks 1–4 is scored at its own task's end (the run's task "
             "boundary: the network then, Σ of that boundary — FROMP's and the BLR's own, for none and EWC a "
             "diagonal Laplace–GGN over tasks 1..t with δ = 1e-3) and at the stream's end. ρ: Spearman's rank "
             "correlation of the score with the loss increase −log p_y(stream's end) − (−log p_y(task's end)), "
             "over all examples. AUROC: for 'forgotten' (correct at its task's end, wrong at the stream's), among "
             "the examples correct at their task's end; 0.5 is chance, a constant score (no memory) exactly 0.5. "
             "mean ± sample std over seeds; '(k of n)': only k seeds forgot anything. For binary heads tr Λ = "
             "2p(1 − p) and the loss −log p rank the examples correct at their task's end identically (same AUROC). "
             "Scores: tr Λ relevance Σ p(1 − p); tr V = "
             "tr J Σ Jᵀ; ‖Ve‖₁ the leave-one-out sensitivity (Nickl et al. 2023); memory: stored by the method "
             "as the next task starts; loss: −log p_y at the task's end (a baseline).", ""]
    for stream in STREAMS:
        rows = [r for r in recs if r["stream"] == stream]
        if not rows:
            continue
        lines += [f"## {stream.replace('_', ' ')}", "",
                  "| method | seeds | final avg acc % | forgotten / correct at task end, per seed | "
                  + " | ".join(f"ρ {LABELS[z]}" for z in PREDICTORS) + " | "
                  + " | ".join(f"AUROC {LABELS[z]}" for z in PREDICTORS) + " |",
                  "|---|---|---|---|" + "---|" * (2 * len(PREDICTORS))]
        for m in METHODS:
            rs = [r for r in rows if r["method"] == m]
            if not rs:
                continue
            f = [r["forgetting"] for r in rs]
            forg = ", ".join(f"{x['n_forgotten']} / {x['n_correct_task_end']}" for x in f)
            stores = any(x["predictors"]["memory"]["auroc"] not in (None, 0.5) or x["predictors"]["memory"]["spearman"]
                         is not None for x in f)

            def cell(z: str, key: str, digits: int) -> str:
                if z == "memory" and not stores:
                    return "no memory"
                return _ms([x["predictors"][z][key] for x in f], digits)

            cells = [METHOD_LABELS[m], ",".join(str(r["seed"]) for r in rs),
                     _ms([100 * r["avg_acc"] for r in rs]), forg]
            cells += [cell(z, "spearman", 2) for z in PREDICTORS]
            cells += [cell(z, "auroc", 3) for z in PREDICTORS]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", f"Within tasks ({stream.replace('_', ' ')}): the per-task AUROCs averaged with weights the tasks' "
                  "forgotten counts (`continual_blr.inspect.forgetting.within_task_auroc`, from the records' per-task "
                  "values); the pooled AUROC above also rewards a score for telling the tasks apart.", "",
                  "| method | " + " | ".join(f"AUROC within {LABELS[z]}" for z in PREDICTORS if z != "memory")
                  + " | AUROC within memory |", "|---|" + "---|" * len(PREDICTORS)]
        from continual_blr.inspect.forgetting import within_task_auroc

        for m in METHODS:
            rs = [r for r in rows if r["method"] == m]
            if not rs:
                continue
            cells = [METHOD_LABELS[m]]
            for z in [p for p in PREDICTORS if p != "memory"] + ["memory"]:
                if z == "memory" and m != "fromp":
                    cells.append("no memory")
                    continue
                cells.append(_ms([within_task_auroc(r["forgetting"]["per_task"], z) for r in rs], 3))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Generalisation from training data alone: the leave-one-out estimate of each task's test NLL", "",
              "LOO NLL = mean over the task's training examples of −log softmax(f_i + V_i e_i)_{y_i} (no test data), "
              "beside the network's measured softmax NLL on the task's test set; gap = LOO − test. At its task's end "
              "(the task-boundary network and Σ) and at the stream's end (the final network and the run's Σ). "
              "Seed 0.", ""]
    for stream in STREAMS:
        for m in METHODS:
            r = next((r for r in recs if r["stream"] == stream and r["method"] == m and r["seed"] == 0), None)
            if r is None:
                continue
            g = r["generalisation"]
            lines += [f"### {stream.replace('_', ' ')}, {METHOD_LABELS[m]} (seed 0)", "",
                      f"Σ at the stream's end: {g['sigma_stream_end']}.", "",
                      "| task | train NLL (task end) | LOO NLL (task end) | test NLL (task end) | gap | LOO acc | test acc "
                      "| train NLL (stream end) | LOO NLL (stream end) | test NLL (stream end) | gap | LOO acc | test acc |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for te, se in zip(g["at_task_end"], g["at_stream_end"]):
                def six(x):
                    return [f"{x['train_nll']:.4g}", f"{x['loo_nll']:.4g}", f"{x['test_nll']:.4g}",
                            f"{x['nll_gap']:+.4g}", f"{x['loo_acc']:.4f}", f"{x['test_acc']:.4f}"]
                lines.append("| " + " | ".join([str(te["task_id"] + 1), *six(te), *six(se)]) + " |")
            lines.append("")
    cost = RECORDS / "log_loo_cost.json"
    if cost.is_file():
        c = json.loads(cost.read_text())
        lines += ["## The cost of `continual-blr run --log-loo`", "",
                  f"`{c['config_file']}`, seed {c['seed']}, 1 thread, the two runs back to back: without "
                  f"{c['plain']['wall_s']:.1f} s wall ({c['plain']['cpu_s']:.1f} s CPU), with `--log-loo` "
                  f"{c['log_loo']['wall_s']:.1f} s wall ({c['log_loo']['cpu_s']:.1f} s CPU); the log's own "
                  f"`seconds` column sums to {c['logged_seconds']:.1f} s over the {c['task_ends']} task ends. "
                  f"Same accuracy matrix: {c['same_acc_matrix']}.", ""]
    def prov(p: dict) -> str:
        return f"{(p['commit'] or '?')[:9]}{' (dirty)' if p.get('dirty') else ''} / library {p['library_hash']}"

    run_p = sorted({prov(r["run"]["provenance"]) for r in recs})
    ana_p = sorted({prov(r["analysis"]["provenance"]) for r in recs})
    lines += [f"Records: {len(recs)}. Runs made at {'; '.join(run_p)}. Analysed at {'; '.join(ana_p)} "
              "('dirty': tracked files under continual_blr/, configs/ or benchmarks/ differed from the commit — "
              "others' edits in a shared tree).", ""]
    return "\n".join(lines)


def log_loo_cost(runs: Path, threads: int, argv: list[str]) -> Path:
    """Split MNIST FROMP seed 0 run twice back to back, without and with ``--log-loo``."""
    import csv

    out = {}
    for key, extra in (("plain", []), ("log_loo", ["--log-loo"])):
        folder = _folder(runs, "split_mnist", "fromp", 0, f"-cost-{key}")
        if (folder / "provenance.json").is_file():
            (folder / "provenance.json").unlink()  # measure again: the two must run back to back
        out[key] = run_one("split_mnist", "fromp", 0, folder, threads, extra)
        out[key]["folder"] = str(folder)
    with (Path(out["log_loo"]["folder"]) / "fromp" / "generalisation.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    seconds = {int(r["after_task"]): float(r["seconds"]) for r in rows}
    mats = [json.loads((Path(out[k]["folder"]) / "results.json").read_text())["results"][0]["acc_matrix"]
            for k in ("plain", "log_loo")]
    rec = {"benchmark": "forgetting/log_loo_cost", "config_file": "configs/split_mnist/fromp.yaml", "seed": 0,
           "command": "python benchmarks/forgetting.py " + " ".join(argv), **out,
           "logged_seconds": sum(seconds.values()), "task_ends": len(seconds),
           "same_acc_matrix": mats[0] == mats[1], "generalisation_log": rows}
    path = RECORDS / "log_loo_cost.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, default=Path("/tmp/forgetting_runs"), help="run folders (outside the tree)")
    ap.add_argument("--streams", nargs="+", default=list(STREAMS), choices=STREAMS)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--seeds-mnist", nargs="+", type=int, default=[0])
    ap.add_argument("--seeds-digits", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--table", action="store_true", help="only rebuild the table from the records")
    ap.add_argument("--log-loo-cost", action="store_true", help="only measure the cost of run --log-loo")
    ap.add_argument("--no-write", action="store_true", help="print, write no record and no table")
    args = ap.parse_args(argv)
    if args.table:
        TABLE.write_text(table_from_records())
        print(f"wrote {TABLE}")
        return 0
    if args.log_loo_cost:
        print(f"wrote {log_loo_cost(args.runs, args.threads, argv)}")
        return 0
    analysis_provenance = run_records.provenance()  # the library this process analyses with, imported now
    import continual_blr.inspect  # noqa: F401
    import continual_blr.saved_run  # noqa: F401
    for stream in args.streams:
        seeds = args.seeds_mnist if stream == "split_mnist" else args.seeds_digits
        for seed in seeds:
            for method in args.methods:
                folder = _folder(args.runs, stream, method, seed)
                info = run_one(stream, method, seed, folder, args.threads)
                res = analyse(folder, method)
                t = res["forgetting"]
                print(f"{stream} {method} seed {seed}: forgotten {t['n_forgotten']}/{t['n_correct_task_end']}; "
                      + ", ".join(f"{z} ρ {t['predictors'][z]['spearman']:.3f} AUROC {t['predictors'][z]['auroc']:.3f}"
                                  for z in PREDICTORS), flush=True)
                if not args.no_write:
                    print(f"  wrote {record(stream, method, seed, folder, info, res, argv, analysis_provenance)}",
                          flush=True)
    if not args.no_write:
        TABLE.write_text(table_from_records())
        print(f"wrote {TABLE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
