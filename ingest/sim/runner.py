"""Run a simulation into a sink, as fast as possible (`max`) or paced to simulated time
(`realtime`: a batch is sent once the wall clock since start reaches its release time).

Sinks implement `Sink`: `batch(kind, bytes, key)`, `truth(list[TruthRecord])` and `close()`.
`KafkaSink` publishes through ingest.publish.BatchPublisher (topology to the jobs topic,
batches to their kind's topic under their key: ingest/keys.py, truth as JSON lines to the truth
topic);
`DirSink` writes `<kind>.jsonl` (one encoded batch per line) plus `truth.json`; `NullSink` only
counts (benchmarks: batches are still encoded).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import orjson

from ingest.keys import batch_key
from ingest.sim.simulation import Simulation
from ingest.sim.truth import TruthRecord
from ingest.topics import Topics


class Sink(Protocol):
    #: How batches are encoded for this sink (ingest.batch.encode_batch's `framing`): "binary"
    #: where every reader is a worker (Kafka), "json" for files of one batch per line.
    framing: str

    def batch(self, kind: str, data: bytes, key: str = "") -> None:
        """Deliver one encoded batch (kind "jobs" is the topology); `key` its Kafka key
        (ingest/keys.py; "" for the job id)."""

    def truth(self, records: list[TruthRecord]) -> None:
        """Deliver the ground truth, once, after the last batch."""

    def close(self) -> None: ...


class NullSink:
    framing = "json"

    def __init__(self) -> None:
        self.bytes = 0

    def batch(self, kind: str, data: bytes, key: str = "") -> None:
        self.bytes += len(data)

    def truth(self, records: list[TruthRecord]) -> None:
        pass

    def close(self) -> None:
        pass


class DirSink:
    framing = "json"  # one batch per line: text

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, Any] = {}

    def batch(self, kind: str, data: bytes, key: str = "") -> None:
        f = self._files.get(kind)
        if f is None:
            f = self._files[kind] = (self.path / f"{kind}.jsonl").open("wb")
        f.write(data + b"\n")

    def truth(self, records: list[TruthRecord]) -> None:
        (self.path / "truth.json").write_bytes(
            orjson.dumps([r.model_dump() for r in records], option=orjson.OPT_INDENT_2))

    def close(self) -> None:
        for f in self._files.values():
            f.close()


class KafkaSink:
    framing = "binary"  # framed batches (docs/records.md): 5x cheaper for the worker to decode

    def __init__(self, bootstrap: str, topics: Topics, job_id: str) -> None:
        from ingest.publish import BatchPublisher  # only this sink needs a Kafka client

        self.publisher = BatchPublisher(bootstrap, topics)
        self.topics, self.job_id = topics, job_id

    def batch(self, kind: str, data: bytes, key: str = "") -> None:
        if kind == "jobs":
            self.publisher.publish("jobs", data, key=self.job_id)
            return
        # the job's home partition, or an uploader's share of a spread kind (ingest/keys.py)
        self.publisher.publish(kind, data, key=key or self.job_id)

    def truth(self, records: list[TruthRecord]) -> None:
        for r in records:
            self.publisher.publish("truth", r.model_dump_json().encode(), key=self.job_id,
                                   topic=self.topics.truth)

    def close(self) -> None:
        self.publisher.close()


@dataclass
class RunStats:
    batches: Counter[str] = field(default_factory=Counter)
    bytes: int = 0
    wall_s: float = 0.0
    sim_s: float = 0.0

    def summary(self, sim: Simulation) -> dict[str, Any]:
        return {
            "job_id": sim.cfg.job_id, "world": sim.layout.world, "steps": sim.steps_done,
            "stalled_at_s": sim.stalled_at, "sim_s": round(self.sim_s, 3),
            "wall_s": round(self.wall_s, 3), "rows": sim.rows,
            "rows_by_kind": dict(sim.rows_by_kind), "bytes": self.bytes,
            "batches": dict(self.batches),
            "rank_s_per_wall_s": round(sim.layout.world * self.sim_s / max(self.wall_s, 1e-9),
                                       1),
            "truth": [r.model_dump() for r in sim.truth],
        }


def run(sim: Simulation, sink: Sink, speed: str = "max",
        progress: Callable[[str], None] | None = None, sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        kinds: Collection[str] | None = None) -> RunStats:
    """Drive `sim` into `sink`; returns counts and timings. `progress` gets a line now and then;
    `kinds` keeps only those raw kinds (benchmarks of one kind's path)."""
    if speed not in ("max", "realtime"):
        raise ValueError(f"speed={speed!r}: expected max or realtime")
    stats = RunStats()
    t0 = clock()
    last_note = t0
    for release, kind, producer, data in sim.uploads(kinds=kinds, framing=sink.framing):
        if speed == "realtime":
            wait = release - (clock() - t0)
            if wait > 0:
                sleep(wait)
        sink.batch(kind, data, batch_key(kind, sim.cfg.job_id, producer))
        stats.batches[kind] += 1
        stats.bytes += len(data)
        stats.sim_s = max(stats.sim_s, release)
        now = clock()
        if progress is not None and now - last_note >= 2.0:
            last_note = now
            progress(f"step {sim.steps_done}/{sim.cfg.steps}  sim {stats.sim_s:.1f}s  "
                     f"{sim.rows / max(now - t0, 1e-9):,.0f} records/s")
    sink.truth(sim.truth)
    sink.close()
    stats.wall_s = clock() - t0
    return stats


def stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
