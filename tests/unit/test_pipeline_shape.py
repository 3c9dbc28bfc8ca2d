"""ingest.agent.shape: a job's pipeline shape from its point-to-point pattern, and the topology
record built from it (ingest.agent.topology.build)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ingest.agent.shape import P2PLog, chains_of, infer_pipeline
from ingest.agent.topology import build


def test_chains_are_paths_covering_every_rank() -> None:
    assert chains_of(4, [(0, 2), (1, 3)]) == [[0, 2], [1, 3]]
    assert chains_of(6, [(3, 1), (1, 5), (0, 2), (2, 4)]) == [[0, 2, 4], [3, 1, 5]]
    assert chains_of(4, [(0, 1), (1, 2), (2, 3), (3, 0)]) is None  # a ring, not a pipeline
    assert chains_of(4, [(0, 1), (1, 2)]) is None  # rank 3 takes no part
    assert chains_of(4, [(0, 1), (2, 3), (1, 2), (1, 3)]) is None  # rank 1 has 3 peers
    assert chains_of(5, [(0, 1), (1, 2), (3, 4)]) is None  # uneven chains
    assert chains_of(2, [(0, 0), (0, 1), (1, 7)]) == [[0, 1]]  # self-loops, bad ranks ignored


def test_stage_order_from_who_sends_first() -> None:
    """Ranks 5→3→1 and 4→2→0 (first stage = the one whose step starts with a Send): not
    Megatron's order, so the shape says so; dp from the same-stage groups."""
    edges = [(5, 3), (3, 1), (4, 2), (2, 0)]
    first = {5: True, 3: False, 1: False, 4: True, 2: False, 0: False}
    groups = [("world", list(range(6))), ("dp", [4, 5]), ("dp", [2, 3]), ("dp", [0, 1])]
    s = infer_pipeline(6, edges, first, [4, 4, 3, 4, 4], groups)
    assert s is not None
    assert (s.pp, s.dp, s.tp, s.microbatches) == (3, 2, 1, 4)
    assert s.chains == ((4, 2, 0), (5, 3, 1)) and not s.megatron_order
    # without knowing who sends first, the lower rank starts the chain
    s = infer_pipeline(6, edges, {}, [], groups)
    assert s is not None and s.chains == ((0, 2, 4), (1, 3, 5)) and s.megatron_order
    assert s.microbatches is None


def test_tp_from_named_groups_and_dp_the_rest() -> None:
    """2 stages × (tp 2 × dp 2): 4 chains; TP groups named tp split them."""
    edges = [(r, r + 4) for r in range(4)]
    first = {r: r < 4 for r in range(8)}
    tp = [("tp", [0, 1]), ("tp", [2, 3]), ("tp", [4, 5]), ("tp", [6, 7])]
    dp = [("dp", [0, 2]), ("dp", [1, 3]), ("dp", [4, 6]), ("dp", [5, 7])]
    s = infer_pipeline(8, edges, first, [2], tp + dp)
    assert s is not None and (s.pp, s.dp, s.tp) == (2, 2, 2)
    s = infer_pipeline(8, edges, first, [2], dp)  # unnamed TP: the DP groups leave tp = 2
    assert s is not None and (s.pp, s.dp, s.tp) == (2, 2, 2)
    s = infer_pipeline(8, edges, first, [2], [])
    assert s is not None and (s.pp, s.dp, s.tp) == (2, 4, 1)


def schedule(pp: int, dp: int, m: int, steps: range) -> dict[str, np.ndarray]:
    """The Send/Recv ops of a GPipe-style step on every rank (Megatron order), plus one DP
    all-reduce per rank and step, times increasing."""
    rows: list[tuple[int, str, int, int, int]] = []
    t = 1000
    for step in steps:
        for d in range(dp):
            for s in range(pp):
                r = s * dp + d
                for _ in range(m):  # forward: recv from the previous stage, send to the next
                    if s > 0:
                        rows.append((r, "Recv", r - dp, step, t))
                        t += 1
                    if s < pp - 1:
                        rows.append((r, "Send", r + dp, step, t))
                        t += 1
                for _ in range(m):  # backward
                    if s < pp - 1:
                        rows.append((r, "Recv", r + dp, step, t))
                        t += 1
                    if s > 0:
                        rows.append((r, "Send", r - dp, step, t))
                        t += 1
                rows.append((r, "AllReduce", -1, step, t))
                t += 1
    rank, op, peer, step_, ts = zip(*rows, strict=True)
    return {"rank": np.array(rank), "op": np.array(op, dtype=object), "peer": np.array(peer),
            "step": np.array(step_), "t_start": np.array(ts), "t_end": np.array(ts) + 5}


def test_log_counts_complete_steps_across_drains() -> None:
    log = P2PLog()
    log.observe(schedule(3, 2, 4, range(0, 2)))
    log.observe(schedule(3, 2, 4, range(2, 3)))
    assert log.edges == {(0, 2), (2, 4), (1, 3), (3, 5)}
    counts = log.sends_per_step()
    assert counts and set(counts) == {4}  # step 2 is not complete yet: not counted
    assert log.first_is_send() == {0: True, 1: True, 2: False, 3: False, 4: False, 5: False}
    s = infer_pipeline(6, log.edges, log.first_is_send(), counts,
                       [("dp", [0, 1]), ("dp", [2, 3]), ("dp", [4, 5])])
    assert s is not None and (s.pp, s.dp, s.tp, s.microbatches) == (3, 2, 1, 4)
    assert s.chains == ((0, 2, 4), (1, 3, 5)) and s.megatron_order


def test_log_ignores_collectives_in_flight_and_unknown_steps() -> None:
    log = P2PLog()
    ops = schedule(2, 1, 2, range(1))
    ops["t_end"][:] = 0  # nothing completed
    log.observe(ops)
    ops = schedule(2, 1, 2, range(1))
    ops["step"][:] = -1
    log.observe(ops)
    log.observe({"rank": np.array([0]), "op": np.array(["AllReduce"], object),
                 "peer": np.array([-1]), "step": np.array([0]), "t_start": np.array([1]),
                 "t_end": np.array([2])})
    log.observe({})
    assert not log.edges and not log.sends_per_step()


def sidecar(rank: int, world: int, comms: list[dict[str, Any]],
            parallel: dict[str, int] | None = None) -> dict[str, Any]:
    return {"job_id": "j", "rank": rank, "world_size": world, "host": "h", "pid": 1,
            "parallel": parallel or {}, "comms": comms, "hosts": []}


def test_topology_says_given_inferred_or_default() -> None:
    comms = [{"comm_id": "world", "kind": "world", "members": [0, 1, 2, 3]},
             {"comm_id": "pg1", "kind": "dp", "members": [0, 1]},
             {"comm_id": "pg2", "kind": "dp", "members": [2, 3]}]
    docs = [sidecar(r, 4, comms) for r in range(4)]
    shape = infer_pipeline(4, [(0, 2), (1, 3)], {0: True, 2: False}, [3, 3],
                           [("dp", [0, 1]), ("dp", [2, 3])])
    assert shape is not None
    topo = build("j", docs, 1, shape)
    assert (topo.pp, topo.dp, topo.tp, topo.microbatches, topo.schedule) == (2, 2, 1, 3, "1f1b")
    assert topo.shape_source == {"tp": "inferred", "pp": "inferred", "dp": "inferred",
                                 "microbatches": "inferred", "schedule": "default"}
    assert [c.comm_id for c in topo.communicators] == ["world", "pg1", "pg2"]  # Megatron order

    given = [sidecar(r, 4, comms, {"pp": 2, "dp": 2}) for r in range(4)]
    topo = build("j", given, 1, shape)
    assert (topo.pp, topo.dp, topo.microbatches) == (2, 2, 3)
    assert topo.shape_source["pp"] == "given" and topo.shape_source["microbatches"] == "inferred"

    topo = build("j", docs, 1, None)
    assert (topo.pp, topo.dp, topo.schedule) == (1, 4, "none")
    assert set(topo.shape_source.values()) == {"default"}


def test_topology_lists_chains_that_megatron_order_would_misplace() -> None:
    """Stages 0: ranks 1, 3; stage 1: ranks 0, 2 — pp communicators in stage order say so, and
    the grid reads each rank's stage from them."""
    from diagnosis.groups import grid_of

    comms = [{"comm_id": "world", "kind": "world", "members": [0, 1, 2, 3]}]
    shape = infer_pipeline(4, [(1, 0), (3, 2)], {1: True, 3: True, 0: False, 2: False}, [2],
                           [])
    assert shape is not None and not shape.megatron_order
    topo = build("j", [sidecar(r, 4, comms) for r in range(4)], 1, shape)
    pp = {c.comm_id: c.members for c in topo.communicators if c.kind == "pp"}
    assert pp == {"pp:inferred:0": [1, 0], "pp:inferred:1": [3, 2]}
    assert grid_of(topo).stage.tolist() == [1, 0, 1, 0]


def test_log_stays_bounded_under_nonsense_peers(monkeypatch: Any) -> None:
    from ingest.agent import shape

    monkeypatch.setattr(shape, "MAX_PAIRS", 50)
    log = P2PLog()
    n = 2000
    log.observe({"rank": np.zeros(n, np.int64), "op": np.full(n, "Send", object),
                 "peer": np.arange(1, n + 1), "step": np.arange(n) % 3,
                 "t_start": np.arange(n), "t_end": np.arange(n) + 1})
    assert len(log.edges) <= 50 and len(log.sends) <= 50
    assert infer_pipeline(4, log.edges, {}, [], []) is None  # and no pipeline of it


def test_log_matches_a_row_by_row_account() -> None:
    """P2PLog's vectorized grouping against the same account kept row by row: edges, sends per
    (rank, peer, step), each (rank, step)'s earliest call, each rank's last step — over
    batches of random calls (collectives, unfinished calls and steps unknown mixed in)."""
    rng = np.random.default_rng(7)
    log = P2PLog()
    edges: set[tuple[int, int]] = set()
    sends: dict[tuple[int, int], dict[int, int]] = {}
    first: dict[int, dict[int, tuple[int, bool]]] = {}
    last: dict[int, int] = {}
    for b in range(6):
        n = 40
        rank = rng.integers(0, 4, n)
        peer = np.where(rng.random(n) < 0.2, -1, rng.integers(0, 4, n))
        op = rng.choice(np.array(["Send", "Recv", "AllReduce"], object), n)
        step = rng.integers(b, b + 3, n) - (rng.random(n) < 0.1)  # some -1 at b == 0
        t_start = rng.integers(0, 50, n) + 100 * b  # ties between calls of a step
        t_end = np.where(rng.random(n) < 0.1, 0, t_start + 5)
        log.observe({"rank": rank, "op": op, "peer": peer, "step": step, "t_start": t_start,
                     "t_end": t_end})
        for i in range(n):
            if peer[i] < 0 or op[i] not in ("Send", "Recv") or t_end[i] <= 0 or step[i] < 0:
                continue
            r, p, s, t = int(rank[i]), int(peer[i]), int(step[i]), int(t_start[i])
            if r != p:
                edges.add((min(r, p), max(r, p)))
            if op[i] == "Send":
                per = sends.setdefault((r, p), {})
                per[s] = per.get(s, 0) + 1
            old = first.setdefault(r, {}).get(s)
            if old is None or t < old[0]:
                first[r][s] = (t, op[i] == "Send")
            last[r] = max(last.get(r, -1), s)
    assert log.edges == edges and log.last_step == last
    assert log.sends == sends
    # within a batch, among calls at the same earliest time, either may be the first
    assert {r: {s: v[0] for s, v in per.items()} for r, per in log.first.items()} == \
        {r: {s: v[0] for s, v in per.items()} for r, per in first.items()}
