"""Event-time window bookkeeping (streams/windows.py): due windows, late marks, checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

from ingest.units import SECOND as S
from streams.windows import (
    LATE_SUFFIX,
    Checkpoint,
    WatermarkParams,
    Windows,
    WindowSpec,
    event_segments,
    window_start,
)


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


class Wall:
    """The injected wall clock (ns)."""

    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


def learning(wall: Wall) -> Windows:
    return Windows([WindowSpec("p", S, inputs=("ops",)), WindowSpec("k", S)], 2 * S,
                   WatermarkParams(min_lateness_ns=S // 10, margin_ns=S // 10, warmup_batches=3,
                                   silent_ns=2 * S, idle_ns=10 * S), clock=wall)


def feed(w: Windows, wall: Wall, kind: str, t0: int, n: int, *, behind: int = 0,
         source: str = "h1") -> None:
    """n batches of `kind`, one a second of event and wall time, each reaching `behind` back."""
    for i in range(n):
        t = t0 + i * S
        w.observe("j", t - behind, t, source=source, kind=kind)
        wall.ns += S // 4


def test_sources_learn_their_lateness_after_warmup() -> None:
    wall = Wall()
    w = learning(wall)
    feed(w, wall, "ops", 100 * S, 2, behind=3 * S // 2)
    assert w.watermark("j", "p") == 101 * S - 2 * S  # warming up: the fixed lateness
    feed(w, wall, "ops", 102 * S, 3, behind=3 * S // 2)
    # batches a second apart reaching 1.5 s back: each needed 0.5 s; plus the 0.1 s margin
    assert w.watermark("j", "p") == 104 * S - (S // 2 + S // 10)


def test_a_lagging_source_holds_the_windows_back_and_a_silent_one_does_not() -> None:
    wall = Wall()
    w = learning(wall)
    feed(w, wall, "ops", 100 * S, 5, source="fast")
    feed(w, wall, "ops", 90 * S, 5, source="slow")  # live, 10 s behind: it holds the windows
    assert w.watermark("j", "p") < 95 * S
    wall.ns += 3 * S
    feed(w, wall, "ops", 105 * S, 1, source="fast")  # "slow" silent for > 2 s: not waited for
    assert w.watermark("j", "p") >= 104 * S


def test_windows_follow_other_sources_when_the_input_kind_stops() -> None:
    wall = Wall()
    w = learning(wall)
    feed(w, wall, "ops", 100 * S, 5)
    feed(w, wall, "beats", 105 * S, 12)  # the job hangs: no ops, the beats go on
    # ops silent for 2 s: the windows follow the job's newest event (beats at 116 s) − 0.1 s
    assert w.watermark("j", "p") == 116 * S - S // 10
    assert w.due("j", "p", 100)[-1] == 114 * S


def test_a_quiet_job_closes_its_last_windows_and_a_restart_starts_cautious() -> None:
    wall = Wall()
    w = learning(wall)
    feed(w, wall, "ops", 100 * S + S // 2, 5)  # events up to 104.5 s
    assert w.due("j", "p", 100)[-1] < 104 * S  # the window holding the last event waits
    wall.ns += 11 * S  # every source quiet for longer than idle_ns: the job stopped
    assert w.watermark("j", "p") == 105 * S
    assert w.due("j", "p", 100)[-1] == 104 * S  # ... and its last, partial window closes
    fresh = learning(wall)
    fresh.restore(w.checkpoint("j"))
    assert fresh.watermark("j", "p") == 104 * S + S // 2 - 2 * S  # no source known yet
    wall.ns += 11 * S  # nothing came after the restore either: the job is idle
    assert fresh.watermark("j", "p") == 105 * S


def test_a_job_that_sends_again_after_an_idle_close_is_late_only_where_it_was_closed() -> None:
    wall = Wall()
    w = Windows([WindowSpec("it", 10 * S, late_marks=True)], 2 * S,
                WatermarkParams(idle_ns=10 * S), clock=wall)
    w.observe("j", 100 * S, 103 * S, source="h1", kind="ops")
    wall.ns += 11 * S
    for s in w.due("j", "it"):
        w.closed("j", "it", s)
    assert w.open_window("j", "it")[0] == 110 * S  # [100, 110) closed on idle
    assert w.observe("j", 104 * S, 112 * S, source="h1", kind="ops")  # marks [100, 110) late
    assert w.late("j", "it") == [100 * S]
    assert w.watermark("j", "it") == 110 * S  # never goes back


def test_late_marks_are_reported_and_survive_a_restart() -> None:
    w = make()
    w.observe("j", 100 * S, 200 * S)
    for s in w.due("j", "it", limit=100):
        w.closed("j", "it", s)
    assert w.observe("j", 171 * S, 172 * S) is True
    assert w.observe("j", 171 * S, 172 * S) is False  # already marked
    w.observe("j", 185 * S, 186 * S)
    rows = w.checkpoint("j")
    assert Checkpoint("j", "it" + LATE_SUFFIX, 170 * S, 180 * S) in rows
    fresh = make()
    fresh.restore(rows)
    assert fresh.late("j", "it") == [170 * S, 180 * S]
    for s in (170 * S, 180 * S):
        fresh.recomputed("j", "it", s)
    assert Checkpoint("j", "it" + LATE_SUFFIX, -1, -1) in fresh.checkpoint("j")


def test_windows_of_a_kind_exist_from_its_first_input_batch() -> None:
    """A job whose batches are all kernels has no op records: it has no progress windows to
    read (`fed`). They start with the first op (or beat) batch, at its own time — not at the
    kernels' (a backlog read kernels first must not close the progress windows unread)."""
    clock = [0]
    w = Windows([WindowSpec("progress", S, inputs=("ops",), reads=("beats",)),
                 WindowSpec("kernel_summaries", 10 * S, inputs=("kernels",))],
                S, clock=lambda: clock[0])
    w.observe("k", 5 * S, 19 * S, source="h", kind="kernels")
    assert not w.fed("k", "progress") and w.fed("k", "kernel_summaries")
    assert w.due("k", "progress") == [] and w.open_window("k", "progress") == (-1, -1)
    assert w.due("k", "kernel_summaries") == [0]
    w.observe("k", 6 * S, 7 * S, source="h", kind="ops")
    assert w.fed("k", "progress")
    assert w.open_window("k", "progress")[0] == 6 * S
    # a job hung before its first call sends only beats: its progress windows are read
    w.observe("b", 5 * S, 9 * S, source="h", kind="beats")
    assert w.fed("b", "progress") and not w.fed("b", "kernel_summaries")
    w.restore([Checkpoint("r", "progress", 3 * S, 4 * S)])
    assert w.fed("r", "progress") and not w.fed("r", "kernel_summaries")
    # a kind the checkpoint lacks starts no later than the windows the others left open
    w.observe("r", 8 * S, 9 * S, source="h", kind="kernels")
    assert w.open_window("r", "kernel_summaries")[0] == 0


def test_an_earlier_batch_moves_the_first_window_back_until_one_is_closed() -> None:
    # a backlog read from several partitions: the first batch seen comes from late in the job
    w = make()
    w.observe("j", 110 * S, 111 * S)
    w.observe("j", 100 * S + 5, 101 * S)
    w.observe("j", 111 * S, 114 * S)
    assert w.due("j", "p", limit=100)[0] == 100 * S
    assert w.due("j", "it") == [100 * S]  # the earlier batch is in a window, not a late mark
    assert w.late("j", "it") == []
    w.closed("j", "p", 100 * S)
    w.observe("j", 95 * S, 96 * S)  # once a window closed, earlier records are late data
    assert w.due("j", "p", limit=1) == [101 * S]
    assert w.due("j", "it") == [90 * S, 100 * S]  # "it" closed nothing yet: it moved back
    w.closed("j", "it", 90 * S)
    w.observe("j", 85 * S, 86 * S)  # now a late mark (reaching 5 s forward, into [90, 100))
    assert w.late("j", "it") == [80 * S, 90 * S]


def test_a_restored_kind_does_not_move_back() -> None:
    w = make()
    w.restore([Checkpoint("j", "p", 100 * S, 105 * S)])
    w.observe("j", 90 * S, 106 * S)
    assert w.due("j", "p", limit=1) == [100 * S]


def test_a_start_not_yet_closed_is_checkpointed_open_and_restored_movable() -> None:
    """The batch that opens a kind's windows or moves their start back reports it (the caller
    stores the checkpoint before the batch is committed), and the start is restored as it was:
    still free to move back to a batch of another partition read later."""
    w = make()
    assert w.observe("j", 110 * S, 111 * S) is True  # opens "p" and "it"
    assert w.observe("j", 111 * S, 112 * S) is False  # nothing a restart needs changed
    assert w.observe("j", 105 * S, 106 * S) is True  # "p" moves back ("it" stays at 100)
    rows = w.checkpoint("j")
    assert Checkpoint("j", "p:open", 105 * S, 112 * S) in rows
    fresh = make()
    fresh.restore(rows)
    assert fresh.open_window("j", "p")[0] == 105 * S
    fresh.observe("j", 102 * S, 103 * S)
    assert fresh.open_window("j", "p")[0] == 102 * S  # moved back: no window was closed
    fresh.closed("j", "p", 102 * S)
    later = fresh.checkpoint("j")
    assert Checkpoint("j", "p", 103 * S, 112 * S) in later
    again = make()
    again.restore(rows + later)  # stream_state keeps both rows: the closed one wins
    again.observe("j", 90 * S, 91 * S)
    assert again.open_window("j", "p")[0] == 103 * S


YEAR = 365 * 86400 * S
NOW = 1_700_000_000 * S


def drain(w: Windows, kind: str, rounds: int, limit: int = 16) -> list[int]:
    """Close what is due, `limit` windows a round (the runner's tick); the windows closed."""
    done = []
    for _ in range(rounds):
        for s in w.due("j", kind, limit):
            w.closed("j", kind, s)
            done.append(s)
    return done


def test_a_year_old_first_batch_does_not_make_the_worker_close_a_year_of_windows() -> None:
    w = make()
    w.observe("j", NOW - YEAR, NOW - YEAR + 3 * S)  # e.g. a stale spill, the job's first batch
    w.observe("j", NOW, NOW + 20 * S)  # the live job
    done = drain(w, "p", rounds=4)
    # the old batch's windows, then the live ones: near now within a tick or two
    assert [s for s in done if s < NOW] == [NOW - YEAR + i * S for i in range(4)]
    assert done[-1] == NOW + 17 * S
    assert w.skipped_windows["p"] == YEAR // S - 4
    assert w.moved("j") and not w.moved("j")  # reported once: the runner checkpoints
    drain(w, "it", rounds=4)
    assert w.jobs["j"].kinds["it"].next_start == NOW + 10 * S


def test_a_year_old_batch_that_moves_a_start_back_costs_its_own_windows_only() -> None:
    w = make()
    w.observe("j", NOW, NOW + 1 * S)  # no window closed yet: the start may move back
    w.observe("j", NOW - YEAR, NOW - YEAR + S // 2)
    assert w.jobs["j"].kinds["p"].next_start == NOW - YEAR
    w.observe("j", NOW + S, NOW + 10 * S)
    done = drain(w, "p", rounds=2)
    assert done == [NOW - YEAR] + [NOW + i * S for i in range(8)]


def test_a_year_old_batch_of_a_running_job_is_late_data() -> None:
    w = make()
    w.observe("j", NOW, NOW + 20 * S)
    drain(w, "p", rounds=2)
    drain(w, "it", rounds=2)
    assert w.observe("j", NOW - YEAR, NOW - YEAR + S) is False  # marks beyond reach: dropped
    w.observe("j", NOW + 20 * S, NOW + 30 * S)
    assert drain(w, "p", rounds=1)[0] == NOW + 18 * S
    assert w.late("j", "it") == [] and w.dropped_late == 1


def test_an_import_of_a_long_trace_closes_every_window_and_skips_none() -> None:
    w = make()
    hours = 3 * 3600
    for i in reversed(range(0, hours, 60)):  # published as fast as it is read, in any order
        w.observe("j", NOW + i * S, NOW + (i + 60) * S, source="import", kind="ops")
    done = drain(w, "p", rounds=hours // 64 + 1, limit=64)
    assert done == [NOW + i * S for i in range(hours - 2)]
    assert not w.skipped_windows


def test_a_job_paused_longer_than_the_gap_resumes_without_closing_the_pause() -> None:
    wall = Wall()
    w = Windows([WindowSpec("p", S)], 2 * S, WatermarkParams(gap_ns=60 * S), clock=wall)
    w.observe("j", NOW, NOW + 10 * S)
    wall.ns += 11 * S  # idle: the last window closes
    assert drain(w, "p", rounds=1)[-1] == NOW + 10 * S
    w.observe("j", NOW + 30 * S, NOW + 40 * S)  # within the gap: closed window by window
    assert drain(w, "p", rounds=2)[0] == NOW + 11 * S and not w.skipped_windows
    w.observe("j", NOW + 3600 * S, NOW + 3610 * S)  # an hour later: the pause is skipped
    assert drain(w, "p", rounds=2)[:4] == [NOW + 38 * S, NOW + 39 * S, NOW + 40 * S,
                                           NOW + 3600 * S]
    assert w.skipped_windows == {"p": 3600 - 41}
    assert len(w.jobs["j"].kinds["p"].segments) == 1  # closed stretches are dropped


def test_a_restored_kind_closes_every_window_from_its_checkpoint() -> None:
    w = make()
    w.observe("j", NOW, NOW + 100 * S)
    drain(w, "p", rounds=1, limit=5)
    fresh = make()
    fresh.restore(w.checkpoint("j"))
    fresh.observe("j", NOW + 2000 * S, NOW + 2001 * S)  # a backlog's newest batch first
    done = drain(fresh, "p", rounds=10, limit=64)
    assert done == [NOW + (5 + i) * S for i in range(96)]  # stored, if unseen: not a gap
    assert fresh.jobs["j"].kinds["p"].next_start == NOW + 1999 * S  # the watermark


def test_segments_are_bounded_and_merge_the_closest() -> None:
    w = Windows([WindowSpec("p", S)], 2 * S, WatermarkParams(gap_ns=S, max_segments=4))
    for i in range(10):
        w.observe("j", NOW + i * 10 * S, NOW + i * 10 * S + S)
    segs = w.jobs["j"].kinds["p"].segments
    assert len(segs) == 4 and segs[0][0] == NOW and segs[-1][1] == NOW + 91 * S


def test_event_segments_split_a_batch_where_a_gap_holds_no_record() -> None:
    start = np.array([NOW + 5 * S, NOW, NOW + 86000 * S, NOW + 2 * S], np.int64)
    end = np.array([0, NOW + 3 * S, NOW + 86001 * S, NOW + 1000 * S], np.int64)
    assert event_segments(start, end, 600 * S) == [(NOW, NOW + 1000 * S),
                                                   (NOW + 86000 * S, NOW + 86001 * S)]
    assert event_segments(start[:2], end[:2], 600 * S) == [(NOW, NOW + 5 * S)]
    assert event_segments(start[:0], end[:0], S) == []
