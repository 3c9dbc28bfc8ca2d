"""The per-host agent: drain every local ring, batch columnar per kind, publish, heartbeat.

Loop (one thread; `run` until stopped):

1. discover the native rings ``/dev/shm/rankwatch.<job>.<rank>.<source>`` (`ingest.ring`; the
   Python tracer's ``py``, the NCCL plugin's ``nccl``, the CUPTI injector's ``cupti``), and
   re-open one that was re-created — looked for only when the shm directory changed, and at
   every beat;
2. drain each ring in bulk (one ctypes call into a numpy array, `split_kinds`, no per-record
   Python), join op starts to ends (decode.OpJoin), append the columns to the (job, kind) buffer;
3. every `beat_s`, for each Python-tracer ring one `beats` row per communicator — only while
   its producer is alive (a hung rank still beats, a dead one stops: the difference hang
   diagnosis needs) — with the last op_seq, the ring's drop counter and the rank's position
   (step, stage, stage entry time) from the ring header and its training thread's scheduler
   counters (/proc/<pid>/schedstat: one small read per rank per beat; the NCCL plugin writes
   its own beats); a rank whose producer is found dead gets one last row, `exited` 1, at the
   time its process was seen ended (a pidfd per rank, checked every pass and slept on between
   passes: `exits.py`), not the beat's;
   publish the job topology when a rank's sidecar changed;
4. hand the columns to the outbox (outbox.py): one encoded batch per (job, kind) when it holds
   `max_rows` rows or is `linger_s` old (`latency_linger_s` for `LATENCY_KINDS`), published
   through `BatchPublisher` (idempotent, zstd, linger), with a bounded spill for what the
   broker does not take (outage), retried first, dropped oldest-first and counted.

A ring whose producer is dead is drained (skipping slots it reserved but never committed), its
open ops are published in flight, and the ring is unlinked. `stats()` reports lag and drop
counters; `run` writes them to ``<sidecar_dir>/agent.<pid>.json`` when they change (one file
per agent, removed when `run` returns). A job's sidecar directory is removed once its last ring
here is retired and nothing else is left in it.

Idle cost: a pass over rings with nothing in them is a directory stat and one drain call per
ring; after `idle_after_s` without a record the loop polls every `idle_poll_s` instead of
`poll_s` (never past the next beat), and returns to `poll_s` on the first record, whose batch
it sends at once rather than lingering: waking adds no latency over polling at `poll_s`
(`rankwatch bench agent`, docs/performance.md). A pass that found records sleeps the rest of
`poll_s` too, unless it read `BUSY_RECORDS` or more: the agent shares the host's cores with the
ranks, and a pass costs about the same for a handful of records as for a few hundred.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ingest import ring
from ingest.agent import decode
from ingest.agent.exits import ExitWatch
from ingest.agent.outbox import Outbox, Publisher
from ingest.agent.shape import P2PLog, PipelineShape, infer_pipeline
from ingest.agent.spill import Pending
from ingest.agent.topology import build, read_sidecar
from ingest.batch import encode_topology

#: A pass that read at least this many records starts the next at once (`Agent.run`).
BUSY_RECORDS = 16_384


@dataclass(frozen=True)
class AgentConfig:
    sidecar_dir: Path  # the tracers' sidecars (ingest.torch.comms); agent.<pid>.json goes here too
    job: str | None = None  # only this job's rings
    prefix: str = ring.DEFAULT_PREFIX
    shm_dir: str = "/dev/shm"
    poll_s: float = 0.05
    idle_after_s: float = 2.0  # no record for this long: the host is idle ...
    idle_poll_s: float = 0.25  # ... and the loop looks this often (beats stay on time)
    linger_s: float = 0.25
    #: ... and the kinds a diagnosis waits on: a step's stage record (the step trigger needs two
    #: slow steps, the analysis four, each delayed by the wait), the calls (a hang is analysed
    #: once the calls the beats announce are stored; a slowdown reads the newest steps' calls
    #: beside their stage records) and the beats (a hang's silence); a few small batches a
    #: second per job
    latency_linger_s: float = 0.05
    max_rows: int = 65_536
    beat_s: float = 1.0
    inflight_s: float = 2.0
    spill_bytes: int = 64 << 20
    remove_dead: bool = True
    producer: str = field(default_factory=lambda: f"{socket.gethostname()}/agent")


@dataclass
class RankRing:
    name: str
    job: str
    rank: int
    source: str
    reader: ring.RingReader
    created_ns: int
    inode: int  # of the shm file when attached: a re-created ring has another
    join: decode.OpJoin
    names: decode.Names = field(default_factory=decode.Names)
    sidecar: dict[str, Any] | None = None
    sidecar_mtime: float = -1.0


@dataclass
class Counters:
    read: int = 0
    unattributed: int = 0  # records of rings without a rank
    detached: int = 0  # NCCL flow/chunk records whose op is unknown (op_seq not known)


#: kind in the ring -> (contract kind, columns builder)
#: Kinds published after `AgentConfig.latency_linger_s` rather than `linger_s`.
LATENCY_KINDS = ("stages", "ops", "beats")

_SIMPLE: dict[str, tuple[str, Callable[..., decode.Cols]]] = {
    "kernel": ("kernels", decode.kernel_columns),
    "flow": ("flows", decode.flow_columns),
    "chunk": ("chunks", decode.chunk_columns),
    "wr": ("wr", decode.wr_columns),
    "beat": ("beats", decode.beat_columns),
}


class Agent:
    def __init__(self, cfg: AgentConfig, publisher: Publisher) -> None:
        self.cfg = cfg
        self.rings: dict[str, RankRing] = {}
        self.out = Outbox(publisher, cfg.producer, linger_s=cfg.linger_s,
                          max_rows=cfg.max_rows, spill_bytes=cfg.spill_bytes,
                          lingers={k: min(cfg.linger_s, cfg.latency_linger_s)
                                   for k in LATENCY_KINDS})
        self._append = self.out.append
        self.counters = Counters()
        self._dtypes = ring.record_dtypes()
        self._next_beat = 0.0
        self._shm_stamp: tuple[int, int] | None = None  # shm dir (mtime, inode) at last scan
        self._last_stats: dict[str, Any] | None = None
        self._last_record = 0.0  # monotonic time of the last pass that read records
        self._slept_idle = False  # the loop slept longer than poll_s since records last came
        self._topo_stamp: dict[str, tuple[Any, ...]] = {}
        self._p2p: dict[str, P2PLog] = {}  # job -> its p2p pattern (pipeline shape inference)
        self._shape_said: dict[str, str] = {}  # job -> the shape last logged
        #: when each rank's process ended, to the loop's resolution (ingest/agent/exits.py)
        self.exits = ExitWatch()

    # -- rings ---------------------------------------------------------------------------------

    def discover(self, force: bool = False) -> None:
        """Attach rings that appeared, re-attach re-created ones. Without `force`, nothing is
        looked at unless the shm directory changed since the last scan (one stat per pass:
        creating or unlinking a ring changes its mtime); `force` scans anyway (the loop does
        every beat, since a coarse mtime can hide a change made right after a scan)."""
        shm = self.cfg.shm_dir
        try:
            st = os.stat(shm)
            stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_ino)
        except OSError:
            stamp = None
        if not force and stamp is not None and stamp == self._shm_stamp:
            return
        self._shm_stamp = stamp
        for name in ring.list_rings(self.cfg.prefix, shm):
            known = self.rings.get(name)
            try:
                inode = os.stat(os.path.join(shm, name.lstrip("/"))).st_ino
            except OSError:
                continue  # unlinked meanwhile
            if known is not None and known.inode == inode:
                continue
            try:
                reader = ring.RingReader(name)
                rst = reader.stat()
            except (OSError, ValueError):
                continue  # not a ring (yet), or foreign: try again next time
            if known is not None and known.created_ns == rst.created_ns:
                known.inode = inode  # the same ring (stat raced its creation): keep ours
                reader.close()
                continue
            if self.cfg.job and rst.job_id != self.cfg.job:
                reader.close()
                continue
            if known is not None:
                self._retire(known, unlink=False)  # re-created by a new producer
            self.rings[name] = RankRing(name, rst.job_id or "default", rst.rank, rst.source,
                                        reader, rst.created_ns, inode,
                                        decode.OpJoin(int(self.cfg.inflight_s * 1e9)))

    def _sidecar(self, r: RankRing) -> Path:
        return self.cfg.sidecar_dir / r.job / f"rank-{r.rank}.json"

    def _refresh_sidecar(self, r: RankRing) -> None:
        side = self._sidecar(r)
        try:
            mtime = side.stat().st_mtime
        except OSError:
            return
        if mtime != r.sidecar_mtime:
            doc = read_sidecar(side)
            if doc is not None:
                r.sidecar, r.sidecar_mtime = doc, mtime

    def drain(self, now_ns: int) -> int:
        """Drain every ring once; returns the number of records read."""
        total = 0
        for r in self.rings.values():  # draining never adds or removes a ring
            total += self._drain_one(r, now_ns, skip_torn=False)
        self.counters.read += total
        return total

    def _drain_one(self, r: RankRing, now_ns: int, skip_torn: bool) -> int:
        raw = r.reader.drain(skip_torn=skip_torn)
        if not len(raw) and not r.join.open.size:
            return 0
        if r.rank < 0:
            self.counters.unattributed += len(raw)
            return len(raw)
        parts = ring.split_kinds(raw, self._dtypes)
        r.names.update(parts["name"])
        self._add_ops(r, r.join.feed(parts["op"], now_ns))
        self._append(r.job, "stages", decode.stage_columns(parts["stage"], r.rank))
        for kind, (contract, build_cols) in _SIMPLE.items():
            recs = parts[kind]
            if len(recs) and kind in ("flow", "chunk"):
                # The plugin could not tie these to an op (e.g. the first op of a process, which
                # ends before NCCL's first kernel-channel event): no op_seq, so they cannot join
                # their op and the contract refuses them. Counted, not published.
                detached = (recs["flags"] & ring.F_DETACHED) != 0
                if detached.any():
                    self.counters.detached += int(detached.sum())
                    recs = recs[~detached]
            if len(recs):
                self._append(r.job, contract, build_cols(recs, r.rank, r.names))
        return len(raw)

    def _add_ops(self, r: RankRing, rows: np.ndarray) -> None:
        if len(rows):
            cols = decode.op_columns(rows, r.rank, r.names)
            log = self._p2p.get(r.job)
            if log is None:
                log = self._p2p[r.job] = P2PLog()
            log.observe(cols)
            self._append(r.job, "ops", cols)

    def _retire(self, r: RankRing, unlink: bool = True) -> None:
        """The producer is gone: drain, publish its open ops in flight, unlink the ring."""
        self._drain_one(r, time.time_ns(), skip_torn=True)
        self._add_ops(r, r.join.close())
        r.reader.close()
        self.rings.pop(r.name, None)
        if unlink and self.cfg.remove_dead:
            ring.load_library().rw_ring__unlink(r.name.encode())
            if not any(o.job == r.job and o.rank == r.rank for o in self.rings.values()):
                self._sidecar(r).unlink(missing_ok=True)
            if not any(o.job == r.job for o in self.rings.values()):
                # the job's last producer here is gone (rmdir fails if a rank starting now has
                # written its sidecar already: it keeps the directory)
                with contextlib.suppress(OSError):
                    self._sidecar(r).parent.rmdir()
        if not any(o.job == r.job for o in self.rings.values()):
            for per_job in (self._p2p, self._shape_said, self._topo_stamp):
                per_job.pop(r.job, None)  # the job left this host

    # -- beats and topology --------------------------------------------------------------------

    def beat(self, now_ns: int) -> None:
        by_job: dict[str, list[tuple[int, str, int, int, int, str, int, int, int, int, int,
                                     int]]] = {}
        for r in list(self.rings.values()):
            st = r.reader.stat()
            py_rank = r.source == "py" and r.rank >= 0  # the NCCL plugin beats itself
            # a process seen ended (its pidfd) is dead though its ring's check still finds
            # it (a zombie until its launcher reaps it): no alive beat after its end
            ended = self.exits.ended_at(st.producer_pid, st.created_ns) \
                if st.producer_pid > 0 else None
            if st.producer == "dead" or ended is not None:
                if py_rank:  # its last beat says so, with the last position it published,
                    # at the time its process was seen ended where that is known (exits.py)
                    step, stage, stage_ts = decode.position(*st.position)
                    by_job.setdefault(r.job, []).append(
                        (r.rank, "", -1, st.drops, step, stage, stage_ts, -1, -1, 1,
                         ended or now_ns, self.exits.status_of(st.producer_pid)))
                self._retire(r)
                continue
            if not py_rank:
                continue
            if st.producer == "alive":
                self.exits.watch(st.producer_pid)
            rows = by_job.setdefault(r.job, [])
            step, stage, stage_ts = decode.position(*st.position)
            run, wait = decode.schedstat(st.producer_pid) if st.producer_pid > 0 else (-1, -1)
            seqs = r.join.last_seq
            if not seqs:
                rows.append((r.rank, "", -1, st.drops, step, stage, stage_ts, run, wait, 0,
                             now_ns, -1))
                continue
            hashes = np.array(list(seqs), dtype=np.int64)
            for comm, seq in zip(r.names.lookup(hashes).tolist(), seqs.values(), strict=True):
                rows.append((r.rank, comm, seq, st.drops, step, stage, stage_ts, run, wait, 0,
                             now_ns, -1))
        for job, rows in by_job.items():
            if rows:
                rk, c, sq, d, step_, stage_, sts, run_, wait_, ex, ts, how = zip(*rows,
                                                                                strict=True)
                self._append(job, "beats", {
                    "rank": np.array(rk, np.int64), "ts": np.array(ts, np.int64),
                    "comm_id": np.array(c, object), "last_op_seq": np.array(sq, np.int64),
                    "dropped": np.array(d, np.int64), "step": np.array(step_, np.int64),
                    "stage": np.array(stage_, object), "stage_ts": np.array(sts, np.int64),
                    "sched_run_ns": np.array(run_, np.int64),
                    "sched_wait_ns": np.array(wait_, np.int64),
                    "exited": np.array(ex, np.int64), "exit_status": np.array(how, np.int64)})
        self._topologies(now_ns)

    def _topologies(self, now_ns: int) -> None:
        jobs: dict[str, list[RankRing]] = {}
        for r in self.rings.values():
            if r.source == "py" and r.rank >= 0:
                self._refresh_sidecar(r)
                jobs.setdefault(r.job, []).append(r)
        for job, rings in jobs.items():
            if not any(r.rank == 0 for r in rings):
                continue
            docs = [r.sidecar for r in rings if r.sidecar is not None]
            if not docs:
                continue  # no sidecar yet (or unreadable): nothing to describe the job with
            shape = self._infer_shape(job, docs)
            stamp = (*sorted(r.sidecar_mtime for r in rings), shape)
            if self._topo_stamp.get(job) == stamp:
                continue
            try:
                topo = build(job, docs, now_ns, shape)
            except (ValueError, KeyError, TypeError) as e:
                print(f"rankwatch agent: job {job}: no topology: {e}", flush=True)
                continue
            self._topo_stamp[job] = stamp
            self._say_shape(job, topo, shape)
            self.out.send(Pending("jobs", job.encode(), encode_topology(
                topo, producer=self.cfg.producer), 1, time.monotonic()))

    def _infer_shape(self, job: str, docs: list[dict[str, Any]]) -> PipelineShape | None:
        """The pipeline shape the job's p2p pattern shows, unless the launcher declared the
        sizes (then it is not needed); None when there is no pipeline to see."""
        log = self._p2p.get(job)
        if log is None or not log.edges or not docs:
            return None
        if any(k in (d.get("parallel") or {}) for d in docs for k in ("tp", "pp", "dp", "cp")):
            return None
        try:
            world = max(int(d["world_size"]) for d in docs)
            groups = [(str(c["kind"]), [int(m) for m in c["members"]])
                      for d in docs for c in d["comms"]]
        except (KeyError, TypeError, ValueError):
            return None
        return infer_pipeline(world, log.edges, log.first_is_send(), log.sends_per_step(),
                              groups)

    def _say_shape(self, job: str, topo: Any, shape: PipelineShape | None) -> None:
        """Log the job's shape and where it came from, when that changed."""
        src = topo.shape_source
        line = (f"pp={topo.pp} ({src.get('pp')}) dp={topo.dp} ({src.get('dp')}) tp={topo.tp} "
                f"({src.get('tp')}) microbatches={topo.microbatches} "
                f"({src.get('microbatches')})")
        if self._shape_said.get(job) == line:
            return
        self._shape_said[job] = line
        how = (f"; inferred from the p2p pattern: {shape.describe()}" if shape is not None
               and "inferred" in src.values() else "")
        print(f"rankwatch agent: job {job}: {line}{how}", flush=True)

    # -- loop ----------------------------------------------------------------------------------

    def step(self) -> int:
        """One pass of the loop (tests drive it directly)."""
        self.exits.check(0.0)  # a process that ended during the last pass: its time first
        now_ns = time.time_ns()
        mono = time.monotonic()
        beat = mono >= self._next_beat
        self.discover(force=beat)
        n = self.drain(now_ns)
        if beat:
            self._next_beat = mono + self.cfg.beat_s
            self.beat(now_ns)
        if n:
            self._last_record = mono
        self.out.pump()
        if self.out.buffers:
            # records found after an idle pause already waited up to idle_poll_s: send them
            # now instead of lingering too, so waking costs no latency over polling at poll_s
            self.out.flush(force=n > 0 and self._slept_idle)
        if n:
            self._slept_idle = False
        self.out.poll(0)  # serve delivery callbacks
        return n

    def pause(self, now: float) -> float:
        """How long the loop sleeps after a pass that read nothing: `poll_s` while records flow
        or wait in the outbox; once none came for `idle_after_s`, `idle_poll_s` — never past the
        next beat."""
        if now - self._last_record < self.cfg.idle_after_s or self.out.buffers \
                or len(self.out.spill):
            return self.cfg.poll_s
        return max(self.cfg.poll_s, min(self.cfg.idle_poll_s, self._next_beat - now))

    def run(self, stop: Callable[[], bool], stats_every_s: float = 1.0) -> None:
        next_stats = 0.0
        while not stop():
            n = self.step()
            # a pass that found records sleeps too: going straight back read the few records
            # a rank wrote meanwhile, at the pass's full fixed cost (a drain, a kind split, an
            # outbox pump per ring) — about 40 passes a second for a 4-rank pipeline job, half
            # of them for a handful of records. Only a pass that read a lot goes on at once:
            # more may be waiting. The whole `poll_s`, not its rest: the next pass must find
            # the batches this one opened past their linger (`latency_linger_s` = `poll_s`),
            # or they wait one more poll
            if n < BUSY_RECORDS:
                pause = self.pause(time.monotonic()) if n == 0 else self.cfg.poll_s
                self._slept_idle = self._slept_idle or pause > self.cfg.poll_s
                self.exits.check(pause)  # sleeps, woken early by a rank's process ending
            if time.monotonic() >= next_stats:
                next_stats = time.monotonic() + stats_every_s
                self.write_stats()
        self.step()
        self.out.flush(force=True)
        self.out.pump()
        self.out.poll(10)
        self.exits.close()
        self.stats_path.unlink(missing_ok=True)

    @property
    def stats_path(self) -> Path:
        """This agent's state file: one per agent, so agents sharing a host never overwrite
        each other's."""
        return self.cfg.sidecar_dir / f"agent.{os.getpid()}.json"

    def stats(self) -> dict[str, Any]:
        """Ring-side counters (read, backlog, drops, torn) and the outbox's (outbox.py)."""
        c = self.counters
        stats = [r.reader.stat() for r in self.rings.values()]
        return {
            "rings": len(self.rings), "read": c.read,
            "ring_backlog": sum(st.pending for st in stats),
            "tracer_dropped": sum(st.drops for st in stats),
            "torn": sum(st.torn for st in stats), "unattributed": c.unattributed,
            "detached": c.detached, **self.out.stats(),
        }

    def write_stats(self) -> None:
        """Write `stats()` to this agent's state file — only when they changed (an idle agent
        writes none)."""
        stats = self.stats()
        if stats == self._last_stats:
            return
        path = self.stats_path
        try:
            self.cfg.sidecar_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(stats))
            os.replace(tmp, path)
            self._last_stats = stats
        except OSError:
            pass
