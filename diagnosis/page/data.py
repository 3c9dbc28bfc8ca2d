"""What an incident page shows, read through a `Query` (SQL in, JSONEachRow rows out) so the
same code runs in the worker (its own database) and in `rankwatch report` (the worker's SQL
endpoint).

- the incident's versions (table `diagnoses`), newest last;
- every rank's completed ops per time bin over [onset − before, onset + after] (table `ops`,
  by `t_end`), the ranks from the job's topology (a rank with no completion at all still gets
  its empty row);
- each rank's mean stage durations over the same span (table `stages`).

Identifiers reach SQL only as quoted string literals (`literal`); numbers are formatted ints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from diagnosis.model import Diagnosis
from ingest.units import SECOND

Query = Callable[[str], list[dict[str, Any]]]
STAGE_COLUMNS = ("data_next_wait", "model_fwd_loss", "model_backward", "callbacks",
                 "optim_step", "step_other")


def literal(s: str) -> str:
    """A ClickHouse string literal holding exactly `s`."""
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


@dataclass
class IncidentData:
    versions: list[Diagnosis]
    world_size: int
    hosts: list[str]
    t0_ns: int
    bin_ns: int
    #: completed ops per (rank, bin)
    progress: np.ndarray
    #: rank -> mean ns per stage (STAGE_COLUMNS order)
    stages: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def latest(self) -> Diagnosis:
        return self.versions[-1]

    @property
    def onset_ns(self) -> int:
        d = self.latest
        return d.onset_ns or d.detected_ns


def _versions(query: Query, incident_id: str) -> list[Diagnosis]:
    rows = query(f"SELECT json FROM diagnoses FINAL WHERE incident_id = {literal(incident_id)} "
                 "ORDER BY version")
    return [Diagnosis.model_validate_json(r["json"]) for r in rows]


def topology(query: Query, job_id: str) -> tuple[int, list[str]]:
    rows = query(f"SELECT argMax(topology, ts) AS t FROM jobs WHERE job_id = {literal(job_id)}")
    if rows and rows[0].get("t"):
        topo = orjson.loads(rows[0]["t"])
        return int(topo.get("world_size", 0)), list(topo.get("hosts") or [])
    return 0, []


def load(query: Query, incident_id: str, before_s: float = 30.0, after_s: float = 30.0,
         bins: int = 60) -> IncidentData | None:
    """The page's data, or None when no such incident is stored."""
    versions = _versions(query, incident_id)
    if not versions:
        return None
    d = versions[-1]
    onset = d.onset_ns or d.detected_ns
    t0 = onset - int(before_s * SECOND)
    t1 = onset + int(after_s * SECOND)
    bin_ns = max(1, (t1 - t0) // bins)
    world, hosts = topology(query, d.job_id)
    job = literal(d.job_id)
    span = (f"BETWEEN fromUnixTimestamp64Nano(toInt64({t0})) "
            f"AND fromUnixTimestamp64Nano(toInt64({t1}))")
    rows = query(f"SELECT rank, intDiv(toUnixTimestamp64Nano(t_end) - {t0}, {bin_ns}) AS b, "
                 f"count() AS n FROM ops WHERE job_id = {job} AND t_end {span} "
                 "GROUP BY rank, b")
    ranks = np.array([int(r["rank"]) for r in rows], dtype=np.int64)
    b = np.array([int(r["b"]) for r in rows], dtype=np.int64)
    n = np.array([int(r["n"]) for r in rows], dtype=np.int64)
    seen_max = int(ranks.max()) + 1 if ranks.size else 0
    world = max(world, seen_max, max(d.culprit_ranks, default=-1) + 1)
    progress = np.zeros((world, bins), dtype=np.int64)
    ok = (ranks >= 0) & (ranks < world) & (b >= 0) & (b < bins)
    np.add.at(progress, (ranks[ok], b[ok]), n[ok])
    cols = ", ".join(f"avg({c}) AS {c}" for c in STAGE_COLUMNS)
    srows = query(f"SELECT rank, {cols} FROM stages WHERE job_id = {job} AND t_start {span} "
                  "GROUP BY rank")
    stages = {int(r["rank"]): np.array([float(r[c] or 0) for c in STAGE_COLUMNS])
              for r in srows}
    return IncidentData(versions, world, hosts, t0, bin_ns, progress, stages)


def incidents(query: Query, limit: int = 200) -> list[dict[str, Any]]:
    """The newest version of the newest incidents, for the index page."""
    rows = query("SELECT job_id, incident_id, max(version) AS v, argMax(status, version) AS s, "
                 "argMax(kind, version) AS k, argMax(summary, version) AS m, "
                 "max(detected_ns) AS t FROM diagnoses FINAL GROUP BY job_id, incident_id "
                 f"ORDER BY t DESC LIMIT {int(limit)}")
    return [{"job_id": r["job_id"], "incident_id": r["incident_id"], "version": int(r["v"]),
             "status": r["s"], "kind": r["k"], "summary": r["m"], "detected_ns": int(r["t"])}
            for r in rows]
