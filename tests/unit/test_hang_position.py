"""hang_rca: the stage a hung rank is inside, with the microbatch its own calls name; p2p calls
in flight are not superseded by later calls of the other direction; a collective desync names
the ranks that left the program order."""

from __future__ import annotations

import numpy as np

from diagnosis import hang_rca
from diagnosis.window import Window, with_delivered_sends, without_superseded_in_flight
from ingest.records import Communicator, JobTopology
from ingest.units import MILLISECOND as MS


def pipeline(pp: int = 2, dp: int = 1, microbatches: int = 4) -> JobTopology:
    w = pp * dp
    return JobTopology(job_id="j", ts=0, world_size=w, pp=pp, dp=dp, microbatches=microbatches,
                       hosts=["h"] * w,
                       communicators=[Communicator(comm_id="world", kind="pp",
                                                   members=list(range(w)))])


def ops(rows: list[tuple[int, int, str, int, int, int, int]]) -> dict[str, np.ndarray]:
    """(rank, op_seq, op, peer, t_enqueue, t_end, step) rows on the one communicator."""
    rank, seq, op, peer, t0, t1, step = zip(*rows, strict=True)
    return {"rank": np.array(rank), "comm_id": np.full(len(rows), "world", object),
            "op_seq": np.array(seq), "op": np.array(op, dtype=object), "peer": np.array(peer),
            "bytes": np.full(len(rows), 4096), "t_enqueue": np.array(t0),
            "t_start": np.array(t0), "t_end": np.array(t1), "step": np.array(step)}


def beat(rank: int, step: int, stage: str, ts: int) -> dict[str, np.ndarray]:
    return {"rank": np.array([rank]), "ts": np.array([ts]), "comm_id": np.array(["world"],
            dtype=object), "last_op_seq": np.array([0]), "dropped": np.array([0]),
            "step": np.array([step]), "stage": np.array([stage], dtype=object),
            "stage_ts": np.array([ts - 5 * MS])}


def test_last_stage_backward_microbatch_counts_its_grad_sends() -> None:
    """Rank 1 (last of 2 stages) sent the gradient of microbatch 0, received the activations
    of microbatch 1 and is inside backward: microbatch 1. Its Send of microbatch 0 is still in
    flight (an isend whose receiver has not posted), a later Recv completed."""
    o = ops([(1, 0, "Recv", 0, 10 * MS, 12 * MS, 7), (1, 1, "Send", 0, 20 * MS, 0, 7),
             (1, 2, "Recv", 0, 21 * MS, 22 * MS, 7)])
    w = Window(pipeline(), {"ops": without_superseded_in_flight(o, 900 * MS),
                            "beats": beat(1, 7, "model.backward", 800 * MS)}, 0, 900 * MS)
    assert hang_rca._inside_stage(w, 1, 7, 900 * MS) == ("bwd mb=1 pp=1", "gpu_compute")
    # without the time of analysis, the pass alone
    assert hang_rca._inside_stage(w, 1, 7) == ("bwd pp=1", "gpu_compute")


def test_first_stage_backward_microbatch_counts_completed_grad_recvs() -> None:
    """Stage 0 sends nothing after a backward: it is in backward m once its m+1-th gradient
    Recv completed (a Recv still in flight does not count)."""
    o = ops([(0, 0, "Send", 1, 1 * MS, 2 * MS, 3), (0, 1, "Send", 1, 3 * MS, 4 * MS, 3),
             (0, 2, "Recv", 1, 5 * MS, 9 * MS, 3), (0, 3, "Send", 1, 10 * MS, 11 * MS, 3),
             (0, 4, "Recv", 1, 12 * MS, 0, 3)])
    w = Window(pipeline(), {"ops": o, "beats": beat(0, 3, "model.backward", 500 * MS)},
               0, 500 * MS)
    assert hang_rca._inside_stage(w, 0, 3, 500 * MS) == ("bwd mb=0 pp=0", "gpu_compute")
    # its forward of microbatch 2: two activation Sends before it
    w2 = Window(pipeline(), {"ops": o, "beats": beat(0, 3, "model.fwd_loss", 500 * MS)},
                0, 500 * MS)
    assert hang_rca._inside_stage(w2, 0, 3, 500 * MS) == ("fwd mb=3 pp=0", "gpu_compute")


def test_microbatch_outside_the_schedule_is_not_named() -> None:
    """More sends of the pass than the job has microbatches: the count means nothing."""
    o = ops([(1, i, "Send", 0, i * MS, (i + 1) * MS, 2) for i in range(5)])
    w = Window(pipeline(microbatches=4), {"ops": o, "beats": beat(1, 2, "model.backward",
                                                                  50 * MS)}, 0, 50 * MS)
    assert hang_rca._inside_stage(w, 1, 2, 50 * MS) == ("bwd pp=1", "gpu_compute")


def test_in_flight_send_is_not_superseded_by_a_later_recv() -> None:
    o = ops([(1, 1, "Send", 0, 20 * MS, 0, 7), (1, 2, "Recv", 0, 21 * MS, 22 * MS, 7)])
    assert without_superseded_in_flight(o, 100 * MS)["op_seq"].tolist() == [1, 2]
    # a later Send to the same peer that completed does supersede it (in-order per lane)
    o = ops([(1, 1, "Send", 0, 20 * MS, 0, 7), (1, 2, "Recv", 0, 21 * MS, 22 * MS, 7),
             (1, 3, "Send", 0, 31 * MS, 35 * MS, 7)])
    assert without_superseded_in_flight(o, 100 * MS)["op_seq"].tolist() == [2, 3]
    # and collectives as before: a later completed call on the communicator
    o = ops([(1, 1, "AllReduce", -1, 20 * MS, 0, 7), (1, 2, "AllReduce", -1, 21 * MS, 22 * MS,
                                                       7)])
    assert without_superseded_in_flight(o, 100 * MS)["op_seq"].tolist() == [2]


def dp_pair() -> JobTopology:
    return JobTopology(job_id="j", ts=0, world_size=4, dp=4, hosts=["h"] * 4,
                       communicators=[Communicator(comm_id="dp", kind="dp", members=[0, 1, 2, 3]),
                                      Communicator(comm_id="dp2", kind="dp",
                                                   members=[0, 1, 2, 3])])


def collective(rows: list[tuple[int, str, int, int, int]]) -> dict[str, np.ndarray]:
    rank, comm, seq, t0, t1 = zip(*rows, strict=True)
    n = len(rows)
    return {"rank": np.array(rank), "comm_id": np.array(comm, dtype=object),
            "op_seq": np.array(seq), "op": np.full(n, "AllReduce", object),
            "peer": np.full(n, -1), "bytes": np.full(n, 1024), "t_enqueue": np.array(t0),
            "t_start": np.array(t0), "t_end": np.array(t1), "step": np.full(n, -1)}


def test_desync_names_the_rank_alone_in_its_collective() -> None:
    """Rank 1 entered an all-reduce on dp2 that no peer joins; ranks 0, 2, 3 wait in the next
    all-reduce on dp for it: Alg. 2 sees a cycle; the minority side is the cause."""
    rows = [(r, "dp", 4, 100 * MS, 110 * MS) for r in range(4)]
    rows += [(r, "dp", 5, 200 * MS, 0) for r in (0, 2, 3)]
    rows += [(1, "dp2", 0, 190 * MS, 0)]
    now = 5000 * MS
    beats = {"rank": np.arange(4), "ts": np.full(4, now - 100 * MS),
             "comm_id": np.full(4, "dp", object), "last_op_seq": np.full(4, 5)}
    w = Window(dp_pair(), {"ops": collective(rows), "beats": beats}, 0, now)
    c = hang_rca.analyze(w, now)
    assert c is not None
    assert (c.kind, c.ranks, c.stage, c.component) == ("hang", (1,), "dp_allreduce",
                                                        "host_software")
    assert "collective_desync" in c.labels and c.confidence < 0.95


def test_symmetric_ordering_deadlock_stays_a_deadlock() -> None:
    """Ranks 0, 1 wait on dp, ranks 2, 3 on dp2 (opposite orders): no minority side."""
    rows = [(r, "dp", 4, 100 * MS, 110 * MS) for r in range(4)]
    rows += [(r, "dp2", 0, 100 * MS, 110 * MS) for r in range(4)]
    rows += [(r, "dp", 5, 200 * MS, 0) for r in (0, 1)]
    rows += [(r, "dp2", 1, 200 * MS, 0) for r in (2, 3)]
    now = 5000 * MS
    beats = {"rank": np.arange(4), "ts": np.full(4, now - 100 * MS),
             "comm_id": np.full(4, "dp", object), "last_op_seq": np.full(4, 5)}
    w = Window(dp_pair(), {"ops": collective(rows), "beats": beats}, 0, now)
    c = hang_rca.analyze(w, now)
    assert c is None or "collective_desync" not in c.labels


def test_a_rank_that_joined_the_stuck_collective_just_now_waits_with_the_others() -> None:
    """At the moment the stall turns `stuck_ns` old for the first arrivals, the last one to
    join (in flight for less) is not a rank that "never reached" the op: still the desync."""
    rows = [(r, "dp", 4, 100 * MS, 110 * MS) for r in range(4)]
    rows += [(r, "dp", 5, 200 * MS, 0) for r in (0, 2)]
    rows += [(3, "dp", 5, 700 * MS, 0), (1, "dp2", 0, 190 * MS, 0)]
    now = 1250 * MS  # stuck_ns is 1 s: ranks 0, 1, 2 are stuck, rank 3 joined 0.55 s ago
    beats = {"rank": np.arange(4), "ts": np.full(4, now - 100 * MS),
             "comm_id": np.full(4, "dp", object), "last_op_seq": np.full(4, 5)}
    c = hang_rca.analyze(Window(dp_pair(), {"ops": collective(rows), "beats": beats}, 0, now),
                         now)
    assert c is not None and c.ranks == (1,) and "collective_desync" in c.labels


def test_a_data_parallel_pass_is_microbatch_0_unless_the_rank_sends_p2p() -> None:
    """Without a pipeline or gradient accumulation a rank runs one backward a step: its
    position names microbatch 0. A rank that sends point to point is a pipeline stage the
    topology does not declare: its pass's index and microbatch are unknown."""
    b = beat(2, 9, "model.backward", 800 * MS)
    b["rank"] = np.array([2])
    c = collective([(r, "dp", 0, 10 * MS, 11 * MS) for r in range(4)])
    w = Window(dp_pair(), {"ops": c, "beats": b}, 0, 900 * MS)
    assert hang_rca._inside_stage(w, 2, 9, 900 * MS) == ("bwd mb=0 pp=0", "gpu_compute")
    p2p = {k: np.concatenate([v, v[:1]]) for k, v in c.items()}
    p2p["rank"][-1], p2p["peer"][-1], p2p["op"][-1] = 2, 3, "Send"
    w = Window(dp_pair(), {"ops": p2p, "beats": b}, 0, 900 * MS)
    assert hang_rca._inside_stage(w, 2, 9, 900 * MS) == ("bwd pp=0", "gpu_compute")


def _p2p_pair(sends: list[tuple[int, int]], recvs: list[tuple[int, int]]
              ) -> dict[str, np.ndarray]:
    """Sends of rank 0 to rank 1 and receives of rank 1 from rank 0: (t_start, t_end) in ms,
    t_end 0 for a call in flight."""
    rows = [(0, i, "Send", 1, a * MS, b * MS, 0) for i, (a, b) in enumerate(sends)]
    rows += [(1, i, "Recv", 0, a * MS, b * MS, 0) for i, (a, b) in enumerate(recvs)]
    return ops(rows)


def _send_ends(o: dict[str, np.ndarray], start_ms: int, now_ms: int) -> list[int]:
    got = with_delivered_sends(o, start_ms * MS, now_ms * MS)
    return [int(t) // MS for t, op in zip(got["t_end"], got["op"], strict=True) if op == "Send"]


def test_an_isend_in_flight_whose_receive_ended_is_delivered() -> None:
    """The tracer sees an isend complete only at its rank's next call: a send in flight whose
    (in-order) receive has ended was taken, and ends with it; one whose receive is still
    waiting, or not posted, was not."""
    sends = [(10, 12), (20, 0), (30, 0)]
    assert _send_ends(_p2p_pair(sends, [(9, 11), (19, 21), (29, 31)]), 0, 40) == [12, 21, 31]
    assert _send_ends(_p2p_pair(sends, [(9, 11), (19, 21), (29, 0)]), 0, 40) == [12, 21, 0]
    assert _send_ends(_p2p_pair(sends, [(9, 11), (19, 21)]), 0, 40) == [12, 21, 0]
    # a receive that ends after the moment analysed has not ended yet
    assert _send_ends(_p2p_pair(sends, [(9, 11), (19, 21), (29, 31)]), 0, 30) == [12, 21, 0]


def test_a_receive_whose_send_came_before_the_window_shifts_the_pairing() -> None:
    """The window holds calls posted since its start: a receive posted in it may take a send
    posted before it. Paired n-th with n-th, the send posted at 15 ms would take the receive
    that ended at 11 ms, before it was posted; the pairing that fits no such thing pairs it
    with the next receive, and the send posted at 25 ms has no receive that ended."""
    o = _p2p_pair([(5, 6), (15, 0), (25, 0)], [(9, 11), (16, 17)])
    assert _send_ends(o, 8, 40) == [6, 17, 0]


def test_a_middle_stage_hung_after_its_isend_is_the_culprit() -> None:
    """3 stages, 2 microbatches: rank 1 (the middle stage) sent the gradient of microbatch 0
    with an isend its receiver (rank 0) took, then hung at the start of its next backward.
    The tracer never saw that isend complete (no later call), so it stays in flight; read as
    it is, rank 1 looks like a rank waiting inside a send its peer is receiving (no culprit).
    Rank 0 waits for the gradient of microbatch 1, rank 2 for rank 1 to take its own."""
    o = ops([
        (0, 0, "Send", 1, 1 * MS, 2 * MS, 7), (0, 1, "Send", 1, 4 * MS, 6 * MS, 7),
        (0, 2, "Recv", 1, 6 * MS, 13 * MS, 7), (0, 3, "Recv", 1, 14 * MS, 0, 7),
        (1, 0, "Recv", 0, 1 * MS, 2 * MS, 7), (1, 1, "Send", 2, 3 * MS, 4 * MS, 7),
        (1, 2, "Recv", 0, 4 * MS, 5 * MS, 7), (1, 3, "Send", 2, 6 * MS, 10 * MS, 7),
        (1, 4, "Recv", 2, 10 * MS, 11 * MS, 7), (1, 5, "Send", 0, 12 * MS, 0, 7),
        (2, 0, "Recv", 1, 2 * MS, 4 * MS, 7), (2, 1, "Send", 1, 8 * MS, 11 * MS, 7),
        (2, 2, "Recv", 1, 9 * MS, 10 * MS, 7), (2, 3, "Send", 1, 12 * MS, 0, 7),
    ])
    now = 3000 * MS
    topo = pipeline(pp=3, microbatches=2)
    beats = {k: np.concatenate([beat(r, 7, "model.backward", now - 200 * MS)[k]
                                for r in range(3)]) for k in beat(0, 0, "", 0)}
    as_read = Window(topo, {"ops": without_superseded_in_flight(o, now), "beats": beats}, 0, now)
    c = hang_rca.analyze(as_read, now)
    assert c is None or c.ranks != (1,)  # the defect this guards against
    fixed = Window(topo, {"ops": with_delivered_sends(without_superseded_in_flight(o, now), 0,
                                                      now), "beats": beats}, 0, now)
    c = hang_rca.analyze(fixed, now)
    assert c is not None and c.kind == "hang" and c.ranks == (1,), c
    assert c.stage == "bwd mb=1 pp=1", c


def test_desync_beside_one_peer_is_the_side_on_a_never_used_communicator() -> None:
    """A 2-rank group: rank 0 waits in the group's all-reduce #5, rank 1 sits in the first
    all-reduce of a copy of the group that rank 0 never joins. Each side holds half its
    members; the copy has never completed a call, the group has completed five: rank 1 left
    the program order."""
    topo = JobTopology(job_id="j", ts=0, world_size=2, dp=2, hosts=["h"] * 2,
                       communicators=[Communicator(comm_id="dp", kind="dp", members=[0, 1]),
                                      Communicator(comm_id="side", kind="dp", members=[0, 1])])
    rows = [(r, "dp", s, (100 + 10 * s) * MS, (105 + 10 * s) * MS) for r in (0, 1)
            for s in range(5)]
    rows += [(0, "dp", 5, 200 * MS, 0), (1, "side", 0, 190 * MS, 0)]
    now = 5000 * MS
    beats = {"rank": np.arange(2), "ts": np.full(2, now - 100 * MS),
             "comm_id": np.full(2, "dp", object), "last_op_seq": np.full(2, 5)}
    c = hang_rca.analyze(Window(topo, {"ops": collective(rows), "beats": beats}, 0, now), now)
    assert c is not None and c.ranks == (1,) and "collective_desync" in c.labels, c


def test_last_stage_forward_is_past_the_forwards_of_its_done_backwards() -> None:
    """The last of 2 stages ran forward 0 and backward 0 (1F1B) and stopped on entering
    forward 1, before its Recv of microbatch 1 was issued: one activation Recv completed, but
    one gradient Send says backward 0 is done, so forward 0 is too — microbatch 1."""
    o = ops([(1, 0, "Recv", 0, 10 * MS, 12 * MS, 7), (1, 1, "Send", 0, 20 * MS, 21 * MS, 7)])
    w = Window(pipeline(), {"ops": o, "beats": beat(1, 7, "model.fwd_loss", 800 * MS)},
               0, 900 * MS)
    assert hang_rca._inside_stage(w, 1, 7, 900 * MS) == ("fwd mb=1 pp=1", "gpu_compute")
    # after its Recv of microbatch 1 completed: the same pass
    o2 = ops([(1, 0, "Recv", 0, 10 * MS, 12 * MS, 7), (1, 1, "Send", 0, 20 * MS, 21 * MS, 7),
              (1, 2, "Recv", 0, 22 * MS, 23 * MS, 7)])
    w2 = Window(pipeline(), {"ops": o2, "beats": beat(1, 7, "model.fwd_loss", 800 * MS)},
                0, 900 * MS)
    assert hang_rca._inside_stage(w2, 1, 7, 900 * MS) == ("fwd mb=1 pp=1", "gpu_compute")
    # no backward done yet (forward 0, its Recv complete): microbatch 0
    o3 = ops([(1, 0, "Recv", 0, 10 * MS, 12 * MS, 7)])
    w3 = Window(pipeline(), {"ops": o3, "beats": beat(1, 7, "model.fwd_loss", 800 * MS)},
                0, 900 * MS)
    assert hang_rca._inside_stage(w3, 1, 7, 900 * MS) == ("fwd mb=0 pp=1", "gpu_compute")
