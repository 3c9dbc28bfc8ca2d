"""Publishing record batches to Kafka (the only module in ingest/ that imports a Kafka client).

One Kafka message is one encoded batch (ingest.batch). The producer is idempotent, compresses
with zstd and lingers a few milliseconds so batches travel together. Keyed messages are placed by
murmur2 (`partitioner=murmur2_random`), as the Java client and aiokafka (Faust) place them, not by
librdkafka's default CRC32: a batch keyed by a job id lands on the job's home partition
(streams.ownership.job_partition) whichever client sent it. `publish` never blocks for
long: when the client's local queue is full it polls for up to `block_s` and then counts the batch
as dropped rather than stalling the caller (training first); `flush` waits for delivery.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from ingest.topics import MAX_MESSAGE_BYTES, Topics


@dataclass
class PublishStats:
    sent: int = 0
    delivered: int = 0
    failed: int = 0
    dropped: int = 0
    bytes: int = 0
    errors: list[str] = field(default_factory=list)


class BatchPublisher:
    """Publishes encoded batches to the raw topic of their kind, keyed for partition spread."""

    def __init__(
        self,
        bootstrap: str,
        topics: Topics | None = None,
        *,
        linger_ms: int = 5,
        block_s: float = 5.0,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.topics = topics or Topics()
        self.block_s = block_s
        self.stats = PublishStats()
        self._lock = threading.Lock()
        conf: dict[str, Any] = {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "compression.type": "zstd",
            "partitioner": "murmur2_random",
            "linger.ms": linger_ms,
            "batch.size": 1 << 20,
            "message.max.bytes": MAX_MESSAGE_BYTES,
            "queue.buffering.max.kbytes": 256 * 1024,
        }
        conf.update(config or {})
        self._producer = Producer(conf)

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        with self._lock:
            if err is None:
                self.stats.delivered += 1
            else:
                self.stats.failed += 1
                if len(self.stats.errors) < 20:
                    self.stats.errors.append(str(err))

    def publish(self, kind: str, data: bytes, key: bytes | str | None = None,
                topic: str | None = None, on_delivery: Callable[..., None] | None = None) -> bool:
        """Queue one encoded batch for its kind's topic (or `topic`). False if dropped."""
        target = topic or self.topics.for_kind(kind)
        waited = 0.0
        while True:
            try:
                self._producer.produce(target, data, key=key,
                                       on_delivery=on_delivery or self._on_delivery)
                break
            except BufferError:
                if waited >= self.block_s:
                    self.stats.dropped += 1
                    return False
                self._producer.poll(0.05)
                waited += 0.05
            except KafkaException as e:
                self.stats.dropped += 1
                self.stats.errors.append(str(e))
                return False
        self.stats.sent += 1
        self.stats.bytes += len(data)
        self._producer.poll(0)
        return True

    def flush(self, timeout: float = 30.0) -> int:
        """Wait for delivery; returns the number of messages still undelivered."""
        return int(self._producer.flush(timeout))

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
