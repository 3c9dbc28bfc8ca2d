"""The topology the host agent infers for a simulated job whose launcher declared no shape.

A traced job without ``RANKWATCH_TP/PP/DP/MICROBATCHES`` first publishes what its sidecars show
(`emit.anonymous_topology`: every rank data-parallel, groups ``pgN``); the agent that hosts rank
0 then reads the pipeline from the point-to-point calls it drains (`ingest.agent.shape`) and,
at its next beat, publishes the topology built with that shape (`ingest.agent.topology.build`).
`AgentShape` does the same for the simulator with the agent's own code: it observes the ops of
rank 0's host (the agent sees its own host's rings only, so a job spread over hosts is not
inferred, as on a real cluster), and once a beat, past a shape change, returns the topology to
publish. Without it the simulator's undeclared jobs were diagnosed as the real ones never are
(no pipeline stage, no microbatch: a hang inside a pipeline backward named "bwd pp=0").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ingest.agent.shape import P2PLog, PipelineShape, infer_pipeline
from ingest.agent.topology import build
from ingest.records import JobTopology

#: the agent's beat: how often it looks at the shape again (`AgentConfig.beat_s`)
BEAT_S = 1.0


class AgentShape:
    def __init__(self, anonymous: JobTopology, local_ranks: np.ndarray) -> None:
        self.topo = anonymous
        self.local = np.asarray(local_ranks, dtype=np.int64)
        self.log = P2PLog()
        self.shape: PipelineShape | None = None
        self.next_s = BEAT_S
        comms = [c.model_dump() for c in anonymous.communicators]
        self.doc: dict[str, Any] = {"rank": 0, "world_size": anonymous.world_size,
                                    "host": anonymous.hosts[0], "hosts": list(anonymous.hosts),
                                    "comms": comms, "parallel": {}}
        self.groups = [(str(c["kind"]), [int(m) for m in c["members"]]) for c in comms]

    def observe(self, ops: dict[str, Any]) -> None:
        """One simulated `ops` column batch (dictionary columns as (codes, names))."""
        keep = np.flatnonzero(np.isin(np.asarray(ops["rank"]), self.local))
        if not keep.size:
            return
        plain = {k: (np.asarray(v[1], dtype=object)[np.asarray(v[0])[keep]]
                     if isinstance(v, tuple) else np.asarray(v)[keep])
                 for k, v in ops.items() if k in ("rank", "op", "peer", "step", "t_start",
                                                  "t_end")}
        self.log.observe(plain)

    def topology(self, now_s: float, epoch_ns: int) -> JobTopology | None:
        """At a beat (every `BEAT_S` of simulated time), the topology with the shape inferred
        since the last one, if it changed; else None."""
        if now_s < self.next_s:
            return None
        self.next_s = (now_s // BEAT_S + 1) * BEAT_S
        if not self.log.edges:
            return None
        shape = infer_pipeline(self.topo.world_size, self.log.edges, self.log.first_is_send(),
                               self.log.sends_per_step(), self.groups)
        if shape is None or shape == self.shape:
            return None
        self.shape = shape
        return build(self.topo.job_id, [self.doc], epoch_ns + int(now_s * 1e9), shape)
