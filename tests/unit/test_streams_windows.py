"""Event-time window bookkeeping (streams/windows.py): due windows, late marks, checkpoints."""

from __future__ import annotations

import pytest

from streams.windows import Windows, WindowSpec, window_start

S = 1_000_000_000


def make() -> Windows:
    return Windows([WindowSpec("p", S), WindowSpec("it", 10 * S, reach_ns=5 * S,
                                                   late_marks=True, max_late_windows=3)], 2 * S)


def test_windows_close_at_the_watermark_in_order() -> None:
    w = make()
    assert w.due("j", "p") == []
    w.observe("j", 100 * S + 5, 103 * S)
    assert w.watermark("j") == 101 * S
    assert w.due("j", "p") == [100 * S]  # [100, 101) ends at the watermark
    with pytest.raises(ValueError):
        w.closed("j", "p", 101 * S)
    w.closed("j", "p", 100 * S)
    assert w.due("j", "p") == []
    w.observe("j", 101 * S, 110 * S)
    assert w.due("j", "p", limit=3) == [101 * S, 102 * S, 103 * S]
    assert w.due("j", "it") == []  # [100, 110) needs the watermark at 110


def test_late_batches_mark_closed_iteration_windows_and_bound_the_marks() -> None:
    w = make()
    w.observe("j", 100 * S, 200 * S)
    for s in w.due("j", "it", limit=100):
        w.closed("j", "it", s)
    assert w.jobs["j"].kinds["it"].next_start == 190 * S
    w.observe("j", 171 * S, 172 * S)  # touches [170,180) and, by reach, nothing past it
    assert w.late("j", "it") == [170 * S]
    w.observe("j", 100 * S, 101 * S)  # older than 3 windows back: dropped and counted
    assert w.late("j", "it") == [170 * S] and w.dropped_late == 1
    w.observe("j", 150 * S, 166 * S)  # [150,160) is too old; [160,170) and [170,180) marked
    assert w.late("j", "it") == [160 * S, 170 * S] and w.dropped_late == 2
    w.recomputed("j", "it", 160 * S)
    assert w.late("j", "it") == [170 * S]


def test_checkpoints_restore_the_next_windows() -> None:
    w = make()
    w.observe("j", 100 * S, 110 * S)
    for s in w.due("j", "p", limit=100):
        w.closed("j", "p", s)
    rows = w.checkpoint("j")
    fresh = make()
    fresh.restore(rows)
    assert fresh.due("j", "p") == []
    fresh.observe("j", 111 * S, 112 * S)
    assert fresh.due("j", "p") == [108 * S, 109 * S]
    assert window_start(-1, S) == -S
