"""`rankwatch notify`: follow rw.diagnoses with its own consumer group and deliver every version
to the sinks its routes name — at least once, deduplicated by `id`, committed after delivery.

The consumer thread decodes and routes; each sink has its own delivery thread
(diagnosis.sinks.delivery), so a sink that is down only grows its own queue. The offset of a
message is committed when every sink routed to is done with it (diagnosis.sinks.offsets); a
sink that exhausts its attempts dead-letters the version to the DLQ topic (rw.dlq, in the same
shape as the ingest dead letters, with `field` = `notify.<sink>`), durably, before it counts as
done. A message that is not a valid diagnosis is dead-lettered at once. A new consumer group
starts at the topic's beginning and skips versions older than `max_age_s`. When more than
`max_pending` messages wait, the consumer pauses its partitions until the sinks catch up.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from pydantic import ValidationError

from diagnosis.model import Diagnosis
from diagnosis.sinks.alertmanager import AlertmanagerSink
from diagnosis.sinks.base import Sink
from diagnosis.sinks.config import NotifyConfig
from diagnosis.sinks.delivery import Item, Post, SinkWorker, http_post
from diagnosis.sinks.offsets import TP, OffsetBook
from diagnosis.sinks.pagerduty import PagerDutySink
from diagnosis.sinks.slack import DEFAULT_MIN_INTERVAL_S, SlackSink
from diagnosis.sinks.state import Ledger
from diagnosis.sinks.webhook import WebhookSink

log = logging.getLogger("rankwatch.notify")


def build_sinks(cfg: NotifyConfig, ledger: Ledger) -> dict[str, Sink]:
    out: dict[str, Sink] = {}
    for name, s in cfg.sinks.items():
        if s.type == "alertmanager":
            out[name] = AlertmanagerSink(name, s.url, ledger, cfg.resend_s, cfg.page_url)
        elif s.type == "pagerduty":
            out[name] = PagerDutySink(name, s.url, s.routing_key, cfg.page_url)
        elif s.type == "slack":
            out[name] = SlackSink(name, s.url, cfg.page_url)
        else:
            out[name] = WebhookSink(name, s.url, s.secret)
    return out


@dataclass
class NotifyStats:
    received: int = 0
    invalid: int = 0
    #: matched no route, or older than max_age_s
    unrouted: int = 0
    commits: int = 0
    latencies: dict[str, list[float]] = field(default_factory=dict)


class Notifier:
    """The service. `run(stop)` blocks until `stop` is set; `workers` and `stats` are for
    metrics and tests."""

    def __init__(self, cfg: NotifyConfig, *, bootstrap: str, topic: str, dlq_topic: str,
                 ledger_path: Path, start: str = "earliest", post: Post = http_post,
                 on_delivered: Callable[[str, Item, float], None] | None = None) -> None:
        self.cfg = cfg
        self.topic, self.dlq_topic = topic, dlq_topic
        self.ledger = Ledger(ledger_path)
        # a version older than max_age_s is skipped before the ledger is asked: keep twice that
        self.ledger.prune(max(2 * cfg.max_age_s, 7 * 86400.0))
        self._stopping = threading.Event()
        self.book = OffsetBook()
        self.stats = NotifyStats()
        self._on_delivered = on_delivered
        self.consumer = Consumer({
            "bootstrap.servers": bootstrap, "group.id": cfg.group_id,
            "enable.auto.commit": False, "auto.offset.reset": start,
            "fetch.wait.max.ms": 100, "session.timeout.ms": 10_000,
            "client.id": f"rankwatch-notify-{cfg.group_id}"})
        self.producer = Producer({"bootstrap.servers": bootstrap, "acks": "all",
                                  "enable.idempotence": True, "linger.ms": 5,
                                  "client.id": "rankwatch-notify-dlq"})
        self._dlq_lock = threading.Lock()
        self.workers: dict[str, SinkWorker] = {}
        for name, sink in build_sinks(cfg, self.ledger).items():
            s = cfg.sinks[name]
            interval = s.min_interval_s or (DEFAULT_MIN_INTERVAL_S if s.type == "slack" else 0.0)
            self.workers[name] = SinkWorker(
                sink, self.ledger, self._dead_letter, max_attempts=cfg.max_attempts_of(name),
                backoff_s=cfg.backoff_s, backoff_max_s=cfg.backoff_max_s,
                min_interval_s=interval, timeout_s=s.timeout_s, resend_s=cfg.resend_s,
                post=post, on_delivered=self._delivered)
        self._paused = False
        self.assigned = threading.Event()

    # -- callbacks from the sink threads -------------------------------------------------

    def _delivered(self, sink: str, item: Item, latency: float) -> None:
        self.stats.latencies.setdefault(sink, []).append(latency)
        del self.stats.latencies[sink][:-10_000]
        if self._on_delivered is not None:
            self._on_delivered(sink, item, latency)

    def _dead_letter(self, sink: str, item: Item, reason: str, attempts: int) -> bool:
        topic, partition, offset = item.source
        return self._publish_dead({
            "v": 1, "source": {"topic": topic, "partition": partition, "offset": offset},
            "field": f"notify.{sink}", "row": -1, "reason": reason, "sink": sink,
            "id": item.d.id, "attempts": attempts,
            "payload_b64": base64.b64encode(item.raw).decode()}, key=item.d.job_id)

    def _publish_dead(self, record: Mapping[str, Any], key: str) -> bool:
        """Produce one dead letter and wait until the broker has it; False if it could not."""
        errors: list[str] = []

        def ack(err: Any, _msg: Any) -> None:
            if err is not None:
                errors.append(str(err))

        with self._dlq_lock:
            try:
                self.producer.produce(self.dlq_topic, value=orjson.dumps(record),
                                      key=key.encode(), on_delivery=ack)
            except (BufferError, KafkaException) as e:
                errors.append(str(e))
            else:
                left = self.producer.flush(30)
                if left:
                    errors.append("not acknowledged within 30 s")
        if errors:
            log.error("dead-letter topic %s: %s", self.dlq_topic, errors[0])
        return not errors

    # -- the consumer thread -------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        log.info("assigned %s", [(p.topic, p.partition) for p in parts])
        self.assigned.set()

    def _on_revoke(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        self._commit()
        self.book.forget([(p.topic, p.partition) for p in parts])

    def handle(self, topic: str, partition: int, offset: int, raw: bytes) -> None:
        """Decode, route and hand one message to its sinks."""
        self.stats.received += 1
        tp: TP = (topic, partition)
        try:
            d = Diagnosis.model_validate_json(raw)
        except ValidationError as e:
            self.stats.invalid += 1
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(record)"
            done = self.book.add(tp, offset, 1)
            rec = {"v": 1, "source": {"topic": topic, "partition": partition, "offset": offset},
                   "field": where, "row": -1, "reason": f"not a diagnosis: {first['msg']}",
                   "payload_b64": base64.b64encode(raw[: 1 << 20]).decode()}
            while not self._publish_dead(rec, key=f"{topic}:{partition}"):
                if self._stopping.wait(1.0):
                    return  # uncommitted: the next run dead-letters it
            done("invalid")
            return
        age_s = (time.time_ns() - d.detected_ns) / 1e9
        sinks = self.cfg.route(d) if age_s <= self.cfg.max_age_s else []
        if not sinks:
            self.stats.unrouted += 1
        done = self.book.add(tp, offset, len(sinks))
        for s in sinks:
            self.workers[s].submit(Item(d, raw, done, (topic, partition, offset)))

    def _commit(self) -> None:
        commits = self.book.take_commits()
        if not commits:
            return
        offsets = [TopicPartition(t, p, o) for (t, p), o in commits.items()]
        try:
            self.consumer.commit(offsets=offsets, asynchronous=False)
            self.stats.commits += 1
        except KafkaException as e:
            log.warning("commit failed (%s); the messages will be redelivered and "
                        "recognised by id", e)

    def _backpressure(self) -> None:
        full = self.book.pending() >= self.cfg.max_pending
        if full != self._paused:
            parts = self.consumer.assignment()
            (self.consumer.pause if full else self.consumer.resume)(parts)
            self._paused = full
            log.info("%s polling: %d versions wait for their sinks",
                     "paused" if full else "resumed", self.book.pending())

    def run(self, stop: threading.Event) -> None:
        self._stopping = stop  # a dead letter that cannot be written waits on it
        for w in self.workers.values():
            w.start()
        self.consumer.subscribe([self.topic], on_assign=self._on_assign,
                                on_revoke=self._on_revoke)
        last_commit = time.monotonic()
        try:
            while not stop.is_set():
                self._backpressure()
                m = self.consumer.poll(0.05)
                if m is not None:
                    err = m.error()
                    if err is None:
                        self.handle(m.topic() or "", m.partition() or 0, m.offset() or 0,
                                    m.value() or b"")
                    elif not err.retriable() and err.fatal():
                        raise KafkaException(err)
                    else:
                        log.warning("consumer: %s", err)
                if time.monotonic() - last_commit >= 0.2:
                    self._commit()
                    last_commit = time.monotonic()
        finally:
            for w in self.workers.values():
                w.stop()
            for w in self.workers.values():
                w.join(timeout=15)
            self._commit()
            self.consumer.close()
            self.producer.flush(10)
            close = getattr(self.producer, "close", None)
            if close is not None:  # stop its threads now; releases without close() do at GC
                close()
            self.ledger.close()
