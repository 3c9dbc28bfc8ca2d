"""Kafka topic names and their default shapes (DESIGN.md, "Topics"). Names are settings."""

from __future__ import annotations

from dataclasses import dataclass, fields

#: Largest message the broker takes (docker-compose.yml KAFKA_MESSAGE_MAX_BYTES, the local
#: broker's message.max.bytes) and the producers may send.
MAX_MESSAGE_BYTES = 16 << 20


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    compacted: bool = False
    retention_ms: int = 24 * 3600 * 1000


@dataclass(frozen=True)
class Topics:
    """Every topic rankwatch reads or writes; `prefix` lets tests run side by side on one broker."""

    jobs: str = "rw.jobs"
    ops: str = "rw.ops"
    flows: str = "rw.flows"
    chunks: str = "rw.chunks"
    stages: str = "rw.stages"
    kernels: str = "rw.kernels"
    wr: str = "rw.wr"
    beats: str = "rw.beats"
    progress: str = "rw.progress"
    iterations: str = "rw.iterations"
    kernel_summaries: str = "rw.kernel_summaries"
    triggers: str = "rw.triggers"
    #: what a worker stored of a job it does not own, for the job's owner (streams/reports.py)
    stored: str = "rw.stored"
    diagnoses: str = "rw.diagnoses"
    truth: str = "rw.truth"
    dlq: str = "rw.dlq"

    @classmethod
    def with_prefix(cls, prefix: str) -> Topics:
        """Topics named `<prefix>.<kind>` instead of `rw.<kind>`."""
        return cls(**{f.name: f"{prefix}.{f.name}" for f in fields(cls)})

    def for_kind(self, kind: str) -> str:
        """The raw topic of a record kind (`ops` -> `rw.ops`)."""
        name: str = getattr(self, kind)
        return name

    def specs(self, partitions: int = 6) -> list[TopicSpec]:
        """What `rankwatch up` creates: raw topics spread over `partitions`, jobs compacted,
        diagnoses kept a year, job-keyed derived topics on as many partitions as the raw ones
        (one owner per job, streams.ownership), the dead-letter topic on fewer."""
        year = 365 * 24 * 3600 * 1000
        few = max(1, partitions // 2)
        out = [TopicSpec(self.jobs, 1, compacted=True, retention_ms=-1)]
        out += [TopicSpec(getattr(self, k), partitions)
                for k in ("ops", "flows", "chunks", "stages", "kernels", "wr", "beats")]
        # job-keyed derived topics have the raw topics' count: a job's home partition of each
        # is assigned to the job's owner (streams.ownership)
        out += [TopicSpec(getattr(self, k), partitions)
                for k in ("progress", "iterations", "kernel_summaries", "triggers", "stored")]
        out += [TopicSpec(self.dlq, few)]
        out += [TopicSpec(self.diagnoses, 1, retention_ms=year), TopicSpec(self.truth, 1)]
        return out
