"""Mycroft Alg. 2 (hang root cause): min-op, min-data, death vs live hang, never the waiters."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from diagnosis.groups import grid_of
from diagnosis.rules.mycroft_hang import analyze_hang
from diagnosis.rules.waits_for import reachable_sinks
from ingest.units import SECOND as S
from tests.unit.topo_fixtures import megatron_topology

NOW = 100 * S
# tp=2 pp=2 dp=2: stage 1 holds ranks 4, 5 (replica 0) and 6, 7 (replica 1)
GRID = grid_of(megatron_topology(2, 2, 2))
Row = tuple[int, str, int, str, int, int, int, int]  # rank comm seq op peer enq start end


def cols(rows: list[Row]) -> dict[str, np.ndarray]:
    names = ("rank", "comm_id", "op_seq", "op", "peer", "t_enqueue", "t_start", "t_end")
    out = {n: np.asarray([r[i] for r in rows], dtype=object if n in ("comm_id", "op") else np.int64)
           for i, n in enumerate(names)}
    return out


def beats(ranks: list[int], until: int) -> dict[str, np.ndarray]:
    r = np.repeat(np.asarray(ranks, dtype=np.int64), 3)
    ts = np.tile(np.array([until - 2 * S, until - S, until]), len(ranks))
    return {"rank": r, "ts": ts.astype(np.int64)}


def compute_hang_ops(t_hang: int = 60 * S) -> list[Row]:
    """Rank 5 stops in compute after TP op 9: rank 4 waits in TP op 10, 6 and 7 in DP op 3."""
    rows: list[Row] = []
    for r, comm in ((4, "tp:pp1:dp0"), (5, "tp:pp1:dp0"), (6, "tp:pp1:dp1"), (7, "tp:pp1:dp1")):
        for k in range(10):
            t = t_hang - (10 - k) * S
            rows.append((r, comm, k, "AllReduce", -1, t, t, t + S // 10))
    for r, comm in ((4, "dp:pp1:tp0"), (5, "dp:pp1:tp1"), (6, "dp:pp1:tp0"), (7, "dp:pp1:tp1")):
        for k in range(3):
            t = t_hang - (30 - k) * S
            rows.append((r, comm, k, "AllReduce", -1, t, t, t + S // 10))
    rows.append((4, "tp:pp1:dp0", 10, "AllReduce", -1, t_hang, t_hang, 0))
    rows += [(6, "tp:pp1:dp1", 10, "AllReduce", -1, t_hang - S, t_hang - S, t_hang - S + 1)]
    rows += [(6, "dp:pp1:tp0", 3, "AllReduce", -1, t_hang, t_hang, 0),
             (7, "dp:pp1:tp1", 3, "AllReduce", -1, t_hang, t_hang, 0)]
    return rows


def test_min_op_live_compute_hang_follows_the_waits_for_chain():
    found = analyze_hang(cols(compute_hang_ops()), GRID, NOW, beats=beats(list(range(8)), NOW))
    assert [f.culprit_ranks for f in found] == [(5,)]
    f = found[0]
    assert f.component == "gpu_compute" and "live_hang" in f.labels and f.kind == "hang"
    assert f.evidence["ranks_waiting"] == 3  # 4 directly, 6 through 4, 7 directly
    assert f.stage in ("tp AllReduce", "dp_allreduce")


def test_process_death_when_records_stop():
    b = beats([0, 1, 2, 3, 4, 6, 7], NOW)
    b5 = beats([5], 59 * S)
    both = {k: np.concatenate([b[k], b5[k]]) for k in b}
    found = analyze_hang(cols(compute_hang_ops()), GRID, NOW, beats=both)
    assert [(f.culprit_ranks, f.stage, f.component) for f in found] == \
        [((5,), "process", "host_software")]


def test_min_data_when_everyone_is_in_the_same_op():
    rows: list[Row] = [(r, "dp:pp1:tp0", 3, "AllReduce", -1, 50 * S, 50 * S, 0) for r in (4, 6)]
    chunks = {"rank": np.array([4, 6]), "comm_id": np.array(["dp:pp1:tp0"] * 2, dtype=object),
              "op_seq": np.array([3, 3]), "channel": np.array([0, 0]),
              "ts": np.array([90 * S, 90 * S]), "total_chunks": np.array([8, 8]),
              "gpu_ready": np.array([4, 2]), "rdma_transmitted": np.array([4, 2]),
              "rdma_done": np.array([4, 2]), }
    chunks["rdma_transmitted"] = np.array([2, 2])  # rank 4's NIC does not post
    found = analyze_hang(cols(rows), GRID, NOW, chunks=chunks)
    assert [(f.rule, f.culprit_ranks, f.component) for f in found] == \
        [("mycroft.alg2.min_data", (4,), "nic_rdma")]
    assert found[0].stage == "dp_allreduce"
    assert analyze_hang(cols(rows), GRID, NOW)[0].culprit_ranks == ()  # no counters: no blame


def test_p2p_missing_send_and_transfer_stall():
    # stage 1 rank 4 waits in Recv from stage 0 rank 0 of pp:dp0:tp0; rank 0 never sent
    rows: list[Row] = [(4, "pp:dp0:tp0", 7, "Recv", 0, 50 * S, 50 * S, 0),
                       (0, "pp:dp0:tp0", 6, "Send", 4, 40 * S, 40 * S, 41 * S)]
    assert [f.culprit_ranks for f in analyze_hang(cols(rows), GRID, NOW)] == [(0,)]
    rows.append((0, "pp:dp0:tp0", 7, "Send", 4, 50 * S, 50 * S, 0))
    found = analyze_hang(cols(rows), GRID, NOW)
    assert [f.rule for f in found] == ["mycroft.alg2.min_data"]


def test_deadlock_cycle():
    rows: list[Row] = [(4, "tp:pp1:dp0", 5, "AllReduce", -1, 50 * S, 50 * S, 0),
                       (5, "tp:pp1:dp0", 4, "AllReduce", -1, 40 * S, 40 * S, 41 * S),
                       (5, "dp:pp1:tp1", 2, "AllReduce", -1, 50 * S, 50 * S, 0),
                       (7, "dp:pp1:tp1", 2, "AllReduce", -1, 50 * S, 50 * S, 0),
                       (4, "dp:pp1:tp0", 1, "AllReduce", -1, 30 * S, 30 * S, 31 * S)]
    # 4 waits for 5 in TP; 5 waits in DP for 7 — who is there: no edge; so 5 is a same-op sink
    found = analyze_hang(cols(rows), GRID, NOW)
    assert all(4 not in f.culprit_ranks for f in found)
    rows2: list[Row] = [(4, "tp:pp1:dp0", 5, "AllReduce", -1, 50 * S, 50 * S, 0),
                        (5, "tp:pp1:dp0", 4, "AllReduce", -1, 40 * S, 40 * S, 41 * S),
                        (5, "pp:dp0:tp1", 9, "Recv", 4, 50 * S, 50 * S, 0)]
    found = analyze_hang(cols(rows2), GRID, NOW)
    assert [(f.rule, f.culprit_ranks) for f in found] == [("mycroft.alg2.deadlock", (4, 5))]


def test_nothing_stuck_nothing_found():
    rows: list[Row] = [(4, "tp:pp1:dp0", 5, "AllReduce", -1, 99 * S, 99 * S, 0)]  # 1 s in flight
    assert analyze_hang(cols(rows), GRID, NOW) == []


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 1, 2, 3, 4, 6, 7]), st.integers(1, 40)),
                max_size=12),
       st.integers(0, 30), st.integers(0, 5))
def test_adding_pure_waiting_to_a_victim_never_moves_blame(extra_beats, longer_wait, old_ops):
    """Victims may beat more, wait longer or show more history: the blame stays on rank 5."""
    rows = compute_hang_ops()
    rows = [(r, c, k, o, p, e - longer_wait * S, s - longer_wait * S, t)
            if t == 0 else (r, c, k, o, p, e, s, t) for (r, c, k, o, p, e, s, t) in rows]
    rows += [(6, "world", k, "Barrier", -1, k * S, k * S, k * S + 1) for k in range(old_ops)]
    b = beats(list(range(8)), NOW)
    xr = np.array([r for r, _ in extra_beats], dtype=np.int64)
    xt = np.array([NOW - k * S for _, k in extra_beats], dtype=np.int64)
    allb = {"rank": np.concatenate([b["rank"], xr]), "ts": np.concatenate([b["ts"], xt])}
    found = analyze_hang(cols(rows), GRID, NOW, beats=allb)
    assert [f.culprit_ranks for f in found] == [(5,)]


def test_call_enqueued_but_never_started_is_not_reached():
    """A stall analysed after it recovered: rank 5's host posted TP op 10 with rank 4's, but its
    kernel started only when the hung backward ended (t_start after now). Rank 4 waited inside
    the op; rank 5 never reached it on the GPU — the min-op culprit, not a same-op member."""
    t_hang, t_back = 60 * S, 90 * S
    rows = [r for r in compute_hang_ops(t_hang) if not (r[0] == 4 and r[2] == 10)]
    rows += [(4, "tp:pp1:dp0", 10, "AllReduce", -1, t_hang, t_hang, t_back),
             (5, "tp:pp1:dp0", 10, "AllReduce", -1, t_hang, t_back, t_back)]
    now = 80 * S
    found = analyze_hang(cols(rows), GRID, now, beats=beats(list(range(8)), now))
    assert [(f.rule, f.culprit_ranks) for f in found] == [("mycroft.alg2.min_op", (5,))]
    assert "live_hang" in found[0].labels


def test_call_starting_within_the_stuck_threshold_counts_as_reached():
    """A kernel that starts a few ms after now (pipelining, clock skew) is not a hang: rank 5
    counts as in the op beside rank 4 (a same-op stall, left to the chunk counters), not as a
    rank that never reached it."""
    now = 80 * S
    rows: list[Row] = [(r, "tp:pp1:dp0", k, "AllReduce", -1, k * S, k * S, k * S + 1)
                       for r in (4, 5) for k in range(10)]
    rows += [(4, "tp:pp1:dp0", 10, "AllReduce", -1, 60 * S, 60 * S, 0),
             (5, "tp:pp1:dp0", 10, "AllReduce", -1, now - S // 100, now + S // 100, 0)]
    found = analyze_hang(cols(rows), GRID, now, beats=beats(list(range(8)), now))
    assert [(f.rule, f.culprit_ranks) for f in found] == [("mycroft.alg2.min_data", ())]


def _sinks_by_search(edges: dict[int, set[int]],
                     starts: list[int]) -> tuple[dict[int, int], set[int]]:
    """The definition: one breadth-first search per start."""
    reach: dict[int, int] = {}
    cyclic: set[int] = set()
    for s in starts:
        seen, todo, found = {s}, [s], False
        while todo:
            x = todo.pop()
            if not edges.get(x):
                reach[x] = reach.get(x, 0) + (x != s)
                found = True
            for y in edges.get(x, set()) - seen:
                seen.add(y)
                todo.append(y)
        if not found:
            cyclic |= seen
    return reach, cyclic


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(0, 12), st.sets(st.integers(0, 12), max_size=4), max_size=13),
       st.sets(st.integers(0, 12), min_size=1))
def test_reachable_sinks_match_one_search_per_start(edges, starts):
    """Sinks, how many starts reach each, and the nodes of sink-less cycles (self-loops,
    empty edge sets included) are those of the per-start search."""
    assert reachable_sinks(edges, sorted(starts)) == _sinks_by_search(edges, sorted(starts))


def test_same_op_member_whose_kernel_never_started_is_blamed_by_its_counters():
    """Live view of a compute hang after the host posted the next collective: ranks 4 and 5 both
    sit in TP op 10, but only rank 4's kernel staged data; rank 5 has no chunk snapshot of it
    (Table 4: receiver not ready) — rank 5's GPU, not rank 4's NIC."""
    rows: list[Row] = [(r, "tp:pp1:dp0", 10, "AllReduce", -1, 50 * S, 50 * S, 0) for r in (4, 5)]
    chunks = {"rank": np.array([4, 4]), "comm_id": np.array(["tp:pp1:dp0"] * 2, dtype=object),
              "op_seq": np.array([10, 10]), "channel": np.array([0, 1]),
              "ts": np.array([90 * S, 90 * S]), "total_chunks": np.array([2, 2]),
              "gpu_ready": np.array([1, 1]), "rdma_transmitted": np.array([0, 0]),
              "rdma_done": np.array([0, 0])}
    found = analyze_hang(cols(rows), GRID, NOW, chunks=chunks, beats=beats(list(range(8)), NOW))
    assert [(f.rule, f.culprit_ranks, f.component) for f in found] == \
        [("mycroft.alg2.min_data", (5,), "gpu_compute")]
    assert "kernel_not_started" in found[0].labels


def test_send_whose_kernel_never_started_is_not_posted():
    """Rank 4 waits in a Recv from rank 0; rank 0's host posted the Send, but its kernel started
    only after now (its stream was stuck): rank 0 is the rank 4 waits for, not a partner whose
    transfer stalled."""
    now = 80 * S
    rows: list[Row] = [(4, "pp:dp0:tp0", 7, "Recv", 0, 50 * S, 50 * S, 90 * S),
                       (0, "pp:dp0:tp0", 6, "Send", 4, 40 * S, 40 * S, 41 * S),
                       (0, "pp:dp0:tp0", 7, "Send", 4, 50 * S, 90 * S, 90 * S)]
    found = analyze_hang(cols(rows), GRID, now, beats=beats(list(range(8)), now))
    assert [(f.rule, f.culprit_ranks) for f in found] == [("mycroft.alg2.min_op", (0,))]
