"""VenusTrace/MegaTrace heartbeat hang trigger and the expected-step learner, explicit clock."""

from __future__ import annotations

import numpy as np

from diagnosis.expectation import Expectation
from diagnosis.triggers.heartbeat import (
    BeatProgress,
    HeartbeatConfig,
    HeartbeatState,
    beat_progress_trigger,
    heartbeat_trigger,
    observe_steps,
)
from ingest.units import SECOND as S


def prog(ranks: list[int], ts: int) -> dict[str, np.ndarray]:
    r = np.asarray(ranks, dtype=np.int64)
    return {"rank": r, "t_enqueue": np.full(r.size, ts, dtype=np.int64),
            "t_end": np.full(r.size, ts, dtype=np.int64)}


def beats(ranks: list[int], ts: int) -> dict[str, np.ndarray]:
    r = np.asarray(ranks, dtype=np.int64)
    return {"rank": r, "ts": np.full(r.size, ts, dtype=np.int64)}


def test_expectation_starts_at_second_sample_and_updates_within_alpha():
    e = Expectation(alpha=0.05)
    e.update(50.0)  # warm-up step, ignored
    assert not e.ready
    e.update(10.0)
    assert float(e.value) == 10.0
    within, _ = e.update(10.4)
    assert bool(within) and 10.0 < float(e.value) < 10.4
    v = float(e.value)
    within, _ = e.update(30.0)  # outside α: ignored
    assert not bool(within) and float(e.value) == v


def test_expectation_rebases_after_consistent_shift():
    e = Expectation(alpha=0.05, rebase_after=3)
    for x in (9.0, 10.0, 10.0, 20.0, 20.1, 19.9):
        _, rebased = e.update(x)
    assert bool(rebased) and abs(float(e.value) - 20.0) < 0.1


def test_hang_after_n_times_expected_step_live_vs_silent():
    st = HeartbeatState("j", world=4, config=HeartbeatConfig(n=2.0))
    observe_steps(st, np.array([1, 2, 3]), np.array([9, 3, 3]) * S, now_ns=10 * S)
    assert st.timeout_ns == 6 * S
    t = 100 * S
    assert heartbeat_trigger(st, prog([0, 1, 2, 3], t), beats([0, 1, 2, 3], t), t) == []
    # rank 2 stops progressing but keeps beating; rank 3 goes fully silent
    for k in range(1, 7):
        now = t + k * S
        out = heartbeat_trigger(st, prog([0, 1], now), beats([0, 1, 2], now), now)
        assert out == [], k
    now = t + 7 * S
    out = heartbeat_trigger(st, prog([0, 1], now), beats([0, 1, 2], now), now)
    assert len(out) == 1 and out[0].kind == "hang" and out[0].ranks == (2, 3)
    assert out[0].evidence["live"] == [2] and out[0].evidence["silent_no_beats"] == [3]
    # no re-fire while still hung; progress re-arms
    assert heartbeat_trigger(st, {}, {}, now + S) == []
    heartbeat_trigger(st, prog([2, 3], now + 2 * S), {}, now + 2 * S)
    assert not st.hung.any()


def test_cold_timeout_before_expectation_and_min_floor():
    st = HeartbeatState("j", world=1, config=HeartbeatConfig(cold_timeout_ns=60 * S))
    heartbeat_trigger(st, prog([0], S), {}, S)
    assert heartbeat_trigger(st, {}, {}, 50 * S) == []
    assert heartbeat_trigger(st, {}, {}, 62 * S)[0].ranks == (0,)
    st2 = HeartbeatState("j", world=1)
    observe_steps(st2, np.array([1, 2]), np.array([1, 1]) * 1000, now_ns=0)  # 1 µs steps
    assert st2.timeout_ns == HeartbeatConfig().min_timeout_ns


def test_regression_trigger_on_rebase_and_per_rank_rows_use_max():
    st = HeartbeatState("j", world=2, config=HeartbeatConfig(rebase_after=3))
    steps = np.array([1, 1, 2, 2, 3, 3])
    observe_steps(st, steps, np.array([5, 4, 2, 3, 3, 3]) * S, now_ns=0)
    assert float(st.expected.value) == 3 * S
    out = observe_steps(st, np.array([4, 5, 6]), np.array([6, 6, 6]) * S, now_ns=1)
    assert [t.kind for t in out] == ["regression"]
    assert observe_steps(st, np.array([6]), np.array([100 * S]), now_ns=2) == []  # already seen


def counted(ranks: list[int], ts: int, seq: list[int], comm: str = "dp",
            exited: int = 0) -> dict[str, np.ndarray]:
    """Beats as the host agent writes them: per (rank, communicator) the newest op_seq."""
    r = np.asarray(ranks, dtype=np.int64)
    return {"rank": r, "ts": np.full(r.size, ts, dtype=np.int64),
            "comm_id": np.full(r.size, comm, dtype=object),
            "last_op_seq": np.asarray(seq, dtype=np.int64),
            "exited": np.full(r.size, exited, dtype=np.int64)}


def _warm(world: int) -> tuple[HeartbeatState, BeatProgress]:
    st = HeartbeatState("j", world, HeartbeatConfig(n=2.0, min_timeout_ns=S))
    observe_steps(st, np.arange(3), np.full(3, 100_000_000), 0)  # T_expected 100 ms: timeout 1 s
    return st, BeatProgress(world)


def test_beats_whose_op_counters_move_never_fire_and_a_stopped_counter_fires_once():
    st, bp = _warm(4)
    for i in range(6):  # one beat a second, every rank's counter moving
        assert beat_progress_trigger(st, bp, counted([0, 1, 2, 3], i * S, [i * 10] * 4)) == []
    # from 6 s on rank 2's counter stops; the others keep beating with theirs moving
    out = []
    for i in range(6, 10):
        out += beat_progress_trigger(st, bp, counted([0, 1, 2, 3], i * S,
                                                     [i * 10, i * 10, 50, i * 10]))
    assert len(out) == 1
    t = out[0]
    # progress last seen at the 5 s beat; silent for more than 1 s at the 7 s beat
    assert t.kind == "hang" and t.ranks == (2,) and t.ts == 7 * S
    assert t.evidence["live"] == [2] and t.evidence["silent_no_beats"] == []
    assert t.evidence["last_progress_ns_min"] == 5 * S
    # it moves again: re-armed, and a new stop is a new episode
    assert beat_progress_trigger(st, bp, counted([2], 10 * S, [60])) == []
    again = [t for i in range(11, 14)
             for t in beat_progress_trigger(st, bp, counted([0, 1, 2, 3], i * S,
                                                            [i * 10, i * 10, 60, i * 10]))]
    assert [t.ranks for t in again] == [(2,)]


def test_a_rank_whose_beats_stop_is_silent_without_beats():
    st, bp = _warm(2)
    beat_progress_trigger(st, bp, counted([0, 1], 1 * S, [1, 1]))
    out = [t for i in range(2, 5)
           for t in beat_progress_trigger(st, bp, counted([0], i * S, [i]))]
    assert [t.ranks for t in out] == [(1,)]
    assert out[0].evidence["silent_no_beats"] == [1] and out[0].evidence["live"] == []


def test_the_clock_is_the_beats_own_and_rows_without_a_counter_are_not_progress():
    st, bp = _warm(2)
    # a beat without a communicator (a rank before its first op), an exit beat: no progress
    beat_progress_trigger(st, bp, counted([0, 1], 1 * S, [-1, -1], comm=""))
    beat_progress_trigger(st, bp, counted([1], 2 * S, [5], exited=1))
    assert not (bp.changed_ns > 0).any()
    # several beats of one (rank, comm) in one batch: the first beat showing the newest count
    b = counted([0, 0, 0], 0, [3, 7, 7])
    b["ts"] = np.asarray([3 * S, 4 * S, 5 * S], dtype=np.int64)
    beat_progress_trigger(st, bp, b)
    assert bp.changed_ns[0] == 4 * S and bp.clock_ns == 5 * S
    # two communicators of a rank: either moving is progress
    beat_progress_trigger(st, bp, counted([0], 6 * S, [7], comm="tp"))
    assert bp.changed_ns[0] == 6 * S
    # a batch holding only older beats leaves the clock where it was
    beat_progress_trigger(st, bp, counted([1], 1 * S, [9]))
    assert bp.clock_ns == 6 * S
