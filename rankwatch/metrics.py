"""Prometheus metrics (`/metrics`) of the worker, the host agent and notify.

Each process exposes one registry on its own loopback port (settings.metrics_port for the
worker, `rankwatch agent --metrics-port`, `rankwatch notify --metrics-port`). Figures are read
from the counters the parts already keep, at scrape time (custom collectors: nothing is added to
the hot paths), except the insert latency, a histogram around the writer's insert, and the
consumer lag, which a background thread asks Kafka for every `LAG_INTERVAL_S` (the group's
committed offsets against each partition's high watermark).

A port that cannot be bound is logged and skipped: metrics never stop the process they watch.
examples/prometheus-rules.yml has alert rules for the stack's own health on these names.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("rankwatch.metrics")
LAG_INTERVAL_S = 10.0
INSERT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def serve(registry: CollectorRegistry, host: str, port: int) -> bool:
    """Serve `registry` at http://host:port/metrics in a daemon thread; False if it could not."""
    if port <= 0:
        return False
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        log.warning("metrics: cannot listen on %s:%d (%s); running without /metrics", host,
                    port, e.strerror)
        return False
    log.info("metrics on http://%s:%d/metrics", host, port)
    return True


def _counter(name: str, doc: str, label: str, values: dict[str, float]) -> Metric:
    m = CounterMetricFamily(name, doc, labels=[label])
    for k, v in sorted(values.items()):
        m.add_metric([k], v)
    return m


def _gauge(name: str, doc: str, labels: list[str],
           values: Iterable[tuple[list[str], float]]) -> Metric:
    m = GaugeMetricFamily(name, doc, labels=labels)
    for k, v in values:
        m.add_metric(k, v)
    return m


# -- the worker --------------------------------------------------------------------------------


class ConsumerLag:
    """Messages behind per topic of one consumer group, refreshed in a daemon thread."""

    def __init__(self, bootstrap: str, group: str, topics: list[str],
                 interval_s: float = LAG_INTERVAL_S) -> None:
        self.bootstrap, self.group, self.topics = bootstrap, group, topics
        self.interval_s = interval_s
        self.lag: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-lag", daemon=True)

    def start(self) -> ConsumerLag:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        from confluent_kafka import Consumer

        c = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.group,
                      "enable.auto.commit": False})
        try:
            while not self._stop.is_set():
                try:
                    self.lag = self.measure(c)
                except Exception as e:  # a broker hiccup: keep the last figures
                    log.debug("consumer lag: %s", e)
                self._stop.wait(self.interval_s)
        finally:
            c.close()

    def measure(self, c: Any) -> dict[str, int]:
        from confluent_kafka import TopicPartition

        meta = c.list_topics(timeout=5)
        parts = [TopicPartition(t, p) for t in self.topics if t in meta.topics
                 for p in meta.topics[t].partitions]
        out: dict[str, int] = dict.fromkeys([t for t in self.topics if t in meta.topics], 0)
        for tp in c.committed(parts, timeout=5) if parts else []:
            low, high = c.get_watermark_offsets(TopicPartition(tp.topic, tp.partition),
                                                timeout=5)
            start = tp.offset if tp.offset >= 0 else low
            out[tp.topic] += max(0, high - start)
        return out


class WorkerCollector(Collector):
    """Scrape-time figures of a running worker (`rankwatch.commands.worker.build`'s app)."""

    def __init__(self, sapp: Any, lag: ConsumerLag | None = None,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.sapp, self.lag, self.clock = sapp, lag, clock

    def collect(self) -> Iterator[Metric]:
        stats: dict[str, dict[str, Any]] = self.sapp.stats()

        def per_kind(key: str) -> dict[str, float]:
            return {k: float(s.get(key, 0)) for k, s in stats.items()}

        yield _counter("rankwatch_records_stored", "Records stored in ClickHouse", "kind",
                       per_kind("rows"))
        yield _counter("rankwatch_messages_stored", "Kafka record batches stored", "kind",
                       per_kind("messages"))
        yield _counter("rankwatch_dead_letters", "Batches dead-lettered (rw.dlq) with a reason",
                       "kind", per_kind("dead_letters"))
        yield _counter("rankwatch_insert_retries", "ClickHouse inserts retried", "kind",
                       per_kind("insert_retries"))
        yield _gauge("rankwatch_ingest_lag_seconds", "Stored time minus record time, last "
                     "insert", ["kind", "stat"],
                     [([k, q], s[f"lag_ms_{q}"] / 1e3) for k, s in sorted(stats.items())
                      for q in ("p50", "max") if f"lag_ms_{q}" in s])
        if self.lag is not None:
            yield _gauge("rankwatch_consumer_lag_messages", "Messages not yet committed by the "
                         "worker's consumer group", ["topic"],
                         [([t], float(n)) for t, n in sorted(self.lag.lag.items())])
        store: Any = getattr(self.sapp, "store", None)
        if hasattr(store, "reports_sent"):
            yield _counter("rankwatch_stored_reports", "Reports of raw batches stored for "
                           "another worker's job (streams/reports.py): sent, folded by the "
                           "owner, read for a job owned elsewhere, malformed", "what",
                           {"sent": float(store.reports_sent),
                            "folded": float(store.reports_folded),
                            "not_owned": float(store.reports_not_owned),
                            "malformed": float(getattr(self.sapp, "bad_reports", 0))})
        yield from self._derived()
        yield from self._diagnosis()

    def _derived(self) -> Iterator[Metric]:
        runner = getattr(self.sapp, "derived", None)
        if runner is None:
            return
        st = runner.stats
        yield _counter("rankwatch_derived_windows", "Derived windows closed", "kind",
                       {k: float(v) for k, v in st.windows.items()})
        yield _counter("rankwatch_derived_windows_skipped", "Derived windows skipped over "
                       "stretches of event time without records", "kind",
                       {k: float(v) for k, v in dict(runner.windows.skipped_windows).items()})
        errors = CounterMetricFamily("rankwatch_derived_errors", "Derived ticks that failed")
        errors.add_metric([], float(st.errors))
        yield errors
        lag: dict[str, float] = {}
        for job in list(runner.windows.jobs.values()):
            for kind, ks in list(job.kinds.items()):
                behind = max(0, job.max_ns - ks.next_start) / 1e9
                lag[kind] = max(lag.get(kind, 0.0), behind)
        yield _gauge("rankwatch_derived_window_lag_seconds", "Newest event time minus the "
                     "start of the first window not closed, worst job", ["kind"],
                     [([k], v) for k, v in sorted(lag.items())])

    def _diagnosis(self) -> Iterator[Metric]:
        agents = getattr(self.sapp, "diagnosis", None)
        if agents is None:
            return
        yield _counter("rankwatch_triggers", "Triggers published", "kind",
                       {k: float(v) for k, v in dict(agents.trigger_counts).items()})
        yield _counter("rankwatch_trigger_batches_dropped", "Batches the trigger agents "
                       "dropped: stored beats or stage records while behind, or waiting for "
                       "a job's topology too long",
                       "reason", {"beats_queue_full": float(agents.beats_dropped),
                                  "stages_queue_full": float(agents.stages_dropped),
                                  "topology_wait": float(agents.waiting_dropped)})
        yield _counter("rankwatch_analysis_cpu_seconds", "The worker's CPU spent diagnosing "
                       "(the analyst's thread and its reads on the database thread): a "
                       "trigger's analysis, pending slowdown tries as evidence is stored, the "
                       "timer's sweeps and re-checks", "work",
                       {k: float(v) for k, v in dict(agents.analysis_cpu_s).items()})
        by = Counter((d.kind, d.status) for d in list(agents.published))
        m = CounterMetricFamily("rankwatch_diagnoses", "Diagnosis versions published",
                                labels=["kind", "status"])
        for (kind, status), n in sorted(by.items()):
            m.add_metric([kind, status], float(n))
        yield m
        open_by = Counter(cls for _job, cls in list(agents.analyst.book.open))
        yield _gauge("rankwatch_open_incidents", "Incidents open now", ["class"],
                     [([c], float(open_by.get(c, 0))) for c in ("hang", "performance")])


def time_inserts(writer: Any, registry: CollectorRegistry) -> None:
    """Observe the duration of each `writer.write` insert per kind."""
    hist = Histogram("rankwatch_insert_duration_seconds", "One ClickHouse insert of record "
                     "batches", ["kind"], registry=registry, buckets=INSERT_BUCKETS)
    write = writer.write

    @functools.wraps(write)
    async def timed(kind: str, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await write(kind, *args, **kwargs)
        finally:
            hist.labels(kind).observe(time.perf_counter() - t0)

    writer.write = timed


# -- the host agent ----------------------------------------------------------------------------


class AgentCollector(Collector):
    """Per-ring drops and backlog and the agent's totals (ingest.agent.agent.Agent)."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        drops = CounterMetricFamily("rankwatch_ring_drops", "Records a rank's tracepoints "
                                    "dropped because its ring was full",
                                    labels=["job_id", "rank", "source"])
        backlog = GaugeMetricFamily("rankwatch_ring_backlog_bytes", "Unread bytes in a rank's "
                                    "ring", labels=["job_id", "rank", "source"])
        rings = list(self.agent.rings.values())
        for r in rings:
            try:
                st = r.reader.stat()
            except (ValueError, OSError):  # the ring closed between the list and the read
                continue
            labels = [r.job, str(r.rank), r.source]
            drops.add_metric(labels, float(st.drops))
            backlog.add_metric(labels, float(st.pending))
        yield drops
        yield backlog
        totals = self.agent.stats()
        for key, value in sorted(totals.items()):
            if isinstance(value, int | float) and not isinstance(value, bool):
                g = GaugeMetricFamily(f"rankwatch_agent_{key}", f"agent: {key}")
                g.add_metric([], float(value))
                yield g


# -- notify ------------------------------------------------------------------------------------


class NotifyCollector(Collector):
    """Per-sink deliveries, retries, dead letters, backlog and last latency of a Notifier."""

    def __init__(self, notifier: Any) -> None:
        self.notifier = notifier

    def collect(self) -> Iterator[Metric]:
        workers = dict(self.notifier.workers)
        for name, doc in (("delivered", "Versions delivered"),
                          ("duplicates", "Redelivered versions recognised by id"),
                          ("retries", "Failed attempts retried"),
                          ("dead", "Versions dead-lettered")):
            yield _counter(f"rankwatch_notify_{name}", doc, "sink",
                           {n: float(getattr(w.stats, name)) for n, w in workers.items()})
        yield _gauge("rankwatch_notify_backlog", "Versions waiting for a sink", ["sink"],
                     [([n], float(w.backlog())) for n, w in sorted(workers.items())])
        yield _gauge("rankwatch_notify_last_latency_seconds", "Receipt to delivery, last "
                     "version", ["sink"],
                     [([n], w.stats.last_latency_s) for n, w in sorted(workers.items())])
        yield _gauge("rankwatch_notify_sink_up", "1 when the sink's last attempt succeeded",
                     ["sink"], [([n], float(w.stats.up)) for n, w in sorted(workers.items())])
