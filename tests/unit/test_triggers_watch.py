"""JobWatch on the derived feeds (diagnosis/triggers/watch.py, diagnosis/agents.py): the
step-level test counts each step once however the feed delivers it, and the trigger clock is the
feed's event time, so a feed that lags the wall clock cannot look like a hang."""

from __future__ import annotations

import numpy as np

from diagnosis.agents import progress_as_ops
from diagnosis.triggers.base import Trigger
from diagnosis.triggers.watch import JobWatch
from ingest.units import SECOND as S
from tests.unit.topo_fixtures import megatron_topology

T0 = 1_700_000_000 * S


def watch() -> JobWatch:
    return JobWatch(megatron_topology(2, 2, 2, job_id="w"))


def steps(w: JobWatch, first: int, durations: list[float]) -> dict[str, np.ndarray]:
    """Rows of consecutive steps on every sampled rank (step s ends at T0 + its end)."""
    ends = T0 + np.cumsum(np.asarray(durations) * S).astype(np.int64) + first * S
    ranks = np.asarray(w.sample.ranks)
    n = len(durations)
    return {"rank": np.repeat(ranks, n), "step": np.tile(np.arange(first, first + n), len(ranks)),
            "step_ns": np.tile((np.asarray(durations) * S).astype(np.int64), len(ranks)),
            "t_end": np.tile(ends, len(ranks))}


def stragglers(out: list[Trigger]) -> list[Trigger]:
    return [t for t in out if t.evidence.get("rule") == "venustrace.expected_step"]


def test_two_slow_steps_fire_once_whatever_the_delivery() -> None:
    for split in ("one message", "previews then windows"):
        w = watch()
        fired = stragglers(w.observe(T0, steps=steps(w, 0, [0.7] * 10)))
        slow = steps(w, 10, [1.1, 1.1, 1.1])
        if split == "one message":
            fired += stragglers(w.observe(T0 + 20 * S, steps=slow))
        else:  # each step previewed, then the window's rows bring all of them again
            for i in range(3):
                one = {k: v[slow["step"] == 10 + i] for k, v in slow.items()}
                fired += stragglers(w.observe(T0 + 20 * S, steps=one))
            fired += stragglers(w.observe(T0 + 21 * S, steps=slow))
        assert len(fired) == 1, split
        assert fired[0].evidence["onset_step"] == 10


def test_a_slow_warm_up_step_does_not_silence_the_step_test() -> None:
    # the second step took 99 ms, then 78 ms ± 10 %; from step 40 the steps take 20 % longer:
    # with the expectation stuck at the warm-up's time no step passed (1 + β) × expected
    rng = np.random.default_rng(7)
    w = watch()
    base = [0.222, 0.099, *(0.078 * (1 + 0.1 * rng.standard_normal(38)))]
    stragglers(w.observe(T0, steps=steps(w, 0, base)))
    expected = w.expected_step_ns()
    assert expected is not None and abs(expected / (0.078 * S) - 1) < 0.08
    slow = list(0.094 * (1 + 0.03 * rng.standard_normal(6)))
    fired_at = [40 + i for i, d in enumerate(slow)
                if stragglers(w.observe(T0 + (50 + i) * S, steps=steps(w, 40 + i, [d])))]
    # a step's time is learned once a later one is seen: step 40's as step 41 arrives
    assert fired_at and fired_at[0] <= 41, fired_at


def test_a_step_delivered_twice_is_not_a_second_slow_step() -> None:
    w = watch()
    w.observe(T0, steps=steps(w, 0, [0.7] * 10))
    slow = steps(w, 10, [1.1])
    assert not stragglers(w.observe(T0 + 20 * S, steps=slow) + w.observe(T0 + 20 * S, steps=slow))


def progress_rows(w: JobWatch, window_end: int, done: bool) -> dict[str, np.ndarray]:
    ranks = np.asarray(w.sample.ranks)
    n = len(ranks)
    return {"window_end": np.full(n, window_end), "rank": ranks,
            "completed_ops": np.full(n, 3 if done else 0), "inflight_ops": np.zeros(n, np.int64),
            "oldest_inflight_age_ns": np.zeros(n, np.int64),
            "last_beat_ts": np.full(n, window_end - S // 2)}


def test_a_lagging_feed_cannot_look_like_a_hang() -> None:
    """The clock is the newest window_end: however late (in wall time) the windows arrive, a
    rank that progressed in every window is not silent; a hang shows once the windows after the
    last progress span the timeout."""
    w = watch()
    w.observe(T0, steps=steps(w, 0, [0.7] * 10))  # expected step 0.7 s: timeout 1.4 s
    fired: list[Trigger] = []
    for i in range(1, 30):  # delivered in one burst after a long backlog
        ops, beats = progress_as_ops(progress_rows(w, T0 + i * S, done=True))
        fired += w.observe(T0 + i * S, ops=ops, beats=beats)
    assert not [t for t in fired if t.kind == "hang"]
    for i in range(30, 33):  # the job stops: no completions, beats go on
        ops, beats = progress_as_ops(progress_rows(w, T0 + i * S, done=False))
        fired += w.observe(T0 + i * S, ops=ops, beats=beats)
    hang = [t for t in fired if t.kind == "hang"]
    assert len(hang) == 1 and hang[0].ts == T0 + 31 * S


def test_stored_beats_are_read_through_their_coded_communicator_column() -> None:
    """A beats batch as the raw sink stores it (decoded with its string columns coded): the
    watch reads the op counters per communicator, and a rank whose counter stops for longer
    than the timeout is a hang at the newest beat's time, whatever the progress feed says."""
    from diagnosis.agents import beat_counters
    from ingest.batch import decode_batch, encode_batch

    w = watch()
    w.observe(T0, steps=steps(w, 0, [0.1] * 10))  # expected step 0.1 s: timeout 1 s
    ranks = np.asarray(w.sample.ranks, dtype=np.int64)
    stuck = int(ranks[0])
    fired: list[Trigger] = []
    for i in range(8):
        seq = np.full(ranks.size, 10 * i, dtype=np.int64)
        seq[ranks == stuck] = min(10 * i, 30)  # its counter stops after the 3 s beat
        data = encode_batch("beats", "w", {
            "rank": ranks, "ts": np.full(ranks.size, T0 + i * S, dtype=np.int64),
            "comm_id": np.full(ranks.size, "dp0", dtype=object), "last_op_seq": seq,
            "dropped": np.zeros(ranks.size, np.int64), "step": np.full(ranks.size, i, np.int64),
            "stage": np.full(ranks.size, "model.fwd_loss", dtype=object),
            "stage_ts": np.full(ranks.size, T0 + i * S, dtype=np.int64),
            "sched_run_ns": np.zeros(ranks.size, np.int64),
            "sched_wait_ns": np.zeros(ranks.size, np.int64),
            "exited": np.zeros(ranks.size, np.int64)})
        b = decode_batch(data, coded=True)
        assert "comm_id" not in b.cols  # the case the reader must handle
        fired += w.observe_beats(beat_counters(b))
    hang = [t for t in fired if t.kind == "hang"]
    assert [t.ranks for t in hang] == [(stuck,)] and hang[0].ts == T0 + 5 * S
