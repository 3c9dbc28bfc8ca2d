"""Tracing without touching the launch command's script: put this directory on PYTHONPATH.

    export PYTHONPATH=$(python -m ingest.torch.autoload)${PYTHONPATH:+:$PYTHONPATH}
    export RANKWATCH_TRACE=1
    torchrun --nproc-per-node 4 train.py

Python imports `sitecustomize` at start-up in every process. With RANKWATCH_TRACE=1 and a RANK
variable (a torchrun worker; the launcher itself has none) it enables `ingest.torch`; otherwise
it does nothing. A failure to enable is printed, never raised. The `sitecustomize` this one
shadows (a distribution's, a virtualenv's) is run afterwards, so both take effect.
"""

import importlib.machinery
import importlib.util
import os
import sys

if os.environ.get("RANKWATCH_TRACE") == "1" and "RANK" in os.environ:
    try:
        import ingest.torch

        ingest.torch.enable()
    except Exception as e:  # tracing must never stop training
        print(f"rankwatch: tracing not enabled: {e}", flush=True)


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        print(f"rankwatch: the shadowed sitecustomize failed: {e}", flush=True)


_run_shadowed()
