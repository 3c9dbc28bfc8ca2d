"""Topology builders for the diagnosis unit tests (Megatron order: TP fastest, PP slowest)."""

from __future__ import annotations

from ingest.records import Communicator, JobTopology


def megatron_topology(tp: int, pp: int, dp: int, *, job_id: str = "job", microbatches: int = 4,
                      ranks_per_host: int = 8, with_comms: bool = True) -> JobTopology:
    world = tp * pp * dp

    def rank(d: int, s: int, t: int) -> int:
        return t + tp * (d + dp * s)

    comms: list[Communicator] = []
    if with_comms:
        for d in range(dp):
            for s in range(pp):
                comms.append(Communicator(comm_id=f"tp:pp{s}:dp{d}", kind="tp",
                                          members=[rank(d, s, t) for t in range(tp)]))
        for d in range(dp):
            for t in range(tp):
                comms.append(Communicator(comm_id=f"pp:dp{d}:tp{t}", kind="pp",
                                          members=[rank(d, s, t) for s in range(pp)]))
        for s in range(pp):
            for t in range(tp):
                comms.append(Communicator(comm_id=f"dp:pp{s}:tp{t}", kind="dp",
                                          members=[rank(d, s, t) for d in range(dp)]))
    return JobTopology(
        job_id=job_id, ts=0, world_size=world, tp=tp, pp=pp, dp=dp, microbatches=microbatches,
        schedule="1f1b" if pp > 1 else "none",
        hosts=[f"node{r // ranks_per_host:04d}" for r in range(world)], communicators=comms,
    )
