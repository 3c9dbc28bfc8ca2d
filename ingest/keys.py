"""Kafka message keys of raw record batches: where a job's batches land (streams/ownership.py).

- **Spread kinds** (`SPREAD_KINDS`: calls, flows, chunks, work requests — the bulk of a job's
  records besides kernels) are keyed by ``<job>/<producer>``: one host's batches of a kind stay
  on one partition, in order, and a job of many hosts is spread over every partition, so every
  worker of the group stores a share of one big job. The worker that stores a batch of a job it
  does not own reports what the owner needs of it (its event-time extent, per-rank newest ends)
  on the job-keyed `stored` topic (streams/reports.py).
- **Every other kind** is keyed by the bare job id, the job's home partition: beats and stage
  records feed the owner's triggers whole, kernel events are summarized from the owner's memory
  (streams/kernel_summaries.py), a topology is read by the owner before anything else.

A producer that keys by the bare job id for every kind (older agents, `rankwatch publish`,
importers) is still right: its batches are all stored by the owner.
"""

from __future__ import annotations

SPREAD_KINDS = frozenset({"ops", "flows", "chunks", "wr"})


def batch_key(kind: str, job_id: str, producer: str) -> str:
    """The key of a `kind` batch of `job_id` from `producer` (module docstring)."""
    if kind in SPREAD_KINDS and producer:
        return f"{job_id}/{producer}"
    return job_id
