"""Tracing without touching the launch command's script: put this directory on PYTHONPATH.

    export PYTHONPATH=$(python -m ingest.torch.autoload)${PYTHONPATH:+:$PYTHONPATH}
    export RANKWATCH_TRACE=1
    torchrun --nproc-per-node 4 train.py

Python imports `sitecustomize` at start-up in every process. With RANKWATCH_TRACE=1 and a RANK
variable (a torchrun worker; the launcher itself has none) it enables `ingest.torch`; otherwise
it does nothing and costs nothing. A failure to enable is printed, never raised.
"""

import os

if os.environ.get("RANKWATCH_TRACE") == "1" and "RANK" in os.environ:
    try:
        import ingest.torch

        ingest.torch.enable()
    except Exception as e:  # tracing must never stop training
        print(f"rankwatch: tracing not enabled: {e}", flush=True)
