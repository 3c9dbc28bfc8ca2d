"""The in-flight supersession rule every reader of `ops` applies (ingest/inflight.py)."""

from __future__ import annotations

import numpy as np

from ingest.inflight import superseded


def test_an_in_flight_row_is_superseded_by_a_completion_of_its_call_or_a_later_one() -> None:
    rank = np.array([0, 0, 0, 0, 1, 1, 0])
    comm = np.array(["dp", "dp", "dp", "dp", "dp", "dp", "tp"], dtype=object)
    seq = np.array([5, 5, 6, 7, 5, 4, 9])
    t_end = np.array([0, 90, 0, 0, 0, 80, 0])
    # rank 0 dp: op 5 completed (its own completed row), ops 6 and 7 are still running;
    # rank 1 dp: 4 completed, 5 running; rank 0 tp: nothing completed on tp
    assert superseded(rank, comm, seq, t_end).tolist() == [True, False, False, False, False,
                                                           False, False]
    # a completion of a later call supersedes the earlier in-flight rows of that communicator
    t_end2 = t_end.copy()
    t_end2[3] = 100  # rank 0 dp op 7 completed
    assert superseded(rank, comm, seq, t_end2).tolist() == [True, False, True, False, False,
                                                            False, False]


def test_completions_after_now_do_not_count() -> None:
    rank, comm = np.array([0, 0]), np.array([1, 1])
    seq, t_end = np.array([3, 3]), np.array([0, 500])
    assert superseded(rank, comm, seq, t_end, now_ns=400).tolist() == [False, False]
    assert superseded(rank, comm, seq, t_end, now_ns=500).tolist() == [True, False]
    assert superseded(rank, comm, seq, t_end).tolist() == [True, False]


def test_no_in_flight_rows_nothing_superseded() -> None:
    assert not superseded(np.array([0]), np.array([0]), np.array([1]), np.array([5])).any()
    assert superseded(np.zeros(0, int), np.zeros(0, int), np.zeros(0, int),
                      np.zeros(0, int)).size == 0


def test_the_mask_is_the_rule_by_brute_force() -> None:
    """Random rows — comm codes as strings, small ints and large ints (hashes) — against the
    definition row by row."""
    rng = np.random.default_rng(11)
    for trial in range(200):
        n = int(rng.integers(1, 60))
        rank = rng.integers(0, 5, n)
        base = rng.integers(0, 3, n)
        comm = [np.array([f"c{c}" for c in base], dtype=object), base,
                base.astype(np.uint64) * np.uint64(2**61)][trial % 3]
        seq = rng.integers(0, 8, n)
        t_end = np.where(rng.random(n) < 0.4, 0, rng.integers(1, 100, n))
        now = None if trial % 2 else int(rng.integers(1, 100))
        want = [bool(t_end[i] == 0 and any(
            rank[j] == rank[i] and base[j] == base[i] and t_end[j] > 0
            and (now is None or t_end[j] <= now) and seq[j] >= seq[i] for j in range(n)))
            for i in range(n)]
        assert superseded(rank, comm, seq, t_end, now).tolist() == want, trial
