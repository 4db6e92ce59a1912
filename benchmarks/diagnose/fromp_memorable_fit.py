"""Does FROMP's penalty hold a past task's function only at its memorable points? Read from a finished run folder.

Run:

    python benchmarks/diagnose/fromp_memorable_fit.py RUN_DIR --data-dir $CONTINUAL_BLR_DATA

``RUN_DIR`` is the FROMP method's run folder of a run made with ``--work-dir`` (it holds ``tasks/after_task<k>.pt``,
the boundary checkpoints). With the run's own config (from ``results.json`` beside it) the stream is rebuilt, with
its validation hold-out if the run had one, and for every boundary k and every earlier task s < k it compares, on
task s's head (and task s's BatchNorm statistics under ``train.batchnorm: per_task``, read from the checkpoint):

* the network after task k with the network after task s (its own boundary checkpoint): the root-mean-square change
  of the centred logits f̃ = f − mean f, at task s's **memorable points** (those FROMP stored) and at its
  **held-out points** (the run's evaluation set: the validation hold-out, or the test set);
* the accuracy at the memorable points (their labels) and at the held-out points.

A penalty that protects the task moves both little; a penalty the network satisfies at the memorable points alone
keeps their change small while the held-out change (and accuracy) goes its own way. Everything runs in fp32, in
eval mode. Markdown on stdout; nothing is written.

A run without memorable points (EWC, none) is compared at another FROMP run's points: ``--points-from FROMP_RUN_DIR``
reads them from that run's last boundary checkpoint (same stream and seed, so the same points of each task).
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from continual_blr.config import RunConfig, from_dict  # noqa: E402
from continual_blr.memory import NormStatistics  # noqa: E402
from continual_blr.models import build_model  # noqa: E402
from continual_blr.runner import build_stream  # noqa: E402


def _centred(f: torch.Tensor) -> torch.Tensor:
    return f - f.mean(-1, keepdim=True)


@torch.no_grad()
def _outputs(model, norm: NormStatistics | None, task_id: int, x: torch.Tensor, head: int,
             batch: int = 500) -> torch.Tensor:
    model.eval()
    ctx = norm.use(model, task_id) if norm is not None else nullcontext()
    with ctx:
        return torch.cat([model(x[i:i + batch], head=head) for i in range(0, x.shape[0], batch)]).float()


def _load(run: Path, k: int, config: RunConfig, stream):
    ck = torch.load(run / "tasks" / f"after_task{k}.pt", map_location="cpu", weights_only=False)
    model = build_model(config.model.arch, stream.input_shape, stream.n_outputs, stream.n_heads,
                        hidden=tuple(config.model.hidden))
    model.load_state_dict(ck["model"])
    norm = None
    stats = ck["progress"].get("norm_statistics") if isinstance(ck.get("progress"), dict) else None
    if stats:
        norm = NormStatistics()
        norm.load_state_dict(stats)
    return model, norm, ck


def _entries(ck: dict, run: Path) -> list[dict]:
    reg = (ck.get("method") or {}).get("regularizer") or {}
    if "memory" not in reg:
        raise SystemExit(f"error: {run}: its checkpoints hold no memorable points; give --points-from FROMP_RUN_DIR")
    return reg["memory"]["entries"]


def summarise(run: Path, data_dir: str | None, points_from: Path | None = None) -> str:
    """The markdown table for one run folder (module docstring); memorable points from ``points_from``'s last
    boundary checkpoint when given."""
    payload = json.loads((run.parent / "results.json").read_text())
    raw = dict(payload["config"])
    if data_dir is not None:
        raw["stream"] = dict(raw["stream"], data_dir=data_dir)
    config = from_dict(RunConfig, raw)
    stream = build_stream(config)
    tasks = list(stream)
    ks = sorted(int(p.stem.removeprefix("after_task")) for p in (run / "tasks").glob("after_task*.pt"))
    nets = {k: _load(run, k, config, stream) for k in ks}
    fixed = None
    if points_from is not None:
        other = json.loads((points_from.parent / "results.json").read_text())["config"]
        same = lambda c: (c.get("seed"), {k: v for k, v in c["stream"].items() if k != "data_dir"})  # noqa: E731
        if same(other) != same(payload["config"]):
            raise SystemExit(f"error: --points-from {points_from}: another stream or seed than {run} "
                             f"({same(other)} against {same(payload['config'])}); its points would be other images")
        last = max(points_from.glob("tasks/after_task*.pt"), key=lambda p: int(p.stem.removeprefix("after_task")))
        fixed = _entries(torch.load(last, map_location="cpu", weights_only=False), points_from)
    lines = [f"**{run}**" + (f" (memorable points of {points_from})" if fixed is not None else ""), "",
             "| after task | task | memorable: RMS Δf̃ since its end | held-out: RMS Δf̃ | memorable acc (%) | "
             "held-out acc (%) |", "|---|---|---|---|---|---|"]
    for k in ks:
        model, norm, ck = nets[k]
        entries = fixed if fixed is not None else _entries(ck, run)
        for s in range(k):
            if s not in nets:
                continue
            e = next((e for e in entries if int(e["task_id"]) == tasks[s].task_id), None)
            if e is None:
                continue
            t = tasks[s]
            old_model, old_norm, _ = nets[s]
            xm, ym, head = e["x"].float(), e["y"], int(e["head"])
            xh, yh = t.x_test.float(), t.y_test
            fm, fm0 = _outputs(model, norm, t.task_id, xm, head), _outputs(old_model, old_norm, t.task_id, xm, head)
            fh, fh0 = _outputs(model, norm, t.task_id, xh, head), _outputs(old_model, old_norm, t.task_id, xh, head)
            rms = lambda a, b: float((_centred(a) - _centred(b)).pow(2).sum(-1).mean().sqrt())  # noqa: E731
            acc = lambda f, y: 100.0 * float((f.argmax(-1) == y.to(f.device)).float().mean())  # noqa: E731
            lines.append(f"| {k + 1} | {s + 1} | {rms(fm, fm0):.2f} | {rms(fh, fh0):.2f} | {acc(fm, ym):.1f} | "
                         f"{acc(fh, yh):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="FROMP run folders holding tasks/after_task<k>.pt")
    ap.add_argument("--data-dir", default=None, help="the data root (default: the run config's)")
    ap.add_argument("--points-from", type=Path, default=None,
                    help="a FROMP run folder whose memorable points to use (for runs without any: EWC, none)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    for run in args.runs:
        if not (run / "tasks").is_dir() or not (run.parent / "results.json").is_file():
            print(f"error: {run}: no tasks/ boundary checkpoints or no results.json beside it (give the method's "
                  "folder of a run made with --work-dir)", file=sys.stderr)
            return 2
        print(summarise(run, args.data_dir, args.points_from))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
