"""Which worker owns a job's derived windows when several workers share one ClickHouse server.

Proposed design (docs/architecture.md, "Limits", notes that today every worker would compute
every job; nothing calls this module yet — the wiring is described below):

- **A job has a home partition**: ``job_partition(job_id, P)``, Kafka's default partitioner
  (murmur2 of the UTF-8 job id, sign bit cleared, modulo P), P the raw topics' partition count.
  It is where a message keyed by the bare job id lands from the Java client, aiokafka (Faust)
  and librdkafka with ``partitioner=murmur2_random``.
- **The owner is the worker assigned that partition of the ops topic.** Faust's assignor gives
  the same-numbered partitions of co-subscribed topics with equal partition counts (all raw
  topics) to one worker, so that worker holds the job's home partition of every raw topic.
  Ownership changes only with a rebalance, never by a message; `owned_jobs` is a pure function
  of (jobs, this worker's assigned partitions, P).
- **Watermarks must cover every partition holding the job's rows.** The derived runner closes a
  window from the event times its own sinks stored. That is complete only if all of the job's
  raw rows pass through the owner, so producers key raw batches by the bare job id (one
  partition per topic per job; a job's ingest is then bounded by one worker). A job too big for
  one worker needs instead a low watermark read from ClickHouse (min over the job's source
  partitions of the max event time stored from each), not a local observation.

Handover: a window computed twice around a rebalance (old owner's tick in flight, new owner
restored from `stream_state`) is harmless: derived inserts carry `<kind>:<job>:<window>` tokens
and the feed is at-least-once.

Assumptions: every raw topic has the same partition count P (``Topics.specs``) and it does not
change while jobs run (changing P moves home partitions, as for any keyed Kafka topic).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """MurmurHash2 as Kafka's clients compute it (seed 0x9747b28c), as a signed 32-bit int."""
    n = len(data)
    h = (_SEED ^ n) & _MASK
    whole = n - n % 4
    for i in range(0, whole, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    tail = data[whole:]
    if tail:
        h ^= int.from_bytes(tail, "little")  # the 1..3 trailing bytes, low byte first
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
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
