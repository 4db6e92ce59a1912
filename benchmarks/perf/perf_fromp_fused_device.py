"""FROMP's training step at the last task with the separate passes or one fused pass, on CifarNet or the reduced
ResNet-18, on the CPU or a GPU: is ``fused_forward`` worth it where the step is launch-bound?

Run (the first lines on a lent GPU, ``benchmarks/device/gpu_check.sh``; the last on the CPU):

    python benchmarks/perf/perf_fromp_fused_device.py --device cuda --arch cifarnet --out $OUT/perf_fromp_fused_cuda_cifarnet.md
    python benchmarks/perf/perf_fromp_fused_device.py --device cuda --arch reduced_resnet18 --out $OUT/perf_fromp_fused_cuda_resnet.md
    python benchmarks/perf/perf_fromp_fused_device.py --device cpu --precision bf16 --steps 3 --no-write

Setting (as ``perf_fromp_bf16.py``'s cost part, whose helpers it uses): five 2-way heads, batch 256, four past tasks
of 200 memorable points each (FROMP's split-CIFAR protocol at task 5; random images: speed does not depend on the
data), one ``loop.train_step`` with Adam of ``none``, of ``fromp`` (the published config: the separate passes, one
for the minibatch and one per past head) and of ``fromp`` with ``fused_forward`` (one pass over the minibatch and every
memorable point: dropout and BatchNorm run their train forward on the minibatch's rows and their eval forward on the
rest, ``continual_blr.memory.eval_rows_after``). Under ``--precision bf16`` both FROMP steps take
``forward_precision: train`` (the fused pass needs it). The settings are interleaved round by round; on CUDA every
timed step ends with ``torch.cuda.synchronize()`` and the wall time is reported (the CPU time of a GPU step is the
host's launch work), on the CPU the process's CPU time. On the AMX Xeon the fused pass was slower for CifarNet
(``benchmarks/results/perf/perf_fromp_bf16_xeon_amx_fused.md``); on a GPU it is unmeasured.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts (benchmarks/ is not a package)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from perf_fromp_bf16 import BATCH, FROMP, PAST, POINTS, SHAPE, _random_task  # noqa: E402
from perf_train import device_name  # noqa: E402

from continual_blr.data.stream import TaskStream  # noqa: E402
from continual_blr.loop import train_step  # noqa: E402
from continual_blr.methods import build_method  # noqa: E402
from continual_blr.methods.base import TrainConfig  # noqa: E402
from continual_blr.mixed_precision import to_channels_last  # noqa: E402
from continual_blr.models import build_model  # noqa: E402
from continual_blr.types import Batch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def step_times(arch: str, device: str, precision: str, steps: int, warmup: int) -> dict[str, float]:
    """Median seconds of one step per setting (wall time on CUDA, CPU time on the CPU)."""
    cuda = device.startswith("cuda")
    g = torch.Generator().manual_seed(0)
    tasks = [_random_task(i, POINTS + 56, g).to(device) for i in range(PAST + 1)]
    stream = TaskStream("perf", tasks, "task", SHAPE, 2, PAST + 1)
    train = TrainConfig(batch_size=BATCH, lr=1e-3, grad_clip=1000.0, precision=precision)
    model = build_model(arch, SHAPE, 2, PAST + 1, generator=torch.Generator().manual_seed(0)).to(device)
    if train.use_channels_last:
        to_channels_last(model)
    extra = {"forward_precision": "train"} if precision == "bf16" else {}
    methods = {"none": build_method("none"),
               "fromp (separate passes)": build_method("fromp", FROMP | extra, seed=0),
               "fromp (fused_forward)": build_method("fromp", FROMP | extra | {"fused_forward": True}, seed=0)}
    for name, m in methods.items():
        m.setup(model, stream, train)
        if name != "none":
            for t in tasks[:PAST]:
                m.on_task_end(model, t)
        m.on_task_start(model, tasks[PAST])
    x = torch.rand(BATCH, *SHAPE, generator=g).to(device)
    batch = Batch(x, torch.randint(0, 2, (BATCH,), generator=g).to(device), PAST)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    clock = time.perf_counter if cuda else time.process_time
    times: dict[str, list[float]] = {k: [] for k in methods}
    for r in range(warmup + steps):
        for k, m in methods.items():
            if cuda:
                torch.cuda.synchronize()
            c0 = clock()
            train_step(model, m, opt, batch, tasks[PAST], train)
            if cuda:
                torch.cuda.synchronize()
            if r >= warmup:
                times[k].append(clock() - c0)
    return {k: statistics.median(v) for k, v in times.items()}


def report(res: dict[str, float], args: argparse.Namespace, command: str) -> str:
    plain = res["none"]
    clock = "wall time, each step synchronised" if args.device.startswith("cuda") else "CPU time"
    lines = [f"# FROMP's step at task 5, separate passes or one fused pass: {args.arch}, {args.precision}, "
             f"{device_name(args.device)}", "", "Produced by:", "", "```", command, "```", "",
             f"torch {torch.__version__}; {torch.get_num_threads()} torch thread(s); medians of {args.steps} steps "
             f"after {args.warmup} warm-up rounds, the settings interleaved, by {clock}. Batch {BATCH}, {PAST} past "
             f"tasks × {POINTS} memorable points.", "",
             "| step | ms | × none |", "|---|---|---|"]
    lines += [f"| {k} | {1e3 * v:.1f} | {v / plain:.2f} |" for k, v in res.items()]
    sep, fused = res["fromp (separate passes)"], res["fromp (fused_forward)"]
    lines += ["", f"The fused pass costs {fused / sep:.2f} × the separate passes' step "
              + ("(faster)." if fused < sep else "(not faster).")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    ap.add_argument("--arch", default="cifarnet", choices=["cifarnet", "reduced_resnet18"])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per setting (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", default=None, help="the report's path (default benchmarks/results/perf/"
                    "perf_fromp_fused_<device>_<arch>.md)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.threads < 1:
        ap.error("--steps and --threads must be >= 1, --warmup >= 0")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device here; allowed: cpu")
    torch.set_num_threads(args.threads)
    res = step_times(args.arch, args.device, args.precision, args.steps, args.warmup)
    command = "python " + " ".join(shlex.quote(a) for a in ["benchmarks/perf/perf_fromp_fused_device.py",
                                                             *(sys.argv[1:] if argv is None else argv)])
    text = report(res, args, command)
    print(text)
    if not args.no_write:
        kind = "cuda" if args.device.startswith("cuda") else "cpu"
        path = Path(args.out or ROOT / "benchmarks" / "results" / "perf" / f"perf_fromp_fused_{kind}_{args.arch}.md")
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
