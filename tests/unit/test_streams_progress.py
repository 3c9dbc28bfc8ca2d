"""The progress feed's per-window merge (streams/progress.py, `ProgressState.window`)."""

from __future__ import annotations

import numpy as np

from ingest.units import SECOND as S
from streams.progress import ProgressState


def cols(**kw: list[object]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=object if k == "comm" else np.int64) for k, v in kw.items()}


NO_BEATS = cols(rank=[], comm=[], beat=[])


def test_a_call_longer_than_the_lookback_counts_where_it_ends() -> None:
    st = ProgressState()
    ws, we = 100 * S, 101 * S
    # rank 0 on dp: one call of 30 s ends inside the window; rank 1's is still in flight
    ops = cols(rank=[0], comm=["dp:0"], completed=[1], seq_done=[7], done_bytes=[4096],
               first_end=[we - S // 2], last_end=[we - S // 2], last_ts=[0])
    running = cols(rank=[1], comm=["dp:0"], op_seq=[0], t0=[70 * S])
    row = st.window(ws, we, ops, NO_BEATS, running)
    by_rank = {int(r): i for i, r in enumerate(row["rank"])}
    r0, r1 = by_rank[0], by_rank[1]
    assert row["completed_ops"][r0] == 1 and row["last_op_seq"][r0] == 7
    assert row["bytes_per_s"][r0] == 4096 and row["inflight_ops"][r0] == 0
    assert row["oldest_inflight_age_ns"][r0] == 0
    assert row["last_record_ts"][r0] == 0  # its start is before the lookback: not "recent"
    assert row["inflight_ops"][r1] == 1 and row["oldest_inflight_age_ns"][r1] == we - 70 * S
    assert row["completed_ops"][r1] == 0 and row["last_op_seq"][r1] == -1


def test_completions_and_the_carried_state_merge() -> None:
    st = ProgressState()
    ws, we = 100 * S, 101 * S
    ops = cols(rank=[0], comm=["tp:0"], completed=[3], seq_done=[9], done_bytes=[300],
               first_end=[ws + S // 10], last_end=[ws + 7 * S // 10], last_ts=[ws + S // 2])
    running = cols(rank=[0], comm=["tp:0"], op_seq=[10], t0=[ws + S // 2])
    row = st.window(ws, we, ops, NO_BEATS, running)
    assert row["completed_ops"][0] == 3 and row["bytes_per_s"][0] == 300
    assert row["op_interval_ns"][0] == (7 * S // 10 - S // 10) // 2
    assert row["last_op_seq"][0] == 9 and row["last_record_ts"][0] == ws + S // 2
    assert row["inflight_ops"][0] == 1
    assert row["oldest_inflight_age_ns"][0] == we - (ws + S // 2)
    # the next window: nothing completed, nothing read; the carried op_seq stays
    empty = cols(rank=[], comm=[], completed=[], seq_done=[], done_bytes=[], first_end=[],
                 last_end=[], last_ts=[])
    nxt = st.window(we, we + S, empty, NO_BEATS, cols(rank=[], comm=[], op_seq=[], t0=[]))
    assert nxt["last_op_seq"][0] == 9 and nxt["completed_ops"][0] == 0
    assert nxt["op_interval_ns"][0] == -1 and nxt["inflight_ops"][0] == 0


def test_a_call_stored_in_flight_and_again_completed_is_not_in_flight_twice_or_forever() -> None:
    """The host agent stores a call running over 2 s in flight (t_end = 0) and again when it
    completes. Running rows whose op_seq is at most the highest completed one are superseded
    (calls on one communicator complete in order); a call stored twice counts once."""
    st = ProgressState()
    ws, we = 100 * S, 101 * S
    ops = cols(rank=[0], comm=["dp:0"], completed=[1], seq_done=[4], done_bytes=[100],
               first_end=[ws + S // 10], last_end=[ws + S // 10], last_ts=[ws + S // 2])
    # op 3: stored in flight 40 s ago, completed since (op 4 completed in this window);
    # op 5: stored in flight and, completed after the window end, stored again
    running = cols(rank=[0, 0, 0], comm=["dp:0"] * 3, op_seq=[3, 5, 5],
                   t0=[60 * S, ws + S // 2, ws + S // 2])
    row = st.window(ws, we, ops, NO_BEATS, running)
    assert row["last_op_seq"][0] == 4
    assert row["inflight_ops"][0] == 1
    assert row["oldest_inflight_age_ns"][0] == we - (ws + S // 2)


def test_bytes_per_second_is_exact_and_never_overflows() -> None:
    """400 Gb/s links, 60 s windows, 10x today's rates: bytes * 10^9 overflows int64, the rate
    does not; every value equals Python's exact integer floor division."""
    from streams.progress import per_second

    rng = np.random.default_rng(3)
    for width in (1, 999, 1_000_000_000, 60_000_000_000, 3_600_000_000_000):
        totals = np.concatenate([rng.integers(0, 1 << 62, 200), [0, 1, width - 1, width,
                                 9_300_000_000, 50 * 10**9 * 60 * 10, (1 << 63) - 1]])
        got = per_second(totals.astype(np.int64), width)
        for t, g in zip(totals.tolist(), got.tolist(), strict=True):
            exact = t * 10**9 // width  # Python's integers: no overflow
            clipped = 9_223_372_035 * 10**9 + (t % width) * 10**9 // width
            assert g == (exact if t // width <= 9_223_372_035 else clipped), (t, width, g)
            assert g >= 0
