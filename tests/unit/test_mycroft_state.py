"""Mycroft Table 4 on chunk counters: states, local vs remote cause, sender vs receiver."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from diagnosis.groups import grid_of
from diagnosis.rules.mycroft_state import (
    GPU_NOT_READY,
    NOT_DELIVERED,
    NOT_STARTED,
    NOT_TRANSMITTED,
    chunk_states,
    classify_states,
    state_findings,
    state_fractions,
)
from tests.unit.topo_fixtures import megatron_topology

GRID = grid_of(megatron_topology(4, 1, 1))  # one TP ring: tp:pp0:dp0 = [0, 1, 2, 3]
COMM = "tp:pp0:dp0"


def snap(rows: Sequence[tuple[int, int, int, int]], total: int = 8, ts: int = 100,
         comm: str = COMM, op_seq: int = 7) -> dict[str, np.ndarray]:
    """rows: (rank, gpu_ready, rdma_transmitted, rdma_done), one channel."""
    a = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
    n = a.shape[0]
    return {"rank": a[:, 0], "comm_id": np.full(n, comm, dtype=object),
            "op_seq": np.full(n, op_seq, dtype=np.int64), "channel": np.zeros(n, dtype=np.int64),
            "ts": np.full(n, ts, dtype=np.int64), "total_chunks": np.full(n, total),
            "gpu_ready": a[:, 1], "rdma_transmitted": a[:, 2], "rdma_done": a[:, 3]}


def blame(rows: Sequence[tuple[int, int, int, int]]) -> dict[int, str | None]:
    st = chunk_states(snap(rows), now_ns=1000, grid=GRID)
    return {f.culprit_ranks[0]: f.component for f in state_findings(st)}


def test_table4_conditions_can_hold_together():
    g, t, d, tot = (np.array(x) for x in ([0, 3, 3, 2, 4], [0, 1, 3, 2, 2], [0, 0, 1, 2, 1],
                                          [8, 8, 8, 8, 8]))
    s = classify_states(g, t, d, tot)
    assert s[0] == NOT_STARTED
    assert s[1] == NOT_TRANSMITTED | NOT_DELIVERED  # "multiple conditions can be met"
    assert s[2] == NOT_DELIVERED
    assert s[3] == GPU_NOT_READY
    assert s[4] == NOT_TRANSMITTED | NOT_DELIVERED


def test_fig2_slow_sender_is_blamed_not_the_ranks_it_delays():
    # Fig. 2: rank 0 transmits slowly; ranks 1-3 wait for its data (①=②=③)
    assert blame([(0, 3, 1, 1), (1, 1, 1, 1), (2, 1, 1, 1), (3, 1, 1, 1)]) == {0: "nic_rdma"}


def test_receiver_failure_sender_undelivered_receiver_all_equal():
    # Mycroft §5.3: sender ①=②>③, receiver ①=②=③ → the receiver
    st = chunk_states(snap([(1, 2, 2, 1), (2, 1, 1, 1), (0, 2, 2, 2), (3, 1, 1, 1)]), 1000, GRID)
    row = int(np.flatnonzero(st.rank == 1)[0])
    assert st.cause[row] == "remote" and st.blamed[row] == 2 and st.peer[row] == 2
    assert {f.culprit_ranks for f in state_findings(st)} == {(2,)}


def test_nic_down_blames_the_rank_with_both_links_undelivered():
    # rank 2's NIC is down: 1→2 and 2→3 are both undelivered; rank 3 looks healthy
    assert blame([(0, 1, 1, 1), (1, 2, 2, 1), (2, 2, 2, 1), (3, 1, 1, 1)]) == {2: "nic_rdma"}


def test_receiver_not_ready_moves_blame_to_receiver():
    st = chunk_states(snap([(0, 2, 2, 2), (1, 2, 0, 0), (2, 0, 0, 0), (3, 2, 2, 2)]), 1000, GRID)
    by_rank = {int(r): (c, int(b)) for r, c, b in zip(st.rank, st.cause, st.blamed, strict=True)}
    assert by_rank[1] == ("remote", 2)
    assert by_rank[2] == ("local", 2)  # uninitialized while its peers progressed
    assert [f.culprit_ranks for f in state_findings(st)] == [(2,)]


def test_blocked_when_nobody_started():
    st = chunk_states(snap([(r, 0, 0, 0) for r in range(4)]), 1000, GRID)
    assert set(st.cause.tolist()) == {"victim"} and state_findings(st) == []


def test_gpu_not_ready_only_for_a_unique_laggard():
    assert blame([(0, 3, 3, 3), (1, 3, 3, 3), (2, 3, 3, 3), (3, 1, 1, 1)]) == {3: "gpu_compute"}
    assert blame([(0, 3, 3, 3), (1, 3, 3, 3), (2, 3, 3, 3), (3, 3, 3, 3)]) == {}
    assert blame([(0, 3, 3, 3), (1, 1, 1, 1), (2, 3, 3, 3), (3, 1, 1, 1)]) == {}


def test_latest_snapshot_before_now_and_peer_from_flows():
    early = snap([(0, 1, 1, 1), (1, 1, 1, 1)], ts=10)
    late = snap([(0, 4, 1, 1), (1, 1, 1, 1)], ts=20)
    future = snap([(0, 8, 8, 8), (1, 8, 8, 8)], ts=99)
    chunks = {k: np.concatenate([early[k], late[k], future[k]]) for k in early}
    flows = {"rank": np.array([0, 1]), "comm_id": np.array([COMM, COMM], dtype=object),
             "op_seq": np.array([7, 7]), "channel": np.array([0, 0]), "peer": np.array([1, 0])}
    st = chunk_states(chunks, now_ns=50, flows=flows)
    assert st.ts.tolist() == [20, 20] and st.peer.tolist() == [1, 0]
    assert [f.culprit_ranks for f in state_findings(st)] == [(0,)]


def test_state_fractions_over_time():
    a = snap([(0, 3, 3, 3), (1, 3, 1, 1)], ts=1)
    b = snap([(0, 4, 4, 4), (1, 4, 4, 4)], ts=2)
    fr = state_fractions({k: np.concatenate([a[k], b[k]]) for k in a}, np.array([0, 1]))
    assert fr["gpu_not_ready"].tolist() == [1.0, 0.5]
    assert fr["not_transmitted"].tolist() == [0.0, 0.5]


def test_collective_receiver_without_any_snapshot_never_started():
    # rank 2 of the TP ring has no row for the op: its kernel never started, so rank 1's staged
    # chunk cannot leave (receiver not ready) — not rank 1's NIC
    rows = [(0, 2, 2, 2), (1, 2, 0, 0), (3, 2, 2, 2)]
    st = chunk_states(snap(rows), now_ns=1000, grid=GRID)
    row = int(np.flatnonzero(st.rank == 1)[0])
    assert (st.cause[row], int(st.blamed[row]), st.component[row]) == ("remote", 2, "")
    assert [f.culprit_ranks for f in state_findings(st)] == [(2,)]
    # without a grid, or on a Send/Recv communicator, absence proves nothing: the sender's NIC
    assert [f.culprit_ranks for f in state_findings(chunk_states(snap(rows), 1000))] == [(1,)]
    pp = grid_of(megatron_topology(1, 4, 1))  # one PP group: pp:dp0:tp0 = [0, 1, 2, 3]
    st = chunk_states(snap(rows, comm="pp:dp0:tp0"), now_ns=1000, grid=pp)
    assert {f.culprit_ranks: f.component for f in state_findings(st)} == {(1,): "nic_rdma"}
