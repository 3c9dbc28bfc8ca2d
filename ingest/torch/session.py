"""Turning tracing on in a training process: `enable()` and what it hooks.

`enable()` patches ``torch.distributed.init_process_group``, ``new_group`` and
``destroy_process_group`` (and DDP, ddp.py); once the default group exists (now, or when the
script initializes it) the rank opens its native ring ``/rankwatch.<job_id>.<rank>.py``
(sink.py), writes its sidecar ``<ring_dir>/<job_id>/rank-<rank>.json`` (comms.py), registers
the world group and every group created after, and installs the collective wrappers
(collectives.py).

Configuration, read when `enable()` runs (never at import), explicit arguments first:
``RANKWATCH_JOB_ID`` — the variable the NCCL plugin reads too, so one setting names the job for
every ring of a rank (``RANKWATCH_JOB`` is accepted; default: torchrun's ``TORCHELASTIC_RUN_ID``,
else ``default``),
``RANKWATCH_RING_DIR`` (sidecars, default ``/dev/shm/rankwatch``), ``RANKWATCH_RING_SLOTS``
(records, power of two,
default 65536), ``RANKWATCH_CUDA_SAMPLE`` (fraction of steps with CUDA events, default 0),
``RANKWATCH_RING_PREFIX`` (shared-memory name prefix, default ``/rankwatch``).
"""

from __future__ import annotations

import atexit
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ingest.torch import collectives, ddp
from ingest.torch.comms import CommTable, HostGather
from ingest.torch.sink import RingSink
from ingest.torch.stages import StageClock
from ingest.torch.tracer import Tracer

DEFAULT_RING_DIR = "/dev/shm/rankwatch"
_JOB_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


@dataclass
class Config:
    job_id: str
    ring_dir: Path
    slots: int
    cuda_sample: float
    prefix: str = "/rankwatch"


def config(job_id: str | None = None, ring_dir: str | Path | None = None,
           slots: int | None = None, cuda_sample: float | None = None,
           prefix: str | None = None) -> Config:
    env = os.environ
    job = (job_id or env.get("RANKWATCH_JOB_ID") or env.get("RANKWATCH_JOB")
           or env.get("TORCHELASTIC_RUN_ID") or "default")
    if not _JOB_RE.match(job):
        raise ValueError(f"job id {job!r}: expected 1-128 of [A-Za-z0-9_.:-]")
    raw_slots = slots if slots is not None else env.get("RANKWATCH_RING_SLOTS", "65536")
    n = int(raw_slots)
    if n < 64 or n & (n - 1):
        raise ValueError(f"RANKWATCH_RING_SLOTS={raw_slots!r}: expected a power of two >= 64")
    q = cuda_sample if cuda_sample is not None else float(env.get("RANKWATCH_CUDA_SAMPLE", "0"))
    prefix = prefix or env.get("RANKWATCH_RING_PREFIX", "/rankwatch")
    return Config(job, Path(ring_dir or env.get("RANKWATCH_RING_DIR") or DEFAULT_RING_DIR), n, q,
                  prefix)


class Session:
    """The process-wide tracing state (one per process)."""

    def __init__(self, cfg: Config, clock: StageClock) -> None:
        self.cfg = cfg
        self.clock = clock
        self.tracer: Tracer | None = None
        self.originals: dict[str, Any] = {}
        self._patched: dict[str, Any] = {}
        self._group_cache: dict[int, int] = {}

    def install(self) -> None:
        import torch.distributed as dist

        self.clock.enable_cuda_events(self.cfg.cuda_sample)
        for name, hook in (("init_process_group", self._after_init),
                           ("new_group", self._after_new_group)):
            self._patched[name] = orig = getattr(dist, name)
            setattr(dist, name, _after(orig, hook))
        self._patched["destroy_process_group"] = orig_destroy = dist.destroy_process_group

        @functools.wraps(orig_destroy)
        def destroy_process_group(group: Any = None) -> Any:
            if group is None or group is dist.group.WORLD:
                self.detach()  # drop every group reference before torch tears them down
            return orig_destroy(group)

        dist.destroy_process_group = destroy_process_group
        ddp.install(self._patched)
        if dist.is_initialized():
            self._attach()
        atexit.register(self.flush)

    def uninstall(self) -> None:
        import torch.distributed as dist

        self.detach()
        ddp.uninstall(self._patched)
        for name in ("init_process_group", "new_group", "destroy_process_group"):
            if name in self._patched:
                setattr(dist, name, self._patched.pop(name))

    def detach(self) -> None:
        """Stop tracing the current default group (destroyed, or tracing disabled): restore the
        collectives, close the ring, forget every process group (holding one past
        destroy_process_group makes torch abort at exit). A later init_process_group attaches
        again."""
        import torch.distributed as dist

        self.flush()
        collectives.uninstall(dist, self.originals)
        self.originals = {}
        self._group_cache.clear()
        if self.tracer is not None:
            self.tracer.polled.clear()
            self.tracer.comms.forget()
            self.clock.publish_position(None)  # the view dies with the ring's mapping
            self.tracer.sink.close()
        self.clock.tracer = self.tracer = None

    def flush(self) -> None:
        if self.tracer is not None and self.tracer.outstanding:
            self.tracer.harvest()

    # -- hooks ---------------------------------------------------------------------------------

    def _after_init(self, _result: Any) -> None:
        self._attach()

    def _after_new_group(self, pg: Any) -> None:
        if self.tracer is not None and self.is_member(pg):
            self.group_index(pg)

    @staticmethod
    def is_member(group: Any) -> bool:
        """False for the placeholder torch returns to ranks outside a new group."""
        import torch.distributed as dist

        if group is None or isinstance(group, int):
            return group is None
        try:
            return bool(dist.get_rank(group) >= 0)
        except (ValueError, RuntimeError):
            return False

    def _attach(self) -> None:
        import torch.distributed as dist

        if self.tracer is not None:
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        base = self.cfg.ring_dir / self.cfg.job_id
        base.mkdir(parents=True, exist_ok=True)
        sink = RingSink(self.cfg.job_id, rank, self.cfg.slots, self.cfg.prefix)
        comms = CommTable(base / f"rank-{rank}.json", self.cfg.job_id, rank, world)
        tracer = Tracer(sink, comms, rank)
        tracer.group_of = self._group_of
        try:
            gather = HostGather(dist.distributed_c10d._get_default_store(), comms)
            if rank == 0:
                tracer.hosts = gather
        except Exception as e:  # no store (custom init): hosts of other nodes stay unknown
            print(f"rankwatch: not gathering host names: {e}", flush=True)
        self.tracer = tracer
        self.group_index(None)
        self.originals = collectives.install(tracer, dist)
        self.clock.publish_position(sink.writer.position())
        self.clock.tracer = tracer

    def _group_of(self, group: Any) -> int:
        idx = self._group_cache.get(id(group))
        return idx if idx is not None else self.group_index(group)

    def group_index(self, group: Any) -> int:
        """Register `group` (None: the default group) as a communicator; its index."""
        import torch.distributed as dist

        assert self.tracer is not None
        world = dist.group.WORLD
        real = world if group is None else group
        if real is world:
            comm_id = "world"
        else:
            comm_id = f"pg{getattr(real, 'group_name', '') or len(self.tracer.comms.comms)}"
        members = [int(r) for r in dist.get_process_group_ranks(real)]
        idx = self.tracer.comms.index(real, comm_id, members)
        if idx == len(self.tracer.nccl):
            self.tracer.nccl.append(dist.get_backend(real) == "nccl")
            self.tracer.sink.comm(comm_id)
        self._group_cache[id(group)] = idx
        return idx


def _after(orig: Any, hook: Any) -> Any:
    @functools.wraps(orig)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = orig(*args, **kwargs)
        try:
            hook(result)
        except Exception as e:  # tracing must never fail the job
            print(f"rankwatch: tracing not attached: {e}", flush=True)
        return result

    return wrapped
