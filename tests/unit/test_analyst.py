"""The Analyst's incident decisions that need no engine run (diagnosis/analyst.py)."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import pytest

from diagnosis.analyst import Analyst, AnalystConfig
from diagnosis.conclusion import Conclusion
from diagnosis.window import Window
from ingest.units import SECOND as S


def slow(ranks: tuple[int, ...]) -> Conclusion:
    return Conclusion("jitter", ranks, "data", "data_loader", 0.9)


def test_the_trace_of_a_resolved_stall_is_not_a_second_incident() -> None:
    a = Analyst(lambda job, lo, hi, kinds=None: None, AnalystConfig(aftermath_s=20))
    assert not a._aftermath("j", slow((3,)), 100 * S)  # no stall resolved yet
    a.resolved_hangs["j"] = (frozenset({3}), 100 * S)
    assert a._aftermath("j", slow((3,)), 110 * S)  # same culprit, same episode
    assert not a._aftermath("j", slow((3, 4)), 110 * S)  # another culprit is news
    assert not a._aftermath("j", slow((3,)), 121 * S)  # later: a new episode
    assert not a._aftermath("k", slow((3,)), 110 * S)  # another job
    assert not a._aftermath("j", Conclusion("hang", (3,), "data", "data_loader", 0.9), 110 * S)
    # the same stall analysed again once it ended: not a second hang incident
    again = Conclusion("hang", (3,), "fwd mb=0 pp=0", "gpu_compute", 0.95,
                       labels=("min_op", "transient", "recovered"))
    assert a._aftermath("j", again, 110 * S) and not a._aftermath("j", again, 121 * S)
    # with its onset known: the stall that began before the incident resolved is that
    # incident's however late it is seen again (a real job's end, 22 s after); a stall that
    # began after it is a new one
    told = Conclusion("hang", (3,), "fwd mb=0 pp=0", "gpu_compute", 0.95,
                      labels=("min_op", "transient", "recovered"), onset_ns=96 * S)
    assert a._aftermath("j", told, 110 * S) and a._aftermath("j", told, 122 * S)
    new = Conclusion("hang", (3,), "fwd mb=0 pp=0", "gpu_compute", 0.95,
                     labels=("min_op", "transient", "recovered"), onset_ns=105 * S)
    assert not a._aftermath("j", new, 122 * S)


def test_a_new_incident_is_rechecked_after_first_recheck_s() -> None:
    from diagnosis.triggers.base import Trigger
    from tests.unit.test_diagnosis_engine import window

    w, now = window("hang rank=13 stage=bwd mb=3 at=3s")
    a = Analyst(lambda job, lo, hi, kinds=None: w, AnalystConfig(recheck_s=4, first_recheck_s=1))
    out = a.on_trigger(Trigger(w.topo.job_id, now, "hang", ()), now)
    assert [d.status for d in out] == ["open"]
    a.tick(now + S // 2)
    assert a.last_check[w.topo.job_id] < now  # not yet
    a.tick(now + S)
    assert a.last_check[w.topo.job_id] == now + S  # the first re-check ran
    a.tick(now + 2 * S)
    assert a.last_check[w.topo.job_id] == now + S  # then every recheck_s


def test_a_hang_trigger_analysed_too_early_is_retried_until_it_concludes() -> None:
    """The trigger's analysis finds nothing (the window ends before the stall is `stuck_ns`
    old); the trigger stays pending and the next ticks, at the advancing event clock, open the
    incident under it — once — and stop retrying; a pending trigger expires after pending_s."""
    from diagnosis.triggers.base import Trigger
    from tests.unit.test_diagnosis_engine import window

    w, now = window("hang rank=13 stage=bwd mb=3 at=3s")
    seen = {"early": True}

    def read(job_id: str, start_ns: int, now_ns: int, kinds: Collection[str] | None = None
             ) -> Window:
        return Window(w.topo, {}, start_ns, now_ns) if seen["early"] else w

    a = Analyst(read, AnalystConfig(pending_s=30), event_clock=lambda job, t: now)
    t = Trigger(w.topo.job_id, now, "hang", (13,), {"rule": "venustrace.heartbeat"})
    assert a.on_trigger(t, now) == [] and w.topo.job_id in a.pending
    assert a.tick(now + S) == []  # still nothing to see
    seen["early"] = False
    out = a.tick(now + 2 * S)
    assert [(d.status, d.kind, d.culprit_ranks) for d in out] == [("open", "hang", [13])]
    assert w.topo.job_id not in a.pending
    assert not [d for d in a.tick(now + 3 * S) if d.status == "open"]  # announced once

    b = Analyst(lambda job, lo, hi, kinds=None: Window(w.topo, {}, lo, hi),
                AnalystConfig(pending_s=5), event_clock=lambda job, t: now)
    assert b.on_trigger(t, now) == []
    b.tick(now + 6 * S)
    assert not b.pending  # expired


def test_a_performance_trigger_analysed_too_early_is_retried_at_its_cost() -> None:
    """A straggler trigger fires at the onset, before enough slow steps are stored; its
    analysis finds nothing, so it stays pending and is tried again — no sooner than
    `retry_s`, and no more often than its cost over `pending_share` — until it concludes
    (once) or `slow_pending_s` runs out."""
    from diagnosis.triggers.base import Trigger
    from tests.unit.test_diagnosis_engine import window

    w, now = window("gpu_slow rank=9 factor=1.6 at=2s", steps=16)
    seen = {"early": True, "reads": 0}

    def read(job_id: str, start_ns: int, now_ns: int, kinds: Collection[str] | None = None
             ) -> Window:
        seen["reads"] += kinds is None  # the analysis's reads (not the exit beats' look)
        return Window(w.topo, {}, start_ns, now_ns) if seen["early"] else w

    a = Analyst(read, AnalystConfig(retry_s=1, slow_pending_s=6, sweep_s=60,
                                    min_sweep_s=60), event_clock=lambda job, t: now)
    a.last_sweep[w.topo.job_id] = now + 100 * S  # no sweep in the way
    t = Trigger(w.topo.job_id, now, "straggler", (9,), {"rule": "venustrace.expected_step"})
    assert a.on_trigger(t, now) == [] and w.topo.job_id in a.pending_slow
    reads = seen["reads"]
    assert a.tick(now + S // 2) == [] and seen["reads"] == reads  # not due yet
    assert a.tick(now + S) == [] and seen["reads"] == reads + 1  # tried again: still nothing
    seen["early"] = False
    out = a.tick(now + 2 * S)
    assert [(d.status, d.culprit_ranks) for d in out] == [("open", [9])]
    assert w.topo.job_id not in a.pending_slow
    assert not [d for d in a.tick(now + 3 * S) if d.status == "open"]  # announced once

    seen["early"] = True
    clock = [0.0]
    b = Analyst(read, AnalystConfig(slow_pending_s=6), event_clock=lambda job, t: now,
                spent=lambda: clock[0])
    b.last_sweep[w.topo.job_id] = now + 100 * S
    assert b.on_trigger(t, now) == []
    b.analysis_ms.clear()
    job = w.topo.job_id
    b.pending_slow[job] = (t, now, now)  # its last try cost 0.5 s: the next in 1 s (50 %)

    def run(fn: object, w_: Window, n: int) -> tuple[None, float]:
        clock[0] += 0.5  # the try (its read and analysis) is 0.5 s of the worker's work
        return None, 5.0

    b._run = run  # type: ignore[method-assign, assignment]
    b.tick(now + S)
    assert b.pending_slow[job][2] == now + S + S
    b.tick(now + 7 * S)
    assert job not in b.pending_slow  # expired


def test_an_incident_kept_on_records_that_no_longer_change_is_not_rechecked_again() -> None:
    """An open incident of a job whose event clock stands still (the job ended) is re-checked
    once on its final records; the same records give the same verdict, so later ticks do
    not read them again — until the clock moves. A re-check that finds nothing is repeated
    until the incident resolves."""
    from diagnosis.triggers.base import Trigger
    from tests.unit.test_diagnosis_engine import window

    w, now = window("hang rank=13 stage=bwd mb=3 at=3s")
    job = w.topo.job_id
    reads: list[int] = []
    clock = {"at": now}

    def read(job_id: str, start_ns: int, now_ns: int,
             kinds: Collection[str] | None = None) -> Window:
        reads.append(now_ns)
        return w

    a = Analyst(read, AnalystConfig(recheck_s=4, first_recheck_s=1),
                event_clock=lambda _job, _now: clock["at"])
    assert [d.status for d in a.on_trigger(Trigger(job, now, "hang", ()), now)] == ["open"]
    a.jobs.add(job)
    n = len(reads)
    a.tick(now + S)  # the first re-check: kept
    assert a.book.is_open(job, "hang") and len(reads) == n + 1
    for k in range(2, 6):
        a.tick(now + 4 * k * S)
    assert len(reads) == n + 1  # the clock stood still: not read again
    clock["at"] = now + S // 10  # records moved on
    a.tick(now + 30 * S)
    assert len(reads) == n + 2
    # a re-check that finds nothing is repeated, the clock standing still, until resolved
    clock["at"] = now + S // 5
    empty = Window(w.topo, {}, w.start_ns, w.now_ns)

    def read_empty(job_id: str, start_ns: int, now_ns: int,
                   kinds: Collection[str] | None = None) -> Window:
        reads.append(now_ns)
        return empty

    a.read = read_empty
    for k in range(8, 30):
        a.tick(now + 4 * k * S)
        if not a.book.is_open(job, "hang"):
            break
    assert not a.book.is_open(job, "hang")


def test_a_job_whose_event_clock_stands_still_is_swept_once() -> None:
    """The sweep reads the job's window, the look for exit beats its recent beats; a job that
    ended (its event clock no longer moves) is not read again every sweep_s."""
    reads: list[tuple[tuple[str, ...], int]] = []

    def read(job_id: str, start_ns: int, now_ns: int, kinds: Collection[str] | None = None
             ) -> None:
        reads.append((tuple(kinds or ()), now_ns))

    clock = {"at": 50 * S}
    a = Analyst(read, AnalystConfig(sweep_s=10), event_clock=lambda job, now: clock["at"])
    a.jobs.add("j")
    a.tick(100 * S)
    a.tick(110 * S)
    a.tick(120 * S)
    once = [(("beats",), 50 * S), (("stages",), 50 * S)]
    assert reads == once  # ended: one look, one sweep
    clock["at"] = 60 * S  # its records move on again
    a.tick(130 * S)
    assert reads == [*once, (("beats",), 60 * S), (("stages",), 60 * S)]


@pytest.mark.slow
@pytest.mark.parametrize("fault", [
    "nic_bw rank=7 factor=0.2 at=7s", "pcie rank=5 factor=0.25 at=7s",
    "gpu_slow rank=9 factor=1.5 at=7s", "kernel_slow rank=12 kernel=attn factor=3 at=7s",
    "data_tail rank=10 p=0.5 delay=180ms at=7s", "ecc_jitter rank=6 p=0.05 factor=10 at=7s",
    "hang rank=13 stage=bwd mb=3 at=7s",
])
def test_a_sweep_reads_only_what_its_rules_use(fault: str) -> None:
    """The sweep's window holds only SWEEP_KINDS (no flows, no beats): its rules conclude on it
    exactly what they conclude on every kind — a rule that starts using another kind fails
    here until SWEEP_KINDS lists it."""
    from diagnosis import hang_rca, slow
    from diagnosis.analyst import SWEEP_KINDS
    from tests.unit.test_diagnosis_engine import window

    w, now = window(fault, steps=24)  # the fault after 9 steps: a baseline to judge it by
    part = Window(w.topo, {k: v for k, v in w.tables.items() if k in SWEEP_KINDS}, w.start_ns,
                  w.now_ns)
    assert set(w.tables) - set(part.tables) >= {"flows", "beats"}
    full_c, part_c = slow.analyze(w, now), slow.analyze(part, now)
    assert full_c == part_c
    np.testing.assert_array_equal(hang_rca.stuck_ranks(w, now), hang_rca.stuck_ranks(part, now))
    if "hang" not in fault:
        assert full_c is not None  # the fault is found: the comparison is not of two Nones


def test_a_job_without_stage_records_is_swept_from_ops_alone() -> None:
    """The slowdown analysis needs stage records: a sweep reads the stages and, finding none,
    only what the analysis from ops alone uses (ops_rca.KINDS); the look for exit beats before
    it reads beats alone."""
    asked: list[tuple[str, ...] | None] = []

    def read(job_id: str, start_ns: int, now_ns: int, kinds: Collection[str] | None = None
             ) -> Window:
        asked.append(tuple(kinds) if kinds is not None else None)
        return Window(topo, {})

    from ingest.sim.config import JobConfig
    from ingest.sim.simulation import Simulation

    topo = Simulation(JobConfig(job_id="j", tp=2, pp=1, dp=1), []).topology()
    a = Analyst(read, AnalystConfig(sweep_s=10))
    a.jobs.add("j")
    a.tick(100 * S)
    assert asked == [("beats",), ("stages",), ("ops", "beats")]  # first the look for exits


def test_a_sweep_stops_reading_the_kinds_a_job_has_none_of_until_some_are_stored(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A kind a sweep's read found none of, and none reported stored, is not read again (a CPU
    job has no kernel events or chunk counters); a batch of any new kind reported stored has
    every kind read again, and a kind reported stored is never left out."""
    asked: list[tuple[str, ...]] = []
    step = np.repeat(np.arange(30), 2)
    stages = {"rank": np.tile(np.arange(2), 30), "step": step, "t_start": step * S // 10,
              "model_fwd_loss": np.full(60, S // 20)}

    def read(job_id: str, start_ns: int, now_ns: int, kinds: Collection[str] | None = None
             ) -> Window:
        ks = tuple(kinds or ())
        if ks != ("stages",):
            asked.append(ks)
        return Window(topo, {"stages": stages} if "stages" in ks else {})

    from ingest.sim.config import JobConfig
    from ingest.sim.simulation import Simulation

    topo = Simulation(JobConfig(job_id="j", tp=2, pp=1, dp=1), []).topology()
    monkeypatch.setattr("diagnosis.analyst.slow.analyze", lambda *_a, **_k: None)
    a = Analyst(read, AnalystConfig())
    a.seen("j", "ops")  # reported stored: read every time, whatever a read finds
    every = ("ops", "chunks", "kernels", "kernel_summaries")
    a._slow_try("j", 4 * S)
    a._slow_try("j", 4 * S)
    assert asked == [every, ("ops",)]
    a.seen("j", "kernels")  # kernel events stored: they, and their summaries, are read again
    a._slow_try("j", 4 * S)
    a._slow_try("j", 4 * S)
    assert asked[2:] == [every, ("ops", "kernels", "kernel_summaries")]
    a.seen("j", "kernels")  # a kind seen before is no news
    a._slow_try("j", 4 * S)
    assert asked[4] == ("ops", "kernels", "kernel_summaries")
    a.seen("j", "chunks")
    a._slow_try("j", 4 * S)
    assert asked[5] == every


@pytest.mark.slow
@pytest.mark.parametrize("fault", [
    "nic_bw rank=7 factor=0.2 at=40s", "gpu_slow rank=9 factor=1.5 at=40s",
    "kernel_slow rank=12 kernel=attn factor=3 at=40s", "data_tail rank=10 p=0.3 delay=180ms at=40s",
    "pcie rank=5 factor=0.25 at=40s", "hang rank=13 stage=bwd mb=3 at=50s",
    "hang rank=4 stage=bwd mb=1 for=6s at=50s",
])
def test_a_sweep_reads_raw_rows_only_from_the_steps_it_judges(fault: str) -> None:
    """The sweep reads ops, chunks and kernels from `slow.reach_start` on (the recent steps
    and SWEEP_MARGIN_STEPS before them), not the whole window: its rules conclude the same as
    on the whole window, with a recovered stall among the steps too, and the cut drops rows."""
    from diagnosis import hang_rca, slow
    from diagnosis.analyst import SWEEP_MARGIN_STEPS
    from diagnosis.window import without_superseded_in_flight
    from tests.unit.test_diagnosis_engine import window

    w, now = window(fault, steps=80)
    lo = slow.reach_start(w.tables["stages"], SWEEP_MARGIN_STEPS)
    assert lo is not None and lo > int(w.tables["stages"]["t_start"].min())
    cut = {"ops": "t_start", "chunks": "ts", "kernels": "t_start"}
    tables = dict(w.tables)
    for kind, tc in cut.items():
        t = tables[kind]
        keep = np.asarray(t[tc]) >= lo
        if kind == "ops":  # calls in flight are read from further back (diagnosis.agents)
            keep |= np.asarray(t["t_end"]) == 0
        assert not keep.all()
        tables[kind] = {c: np.asarray(v)[keep] for c, v in t.items()}
    tables["ops"] = without_superseded_in_flight(tables["ops"], now)
    part = Window(w.topo, tables, w.start_ns, w.now_ns)
    full_c, part_c = slow.analyze(w, now), slow.analyze(part, now)
    assert full_c == part_c
    np.testing.assert_array_equal(hang_rca.stuck_ranks(w, now), hang_rca.stuck_ranks(part, now))
    if "hang" not in fault and "stall" not in fault:
        assert full_c is not None


def test_a_sweeps_recent_steps_reach_back_to_the_previous_sweep() -> None:
    """An onset between two sweeps stays inside the judged steps: `recent` covers the steps
    since the previous sweep (plus onset_steps), never fewer than the default, at most
    MAX_RECENT."""
    from diagnosis import slow
    from diagnosis.analyst import MAX_RECENT

    def stages(n: int) -> Window:
        step = np.repeat(np.arange(n), 4)
        cols = {"rank": np.tile(np.arange(4), n), "step": step, "t_start": step * S // 10}
        return Window(None, {"stages": cols})  # type: ignore[arg-type]

    a = Analyst(lambda job, lo, hi, kinds=None: None)
    base = slow.SlowConfig()
    assert a._sweep_config(stages(300), None).recent == base.recent  # first sweep
    assert a._sweep_config(stages(300), 295 * S // 10).recent == base.recent  # 4 new steps
    assert a._sweep_config(stages(300), 200 * S // 10).recent == 99 + base.onset_steps
    assert a._sweep_config(stages(1000), 0).recent == MAX_RECENT


def test_small_jobs_are_swept_often_large_ones_within_sweep_s() -> None:
    a = Analyst(lambda job, lo, hi, kinds=None: None,
                AnalystConfig(sweep_s=10, min_sweep_s=2, sweep_share=0.05))
    assert a._sweep_gap("new") == 10  # nothing measured yet
    a.sweep_cost["small"], a.sweep_cost["mid"], a.sweep_cost["big"] = 0.02, 0.3, 0.9
    assert a._sweep_gap("small") == 2 and a._sweep_gap("mid") == pytest.approx(6)
    assert a._sweep_gap("big") == 10


def test_a_trigger_judged_on_the_beats_is_analysed_at_their_time() -> None:
    """The event clock follows the progress feed, which trails the stored beats; a hang trigger
    the heartbeat timer fired on the beats' own clock is read up to that clock (then advancing
    with the wall clock while it stays pending), never past the wall clock; any other trigger at
    the event clock."""
    from diagnosis.triggers.base import Trigger

    reads: list[int] = []

    def read(job_id: str, start_ns: int, now_ns: int, kinds: Collection[str] | None = None
             ) -> None:
        reads.append(now_ns)

    lagging = 97 * S  # the progress feed's clock, 3 s behind
    a = Analyst(read, AnalystConfig(pending_s=30), event_clock=lambda job, t: lagging)
    beats = Trigger("j", 99 * S, "hang", (1,), {"rule": "venustrace.heartbeat", "clock": "beats"})
    a.on_trigger(beats, 100 * S)
    feed = Trigger("k", 99 * S, "hang", (1,), {"rule": "venustrace.heartbeat"})
    a.on_trigger(feed, 100 * S)
    assert reads == [99 * S, 97 * S]
    assert a._trigger_clock(beats, 100 * S, 102 * S) == 101 * S  # pending: moves with the wall
    assert a._trigger_clock(beats, 100 * S, 98 * S) == 98 * S  # never past the wall clock


def test_a_window_holding_a_beat_before_its_ops_is_not_settled() -> None:
    """A rank's beat announces the newest op_seq the agent drained per communicator; until an
    op at least that new is stored for it, the window is incomplete for that rank."""
    from diagnosis.window import announced_ops_stored

    beats = {"rank": np.array([0, 1, 1]), "ts": np.array([10, 10, 30]) * S,
             "comm_id": np.array(["dp", "dp", "dp"], dtype=object),
             "last_op_seq": np.array([5, 7, 9])}
    ops = {"rank": np.array([0, 1]), "comm_id": np.array(["dp", "dp"], dtype=object),
           "op_seq": np.array([5, 7])}
    assert announced_ops_stored(ops, beats, 20 * S)  # rank 1's seq 9 is announced after 20 s
    assert not announced_ops_stored(ops, beats, 30 * S)
    ops["op_seq"] = np.array([5, 9])  # its in-flight row, or completion, is stored
    assert announced_ops_stored(ops, beats, 30 * S)
    other = dict(beats, comm_id=np.array(["dp", "tp", "tp"], dtype=object))
    assert not announced_ops_stored(ops, other, 20 * S)  # per communicator
    assert announced_ops_stored(ops, {"rank": beats["rank"], "ts": beats["ts"]}, 30 * S)


def test_a_hang_is_analysed_once_its_window_is_complete() -> None:
    """A partition's backlog stored in part (a broker lost, its ops partition leaderless for
    seconds): ranks 8-15's calls since the onset are missing while their beats announce them.
    Analysed then, the waiting ranks 8 and 9 would be named (checked below); the trigger
    waits until the window is complete and then names rank 13. After `settle_s` an incomplete
    window is analysed as it is."""
    from diagnosis import engine
    from diagnosis.triggers.base import Trigger
    from tests.unit.test_diagnosis_engine import window

    w, now = window("hang rank=13 stage=bwd mb=3 at=3s")
    ops = w.get("ops")
    late = (ops["rank"] >= 8) & (ops["t_enqueue"] > now - 6 * S)
    part = Window(w.topo, dict(w.tables, ops={k: np.asarray(v)[~late] for k, v in ops.items()}),
                  w.start_ns, w.now_ns)
    t = Trigger(w.topo.job_id, now, "hang", (13,), {"rule": "venustrace.heartbeat"})
    wrong = engine.diagnose(part, t, now)
    assert wrong is not None and wrong.ranks != (13,)
    stored = {"all": False}

    def read(job_id: str, start_ns: int, now_ns: int, kinds: Collection[str] | None = None
             ) -> Window:
        return w if stored["all"] else part

    a = Analyst(read, AnalystConfig(settle_s=15), event_clock=lambda job, t: now)
    assert a.on_trigger(t, now) == [] and w.topo.job_id in a.pending
    assert a.tick(now + 5 * S) == []
    stored["all"] = True
    out = a.tick(now + 6 * S)
    assert [(d.status, d.culprit_ranks) for d in out] == [("open", [13])]

    b = Analyst(lambda *_a, **_k: part, AnalystConfig(settle_s=15), event_clock=lambda j, t: now)
    assert b.on_trigger(t, now) == [] and b.tick(now + 14 * S) == []
    assert [d.culprit_ranks for d in b.tick(now + 16 * S)] == [list(wrong.ranks)]


def test_beats_stopped_for_every_rank_are_not_stored_yet() -> None:
    """Agents beat every second while their ranks live: a host whose beats all stop before the
    moment read is behind in the store, unless every rank's last beat there says it ended."""
    from diagnosis.window import beats_current

    beats = {"rank": np.array([0, 1, 0, 1]), "ts": np.array([10, 10, 11, 11]) * S,
             "exited": np.array([0, 0, 0, 0])}
    assert beats_current(beats, 13 * S, 3 * S)
    assert not beats_current(beats, 15 * S, 3 * S)
    assert beats_current(dict(beats, exited=np.array([0, 0, 1, 1])), 15 * S, 3 * S)
    assert not beats_current(dict(beats, exited=np.array([0, 0, 1, 0])), 15 * S, 3 * S)
    assert beats_current({}, 15 * S, 3 * S)
    # two hosts: one is current, the other's beats stopped 5 s before the moment read — a
    # backlog arriving host by host (or that host gone): not current until it catches up
    two = {"rank": np.array([0, 1, 2, 3, 0, 1]), "ts": np.array([10, 10, 10, 10, 14, 14]) * S,
           "exited": np.zeros(6, np.int64)}
    hosts = ["h0", "h0", "h1", "h1"]
    assert beats_current(two, 15 * S, 3 * S)  # one host: its newest beat is current
    assert not beats_current(two, 15 * S, 3 * S, hosts)
    assert beats_current(dict(two, exited=np.array([0, 0, 1, 1, 0, 0])), 15 * S, 3 * S, hosts)


def test_pending_triggers_are_tried_again_at_their_cost_and_a_hang_within_a_second() -> None:
    """A cheap try is repeated after `retry_s`; a costly one after its cost over
    `pending_share` — for a hang at most `HANG_RETRY_S` later, however costly (every rank
    waits)."""
    from diagnosis.analyst import HANG_RETRY_S

    a = Analyst(lambda *_a, **_k: None, AnalystConfig(retry_s=0.25, pending_share=0.05))
    assert a._retry_gap(2.0) == S // 4  # 2 ms / 5 % = 40 ms: the floor
    assert a._retry_gap(100.0) == 2 * S  # 100 ms / 5 %
    assert Analyst(lambda *_a, **_k: None)._retry_gap(200.0) == int(0.4 * S)  # at 50 %
    assert a._retry_gap(100.0, hang=True) == int(HANG_RETRY_S * S)
    assert a._retry_gap(2.0, hang=True) == S // 4


def test_a_slowdown_is_read_up_to_where_every_ranks_records_are_stored() -> None:
    """The event clock follows the progress feed's closed windows, a second at a time; a
    slowdown analysis reads further, to the moment every rank's stage records and calls are
    reported stored (the earliest rank's newest), never past the wall clock."""
    a = Analyst(lambda *_a, **_k: None, event_clock=lambda job, now: 100 * S)
    assert a._slow_clock("j", 200 * S) == 100 * S  # nothing reported: the event clock
    a.stored("j", "stages", np.array([0, 1]), np.array([150 * S, 140 * S]))
    assert a._slow_clock("j", 200 * S) == 140 * S  # rank 1's stage records end there
    a.stored("j", "ops", np.array([0, 1]), np.array([160 * S, 130 * S]))
    assert a._slow_clock("j", 200 * S) == 130 * S  # and its calls earlier still
    a.stored("j", "ops", np.array([1]), np.array([120 * S]))  # an older batch moves nothing
    assert a._slow_clock("j", 200 * S) == 130 * S
    a.stored("j", "ops", np.array([1]), np.array([300 * S]))
    assert a._slow_clock("j", 145 * S) == 140 * S  # the stage records now
    assert a._slow_clock("j", 135 * S) == 135 * S  # never past the wall clock
    assert a._slow_clock("k", 200 * S) == 100 * S  # another job
    b = Analyst(lambda *_a, **_k: None, event_clock=lambda job, now: 170 * S)
    b.stored("j", "stages", np.array([0]), np.array([150 * S]))
    assert b._slow_clock("j", 200 * S) == 170 * S  # the event clock, when it is later


def test_a_trigger_absorbed_by_a_pending_one_keeps_its_tries_going() -> None:
    """A performance trigger that fires while another is pending is absorbed, and its tries
    go on `slow_pending_s` from the newer trigger, under its name: a step trigger on noise
    5 s before a rank's stage rise no longer ends the tries a second after the rise."""
    from diagnosis.triggers.base import Trigger
    from tests.unit.test_diagnosis_engine import window

    w, now = window("gpu_slow rank=9 factor=1.6 at=2s", steps=16)
    job = w.topo.job_id
    seen = {"early": True}

    def read(job_id: str, start_ns: int, now_ns: int, kinds: Collection[str] | None = None
             ) -> Window:
        return Window(w.topo, {}, start_ns, now_ns) if seen["early"] else w

    a = Analyst(read, AnalystConfig(retry_s=1, evidence_retry_s=0.05, slow_pending_s=6,
                                    sweep_s=60, min_sweep_s=60), event_clock=lambda j, t: now)
    a.last_sweep[job] = now + 100 * S
    a.exit_checks[job] = (now + 100 * S, now)
    a.stored(job, "stages", np.array([9]), np.array([now]))
    noise = Trigger(job, now, "straggler", (), {"rule": "venustrace.expected_step"})
    assert a.on_trigger(noise, now) == [] and job in a.pending_slow
    rise = Trigger(job, now + 5 * S, "straggler", (9,), {"rule": "rankwatch.stage_rise"})
    assert a.on_trigger(rise, now + 5 * S) == []
    assert a.pending_slow[job][0] is rise
    seen["early"] = False
    a.stored(job, "stages", np.array([9]), np.array([now]))
    out = a.retry_slow(now + 8 * S)  # 8 s after the first trigger, 3 s after the rise
    assert [(d.status, d.culprit_ranks) for d in out] == [("open", [9])]


def test_a_pending_slowdown_is_tried_as_its_stage_records_are_stored() -> None:
    """Where the worker reports stored stage batches, a pending performance trigger is tried
    again only once new ones are stored — then as soon as `evidence_retry_s` and its cost
    allow, sooner than the tick's `retry_s` — and concludes on the try that finds the
    evidence; another performance trigger meanwhile is absorbed, not analysed."""
    from diagnosis.triggers.base import Trigger
    from tests.unit.test_diagnosis_engine import window

    w, now = window("gpu_slow rank=9 factor=1.6 at=2s", steps=16)
    job = w.topo.job_id
    seen = {"early": True, "reads": 0}

    def read(job_id: str, start_ns: int, now_ns: int, kinds: Collection[str] | None = None
             ) -> Window:
        seen["reads"] += kinds is not None and "stages" in kinds  # a try's first read
        return Window(w.topo, {}, start_ns, now_ns) if seen["early"] else w

    a = Analyst(read, AnalystConfig(retry_s=1, evidence_retry_s=0.05, slow_pending_s=6,
                                    sweep_s=60, min_sweep_s=60), event_clock=lambda j, t: now)
    a.last_sweep[job] = now + 100 * S  # no sweep in the way
    a.exit_checks[job] = (now + 100 * S, now)  # no look for exit beats either
    a.stored(job, "stages", np.array([9]), np.array([now]))
    t = Trigger(job, now, "straggler", (9,), {"rule": "venustrace.expected_step"})
    assert a.on_trigger(t, now) == [] and job in a.pending_slow
    reads, full = seen["reads"], len(a.analysis_ms)
    again = Trigger(job, now + S, "jitter", (9,), {"rule": "argus.l1.jitter"})
    assert a.on_trigger(again, now + S) == [] and len(a.analysis_ms) == full  # absorbed
    assert a.tick(now + 2 * S) == [] and seen["reads"] == reads  # nothing new stored
    a.stored(job, "stages", np.array([9]), np.array([now]))
    assert a.retry_slow(now + 2 * S + S // 10) == [] and seen["reads"] == reads + 1
    assert a.tick(now + 3 * S) == [] and seen["reads"] == reads + 1  # nothing new stored
    a.stored(job, "stages", np.array([9]), np.array([now]))
    seen["early"] = False
    out = a.retry_slow(now + 3 * S + S // 10)
    assert [(d.status, d.culprit_ranks) for d in out] == [("open", [9])]
    assert job not in a.pending_slow and job not in a.slow_tried_at


def test_a_hang_trigger_during_an_open_slowdown_judges_it_as_the_re_checks_do(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A hang trigger of a job whose performance incident is open (the silence after the job
    ends) finds no hang and falls back to the slowdown analysis: it runs with the open
    incident's culprits and stage to confirm, as a re-check does, so the incident keeps its
    answer while the culprit's excess persists. Without them a real job's rank starved of CPU
    for the whole window read as spikes of its optimizer, and the incident that had named
    `host cpu` was turned into `jitter [1] optim` at the job's end."""
    from diagnosis.triggers.base import Trigger
    from tests.unit.test_diagnosis_engine import window

    w, now = window("gpu_slow rank=9 factor=1.5 at=1s")
    job = w.topo.job_id
    starved = Conclusion("slowdown", (9,), "host cpu", "host_software", 0.8)
    spikes = Conclusion("jitter", (9,), "optim", "gpu_compute", 0.75)
    asked: list[tuple[tuple[int, ...], str | None]] = []

    def analyze(w_: Window, now_ns: int, config: object = None, confirm: tuple[int, ...] = (),
                confirm_stage: str | None = None, beats: object = None,
                confirm_since_ns: int | None = None) -> Conclusion:
        asked.append((tuple(confirm), confirm_stage))
        return starved if (not asked[1:] or 9 in confirm) else spikes

    monkeypatch.setattr("diagnosis.engine.slow.analyze", analyze)
    a = Analyst(lambda job_id, lo, hi, kinds=None: w, AnalystConfig(),
                event_clock=lambda job_id, t: now)
    opened = a.on_trigger(Trigger(job, now, "straggler", (9,)), now)
    assert [(d.status, d.stage) for d in opened] == [("open", "host cpu")]
    out = a.on_trigger(Trigger(job, now + S, "hang", (0,)), now + S)
    assert asked == [((), None), ((9,), "host cpu")]
    assert [(d.kind, d.stage) for d in out] in ([], [("slowdown", "host cpu")])
    kept = a.book.current(job, "performance")
    assert kept is not None and kept.stage == "host cpu"


def test_an_incident_judged_against_its_own_past_is_rechecked_from_its_onset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A DDP job's one ring is named by its rise over its own past (label `own_past`): its
    re-checks and the triggers judged during it reach back to the incident's onset, where its
    baseline is, so the incident is not resolved as the baseline slides out of the judged
    steps (and opened again by the next sweep, whose steps reach back). An incident with
    peers to compare its culprit with is re-checked over the usual steps."""
    from diagnosis import slow as slow_mod
    from diagnosis.triggers.base import Trigger
    from tests.unit.test_diagnosis_engine import window

    w, now = window("gpu_slow rank=9 factor=1.5 at=1s")
    job = w.topo.job_id
    onset = now - 3 * S
    ring = Conclusion("slowdown", (0, 1, 2, 3), "dp_allreduce", "nic_rdma", 0.6,
                      onset_ns=onset, labels=("ring_member_unknown", slow_mod.OWN_PAST))
    since: list[int | None] = []

    def analyze(w_: Window, now_ns: int, config: object = None, confirm: tuple[int, ...] = (),
                confirm_stage: str | None = None, beats: object = None,
                confirm_since_ns: int | None = None) -> Conclusion:
        since.append(confirm_since_ns)
        return ring

    monkeypatch.setattr("diagnosis.engine.slow.analyze", analyze)
    monkeypatch.setattr("diagnosis.analyst.slow.analyze", analyze)
    a = Analyst(lambda job_id, lo, hi, kinds=None: w, AnalystConfig(),
                event_clock=lambda job_id, t: now)
    assert [d.status for d in a.on_trigger(Trigger(job, now, "straggler", (1,)), now)] == \
        ["open"]
    a.on_trigger(Trigger(job, now + S, "hang", (0,)), now + S)
    a._recheck(job, ["performance"], now + 5 * S)
    assert since == [None, onset, onset]
    # the same conclusion without the label: judged over the usual steps
    a2 = Analyst(lambda job_id, lo, hi, kinds=None: w, AnalystConfig(),
                 event_clock=lambda job_id, t: now)
    ring = Conclusion("slowdown", (0, 1), "tp_collectives", "nic_rdma", 0.6, onset_ns=onset,
                      labels=("ring_member_unknown",))
    since.clear()
    a2.on_trigger(Trigger(job, now, "straggler", (1,)), now)
    a2._recheck(job, ["performance"], now + 5 * S)
    assert since == [None, None]


def test_reaching_back_judges_every_step_since_the_moment_and_a_baseline_before() -> None:
    """`slow.reach_back`: the recent steps cover the steps begun after the moment and
    `onset_steps` more, at least the default and at most `MAX_RECENT`."""
    from diagnosis import slow as slow_mod
    cfg = slow_mod.SlowConfig()
    step = np.repeat(np.arange(300), 2)
    stages = {"step": step, "t_start": step * 10}
    assert slow_mod.reach_back(cfg, stages, None) == cfg
    assert slow_mod.reach_back(cfg, stages, 2980).recent == cfg.recent  # 1 step since
    assert slow_mod.reach_back(cfg, stages, 2495).recent == 50 + cfg.onset_steps
    assert slow_mod.reach_back(cfg, stages, 0).recent == slow_mod.MAX_RECENT
