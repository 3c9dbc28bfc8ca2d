"""VenusTrace's last arriver per collective (diagnosis/rules/arrival_order.py) and the analysis
from ops alone (diagnosis/ops_rca.py), on call times generated here with a fixed seed."""

from __future__ import annotations

import numpy as np

from diagnosis import ops_rca
from diagnosis.rules.arrival_order import DEFAULT, ArrivalConfig, last_arrivers
from diagnosis.window import Window
from ingest.records import Communicator, JobTopology
from ingest.units import MILLISECOND as MS

T0 = 1_700_000_000_000_000_000


def calls(n: int, slow: int | None, rng: np.random.Generator, late_ms: float = 8.0,
          share: float = 0.9, start: int = 0, groups: int = 2, period_ms: int = 100
          ) -> dict[str, np.ndarray]:
    """`groups` TP pairs (ranks 2g, 2g+1) calling `n` all-reduces `period_ms` apart; jitter
    ~0.2 ms; with `slow`, that rank arrives `late_ms` later in `share` of the calls from the
    call `start` on."""
    rank, comm, seq, t = [], [], [], []
    for g in range(groups):
        for i in range(n):
            base = T0 + i * period_ms * MS + g * (period_ms // 3) * MS
            for r in (2 * g, 2 * g + 1):
                dt = rng.exponential(0.2 * MS)
                if r == slow and i >= start and rng.random() < share:
                    dt += late_ms * MS
                rank.append(r)
                comm.append(f"tp{g}")
                seq.append(i)
                t.append(base + int(dt))
    k = len(rank)
    return {"rank": np.asarray(rank), "comm_id": np.asarray(comm, dtype=object),
            "op_seq": np.asarray(seq), "op": np.asarray(["AllReduce"] * k, dtype=object),
            "t_start": np.asarray(t), "t_end": np.asarray(t) + 5 * MS,
            "bytes": np.full(k, 4096), "t_enqueue": np.asarray(t), "step": np.full(k, -1),
            "peer": np.full(k, -1)}


def topo(groups: int = 2, hosts: list[str] | None = None, kind: str = "tp") -> JobTopology:
    w = 2 * groups
    return JobTopology(job_id="j", ts=0, world_size=w, tp=2 if kind == "tp" else 1,
                       dp=groups if kind == "tp" else w, hosts=hosts or ["unknown"] * w,
                       communicators=[Communicator(comm_id=f"tp{g}", kind=kind,  # type: ignore[arg-type]
                                                   members=[2 * g, 2 * g + 1])
                                      for g in range(groups)])


def run(ops: dict[str, np.ndarray], t: JobTopology,
        cfg: ArrivalConfig = DEFAULT) -> list[int]:
    w = Window(t, {})
    found = last_arrivers(ops["rank"], ops["comm_id"], ops["op_seq"], ops["op"],
                          ops["t_start"], w.grid.comm_members, w.grid.comm_kind, w.grid.hosts,
                          cfg)
    return [f.culprit_ranks[0] for f in found]


def test_a_persistent_last_arriver_is_named() -> None:
    rng = np.random.default_rng(1)
    assert run(calls(400, slow=1, rng=rng), topo())[:1] == [1]


def test_no_culprit_names_no_one_in_many_healthy_runs() -> None:
    named = [run(calls(400, slow=None, rng=np.random.default_rng(seed)), topo())
             for seed in range(30)]
    assert sum(bool(x) for x in named) == 0, named


def test_chance_alone_is_not_enough() -> None:
    """Last in 60 % of the calls but only 0.1 ms later: persistent, yet within the noise."""
    rng = np.random.default_rng(2)
    assert run(calls(600, slow=1, rng=rng, late_ms=0.1, share=0.6), topo()) == []


def test_a_burst_that_ended_is_not_a_straggler() -> None:
    rng = np.random.default_rng(3)
    ops = calls(400, slow=1, rng=rng)
    early = ops["op_seq"] < 150  # the slow calls are only the first 150: keep those lates
    healthy = calls(400, slow=None, rng=np.random.default_rng(4))
    ops["t_start"] = np.where(early, ops["t_start"], healthy["t_start"])
    assert run(ops, topo()) == []


def test_a_fault_that_began_mid_window_is_named() -> None:
    rng = np.random.default_rng(5)
    assert run(calls(400, slow=3, rng=rng, start=150), topo())[:1] == [3]


def test_across_hosts_a_lead_within_clock_tolerance_gives_no_verdict() -> None:
    rng = np.random.default_rng(6)
    ops = calls(1000, slow=1, rng=rng, late_ms=4.0, period_ms=40)  # under the 5 ms tolerance
    assert run(ops, topo(hosts=["a", "b", "a", "b"])) == []
    assert run(ops, topo(hosts=["a", "a", "b", "b"]))[:1] == [1]


def test_ops_rca_names_rank_stage_and_mycroft_measures() -> None:
    rng = np.random.default_rng(7)
    ops = calls(400, slow=2, rng=rng)
    now = int(ops["t_start"].max()) + 10 * MS
    c = ops_rca.analyze(Window(topo(), {"ops": ops}, now - 90 * 10**9, now), now)
    assert c is not None and c.kind == "slowdown" and c.ranks == (2,)
    assert c.stage == "tp_collectives" and c.component is None
    assert [f.rule for f in c.findings] == ["venustrace.arrival_order", "mycroft.interval"]
    assert 0.5 <= c.confidence <= 0.8


def test_mycroft_measures_see_the_interval_double() -> None:
    t = T0 + np.concatenate([np.arange(20) * 10 * MS, 200 * MS + np.arange(20) * 20 * MS])
    m = ops_rca.mycroft_measures(t, t + MS, np.full(40, 100))
    assert m is not None and m["interval_ratio"] == 2.0
    assert ops_rca.mycroft_measures(t[:10], t[:10] + MS, np.full(10, 100)) is None


def test_a_burst_of_a_few_seconds_is_not_persistence() -> None:
    """The same lateness over 8 s of calls (a job's first iterations) names no one."""
    rng = np.random.default_rng(8)
    ops = calls(400, slow=1, rng=rng)
    ops["t_start"] = T0 + (ops["t_start"] - T0) // 5  # 20 ms apart: 8 s in all
    assert run(ops, topo()) == []
