"""Which worker owns a job's derived windows, triggers, incidents and diagnoses when several
workers share one ClickHouse.

- **A job has a home partition**: ``job_partition(job_id, P)``, Kafka's default partitioner
  (murmur2 of the UTF-8 job id, sign bit cleared, modulo P; the hash is aiokafka's, the one
  Faust's producer places messages with). It is where a message keyed by the bare job id lands
  from the Java client, aiokafka and librdkafka with ``partitioner=murmur2_random``.
- **A job's messages of every job-keyed topic sit on its home partition**: the derived,
  trigger and `stored` topics are keyed by the bare job id, and so are the raw kinds the owner
  needs whole (stage records, beats, kernel events, the topology). The bulk raw kinds (calls,
  flows, chunks, work requests) are keyed by job and producer (ingest/keys.py) and spread over
  every partition.
- **The owner is the worker assigned that partition of the ops topic.** Faust's assignor gives
  the same-numbered partitions of co-subscribed topics with equal partition counts (every
  job-keyed topic: ingest.topics.Topics.specs) to one worker, so that worker closes the job's
  windows, runs its triggers and root cause, and keeps its incidents. Raw storage is spread
  over every worker: a worker that stores a batch of a job it does not own reports its extent
  to the owner (streams/reports.py), so the owner's watermark is complete.
- **Ownership changes only with a rebalance**, never by a message: `Ownership.assign` is called
  with the worker's new partitions; `owns` is a pure function of (job, partitions, P).
  The derived runner and the diagnosis agents drop what they held of jobs they lost and load
  the checkpoints (`stream_state`) and open incidents (`diagnoses`) of jobs they gained from
  ClickHouse before those jobs' messages are read (streams/derived.py, diagnosis/agents.py).

Handover: a window computed twice around a rebalance (old owner's tick in flight, new owner
restored from `stream_state`) is harmless: derived inserts carry `<kind>:<job>:<window>` tokens
and the feed is at-least-once. An incident opened by the old owner is in the `diagnoses` table
before its trigger's offset is committed, so the new owner restores it and a redelivered trigger
is absorbed rather than announced again.

Assumptions: every job-keyed topic has the same partition count P and it does not change while
jobs run (changing P moves home partitions, as for any keyed Kafka topic).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from aiokafka.partitioner import murmur2 as _murmur2


def murmur2(data: bytes) -> int:
    """MurmurHash2 as Kafka's clients compute it (seed 0x9747b28c), as a signed 32-bit int (Java's
    value). aiokafka's implementation, which returns it unsigned."""
    h = int(_murmur2(data))
    return h - (1 << 32) if h & 0x80000000 else h


def job_partition(job_id: str, partitions: int) -> int:
    """The job's home partition among `partitions`: where Kafka's default partitioner puts a
    message keyed by `job_id`."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    if not job_id:
        raise ValueError("empty job_id")
    return (murmur2(job_id.encode()) & 0x7FFFFFFF) % partitions


def owned_jobs(jobs: Iterable[str], assigned: Collection[int], partitions: int) -> frozenset[str]:
    """The jobs among `jobs` whose home partition is in `assigned` (this worker's partitions of
    the ops topic). Over workers with disjoint assignments covering 0..P-1, every job has
    exactly one owner."""
    bad = [p for p in assigned if not 0 <= p < partitions]
    if bad:
        raise ValueError(f"assigned partitions {sorted(bad)} outside 0..{partitions - 1}")
    return frozenset(j for j in jobs if job_partition(j, partitions) in assigned)


class Ownership:
    """One worker's current share of the jobs (module docstring).

    Standalone (`Ownership()`, the default of every component used on its own) it owns every
    job. A worker in a consumer group makes it with `standalone=False`: it owns nothing until
    its first assignment, then the jobs whose home partition it was assigned. `generation`
    counts assignments, so a component can tell that it must hand jobs over."""

    def __init__(self, *, standalone: bool = True) -> None:
        self.standalone = standalone
        self.partitions: frozenset[int] = frozenset()
        self.count = 0
        self.generation = 0
        self._cache: dict[str, bool] = {}

    def assign(self, partitions: Collection[int], count: int) -> None:
        """This worker now holds `partitions` of the ops topic's `count`."""
        bad = [p for p in partitions if not 0 <= p < count]
        if bad:
            raise ValueError(f"assigned partitions {sorted(bad)} outside 0..{count - 1}")
        self.standalone = False
        self.partitions, self.count = frozenset(partitions), count
        self.generation += 1
        self._cache.clear()

    def owns(self, job_id: str) -> bool:
        if self.standalone:
            return True
        if not self.count or not job_id:
            return False
        got = self._cache.get(job_id)
        if got is None:
            if len(self._cache) > 100_000:
                self._cache.clear()
            got = self._cache[job_id] = job_partition(job_id, self.count) in self.partitions
        return got
