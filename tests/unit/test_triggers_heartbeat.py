"""VenusTrace/MegaTrace heartbeat hang trigger and the expected-step learner, explicit clock."""

from __future__ import annotations

import numpy as np

from diagnosis.expectation import Expectation
from diagnosis.triggers.heartbeat import (
    HeartbeatConfig,
    HeartbeatState,
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
