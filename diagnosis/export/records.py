"""A job's ops, stages and kernels over a time span, read through a `Query` (the worker's SQL
endpoint or its database) as numpy columns, for the exports. Each kind is capped at `limit`
rows (the earliest first); a call stored twice (in flight, then completed) is read once, its
latest end kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from diagnosis.page.data import Query, literal


@dataclass
class Span:
    job_id: str
    t0_ns: int
    t1_ns: int
    ops: dict[str, np.ndarray]
    stages: dict[str, np.ndarray]
    kernels: dict[str, np.ndarray]
    #: kinds whose rows reached the limit
    truncated: list[str]


def _columns(rows: list[dict[str, Any]], ints: tuple[str, ...],
             strs: tuple[str, ...]) -> dict[str, np.ndarray]:
    out = {c: np.array([int(r[c]) for r in rows], dtype=np.int64) for c in ints}
    out.update({c: np.array([str(r[c]) for r in rows], dtype=object) for c in strs})
    return out


def job_span(query: Query, job_id: str) -> tuple[int, int] | None:
    """The first and last op time stored for the job, or None."""
    rows = query("SELECT toUnixTimestamp64Nano(min(t_start)) AS a, "
                 "toUnixTimestamp64Nano(max(t_start)) AS b, count() AS n FROM ops "
                 f"WHERE job_id = {literal(job_id)}")
    if not rows or int(rows[0]["n"]) == 0:
        return None
    return int(rows[0]["a"]), int(rows[0]["b"])


def load(query: Query, job_id: str, t0: int, t1: int, limit: int = 1_000_000) -> Span:
    job = literal(job_id)
    span = (f"BETWEEN fromUnixTimestamp64Nano(toInt64({int(t0)})) "
            f"AND fromUnixTimestamp64Nano(toInt64({int(t1)}))")
    # output names differ from the columns: an alias named like a column would replace it in
    # WHERE (ClickHouse resolves aliases there)
    rows = query("SELECT rank, comm_id, op_seq, any(op) AS op_name, max(bytes) AS op_bytes, "
                 "min(toUnixTimestamp64Nano(t_start)) AS s, "
                 "max(toUnixTimestamp64Nano(t_end)) AS e FROM ops "
                 f"WHERE job_id = {job} AND t_start {span} GROUP BY rank, comm_id, op_seq "
                 f"ORDER BY s LIMIT {int(limit)}")
    ops = [{"rank": r["rank"], "comm_id": r["comm_id"], "op_seq": r["op_seq"],
            "op": r["op_name"], "bytes": r["op_bytes"], "t_start": r["s"], "t_end": r["e"]}
           for r in rows]
    stages = [{**r, "t_start": r["s"]} for r in query(
        "SELECT rank, step, toUnixTimestamp64Nano(t_start) AS s, data_next_wait, "
        "model_fwd_loss, model_backward, callbacks, optim_step, step_other FROM stages "
        f"WHERE job_id = {job} AND t_start {span} ORDER BY s LIMIT {int(limit)}")]
    kernels = [{**r, "t_start": r["s"]} for r in query(
        "SELECT rank, stream, kernel, toUnixTimestamp64Nano(t_start) AS s, duration FROM "
        f"kernels WHERE job_id = {job} AND t_start {span} ORDER BY s LIMIT {int(limit)}")]
    truncated = [k for k, rows in (("ops", ops), ("stages", stages), ("kernels", kernels))
                 if len(rows) >= limit]
    return Span(
        job_id, t0, t1,
        _columns(ops, ("rank", "op_seq", "bytes", "t_start", "t_end"), ("comm_id", "op")),
        _columns(stages, ("rank", "step", "t_start", "data_next_wait", "model_fwd_loss",
                          "model_backward", "callbacks", "optim_step", "step_other"), ()),
        _columns(kernels, ("rank", "stream", "t_start", "duration"), ("kernel",)),
        truncated)
