"""The progress feed's per-window merge (streams/progress.py, `ProgressState.window`)."""

from __future__ import annotations

import numpy as np

from streams.progress import ProgressState

S = 1_000_000_000


def cols(**kw: list[object]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=object if k == "comm" else np.int64) for k, v in kw.items()}


A_COLS = ("rank", "comm", "n_done", "seq_done", "completed", "done_bytes", "first_end",
          "last_end", "inflight", "oldest", "last_ts")
B_COLS = ("rank", "comm", "inflight", "oldest", "completed", "done_bytes", "first_end",
          "last_end", "seq_done")


def test_a_call_longer_than_the_lookback_counts_where_it_ends() -> None:
    st = ProgressState()
    ws, we = 100 * S, 101 * S
    ops = cols(**{k: [] for k in A_COLS})
    # rank 0 on dp: one call of 30 s ends inside the window (query B); rank 1 still in flight
    hung = cols(rank=[0, 1], comm=["dp:0", "dp:0"], inflight=[0, 1], oldest=[0, 70 * S],
                completed=[1, 0], done_bytes=[4096, 0], first_end=[we - S // 2, 0],
                last_end=[we - S // 2, 0], seq_done=[7, 0])
    beats = cols(rank=[], comm=[], beat=[])
    row = st.window(ws, we, ops, hung, beats)
    by_rank = {int(r): i for i, r in enumerate(row["rank"])}
    r0, r1 = by_rank[0], by_rank[1]
    assert row["completed_ops"][r0] == 1 and row["last_op_seq"][r0] == 7
    assert row["bytes_per_s"][r0] == 4096 and row["inflight_ops"][r0] == 0
    assert row["oldest_inflight_age_ns"][r0] == 0
    assert row["inflight_ops"][r1] == 1 and row["oldest_inflight_age_ns"][r1] == we - 70 * S
    assert row["completed_ops"][r1] == 0 and row["last_op_seq"][r1] == -1


def test_completions_from_both_ranges_merge() -> None:
    st = ProgressState()
    ws, we = 100 * S, 101 * S
    ops = cols(rank=[0], comm=["tp:0"], n_done=[2], seq_done=[9], completed=[2],
               done_bytes=[200], first_end=[ws + S // 10], last_end=[ws + S // 5], inflight=[1],
               oldest=[ws + S // 2], last_ts=[ws + S // 2])
    hung = cols(rank=[0], comm=["tp:0"], inflight=[0], oldest=[0], completed=[1],
                done_bytes=[100], first_end=[ws + 7 * S // 10], last_end=[ws + 7 * S // 10],
                seq_done=[5])
    row = st.window(ws, we, ops, hung, cols(rank=[], comm=[], beat=[]))
    assert row["completed_ops"][0] == 3 and row["bytes_per_s"][0] == 300
    assert row["op_interval_ns"][0] == (7 * S // 10 - S // 10) // 2
    assert row["last_op_seq"][0] == 9
    assert row["oldest_inflight_age_ns"][0] == we - (ws + S // 2)  # B's 0 is not an in-flight start
