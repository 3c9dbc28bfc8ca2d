"""The job's topology record from the ranks' sidecars (ingest/torch/comms.py).

Communicators are the union over ranks by comm_id (members agree: every member of a group
registers the same torch group). Parallel sizes come from RANKWATCH_TP/PP/DP/… when the launcher
set them and they multiply to the world size; otherwise the job is described as pure data
parallel (dp = world_size, schedule "none"), which is what the records alone can show.

Hosts: rank 0's sidecar carries every rank's host once the tracer gathered them through the
job's c10d store (comms.HostGather, a few steps in); until then a host agent knows only its own
ranks and names the others "unknown". Only the agent that hosts rank 0 publishes the topology.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ingest.records import Communicator, JobTopology


def read_sidecar(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # being replaced right now, or gone: read it next time
    return doc if isinstance(doc, dict) and isinstance(doc.get("comms"), list) else None


def build(job_id: str, sidecars: list[dict[str, Any]], now_ns: int | None = None) -> JobTopology:
    """JobTopology from the sidecars of one job's local ranks. Raises ValueError if inconsistent."""
    if not sidecars:
        raise ValueError(f"job {job_id}: no sidecars")
    world = max(int(s["world_size"]) for s in sidecars)
    hosts = ["unknown"] * world
    comms: dict[str, Communicator] = {}
    parallel: dict[str, int] = {}
    for s in sidecars:
        gathered = s.get("hosts") or []
        if len(gathered) == world:
            hosts = [str(h) or "unknown" for h in gathered]
            break
    for s in sidecars:
        rank = int(s["rank"])
        if 0 <= rank < world and hosts[rank] == "unknown":
            hosts[rank] = str(s.get("host") or "unknown")
        parallel = parallel or dict(s.get("parallel") or {})
        for c in s["comms"]:
            if c["comm_id"] not in comms:
                comms[c["comm_id"]] = Communicator(
                    comm_id=c["comm_id"], kind=c["kind"], members=sorted(c["members"]))
    sizes = {k: parallel.get(k, 1) for k in ("tp", "pp", "cp")}
    sizes["dp"] = parallel.get("dp", world // max(1, sizes["tp"] * sizes["pp"] * sizes["cp"]))
    fields: dict[str, Any] = {"job_id": job_id, "ts": now_ns or time.time_ns(),
                              "world_size": world, "hosts": hosts,
                              "communicators": list(comms.values()),
                              "microbatches": parallel.get("microbatches", 1)}
    try:
        return JobTopology.model_validate({
            **fields, **sizes, "ep": parallel.get("ep", 1),
            "schedule": "1f1b" if sizes["pp"] > 1 else "none"})
    except ValidationError:
        return JobTopology.model_validate({**fields, "dp": world, "schedule": "none"})
