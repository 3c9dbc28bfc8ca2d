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
