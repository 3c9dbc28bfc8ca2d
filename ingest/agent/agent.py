"""The per-host agent: drain every local ring, batch columnar per kind, publish, heartbeat.

Loop (one thread; `run` until stopped):

1. discover rings ``<ring_dir>/<job>/rank-<r>.ring`` (new ones, replaced ones by inode);
2. bulk-read each ring (numpy, no per-record Python), join op starts to ends (decode.OpJoin),
   append the rows to the (job, kind) buffer;
3. every `beat_s`, one `beats` row per live rank and communicator — live means its process
   exists (a hung rank still beats, a dead one stops: the difference hang diagnosis needs) —
   with its last op_seq and the drop counter of its ring; publish the job topology when a
   sidecar changed;
4. flush a buffer as one encoded batch when it holds `max_rows` rows or is `linger_s` old;
5. publish through `BatchPublisher` (idempotent, zstd, linger). A batch the client will not take
   now, or whose delivery failed (broker down past ``message.timeout.ms``), goes to the bounded
   spill and is retried first on later loops; the spill drops oldest-first and counts.

A ring whose process is gone is drained, its open ops published in flight, and its files removed.
`stats()` reports lag and drop counters; `run` writes them to ``<ring_dir>/agent.json``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ingest.agent import decode
from ingest.agent.spill import Pending, Spill
from ingest.agent.topology import build, read_sidecar
from ingest.batch import encode_batch, encode_topology
from ingest.torch.spool import SpoolReader


class Publisher(Protocol):
    def publish(self, kind: str, data: bytes, key: bytes | str | None = None,
                topic: str | None = None,
                on_delivery: Callable[..., None] | None = None) -> bool: ...

    def flush(self, timeout: float = 30.0) -> int: ...


@dataclass(frozen=True)
class AgentConfig:
    ring_dir: Path
    job: str | None = None  # only this job's rings
    poll_s: float = 0.05
    linger_s: float = 0.25
    max_rows: int = 65_536
    beat_s: float = 1.0
    inflight_s: float = 2.0
    spill_bytes: int = 64 << 20
    remove_dead: bool = True
    producer: str = field(default_factory=lambda: f"{socket.gethostname()}/agent")


@dataclass
class RankRing:
    job: str
    rank: int
    path: Path
    reader: SpoolReader
    join: decode.OpJoin
    inode: int
    comm_ids: np.ndarray = field(default_factory=lambda: np.empty(0, object))
    sidecar: dict[str, Any] | None = None
    sidecar_mtime: float = -1.0
    alive: bool = True


@dataclass
class Counters:
    read: int = 0
    delivered_batches: int = 0
    delivered_records: int = 0
    failed_batches: int = 0
    retried_batches: int = 0
    latency_s_max: float = 0.0
    latency_s_last: float = 0.0


class Agent:
    def __init__(self, cfg: AgentConfig, publisher: Publisher) -> None:
        self.cfg = cfg
        self.pub = publisher
        self.rings: dict[Path, RankRing] = {}
        self.buffers: dict[tuple[str, str], tuple[list[decode.Cols], int, float]] = {}
        self.spill = Spill(cfg.spill_bytes)
        self.counters = Counters()
        self.seq = 0
        self._next_beat = 0.0
        self._topo_stamp: dict[str, tuple[float, ...]] = {}

    # -- rings ---------------------------------------------------------------------------------

    def discover(self) -> None:
        pattern = f"{self.cfg.job}/rank-*.ring" if self.cfg.job else "*/rank-*.ring"
        for path in self.cfg.ring_dir.glob(pattern):
            try:
                inode = path.stat().st_ino
                rank = int(path.stem.split("-", 1)[1])
            except (OSError, ValueError):
                continue
            known = self.rings.get(path)
            if known is not None and known.inode == inode:
                continue
            if known is not None:
                self._retire(known)
            try:
                reader = SpoolReader(path)
            except (OSError, ValueError):
                continue
            join = decode.OpJoin(rank, int(self.cfg.inflight_s * 1e9))
            self.rings[path] = RankRing(path.parent.name, rank, path, reader, join, inode)

    def _refresh_sidecar(self, ring: RankRing) -> None:
        side = ring.path.with_suffix(".json")
        try:
            mtime = side.stat().st_mtime
        except OSError:
            return
        if mtime == ring.sidecar_mtime:
            return
        doc = read_sidecar(side)
        if doc is not None:
            ring.sidecar, ring.sidecar_mtime = doc, mtime
            ring.comm_ids = np.array([c["comm_id"] for c in doc["comms"]], dtype=object)

    def drain(self, now_ns: int) -> int:
        """Read every ring once; returns the number of slots read."""
        total = 0
        for ring in list(self.rings.values()):
            rows = ring.reader.read()
            total += len(rows)
            if len(rows) or ring.join.open.size:
                self._refresh_sidecar(ring)
                self._add(ring, ring.join.feed(rows, now_ns))
            if len(rows):
                self._append(ring.job, "stages", decode.stage_columns(rows, ring.rank))
        self.counters.read += total
        return total

    def _add(self, ring: RankRing, op_rows: np.ndarray) -> None:
        if len(op_rows):
            self._append(ring.job, "ops", decode.op_columns(op_rows, ring.rank, ring.comm_ids))

    def _retire(self, ring: RankRing) -> None:
        """The process is gone: drain, publish its open ops in flight, remove its files."""
        self._refresh_sidecar(ring)
        self._add(ring, ring.join.feed(ring.reader.read(), time.time_ns()))
        self._add(ring, ring.join.close())
        ring.reader.close()
        self.rings.pop(ring.path, None)
        if self.cfg.remove_dead:
            for p in (ring.path, ring.path.with_suffix(".json")):
                p.unlink(missing_ok=True)

    # -- beats and topology --------------------------------------------------------------------

    def beat(self, now_ns: int) -> None:
        by_job: dict[str, list[tuple[int, str, int, int]]] = {}
        for ring in list(self.rings.values()):
            pid = ring.reader.pid
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                self._retire(ring)
                continue
            except PermissionError:
                pass
            rows = by_job.setdefault(ring.job, [])
            dropped = ring.reader.dropped
            seqs = ring.join.last_seq
            if not seqs or not len(ring.comm_ids):
                rows.append((ring.rank, "", -1, dropped))
            for ci, seq in seqs.items():
                if ci < len(ring.comm_ids):
                    rows.append((ring.rank, str(ring.comm_ids[ci]), seq, dropped))
        for job, rows in by_job.items():
            if rows:
                r, c, s, d = zip(*rows, strict=True)
                self._append(job, "beats", {
                    "rank": np.array(r, np.int64), "ts": np.full(len(r), now_ns, np.int64),
                    "comm_id": np.array(c, object), "last_op_seq": np.array(s, np.int64),
                    "dropped": np.array(d, np.int64)})
        self._topologies(now_ns)

    def _topologies(self, now_ns: int) -> None:
        jobs: dict[str, list[RankRing]] = {}
        for ring in self.rings.values():
            self._refresh_sidecar(ring)
            jobs.setdefault(ring.job, []).append(ring)
        for job, rings in jobs.items():
            stamp = tuple(sorted(r.sidecar_mtime for r in rings))
            if self._topo_stamp.get(job) == stamp or not any(r.rank == 0 for r in rings):
                continue
            docs = [r.sidecar for r in rings if r.sidecar is not None]
            try:
                topo = build(job, docs, now_ns)
            except (ValueError, KeyError, TypeError) as e:
                print(f"rankwatch agent: job {job}: no topology: {e}", flush=True)
                continue
            self._topo_stamp[job] = stamp
            self._send(Pending("jobs", job.encode(), encode_topology(topo, producer=
                               self.cfg.producer), 1, time.monotonic()))

    # -- batching and publishing ---------------------------------------------------------------

    def _append(self, job: str, kind: str, cols: decode.Cols) -> None:
        n = decode.n_rows(cols)
        if not n:
            return
        parts, rows, t0 = self.buffers.get((job, kind), ([], 0, time.monotonic()))
        parts.append(cols)
        self.buffers[(job, kind)] = (parts, rows + n, t0)
        if rows + n >= self.cfg.max_rows:
            self._flush_buffer(job, kind)

    def flush_buffers(self, force: bool = False) -> None:
        now = time.monotonic()
        for (job, kind), (_, _, t0) in list(self.buffers.items()):
            if force or now - t0 >= self.cfg.linger_s:
                self._flush_buffer(job, kind)

    def _flush_buffer(self, job: str, kind: str) -> None:
        parts, rows, t0 = self.buffers.pop((job, kind))
        cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        self.seq += 1
        data = encode_batch(kind, job, cols, producer=self.cfg.producer, seq=self.seq,
                            validate=False)
        key = f"{job}:{self.cfg.producer}:{self.seq}".encode()
        self._send(Pending(kind, key, data, rows, t0))

    def _send(self, item: Pending) -> None:
        if len(self.spill) or not self._try(item):
            self.spill.push(item)

    def _try(self, item: Pending) -> bool:
        def delivered(err: Any, _msg: Any) -> None:
            c = self.counters
            if err is not None:
                c.failed_batches += 1
                self.spill.push(item)
                return
            c.delivered_batches += 1
            c.delivered_records += item.records
            c.latency_s_last = time.monotonic() - item.t_read
            c.latency_s_max = max(c.latency_s_max, c.latency_s_last)

        return self.pub.publish(item.kind, item.data, key=item.key, on_delivery=delivered)

    def pump_spill(self) -> None:
        """Retry spilled batches, oldest first, until the client refuses one."""
        while (item := self.spill.pop()) is not None:
            self.counters.retried_batches += 1
            if not self._try(item):
                self.spill.unpop(item)
                return

    # -- loop ----------------------------------------------------------------------------------

    def step(self) -> int:
        """One pass of the loop (tests drive it directly)."""
        now_ns = time.time_ns()
        self.discover()
        n = self.drain(now_ns)
        if time.monotonic() >= self._next_beat:
            self._next_beat = time.monotonic() + self.cfg.beat_s
            self.beat(now_ns)
        self.pump_spill()
        self.flush_buffers()
        self.pub.flush(0)  # serve delivery callbacks
        return n

    def run(self, stop: Callable[[], bool], stats_every_s: float = 1.0) -> None:
        next_stats = 0.0
        while not stop():
            if self.step() == 0:
                time.sleep(self.cfg.poll_s)
            if time.monotonic() >= next_stats:
                next_stats = time.monotonic() + stats_every_s
                self.write_stats()
        self.step()
        self.flush_buffers(force=True)
        self.pump_spill()
        self.pub.flush(10)
        self.write_stats()

    def stats(self) -> dict[str, Any]:
        c = self.counters
        oldest = min((t0 for _, _, t0 in self.buffers.values()), default=None)
        buffered_age = time.monotonic() - oldest if oldest is not None else 0.0
        return {
            "rings": len(self.rings), "read": c.read,
            "ring_backlog": sum(r.reader.backlog for r in self.rings.values()),
            "tracer_dropped": sum(r.reader.dropped for r in self.rings.values()),
            "delivered_batches": c.delivered_batches, "delivered_records": c.delivered_records,
            "failed_batches": c.failed_batches, "retried_batches": c.retried_batches,
            "spill_batches": len(self.spill), "spill_bytes": self.spill.bytes,
            "spill_dropped_batches": self.spill.dropped_batches,
            "spill_dropped_records": self.spill.dropped_records,
            "lag_s": round(max(buffered_age, self.spill.oldest_age()), 3),
            "publish_latency_s_last": round(c.latency_s_last, 3),
            "publish_latency_s_max": round(c.latency_s_max, 3),
        }

    def write_stats(self) -> None:
        path = self.cfg.ring_dir / "agent.json"
        try:
            self.cfg.ring_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.stats()))
            os.replace(tmp, path)
        except OSError:
            pass
