"""``python -m continual_blr ...``: the command line (``continual_blr.cli``), also under torchrun.

    torchrun --nproc-per-node 2 -m continual_blr run configs/split_mnist/fromp.yaml

With torchrun's variables set (``WORLD_SIZE`` > 1) the process joins the process group first
(:func:`continual_blr.distributed.init_from_env`: gloo on CPU, nccl on GPUs); every rank then runs the
same command data-parallel (``docs/distributed.md``) and only rank 0 writes outputs. An error on one
rank ends that rank with one line on stderr and exit status 1 (torchrun then stops the others).
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    """Join the torchrun process group (if any) and run the CLI; returns the exit status. In a multi-process run
    the process ends here with that status (``os._exit``, after the group is left and the streams are flushed)."""
    if os.environ.get("WORLD_SIZE", "1") == "1":  # no launcher: torch is imported only by commands that need it
        from .cli import main as cli_main

        return cli_main(argv)
    from . import distributed

    try:
        distributed.init_from_env()
    except (ValueError, RuntimeError) as err:
        print(f"continual-blr: error: {str(err).splitlines()[0] if str(err) else type(err).__name__}",
              file=sys.stderr)
        return 2
    from .cli import main as cli_main

    with distributed.fail_fast():
        status = cli_main(argv)
    if status != 0 and distributed.is_distributed():  # the CLI reported its one line; do not wait for peers
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    distributed.shutdown()
    # every output is written (atomically) and the group is left: end here rather than in the interpreter's
    # teardown, where gloo's background threads could still abort the process (exit -6) after a successful run
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
