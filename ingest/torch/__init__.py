"""The PyTorch tracer: torch.distributed collectives and p2p, process groups, and stage timers.

Enable it in code::

    import ingest.torch as rwt
    rwt.enable()                      # before or after init_process_group
    with rwt.stages.step():
        with rwt.stages.data(): ...

or without code changes under torchrun (both read RANKWATCH_JOB_ID, RANKWATCH_RING_DIR, …)::

    torchrun --nproc-per-node 4 -m ingest.torch.run train.py ARGS
    PYTHONPATH=$(python -m ingest.torch.autoload) RANKWATCH_TRACE=1 torchrun … train.py ARGS

Records go to a per-rank shared-memory ring that the host agent (`rankwatch agent`) drains. This
package imports torch only when `enable()` runs.
"""

from __future__ import annotations

from typing import Any

from ingest.torch.stages import StageClock

#: The process-wide stage timers (usable before `enable()`; they write once a ring is open).
stages = StageClock()
_session: Any = None


def enable(job_id: str | None = None, ring_dir: str | None = None, *, slots: int | None = None,
           cuda_sample: float | None = None, prefix: str | None = None) -> None:
    """Start tracing this process (idempotent). See `ingest.torch.session` for the settings."""
    global _session
    if _session is not None:
        return
    from ingest.torch.session import Session, config

    session = Session(config(job_id, ring_dir, slots, cuda_sample, prefix), stages)
    session.install()
    _session = session


def disable() -> None:
    """Stop tracing and restore torch.distributed (tests, benchmarks)."""
    global _session
    if _session is not None:
        _session.uninstall()
        _session = None


def name_group(group: Any, kind: str) -> None:
    """Declare a process group's role: tp, pp, dp, ep, cp or world (for the topology record)."""
    if kind not in ("tp", "pp", "dp", "ep", "cp", "world"):
        raise ValueError(f"kind {kind!r}: expected tp, pp, dp, ep, cp or world")
    if _session is None or _session.tracer is None or not _session.is_member(group):
        return
    try:
        _session.group_index(group)
        _session.tracer.comms.set_kind(group, kind)
    except Exception as e:  # tracing never raises into training
        print(f"rankwatch: cannot name group: {e}", flush=True)


def active_tracer() -> Any:
    """The active tracer, or None (diagnostics, tests)."""
    return None if _session is None else _session.tracer


__all__ = ["active_tracer", "disable", "enable", "name_group", "stages"]
