"""The derived runner's gates (streams/derived.py), as functions of explicit values and clock:
previews are for live jobs (`pace_samples`, `replaying`): a job whose event time runs far ahead of
the wall clock — a backlog, a replay — gets none, a live one does; how far frames reach
(`frame_reach`); which part of the open window a preview looks at (`preview_range`) and where its
frame starts (`frame_start`)."""

from __future__ import annotations

import numpy as np

from ingest.units import SECOND as SEC
from streams.derived import (
    DerivedConfig,
    Preview,
    frame_reach,
    frame_start,
    pace_samples,
    preview_range,
    replaying,
)

CFG = DerivedConfig()


def paces(event_per_wall: float, ticks: int = 40, tick_ns: int = SEC // 4) -> list[bool]:
    """`replaying` at every tick of a job whose records advance `event_per_wall` event-ns per
    wall-ns."""
    clock = 1_000 * SEC
    seen: list[tuple[int, int]] = []
    got = []
    for i in range(ticks):
        clock += tick_ns
        event = 2_000 * SEC + int(i * tick_ns * event_per_wall)
        seen = pace_samples(seen, clock, event, CFG.pace_span_ns)
        got.append(replaying(seen, span_ns=CFG.pace_span_ns, max_pace=CFG.preview_max_pace))
    return got


def test_a_live_job_is_previewed_and_a_replay_is_not() -> None:
    span_ticks = CFG.pace_span_ns // (SEC // 4)
    live = paces(1.0)
    assert not any(live)
    fast = paces(5.0)
    assert not any(fast[:span_ticks // 2 - 1])  # too little history yet: treated as live
    assert all(fast[span_ticks:])
    assert not any(paces(1.8))  # under the threshold (2x)
    # the pace is measured over the recent span: a replay that caught up is live again
    clock = 1_000 * SEC
    event = 2_000 * SEC
    samples: list[tuple[int, int]] = []
    seen = []
    longest = 0
    for i in range(80):
        clock += SEC // 4
        event += (5 if i < 30 else 1) * SEC // 4
        samples = pace_samples(samples, clock, event, CFG.pace_span_ns)
        longest = max(longest, len(samples))
        seen.append(replaying(samples, span_ns=CFG.pace_span_ns, max_pace=CFG.preview_max_pace))
    assert seen[25] and not any(seen[60:])
    assert longest <= span_ticks + 2  # bounded by the span, not the run length


def test_pace_samples_keep_the_newest_sample_a_span_old_and_at_least_two() -> None:
    span = 4 * SEC
    assert pace_samples([], 10 * SEC, 7, span) == [(10 * SEC, 7)]
    seen = [(1 * SEC, 1), (2 * SEC, 2), (5 * SEC, 5), (7 * SEC, 7)]
    # at 9 s: 5 s is the newest sample at least 4 s old; 1 s and 2 s are no longer needed
    assert pace_samples(seen, 9 * SEC, 9, span) == [(5 * SEC, 5), (7 * SEC, 7), (9 * SEC, 9)]
    # however old, the two newest stay
    assert pace_samples([(1 * SEC, 1)], 100 * SEC, 2, span) == [(1 * SEC, 1), (100 * SEC, 2)]
    assert seen == [(1 * SEC, 1), (2 * SEC, 2), (5 * SEC, 5), (7 * SEC, 7)]  # not modified


def test_replaying_compares_event_and_wall_time_once_half_a_span_is_seen() -> None:
    span = 4 * SEC
    fast = [(0, 0), (1 * SEC, 9 * SEC)]
    assert not replaying(fast, span_ns=span, max_pace=2.0)  # 1 s seen, under half the span
    fast = [(0, 0), (2 * SEC, 9 * SEC)]
    assert replaying(fast, span_ns=span, max_pace=2.0)  # 4.5x
    assert not replaying([(0, 0), (2 * SEC, 4 * SEC)], span_ns=span, max_pace=2.0)  # exactly 2x
    assert replaying([(0, 0), (2 * SEC, 4 * SEC + 1)], span_ns=span, max_pace=2.0)


def test_frames_reach_twice_the_last_longest_step_and_a_second_at_most_max_step() -> None:
    assert frame_reach(None, CFG.max_step_ns) == CFG.max_step_ns  # nothing known yet
    assert frame_reach(2 * SEC, CFG.max_step_ns) == 5 * SEC
    assert frame_reach(40 * SEC, CFG.max_step_ns) == CFG.max_step_ns


def test_a_preview_goes_on_from_its_cut_in_the_same_window_and_from_the_start_in_a_new_one(
        ) -> None:
    w = CFG.iteration_window_ns
    # first preview of window 10 s: from its start up to the largest event time + 1
    assert preview_range(None, 10 * SEC, 13 * SEC, w) == (10 * SEC, 13 * SEC + 1, set())
    done = Preview(10 * SEC, 13 * SEC + 1, {7})
    assert preview_range(done, 10 * SEC, 15 * SEC, w) == (13 * SEC + 1, 15 * SEC + 1, {7})
    # no event past the cut: nothing to do (cut <= from)
    start, cut, _ = preview_range(done, 10 * SEC, 13 * SEC, w)
    assert cut <= start
    # the cut never passes the window's end
    assert preview_range(done, 10 * SEC, 40 * SEC, w)[1] == 20 * SEC
    # the window closed: a preview of the next one starts afresh
    assert preview_range(done, 20 * SEC, 23 * SEC, w) == (20 * SEC, 23 * SEC + 1, set())


def test_a_preview_frame_starts_at_the_ranks_known_step_ends_when_they_are_later() -> None:
    assert frame_start(20 * SEC, 5 * SEC, None) == (15 * SEC, None)
    ends = np.array([17 * SEC, 16 * SEC], np.int64)
    prior = (np.array([0, 1], np.int64), np.array([4, 4], np.int64), ends)
    lo, used = frame_start(20 * SEC, 5 * SEC, prior)
    assert lo == 16 * SEC and used is prior  # every rank's next step starts after its end
    assert frame_start(20 * SEC, 3 * SEC, prior) == (17 * SEC, None)  # reach is later already
    empty = (np.zeros(0, np.int64),) * 3
    assert frame_start(20 * SEC, 5 * SEC, empty) == (15 * SEC, None)
