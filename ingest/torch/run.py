"""`python -m ingest.torch.run [-m MODULE | SCRIPT] ARGS…`: run a training script traced.

Made for torchrun, which runs a module in every worker with ``-m``::

    torchrun --nproc-per-node 4 -m ingest.torch.run train.py --epochs 3

Tracing is enabled before the script runs (`ingest.torch.enable()`, configured by the
RANKWATCH_* variables of `ingest.torch.session`); the script then runs as ``__main__`` with
``sys.argv`` as if it had been started directly.
"""

from __future__ import annotations

import runpy
import sys


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    import ingest.torch

    ingest.torch.enable()
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("ingest.torch.run: -m needs a module name")
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
