"""The Faust app: one agent per raw record kind, each storing its topic into ClickHouse.

Known traps this module is built around (faust-streaming 0.15.3, chdb 26.9):
- agent concurrency stays 1: with more, Faust can commit past a message still in flight
  (faust-streaming issue #606); scale with partitions and workers instead;
- `take_events` acks the whole buffer when the loop body returns, *and also when the body
  raises* (its `finally` acks). So the insert finishes inside the body, failures are retried
  there, and if the worker must stop while rows are still not stored it exits the process hard
  (`os._exit`) so the unstored offsets are never committed;
- windowing happens in our own code (Faust's windowed tables expire on wall-clock time);
- at-least-once plus idempotent inserts (streams.raw_sink), not Faust's exactly-once mode;
- Faust's producer turns Kafka's idempotence on only in exactly-once mode, so a send retried
  across a partition leader change could be written twice: `App` makes it idempotent always
  (`IdempotentProducer`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import faust
import orjson
from faust.streams import Stream
from faust.transport.drivers.aiokafka import Producer as KafkaProducer
from faust.types import ProducerT, StreamT

from ingest.backoff import Backoff, retry
from ingest.batch import BatchError, decode_batch
from ingest.records import MODELS
from ingest.topics import MAX_MESSAGE_BYTES, Topics
from streams.batching import LingerStream
from streams.ownership import Ownership
from streams.raw_sink import DeadLetter, Message, RawSink, TimeBounds, refused_by_store
from streams.reports import Extent, ReportError, check_times, decode_report
from streams.store import ClickHouseStore

log = logging.getLogger(__name__)

#: Raw kinds a diagnosis waits on — a hang's positions and silence (ops, beats), a slowdown's
#: steps (stages) — written within `AppConfig.latency_within_s`; the bulk kinds (kernels,
#: flows, chunks, work requests) feed windows of seconds and keep the longer batching.
#: `take_events` flushes on a timer's grid, not when the stream goes quiet: a batch waits
#: for the timer's next turn, on average half its period (streams/batching.py). A job's
#: topology (`jobs`, a few records per job) is waited on too: the trigger agents read
#: nothing of a job before it is stored.
LATENCY_KINDS = frozenset({"ops", "stages", "beats", "jobs"})

#: Exit code when the worker stops with rows it could not store (offsets left uncommitted).
EXIT_UNSTORED = 75
#: Waits (s) between tries of a topology insert or a dead letter's publish while the store or
#: the broker is out: the first, and the most (ingest.backoff).
RETRY_S = (0.2, 10.0)


@dataclass(frozen=True)
class AppConfig:
    """What the streams app needs; built from rankwatch's Settings by the composition root."""

    app_id: str
    bootstrap: str
    topics: Topics
    max_messages: int = 256
    within_s: float = 0.5
    #: the wait of `LATENCY_KINDS` (at most `within_s`)
    latency_within_s: float = 0.1
    commit_interval_s: float = 1.0
    #: Consumer-group session timeout (heartbeats every sixth of it, at most 3 s).
    session_timeout_s: float = 60.0
    #: Plausible event times around the producer's clock (streams.raw_sink.TimeBounds); None
    #: accepts any time the contract does.
    bounds: TimeBounds | None = None

    def within(self, kind: str) -> float:
        """How long the writer of raw `kind` waits to fill a batch."""
        return min(self.within_s, self.latency_within_s) if kind in LATENCY_KINDS \
            else self.within_s


class IdempotentProducer(KafkaProducer):
    """Faust's Kafka producer with idempotence on (acks=all, a producer id and per-partition
    sequence numbers): the broker writes a batch retried after a lost answer or a leader
    change once. Derived records, triggers, diagnoses and dead letters go through it."""

    def _settings_extra(self) -> Any:
        return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}


class App(faust.App):
    """faust.App whose producer is `IdempotentProducer`."""

    def _new_producer(self) -> ProducerT:
        return IdempotentProducer(self.transport, loop=self.loop, beacon=self.beacon)


def raw_table(kind: str) -> str:
    return kind


def _timestamp_ns(message: Any) -> int:
    """A consumed message's Kafka timestamp in ns (its producer's clock), 0 when it has none."""
    ts = getattr(message, "timestamp", None)
    try:
        return int(float(ts) * 1e9) if ts and float(ts) > 0 else 0
    except (TypeError, ValueError, OverflowError):
        return 0


class StreamsApp:
    """Holds the Faust app, the sinks and their stats; `app` is what a faust.Worker runs."""

    def __init__(self, cfg: AppConfig, store: ClickHouseStore,
                 ownership: Ownership | None = None) -> None:
        self.cfg = cfg
        #: The jobs this worker owns (streams/ownership.py), from each assignment of the ops
        #: topic's partitions; shared with the derived runner and the diagnosis agents.
        self.ownership = ownership or Ownership(standalone=False)
        self.store = store
        self.stopping = False
        self.app = App(
            cfg.app_id,
            broker=f"kafka://{cfg.bootstrap}",
            store="memory://",
            web_enabled=False,
            consumer_auto_offset_reset="earliest",
            broker_commit_interval=cfg.commit_interval_s,
            broker_session_timeout=cfg.session_timeout_s,
            broker_heartbeat_interval=min(3.0, cfg.session_timeout_s / 6),
            topic_disable_leader=True,
            producer_compression_type="zstd",
            # the broker's message.max.bytes (rankwatch/kafka/broker.py): a raw message of any
            # size the broker took can be forwarded to the dead-letter topic
            producer_max_request_size=MAX_MESSAGE_BYTES,
            # take_events sleeps while nothing comes (streams/batching.py)
            Stream=LingerStream,
        )
        self.dlq_topic = self.app.topic(cfg.topics.dlq, value_serializer="raw",
                                        key_serializer="raw")
        self.sinks: dict[str, RawSink] = {}
        self.dead_lettered = 0
        #: reports on the `stored` topic that were not reports (add_reports_agent)
        self.bad_reports = 0
        #: Called with (exit code, reason) before the worker exits uncommitted.
        self.on_exit: Callable[[int, str], None] | None = None
        self._commits: dict[Any, tuple[int | None, float]] = {}  # tp -> (committed, since)
        #: The derived runner (streams.derived.DerivedRunner) when the composition root adds one.
        self.derived: Any = None
        for kind in MODELS:
            self._add_raw_agent(kind)
        self._add_jobs_agent()
        # mode's Signal.connect annotation does not admit coroutine functions; it calls them fine
        self.app.on_partitions_assigned.connect(self._on_assigned)  # type: ignore[arg-type]
        self.app.on_before_shutdown.connect(self._on_shutdown)  # type: ignore[arg-type]

    # -- agents ------------------------------------------------------------------------------

    def _add_raw_agent(self, kind: str) -> None:
        sink = RawSink(kind, raw_table(kind), self.store, self._dead_letters,
                       stopping=lambda: self.stopping, bounds=self.cfg.bounds,
                       on_skipped=getattr(self.store, "skipped", None))
        self.sinks[kind] = sink
        topic = self.app.topic(self.cfg.topics.for_kind(kind), value_serializer="raw",
                               key_serializer="raw")
        within = self.cfg.within(kind)

        async def consume(stream: StreamT[Any]) -> None:
            stream_ = cast(Stream[bytes], stream)
            async for events in stream_.take_events(self.cfg.max_messages, within):
                msgs = [Message(e.message.topic, e.message.partition, e.message.offset,
                                e.message.value or b"", _timestamp_ns(e.message))
                        for e in events]
                try:
                    await sink.process(msgs)
                except BaseException as e:
                    log.critical("stopping with unstored %s rows; exiting without committing "
                                 "their offsets so they are delivered again", kind,
                                 exc_info=True)
                    self.exit_unstored(f"{kind}: {type(e).__name__}: {e}")

        self.app.agent(topic, name=f"rankwatch.ingest.{kind}", concurrency=1)(consume)

    def _add_jobs_agent(self) -> None:
        topic = self.app.topic(self.cfg.topics.jobs, value_serializer="raw", key_serializer="raw")

        async def consume(stream: StreamT[Any]) -> None:
            within = self.cfg.within("jobs")
            async for events in cast(Stream[bytes], stream).take_events(64, within):
                topos: list[tuple[Any, Any]] = []
                dead: list[DeadLetter] = []
                for e in events:
                    m = e.message
                    try:
                        rb = decode_batch(m.value or b"")
                        if rb.kind != "jobs":
                            raise BatchError(f"a {rb.kind!r} batch on the jobs topic", "kind")
                        topos.extend((m, t) for t in rb.topologies)
                    except BatchError as err:
                        dead.append(DeadLetter(m.topic, m.partition, m.offset, err, m.value or b""))
                try:
                    if dead:
                        await self._dead_letters(dead)
                    if topos:
                        first, last = events[0].message, events[-1].message
                        await self._write_topologies(
                            topos, f"jobs:{first.partition}:{first.offset}-{last.offset}", events)
                except BaseException as e:
                    log.critical("stopping with unstored topologies; exiting uncommitted",
                                 exc_info=True)
                    self.exit_unstored(f"jobs: {type(e).__name__}: {e}")

        self.app.agent(topic, name="rankwatch.ingest.jobs", concurrency=1)(consume)

    def add_reports_agent(self, fold: Callable[[Sequence[list[Extent]]], Awaitable[None]]
                          ) -> None:
        """Read the `stored` topic (what other workers stored of the jobs this worker owns:
        streams/reports.py) into `fold` (`ObservingStore.fold_reports`), retried while it fails
        (the store out); a malformed report, or one with times no stored batch could have
        (`check_times` with the raw sinks' bounds), is logged, counted and skipped. Subscribed
        with the job-keyed topics' partition count, so a job's reports reach its owner."""
        topic = self.app.topic(self.cfg.topics.stored, value_serializer="raw",
                               key_serializer="raw")
        within = self.cfg.within("ops")

        async def consume(stream: StreamT[Any]) -> None:
            async for events in cast(Stream[bytes], stream).take_events(256, within):
                reports = []
                for e in events:
                    try:
                        exts = decode_report(e.message.value or b"")
                        if self.cfg.bounds is not None:  # the raw batches' bounds (future)
                            ref = _timestamp_ns(e.message) or time.time_ns()
                            check_times(exts, self.cfg.bounds.min_ns,
                                        ref + self.cfg.bounds.future_ns)
                        reports.append(exts)
                    except ReportError as err:
                        self.bad_reports += 1
                        log.warning("bad report %s[%d]@%d skipped: %s", e.message.topic,
                                    e.message.partition, e.message.offset, err)
                try:
                    await retry(functools.partial(fold, reports), Backoff(*RETRY_S),
                                self._again("folding stored reports"))
                except BaseException as e:
                    log.critical("stopping with unfolded reports; exiting without committing "
                                 "them so they are delivered again", exc_info=True)
                    self.exit_unstored(f"stored reports: {type(e).__name__}: {e}")

        self.app.agent(topic, name="rankwatch.ingest.stored", concurrency=1)(consume)

    async def _write_topologies(self, topos: list[tuple[Any, Any]], token: str,
                                events: Sequence[Any]) -> None:
        """Store topologies in one insert, retried while the store is out; when the store refuses
        them, one message at a time, dead-lettering the messages it still refuses."""
        try:
            await self._retrying(lambda: self.store.write_topologies([t for _, t in topos], token))
            return
        except _Refused as r:
            log.warning("jobs: the store refused %d topologies (%s); storing them one message "
                        "at a time", len(topos), r.error)
        for m in dict.fromkeys(m for m, _ in topos):
            mine = [t for mm, t in topos if mm is m]
            try:
                await self._retrying(lambda mine=mine, m=m: self.store.write_topologies(
                    mine, f"jobs:{m.partition}:{m.offset}-{m.offset}"))
            except _Refused as r:
                err = BatchError(f"the store refused the topology: {type(r.error).__name__}: "
                                 f"{' '.join(str(r.error).split())[:2000]}")
                await self._dead_letters([DeadLetter(m.topic, m.partition, m.offset, err,
                                                     m.value or b"")])

    async def _retrying(self, write: Any) -> None:
        """`write()`, retried while the store is out; _Refused when the store refuses the rows."""

        def again(e: Exception, wait: float) -> bool:
            if refused_by_store(e):
                raise _Refused(e) from e
            if self.stopping:
                return False
            log.warning("jobs: storing topologies failed (%s: %s); retrying in %.1fs",
                        type(e).__name__, e, wait)
            return True

        await retry(write, Backoff(*RETRY_S), again)

    # -- dead letters and lifecycle --------------------------------------------------------

    async def _send_dead_letter(self, key: bytes, value: bytes) -> None:
        fut = await self.dlq_topic.send(key=key, value=value)
        await fut

    def _again(self, what: str) -> Callable[[Exception, float], bool]:
        """For `ingest.backoff.retry`: try `what` again after a failure, logged, until the
        worker stops."""

        def again(e: Exception, wait: float) -> bool:
            if self.stopping:
                return False
            log.warning("%s failed (%s: %s); retrying in %.1fs", what, type(e).__name__, e,
                        wait)
            return True

        return again

    async def _dead_letters(self, dead: Sequence[DeadLetter]) -> None:
        """Durable in the DLQ topic before the source offsets are committed; also in SQL. A
        dead letter carries at most streams.raw_sink.DLQ_PAYLOAD_MAX bytes of its message, so
        it fits the topic; publishing is retried while the broker is out (until the worker
        stops: then the caller exits uncommitted and the message comes again)."""
        for d in dead:
            log.warning("dead letter %s[%d]@%d: %s", d.topic, d.partition, d.offset, d.reason())
            send = functools.partial(self._send_dead_letter, f"{d.topic}:{d.partition}".encode(),
                                     orjson.dumps(d.to_json()))
            await retry(send, Backoff(*RETRY_S), self._again("publishing a dead letter"))
        self.dead_lettered += len(dead)
        try:  # the topic has them: the table is a convenience and must not stop the stream
            await self.store.write_dead_letters(dead)
        except Exception:
            log.exception("storing %d dead letters in the dlq table failed; they are in the "
                          "%s topic", len(dead), self.cfg.topics.dlq)

    async def _on_assigned(self, sender: Any, *args: Any, signal: Any = None,
                           **kwargs: Any) -> None:
        for sink in self.sinks.values():
            sink.forget_partitions()
        ops = self.cfg.topics.ops
        mine = [tp.partition for tp in self.app.consumer.assignment() if tp.topic == ops]
        count = self._partition_count(ops)
        if not count:
            log.error("no partition count known for %s after an assignment: this worker owns "
                      "no job until the next one", ops)
            self.ownership.assign([], 1)
            return
        self.ownership.assign(mine, count)
        log.info("assigned partitions %s of %d of %s: owner of the jobs whose home partition "
                 "is among them", sorted(mine), count, ops)

    def _partition_count(self, topic: str) -> int:
        """The topic's partition count: Faust's (known to the group leader), else the consumer
        client's cluster metadata (every member has it for the topics it subscribed to)."""
        n = self.app.consumer.topic_partitions(topic)
        if n:
            return int(n)
        try:  # aiokafka's consumer inside Faust's consumer thread
            client = self.app.consumer._thread._ensure_consumer()._client  # type: ignore[attr-defined]
            return len(client.cluster.partitions_for_topic(topic) or ())
        except Exception as e:  # another driver, or the consumer is gone
            log.warning("cannot read %s's partition count: %s", topic, e)
            return 0

    def owned_jobs(self, jobs: Iterable[str]) -> frozenset[str]:
        """The jobs among `jobs` this worker owns (streams/ownership.py)."""
        return frozenset(j for j in jobs if self.ownership.owns(j))

    def exit_unstored(self, reason: str) -> None:
        """Exit now, uncommitted (EXIT_UNSTORED), after telling `on_exit` why."""
        try:
            if self.on_exit is not None:
                self.on_exit(EXIT_UNSTORED, reason)
        finally:
            os._exit(EXIT_UNSTORED)

    async def _on_shutdown(self, sender: Any, *args: Any, signal: Any = None,
                           **kwargs: Any) -> None:
        self.stopping = True

    def health(self, stall_s: float, now: float | None = None) -> list[str]:
        """What stops ingest now: a batch not stored for `stall_s` (an insert retrying), or a
        partition with messages waiting whose committed offset has not moved for `stall_s`."""
        now = time.monotonic() if now is None else now
        problems = []
        for kind, sink in self.sinks.items():
            since = sink.busy_since
            if since is not None and now - since > stall_s:
                problems.append(f"ingest of {kind} stalled: a batch has waited {now - since:.0f} s"
                                f" to be stored ({sink.stats.last_error or 'no error yet'})")
        try:
            consumer = self.app.consumer
            committed = getattr(consumer, "_committed_offset", {})
            for tp in consumer.assignment():
                hw, done = consumer.highwater(tp), committed.get(tp)
                lagging = hw is not None and hw > (done or 0)
                seen = self._commits.get(tp)
                if not lagging or seen is None or seen[0] != done:
                    self._commits[tp] = (done, now)
                    continue
                if now - seen[1] > stall_s:
                    problems.append(f"consumer stalled on {tp.topic}[{tp.partition}]: "
                                    f"{hw - (done or 0)} messages waiting, no commit for "
                                    f"{now - seen[1]:.0f} s")
        except Exception as e:  # no consumer yet (starting) or a rebalance in progress
            log.debug("health: consumer state unavailable: %s", e)
        return problems

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for kind, s in self.sinks.items():
            st = s.stats
            out[kind] = {"messages": st.messages, "rows": st.rows, "inserts": st.inserts,
                         "skipped_messages": st.skipped_messages,
                         "dead_letters": st.dead_letters, "insert_retries": st.insert_retries}
            lag = self.store.writer.last_lag.get(kind)
            if lag is not None:
                out[kind].update(lag_ms_p50=lag.p50_ms, lag_ms_max=lag.max_ms)
        return out

    def derived_stats(self) -> dict[str, Any]:
        if self.derived is None:
            return {}
        st = self.derived.stats
        return {"windows": dict(st.windows), "rows": dict(st.rows),
                "late_recomputed": st.late_recomputed, "errors": st.errors,
                "kernel_windows_from_memory": self.derived.kernels.buffer.hits,
                "kernel_windows_read_back": self.derived.kernels.buffer.misses,
                "last_error": st.last_error}


class _Refused(Exception):
    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error
