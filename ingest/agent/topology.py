"""The job's topology record from the ranks' sidecars (ingest/torch/comms.py).

Communicators are the union over ranks by comm_id (members agree: every member of a group
registers the same torch group). Parallel sizes, in order of preference:

1. given: RANKWATCH_TP/PP/DP/… when the launcher set them and they multiply to the world size;
2. inferred: the pipeline shape the ranks' point-to-point pattern shows (shape.py: pp from the
   chains of p2p peers, dp/tp from the groups, microbatches from the sends per step). When the
   chains do not follow Megatron's rank order, one `pp` communicator per chain (members in stage
   order) tells readers each rank's stage;
3. default: pure data parallel (dp = world_size, schedule "none").

`shape_source` says which applied to each of tp, pp, dp, microbatches and schedule.

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

from ingest.agent.shape import PipelineShape
from ingest.records import Communicator, JobTopology

SHAPE_KEYS = ("tp", "pp", "dp", "microbatches", "schedule")


def read_sidecar(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # being replaced right now, or gone: read it next time
    return doc if isinstance(doc, dict) and isinstance(doc.get("comms"), list) else None


def build(job_id: str, sidecars: list[dict[str, Any]], now_ns: int | None = None,
          inferred: PipelineShape | None = None) -> JobTopology:
    """JobTopology from the sidecars of one job's local ranks (and the pipeline shape inferred
    from its ops, if any). Raises ValueError if inconsistent."""
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
    source = dict.fromkeys(SHAPE_KEYS, "default")
    given_sizes = any(k in parallel for k in ("tp", "pp", "dp", "cp"))
    if given_sizes or inferred is None:
        sizes = {k: parallel.get(k, 1) for k in ("tp", "pp", "cp")}
        sizes["dp"] = parallel.get("dp",
                                   world // max(1, sizes["tp"] * sizes["pp"] * sizes["cp"]))
        source.update({k: "given" for k in ("tp", "pp", "dp") if k in parallel})
    else:
        sizes = {"tp": inferred.tp, "pp": inferred.pp, "dp": inferred.dp, "cp": 1}
        source.update({"tp": "inferred", "pp": "inferred", "dp": "inferred"})
        if not inferred.megatron_order:
            for i, chain in enumerate(inferred.chains):
                comms.setdefault(f"pp:inferred:{i}", Communicator(
                    comm_id=f"pp:inferred:{i}", kind="pp", members=list(chain)))
    microbatches = parallel.get("microbatches", 1)
    if "microbatches" in parallel:
        source["microbatches"] = "given"
    elif inferred is not None and inferred.microbatches is not None:
        microbatches, source["microbatches"] = inferred.microbatches, "inferred"
    fields: dict[str, Any] = {"job_id": job_id, "ts": now_ns or time.time_ns(),
                              "world_size": world, "hosts": hosts,
                              "communicators": list(comms.values()),
                              "microbatches": microbatches}
    try:
        return JobTopology.model_validate({
            **fields, **sizes, "ep": parallel.get("ep", 1),
            "schedule": "1f1b" if sizes["pp"] > 1 else "none", "shape_source": source})
    except ValidationError:
        fallback = {**source, "tp": "default", "pp": "default", "dp": "default"}
        fields["communicators"] = [c for c in fields["communicators"]
                                   if not c.comm_id.startswith("pp:inferred:")]
        return JobTopology.model_validate({**fields, "dp": world, "schedule": "none",
                                           "shape_source": fallback})
