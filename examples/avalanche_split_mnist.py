"""Split MNIST (or permuted MNIST) with Avalanche's Naive strategy and a continual_blr method as a plugin.

    python examples/avalanche_split_mnist.py --data-dir ~/data --method fromp
    python examples/avalanche_split_mnist.py --data-dir ~/data --method ewc --params '{"lam": 100}'
    python examples/avalanche_split_mnist.py --data-dir ~/data --method blr --benchmark permuted

``--data-dir`` is the folder holding ``MNIST/raw/`` (torchvision's layout); without it Avalanche
downloads MNIST to ``~/.avalanche/data/mnist``. The defaults are FROMP's split-MNIST protocol
(784-256-256 MLP with one 2-way head per task, Adam 1e-4, batch 128, 15 epochs, gradient-norm clip 1.0 — the
reference's 0.1 on (1/τ)·gradient, in our units of the gradient of CE + (τ/2)·regulariser —
τ = 10, 40 memorable points per task; docs/avalanche.md). Everything Avalanche-specific is plain
Avalanche; the only continual_blr line that matters is the plugin.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore", message=".*QP solver.*")  # Avalanche's import-time notice

from avalanche.benchmarks.classic import PermutedMNIST, SplitMNIST  # noqa: E402
from avalanche.evaluation.metrics import accuracy_metrics, forgetting_metrics  # noqa: E402
from avalanche.logging import CSVLogger, InteractiveLogger, TextLogger  # noqa: E402
from avalanche.training import Naive  # noqa: E402
from avalanche.training.plugins import EvaluationPlugin  # noqa: E402

from continual_blr.integrations.avalanche import MethodPlugin, TaskLabelModel, accuracy_matrix  # noqa: E402
from continual_blr.models import MLP  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=None, help="folder with MNIST/raw/ (default: Avalanche downloads MNIST)")
    p.add_argument("--benchmark", choices=("split", "permuted"), default="split")
    p.add_argument("--n-experiences", type=int, default=None, help="default: 5 (split), 10 (permuted)")
    p.add_argument("--method", default="fromp", help="a name from continual_blr.methods.METHODS")
    p.add_argument("--params", default="{}", help="the method's parameters as JSON")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--grad-clip", type=float, default=1.0,
                   help="gradient-norm clip of CE + (tau/2) reg (the reference's 0.1 on its (1/tau)-scaled gradient)")
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 256])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--log-dir", default=None, help="also write Avalanche's text and CSV logs here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[list[float]]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)  # Avalanche's data loaders shuffle with the global RNG

    # 1. An Avalanche benchmark. transform=None keeps pixels / 255 (FROMP's preprocessing).
    if args.benchmark == "split":
        benchmark = SplitMNIST(args.n_experiences or 5, return_task_id=True, class_ids_from_zero_in_each_exp=True,
                               seed=args.seed, dataset_root=args.data_dir, train_transform=None, eval_transform=None)
        n_outputs, n_heads = 2, len(benchmark.train_stream)
    else:
        benchmark = PermutedMNIST(args.n_experiences or 10, seed=args.seed, dataset_root=args.data_dir,
                                  train_transform=None, eval_transform=None)
        n_outputs, n_heads = 10, 1

    # 2. A network. TaskLabelModel lets Avalanche pass task labels to our multi-head MLP; any Avalanche
    #    model works as well (e.g. avalanche.models.MTSimpleMLP(), which grows a head per task).
    model = TaskLabelModel(MLP(28 * 28, tuple(args.hidden), n_outputs, n_heads))

    # 3. The continual_blr method as a plugin: the library's own regulariser / posterior / optimiser.
    plugin = MethodPlugin(args.method, json.loads(args.params), seed=args.seed, grad_clip=args.grad_clip)

    loggers, log_file = [InteractiveLogger()], None
    if args.log_dir is not None:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        log_file = open(Path(args.log_dir) / "log.txt", "w")
        loggers += [TextLogger(log_file), CSVLogger(log_folder=args.log_dir)]
    evaluator = EvaluationPlugin(
        accuracy_metrics(experience=True, stream=True),
        forgetting_metrics(experience=True, stream=True),
        loggers=loggers,
    )
    strategy = Naive(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=args.lr),
        train_mb_size=args.batch_size,
        train_epochs=args.epochs,
        eval_mb_size=1024,
        device=args.device,
        plugins=[plugin],
        evaluator=evaluator,
    )

    # 4. The usual Avalanche loop: train on each experience, evaluate on every experience seen so far.
    results = []
    try:
        for i, experience in enumerate(benchmark.train_stream):
            strategy.train(experience)
            results.append(strategy.eval(benchmark.test_stream[: i + 1]))
    finally:
        for logger in loggers:
            if hasattr(logger, "close"):
                logger.close()
        if log_file is not None:
            log_file.close()

    acc = accuracy_matrix(results)
    final = acc[-1]
    print("accuracy matrix R[i][j] (after experience i, on experience j):")
    for row in acc:
        print("  " + " ".join("  -  " if v != v else f"{v:.3f}" for v in row))
    print(f"{args.method}: final average accuracy {sum(final) / len(final):.4f}")
    return acc


if __name__ == "__main__":
    main()
