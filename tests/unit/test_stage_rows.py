"""The in-memory copy of a job's stored stage records (diagnosis/stage_rows.py)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diagnosis.agents import WINDOW_COLUMNS
from diagnosis.stage_rows import COLUMNS, IDLE_S, KEEP_BEFORE_S, MAX_PENDING, StageRows
from ingest.units import SECOND


def rows(steps: list[int], ranks: int = 2, step_ns: int = 100) -> dict[str, np.ndarray]:
    step = np.repeat(np.asarray(steps, np.int64), ranks)
    rank = np.tile(np.arange(ranks), len(steps))
    out = {k: np.zeros(step.size, np.int64) for k in COLUMNS}
    out.update(rank=rank, step=step, t_start=step * step_ns + rank,
               model_backward=step * 10 + rank)
    return out


def as_set(t: Mapping[str, np.ndarray]) -> list[tuple[int, ...]]:
    return sorted(zip(*(t[k].tolist() for k in COLUMNS), strict=True)) if t else []


def test_the_columns_are_the_stage_reads():
    assert list(COLUMNS) == list(WINDOW_COLUMNS["stages"][1])


def test_reads_wait_for_the_anchor_then_come_from_memory():
    s = StageRows()
    assert s.read("j", 0, 10_000) is None  # nothing anchored: the caller queries
    s.begin("j", 0)
    s.add("j", rows([3]))  # stored while the query ran, and returned by it too
    assert s.read("j", 0, 10_000) is None
    s.anchor("j", 0, rows([1, 2, 3]))
    s.add("j", rows([4]))
    got = s.read("j", 150, 10_000)
    assert got is not None and as_set(got) == as_set(rows([2, 3, 4]))  # step 3 once
    assert np.all(np.diff(got["t_start"]) >= 0)  # in (t_start, rank) order
    assert got["rank"].dtype == np.int32 and got["step"].dtype == np.int64
    assert s.read("j", 10_000, 20_000) == {}  # nothing in range
    with pytest.raises(ValueError):
        got["model_backward"][0] = 7  # the copy's arrays are read-only
    assert (s.hits, s.anchors) == (2, 1)


def test_what_the_copy_cannot_serve_is_queried_again():
    s = StageRows()
    s.begin("j", 1_000)
    s.anchor("j", 1_000, rows([10, 11]))
    assert s.read("j", 999, 5_000) is None  # starts before the copy
    start = int(KEEP_BEFORE_S * SECOND) + 2_000
    assert s.read("j", start, start + 1) == {}  # lets go of what is older than 30 s before
    assert s.read("j", 1_000, 5_000) is None
    s.begin("j", 0)
    s.anchor("j", 0, {})
    assert s.read("j", 0, 5_000) == {}
    s.add("j", {k: v for k, v in rows([1]).items() if k != "sched_wait_ns"})
    assert s.read("j", 0, 5_000) is None  # a batch the copy cannot mirror: dropped
    s.begin("j", 0)
    s.drop("j")
    s.anchor("j", 0, rows([1]))  # dropped while its query ran: not anchored
    assert s.read("j", 0, 5_000) is None
    s.begin("j", 0)
    s.anchor("j", 0, None)
    for i in range(MAX_PENDING + 1):  # a job added to but never read
        s.add("j", rows([i]))
    assert s.read("j", 0, 5_000) is None


def test_a_copy_no_read_asks_for_is_let_go():
    """A job that ended is read no more: its copy goes when another job's is anchored."""
    now = [0.0]
    s = StageRows(clock=lambda: now[0])
    for job in ("ended", "live"):
        s.begin(job, 0)
        s.anchor(job, 0, rows([1]))
    now[0] = IDLE_S / 2
    assert s.read("live", 0, 5_000)
    now[0] = IDLE_S + 1
    s.begin("new", 0)
    assert set(s.copies) == {"live", "new"}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=30, unique=True),
       st.integers(0, 30), st.lists(st.integers(0, 5), max_size=8),
       st.integers(0, 4_000), st.integers(0, 4_000))
def test_a_read_equals_the_stored_rows_in_its_range(steps, n_anchor, cuts, a, b):
    """Whatever part of the stored rows the anchoring query returned, however the rest came in
    batches (with the rows of the query's last batch added again), a read returns exactly the
    stored rows in its range."""
    stored = rows(steps, ranks=3)
    n = stored["step"].size
    k = min(n_anchor * 3, n)
    s = StageRows()
    s.begin("j", 0)
    overlap = {c: v[max(k - 3, 0):k] for c, v in stored.items()}  # added and returned
    s.add("j", overlap)
    s.anchor("j", 0, {c: v[:k] for c, v in stored.items()})
    at = k
    for c in cuts:
        nxt = min(n, at + c * 3)
        s.add("j", {col: v[at:nxt] for col, v in stored.items()})
        at = nxt
    s.add("j", {col: v[at:] for col, v in stored.items()})
    lo, hi = min(a, b), max(a, b)
    got = s.read("j", lo, hi)
    keep = (stored["t_start"] >= lo) & (stored["t_start"] <= hi)
    want = {c: v[keep] for c, v in stored.items()} if keep.any() else {}
    assert got is not None and as_set(got) == as_set(want)
    if got:
        order = np.lexsort((got["rank"], got["t_start"]))
        assert np.array_equal(order, np.arange(order.size))
