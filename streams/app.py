"""The Faust app: one agent per raw record kind, each storing its topic into ClickHouse.

Known traps this module is built around (faust-streaming 0.15.3, chdb 26.9):
- agent concurrency stays 1: with more, Faust can commit past a message still in flight
  (faust-streaming issue #606); scale with partitions and workers instead;
- `take_events` acks the whole buffer when the loop body returns, *and also when the body
  raises* (its `finally` acks). So the insert finishes inside the body, failures are retried
  there, and if the worker must stop while rows are still not stored it exits the process hard
  (`os._exit`) so the unstored offsets are never committed;
- windowing happens in our own code (Faust's windowed tables expire on wall-clock time);
- at-least-once plus idempotent inserts (streams.raw_sink), not Faust's exactly-once mode.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import faust
import numpy as np
import orjson

from ingest.batch import BatchError, decode_batch
from ingest.records import MODELS
from ingest.topics import Topics
from streams.raw_sink import DeadLetter, Message, RawSink, Store

log = logging.getLogger(__name__)

#: Exit code when the worker stops with rows it could not store (offsets left uncommitted).
EXIT_UNSTORED = 75


@dataclass(frozen=True)
class AppConfig:
    """What the streams app needs; built from rankwatch's Settings by the composition root."""

    app_id: str
    bootstrap: str
    topics: Topics
    max_messages: int = 256
    within_s: float = 0.5
    commit_interval_s: float = 1.0


def raw_table(kind: str) -> str:
    return kind


class StreamsApp:
    """Holds the Faust app, the sinks and their stats; `app` is what a faust.Worker runs."""

    def __init__(self, cfg: AppConfig, store: Store, dlq_store: Any = None) -> None:
        self.cfg = cfg
        self.store = store
        self.dlq_store = dlq_store
        self.stopping = False
        self.app = faust.App(
            cfg.app_id,
            broker=f"kafka://{cfg.bootstrap}",
            store="memory://",
            web_enabled=False,
            consumer_auto_offset_reset="earliest",
            broker_commit_interval=cfg.commit_interval_s,
            topic_disable_leader=True,
            producer_compression_type="zstd",
        )
        self.dlq_topic = self.app.topic(cfg.topics.dlq, value_serializer="raw",
                                        key_serializer="raw")
        self.sinks: dict[str, RawSink] = {}
        for kind in MODELS:
            self._add_raw_agent(kind)
        self._add_jobs_agent()
        self.app.on_partitions_assigned.connect(self._on_assigned)
        self.app.on_before_shutdown.connect(self._on_shutdown)

    # -- agents ------------------------------------------------------------------------------

    def _add_raw_agent(self, kind: str) -> None:
        sink = RawSink(kind, raw_table(kind), self.store, self._dead_letters,
                       stopping=lambda: self.stopping)
        self.sinks[kind] = sink
        topic = self.app.topic(self.cfg.topics.for_kind(kind), value_serializer="raw",
                               key_serializer="raw")

        async def consume(stream: faust.StreamT[bytes]) -> None:
            async for events in stream.take_events(self.cfg.max_messages, self.cfg.within_s):
                msgs = [Message(e.message.topic, e.message.partition, e.message.offset,
                                e.message.value) for e in events]
                try:
                    await sink.process(msgs)
                except BaseException:
                    log.critical("stopping with unstored %s rows; exiting without committing "
                                 "their offsets so they are delivered again", kind)
                    os._exit(EXIT_UNSTORED)

        self.app.agent(topic, name=f"rankwatch.ingest.{kind}", concurrency=1)(consume)

    def _add_jobs_agent(self) -> None:
        topic = self.app.topic(self.cfg.topics.jobs, value_serializer="raw", key_serializer="raw")

        async def consume(stream: faust.StreamT[bytes]) -> None:
            async for events in stream.take_events(64, self.cfg.within_s):
                topos, dead = [], []
                for e in events:
                    m = e.message
                    try:
                        rb = decode_batch(m.value)
                        if rb.kind != "jobs":
                            raise BatchError(f"a {rb.kind!r} batch on the jobs topic", "kind")
                        topos.extend(rb.topologies)
                    except BatchError as err:
                        dead.append(DeadLetter(m.topic, m.partition, m.offset, err, m.value))
                try:
                    if topos and hasattr(self.store, "write_topologies"):
                        await self.store.write_topologies(topos)
                    if dead:
                        await self._dead_letters(dead)
                except BaseException:
                    log.critical("stopping with unstored topologies; exiting uncommitted")
                    os._exit(EXIT_UNSTORED)

        self.app.agent(topic, name="rankwatch.ingest.jobs", concurrency=1)(consume)

    # -- dead letters and lifecycle --------------------------------------------------------

    async def _dead_letters(self, dead: Sequence[DeadLetter]) -> None:
        """Durable in the DLQ topic before the source offsets are committed; also in SQL."""
        for d in dead:
            log.warning("dead letter %s[%d]@%d: %s", d.topic, d.partition, d.offset, d.error)
            fut = await self.dlq_topic.send(key=f"{d.topic}:{d.partition}".encode(),
                                            value=orjson.dumps(d.to_json()))
            await fut
        if self.dlq_store is not None:
            await self.dlq_store(dead)

    async def _on_assigned(self, sender: Any, assigned: Any, **kwargs: Any) -> None:
        for sink in self.sinks.values():
            sink.forget_partitions()

    async def _on_shutdown(self, sender: Any, **kwargs: Any) -> None:
        self.stopping = True

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for kind, s in self.sinks.items():
            st = s.stats
            out[kind] = {"messages": st.messages, "rows": st.rows, "inserts": st.inserts,
                         "skipped_messages": st.skipped_messages,
                         "dead_letters": st.dead_letters, "insert_retries": st.insert_retries,
                         "lag_ms_p50": st.lag_ms_p50, "lag_ms_max": st.lag_ms_max}
        return out


def metrics_rows(stats: dict[str, Any], worker: str) -> dict[str, np.ndarray]:
    """The per-kind counters as columns for the ingest_metrics table."""
    kinds = [k for k, v in stats.items() if v["messages"]]
    now = time.time_ns()
    return {
        "ts": np.full(len(kinds), now, np.int64),
        "worker": np.asarray([worker] * len(kinds), dtype=object),
        "kind": np.asarray(kinds, dtype=object),
        "messages": np.asarray([stats[k]["messages"] for k in kinds], np.int64),
        "rows": np.asarray([stats[k]["rows"] for k in kinds], np.int64),
        "dead_letters": np.asarray([stats[k]["dead_letters"] for k in kinds], np.int64),
        "lag_ms_p50": np.asarray([stats[k]["lag_ms_p50"] for k in kinds], np.float64),
        "lag_ms_max": np.asarray([stats[k]["lag_ms_max"] for k in kinds], np.float64),
    }
