"""hang_rca.process_exit: a job whose processes ended with calls in flight names the rank whose
process ended first — the one its peers were waiting for — and nothing else: not a job that
ended normally, not one stopped from outside with every rank inside the same call, not a hang
the end came after, not a job without the agents' exit beats."""

from __future__ import annotations

import signal
from collections.abc import Collection, Sequence

import numpy as np

from diagnosis import hang_rca
from diagnosis.analyst import Analyst
from diagnosis.window import Window
from ingest.records import Communicator, JobTopology
from ingest.units import MILLISECOND as MS
from ingest.units import SECOND as S

STEP = 50 * MS


def ddp4() -> JobTopology:
    return JobTopology(job_id="j", ts=0, world_size=4, dp=4, hosts=["h"] * 4,
                       communicators=[Communicator(comm_id="world", kind="dp",
                                                   members=[0, 1, 2, 3])])


def all_reduces(last: dict[int, int], in_flight: set[int], steps_from: int = 30
                ) -> dict[str, np.ndarray]:
    """One all-reduce per step from `steps_from` to `last[rank]` on each rank, every 50 ms;
    a rank in `in_flight` never completed its last one."""
    rows = [(r, s, s * STEP + 30 * MS, 0 if (r in in_flight and s == n) else s * STEP + 40 * MS)
            for r, n in last.items() for s in range(steps_from, n + 1)]
    rank, seq, t0, t1 = (np.array(x) for x in zip(*rows, strict=True))
    return {"rank": rank, "comm_id": np.full(rank.size, "world", object), "op_seq": seq,
            "op": np.full(rank.size, "AllReduce", object), "peer": np.full(rank.size, -1),
            "bytes": np.full(rank.size, 4096), "t_enqueue": t0, "t_start": t0, "t_end": t1,
            "step": seq}


def beats(rows: list[tuple[int, int, int, str, int]]) -> dict[str, np.ndarray]:
    """(rank, ts, step, stage, exited) rows."""
    rank, ts, step, stage, ex = zip(*rows, strict=True)
    n = len(rows)
    return {"rank": np.array(rank), "ts": np.array(ts), "comm_id": np.full(n, "world", object),
            "last_op_seq": np.full(n, -1), "dropped": np.zeros(n, int), "step": np.array(step),
            "stage": np.array(stage, dtype=object), "stage_ts": np.array(ts) - MS,
            "exited": np.array(ex)}


def killed_rank_2(extra_beats: Sequence[tuple[int, int, int, str, int]] = ()) -> Window:
    """Rank 2 was killed in the forward of step 40; ranks 0, 1 and 3 were inside all-reduce 40
    when their calls failed; the agent saw all four processes gone 0.6 s later."""
    o = all_reduces({0: 40, 1: 40, 2: 39, 3: 40}, in_flight={0, 1, 3})
    gone = 40 * STEP + 600 * MS
    b = beats([(r, 39 * STEP, 39, "model.backward", 0) for r in range(4)]
              + [(0, gone, 40, "model.backward", 1), (1, gone, 40, "model.backward", 1),
                 (2, gone, 40, "model.fwd_loss", 1), (3, gone, 40, "model.backward", 1)]
              + list(extra_beats))
    return Window(ddp4(), {"ops": o, "beats": b}, 0, gone + S)


def test_the_rank_whose_process_ended_first_is_named_with_its_last_stage() -> None:
    w = killed_rank_2()
    c = hang_rca.process_exit(w, w.now_ns)
    assert c is not None
    assert (c.kind, c.ranks, c.stage, c.component) == ("hang", (2,), "process", "host_software")
    assert c.findings[0].rule == "rankwatch.process_exit"
    assert "mycroft.alg2.min_op" in {f.rule for f in c.findings}
    text = c.summaries[0][1]
    assert "model.fwd_loss of step 40" in text and "[0, 1, 3]" in text and "AllReduce #40" in text
    assert hang_rca.analyze(w, w.now_ns) == c  # the hang analysis (triggers, re-checks) too


def test_no_exit_beats_no_verdict() -> None:
    w = killed_rank_2()
    b = {k: v for k, v in w.tables["beats"].items() if k != "exited"}
    assert hang_rca.process_exit(Window(w.topo, {**w.tables, "beats": b}, 0, w.now_ns),
                                 w.now_ns) is None
    b = {**w.tables["beats"], "exited": np.zeros(w.tables["beats"]["rank"].size, int)}
    assert hang_rca.process_exit(Window(w.topo, {**w.tables, "beats": b}, 0, w.now_ns),
                                 w.now_ns) is None


def test_a_normal_end_and_a_job_stopped_from_outside_name_no_one() -> None:
    gone = 41 * STEP + 600 * MS
    ended = beats([(r, gone, 40, "", 1) for r in range(4)])
    normal = Window(ddp4(), {"ops": all_reduces({r: 40 for r in range(4)}, set()),
                             "beats": ended}, 0, gone + S)
    assert hang_rca.process_exit(normal, normal.now_ns) is None
    stopped = Window(ddp4(), {"ops": all_reduces({r: 40 for r in range(4)}, {0, 1, 2, 3}),
                              "beats": ended}, 0, gone + S)
    assert hang_rca.process_exit(stopped, stopped.now_ns) is None


def test_a_hang_that_the_end_came_after_is_left_to_the_hang_analysis() -> None:
    """The waiters beat on, alive, for seconds inside all-reduce 40 before the job was
    stopped: rank 2 hung (or died) long before the end; that is the live hang's verdict."""
    w = killed_rank_2([(r, 40 * STEP + k * S, 40, "model.backward", 0)
                       for r in (0, 1, 3) for k in (1, 2, 3)])
    gone = 40 * STEP + 4 * S
    b = w.tables["beats"]
    b = {**b, "ts": np.where(b["exited"] == 1, gone, b["ts"])}
    w = Window(w.topo, {**w.tables, "beats": b}, 0, gone + S)
    assert hang_rca.process_exit(w, w.now_ns) is None


def killed_before_the_collective(ends_ms: dict[int, float], stage_of: dict[int, str] | None = None,
                                 step_of: dict[int, int] | None = None,
                                 status: dict[int, int] | None = None) -> Window:
    """Rank 2 killed in the forward of step 40, its peers stopped in their backward before the
    all-reduce it never reached: no call in flight; each rank's exit row at `ends_ms` after
    step 40's start (when its process was seen ended), with its exit status `status` (waitpid's
    form; no `exit_status` column without it, as from an agent before it)."""
    o = all_reduces({r: 39 for r in range(4)}, set())
    stage_of = {2: "model.fwd_loss"} | (stage_of or {})
    step_of = step_of or {}
    t0 = 40 * STEP
    b = beats([(r, 39 * STEP, 39, "optim.step", 0) for r in range(4)]
              + [(r, t0 + int(ends_ms[r] * MS), step_of.get(r, 40),
                  stage_of.get(r, "model.backward"), 1) for r in range(4)])
    if status is not None:
        b["exit_status"] = np.array([-1] * 4 + [status.get(r, -1) for r in range(4)])
    return Window(ddp4(), {"ops": o, "beats": b}, 0, t0 + 2 * S)


KILL, TERM, SEGV = int(signal.SIGKILL), int(signal.SIGTERM), int(signal.SIGSEGV)


def test_a_first_end_the_kernel_says_went_down_needs_no_gap_beyond_the_agents() -> None:
    """A live fast-stop run: rank 2 ended 49 ms before the others, which ended over 33 ms —
    short of twice their spread, so the order alone names no one. Where the agent read how
    each process ended, rank 2 killed by SIGKILL (or crashed, or exited with an error) while
    the others were stopped by SIGTERM, or are unknown, is named with the kernel's account.
    Every rank ended alike (a job killed as a whole, or all failing), a stop signal, or a gap
    the agent's passes could make (10 ms): the order must stand out as before."""
    ends = {0: 55.0, 1: 82.0, 2: 6.0, 3: 70.0}
    w = killed_before_the_collective(ends)
    assert hang_rca.process_exit(w, w.now_ns) is None
    for mine, others in ((KILL, TERM), (KILL, -1), (SEGV, TERM), (1 << 8, TERM)):
        w = killed_before_the_collective(ends, status={0: others, 1: others, 2: mine, 3: others})
        c = hang_rca.process_exit(w, w.now_ns)
        assert c is not None and c.ranks == (2,) and c.confidence == hang_rca.DOWN_CONFIDENCE
        assert "went_down" in c.labels and c.findings[0].evidence["exit_status"] == mine
        assert hang_rca.how_ended(mine) in c.summaries[0][1]
    w = killed_before_the_collective(ends, status={0: TERM, 1: TERM, 2: KILL, 3: TERM})
    c = hang_rca.process_exit(w, w.now_ns)
    assert c is not None and "killed by SIGKILL; the others: killed by SIGTERM" in c.summaries[0][1]
    for st in ({r: KILL for r in range(4)}, {r: 1 << 8 for r in range(4)},
               {0: TERM, 1: TERM, 2: TERM, 3: TERM}, {0: TERM, 1: KILL, 2: KILL, 3: TERM}):
        w = killed_before_the_collective(ends, status=st)
        assert hang_rca.process_exit(w, w.now_ns) is None, st
    close = killed_before_the_collective({0: 16.0, 1: 20.0, 2: 6.0, 3: 18.0},
                                         status={0: TERM, 1: TERM, 2: KILL, 3: TERM})
    assert hang_rca.process_exit(close, close.now_ns) is None  # 10 ms < ALONE_MIN_NS
    # with the order alone standing out, the status only raises the confidence
    clear = killed_before_the_collective({0: 31.0, 1: 30.6, 2: 3.0, 3: 31.2},
                                         status={0: TERM, 1: TERM, 2: KILL, 3: TERM})
    c = hang_rca.process_exit(clear, clear.now_ns)
    assert c is not None and c.ranks == (2,) and c.confidence == hang_rca.DOWN_CONFIDENCE


def test_exit_statuses_in_words() -> None:
    assert hang_rca.went_down(KILL) and hang_rca.went_down(SEGV) and hang_rca.went_down(1 << 8)
    assert not any(hang_rca.went_down(s) for s in (-1, 0, TERM, int(signal.SIGINT)))
    assert hang_rca.how_ended(KILL) == "killed by SIGKILL"
    assert hang_rca.how_ended(3 << 8) == "exited with code 3"
    assert hang_rca.how_ended(0) == "exited with code 0" and hang_rca.how_ended(-1) == ""
    assert hang_rca.how_ended(100) == "killed by signal 100"


def test_a_rank_that_ended_alone_and_first_inside_a_step_is_named() -> None:
    w = killed_before_the_collective({0: 31.0, 1: 30.6, 2: 3.0, 3: 31.2})
    c = hang_rca.process_exit(w, w.now_ns)
    assert c is not None
    assert (c.kind, c.ranks, c.stage, c.component, c.confidence) == (
        "hang", (2,), "process", "host_software", hang_rca.ALONE_CONFIDENCE)
    assert "ended_alone" in c.labels and c.findings[0].rule == "rankwatch.process_exit"
    assert "model.fwd_loss of step 40" in c.summaries[0][1]
    assert "28 ms before every other rank's" in c.summaries[0][1]


def test_ends_together_between_stages_or_spread_out_name_no_one() -> None:
    """Exit rows timed at one beat (no pidfds: one time for all), a first end between stages
    (a normal end), others ending over a spread the gap does not stand out of, a peer behind
    the first (it did not lead), a rank still running: no verdict."""
    at_beat = killed_before_the_collective({r: 600.0 for r in range(4)})
    assert hang_rca.process_exit(at_beat, at_beat.now_ns) is None
    normal = killed_before_the_collective({0: 31.0, 1: 30.6, 2: 3.0, 3: 31.2}, {2: ""})
    assert hang_rca.process_exit(normal, normal.now_ns) is None
    spread = killed_before_the_collective({0: 30.0, 1: 45.0, 2: 3.0, 3: 60.0})
    assert hang_rca.process_exit(spread, spread.now_ns) is None  # 27 ms < 5 × 30 ms
    behind = killed_before_the_collective({0: 31.0, 1: 30.6, 2: 3.0, 3: 31.2}, step_of={3: 39})
    assert hang_rca.process_exit(behind, behind.now_ns) is None
    w = killed_before_the_collective({0: 31.0, 1: 30.6, 2: 3.0, 3: 31.2})
    b = w.tables["beats"]
    running = {k: v[b["rank"] != 3] if k != "x" else v for k, v in b.items()}
    still = Window(w.topo, {**w.tables, "beats": running}, 0, w.now_ns)
    assert hang_rca.process_exit(still, still.now_ns) is None


def ended_in_step_40(o: dict[str, np.ndarray], ends_ms: dict[int, float]) -> Window:
    """The calls `o` and each rank's exit row `ends_ms` into step 40 (rank 2 in its forward,
    the others in their backward), after a beat at step 39."""
    t0 = 40 * STEP
    b = beats([(r, 39 * STEP, 39, "optim.step", 0) for r in range(4)]
              + [(r, t0 + int(ends_ms[r] * MS), 40,
                  "model.fwd_loss" if r == 2 else "model.backward", 1) for r in range(4)])
    return Window(ddp4(), {"ops": o, "beats": b}, 0, t0 + 2 * S)


def test_of_two_ranks_that_never_issued_the_call_the_one_that_ended_alone_is_named() -> None:
    """Ranks 0 and 3 inside all-reduce 40; rank 2 killed in its forward, rank 1 stopped by the
    launcher before it got there: both never issued the call. Timed ends single out rank 2;
    ends at one beat leave both named."""
    o = all_reduces({0: 40, 1: 39, 2: 39, 3: 40}, in_flight={0, 3})
    timed = ended_in_step_40(o, {0: 116.1, 1: 116.1, 2: 35.0, 3: 117.5})
    c = hang_rca.process_exit(timed, timed.now_ns)
    assert c is not None and c.ranks == (2,) and "min_op" in c.findings[0].labels
    one_beat = ended_in_step_40(o, {r: 600.0 for r in range(4)})
    c = hang_rca.process_exit(one_beat, one_beat.now_ns)
    assert c is not None and c.ranks == (1, 2)


def test_of_several_that_never_issued_the_call_the_one_gone_before_the_wait_is_named() -> None:
    """Rank 1 inside all-reduce 40 from 30 ms into step 40; rank 2 killed in its forward 20 ms
    in, ranks 0 and 3 stopped by a fast launcher in their backward after rank 1 began to wait
    (38 ms after rank 2, the rest over 20 ms: too close for the ended-alone test). Of the three
    that never issued the call, only rank 2 was already gone when the wait began; ends timed at
    one beat say nothing of that, and all three stay named."""
    o = all_reduces({0: 39, 1: 40, 2: 39, 3: 39}, in_flight={1})
    timed = ended_in_step_40(o, {0: 58.0, 1: 78.0, 2: 20.0, 3: 75.0})
    c = hang_rca.process_exit(timed, timed.now_ns)
    assert c is not None and c.ranks == (2,) and "min_op" in c.findings[0].labels
    one_beat = ended_in_step_40(o, {r: 600.0 for r in range(4)})
    c = hang_rca.process_exit(one_beat, one_beat.now_ns)
    assert c is not None and c.ranks == (0, 2, 3)


def test_the_teardown_of_a_job_hung_for_seconds_is_no_process_exit() -> None:
    """Every rank inside all-reduce 40 for 13 s (a hang), then the job stopped from outside,
    rank 0 first and alone: the ends are the hang's teardown, not a process that took the job
    down — no verdict here (the hang analysis names the hang). The same ends 30 ms after the
    calls began still name the first rank to go."""
    o = all_reduces({r: 40 for r in range(4)}, in_flight={0, 1, 2, 3})
    began = 40 * STEP + 30 * MS

    def ended(after_ms: float) -> Window:
        b = beats([(r, 39 * STEP, 39, "optim.step", 0) for r in range(4)]
                  + [(r, began + int((after_ms + (0 if r == 0 else 100)) * MS), 40,
                      "model.backward", 1) for r in range(4)])
        return Window(ddp4(), {"ops": o, "beats": b}, 0, began + int(after_ms * MS) + 2 * S)

    hung = ended(13_000.0)
    assert hang_rca.process_exit(hung, hung.now_ns) is None
    quick = ended(30.0)
    c = hang_rca.process_exit(quick, quick.now_ns)
    assert c is not None and c.ranks == (0,) and "ended_alone" in c.labels


def test_the_analyst_looks_for_exits_and_opens_one_incident() -> None:
    """No trigger fires for a job whose ranks all stopped within a beat; the analyst's look
    for exit beats (every min_sweep_s) opens the incident, once."""
    w = killed_rank_2()

    def read(job_id: str, start_ns: int, now_ns: int,
             kinds: Collection[str] | None = None) -> Window:
        tables = {k: v for k, v in w.tables.items() if kinds is None or k in kinds}
        return Window(w.topo, tables, start_ns, now_ns)

    a = Analyst(read, event_clock=lambda job, now: w.now_ns)
    a.jobs.add("j")
    out = a.tick(w.now_ns)
    assert [(d.status, d.kind, d.culprit_ranks, d.stage) for d in out] == [
        ("open", "hang", [2], "process")]
    assert out[0].rules[0] == "rankwatch.process_exit"
    assert not [d for d in a.tick(w.now_ns + 3 * S) if d.status == "open"]


def test_an_ended_jobs_incident_is_rechecked_where_it_was_concluded() -> None:
    """The event clock of a job that ended stops at its progress watermark plus the feed's
    lateness, here before the exit beats. A trigger judged on the beats' clock opened the
    incident from them; its re-checks read no earlier than that, so they find the dead rank
    again instead of nothing: the incident stays open, not resolved and opened again."""
    from diagnosis.triggers.base import Trigger

    w = killed_rank_2()
    reads: list[int] = []

    def read(job_id: str, start_ns: int, now_ns: int,
             kinds: Collection[str] | None = None) -> Window:
        reads.append(now_ns)
        cut = {"ops": "t_start", "beats": "ts"}
        tables = {k: {c: v[w.tables[k][cut[k]] <= now_ns] for c, v in w.tables[k].items()}
                  for k in w.tables if kinds is None or k in kinds}
        return Window(w.topo, tables, start_ns, now_ns)

    watermark = 40 * STEP + 100 * MS  # the survivors' last calls: before the exit beats
    a = Analyst(read, event_clock=lambda job, now: watermark)
    a.jobs.add("j")
    t = Trigger("j", w.now_ns, "hang", (0, 1, 3), {"rule": "venustrace.heartbeat",
                                                  "clock": "beats"})
    opened = a.on_trigger(t, w.now_ns)
    assert [(d.status, d.culprit_ranks, d.stage) for d in opened] == [("open", [2], "process")]
    out = [d for k in range(1, 20) for d in a.tick(w.now_ns + k * S)]
    assert not [d for d in out if d.status in ("resolved", "open")], \
        [(d.status, d.version) for d in out]
    assert reads[-1] >= w.now_ns  # the re-checks read up to the incident's own moment
    # a lagging clock alone: the same re-checks at it find nothing (what the fix prevents)
    assert hang_rca.analyze(read("j", 0, watermark), watermark) is None


def test_the_silence_before_a_normal_end_is_not_tried_as_a_hang_for_pending_s() -> None:
    """Every rank of a job finished its last step, went quiet for its teardown (the heartbeat
    timer fired) and exited with nothing in flight. The trigger's analysis finds nothing and
    waits; once the exit beats are seen the job has ended: the pending trigger is dropped, a
    later trigger about the silence before the end is not analysed, and a rank of the same job
    id beating after the end makes its triggers count again."""
    from diagnosis.triggers.base import Trigger

    gone = 41 * STEP + 2 * S
    seen = {"exits": False, "restart": False, "reads": 0}

    def read(job_id: str, start_ns: int, now_ns: int,
             kinds: Collection[str] | None = None) -> Window:
        rows = [(r, 40 * STEP + k * S // 2, 40, "", 0) for r in range(4) for k in (1, 2)]
        if seen["exits"]:
            rows += [(r, gone, 40, "", 1) for r in range(4)]
        if seen["restart"]:
            rows += [(0, gone + 30 * S, 1, "model.fwd_loss", 0)]
        if kinds is None:
            seen["reads"] += 1
        tables = {"ops": all_reduces({r: 40 for r in range(4)}, set()), "beats": beats(rows)}
        return Window(ddp4(), {k: v for k, v in tables.items() if kinds is None or k in kinds},
                      start_ns, now_ns)

    clock = {"at": 40 * STEP + S + S // 2}
    a = Analyst(read, event_clock=lambda job, now: clock["at"])
    t = Trigger("j", 40 * STEP + S + 100 * MS, "hang", (0,), {"rule": "venustrace.heartbeat"})
    now = 50 * S
    assert a.on_trigger(t, now) == [] and "j" in a.pending
    assert a.tick(now + S) == [] and "j" in a.pending  # still tried: nothing says it ended
    seen["exits"], clock["at"] = True, gone + S
    assert a.tick(now + 3 * S) == []  # the exits are seen: a normal end names no one
    assert "j" not in a.pending and a.ended == {"j": gone}
    reads = seen["reads"]
    late = Trigger("j", gone - S // 2, "hang", (0, 1, 2, 3), {"rule": "venustrace.heartbeat",
                                                             "after_the_fact": True})
    assert a.on_trigger(late, now + 4 * S) == [] and "j" not in a.pending
    assert seen["reads"] == reads  # not analysed at all
    seen["restart"], clock["at"] = True, gone + 31 * S
    a.tick(now + 40 * S)
    assert "j" not in a.ended  # the job id runs again
    again = Trigger("j", gone + 31 * S, "hang", (0,), {"rule": "venustrace.heartbeat"})
    a.on_trigger(again, now + 41 * S)
    assert seen["reads"] > reads


def test_exit_beats_past_a_stopped_clock_are_judged_within_seconds() -> None:
    """Every process ended 0.1 s after rank 2 was killed, so nothing moves the job's event
    clock past the survivors' last calls, and the agents' exit beats lie after it. The first
    look reads up to the clock and finds none; once the clock has not moved, the next looks
    read past it and judge the job as of its newest exit beat — not only after the windows'
    idle close moves the clock — and stop looking `EXIT_MARGIN_S` after it stopped."""
    from diagnosis.analyst import EXIT_MARGIN_S

    w = killed_rank_2()
    reads: list[int] = []

    def read(job_id: str, start_ns: int, now_ns: int,
             kinds: Collection[str] | None = None) -> Window:
        if kinds is not None and "beats" in kinds and len(kinds) == 1:
            reads.append(now_ns)
        cut = {"ops": "t_start", "beats": "ts"}
        tables = {k: {c: v[w.tables[k][cut[k]] <= now_ns] for c, v in w.tables[k].items()}
                  for k in w.tables if kinds is None or k in kinds}
        return Window(w.topo, tables, start_ns, now_ns)

    clock = 40 * STEP + 100 * MS  # the survivors' last calls; the exit beats 0.5 s later
    a = Analyst(read, event_clock=lambda job, now: clock)
    a.jobs.add("j")
    t0 = w.now_ns
    first = a.tick(t0)
    assert not [d for d in first if d.status == "open"] and reads == [clock]
    gap = int(a.config.min_sweep_s * S)
    out = a.tick(t0 + gap)
    assert [(d.status, d.culprit_ranks, d.stage) for d in out] == [("open", [2], "process")]
    assert reads[-1] > clock
    # a job whose clock stopped without an exit (its agent gone too): looked at for
    # EXIT_MARGIN_S after the clock stopped, then no more
    live = w.tables["beats"]["exited"] == 0
    w = Window(w.topo, {**w.tables, "beats": {c: v[live] for c, v in w.tables["beats"].items()}},
               w.start_ns, w.now_ns)
    reads.clear()
    quiet = Analyst(read, event_clock=lambda job, now: clock)
    quiet.jobs.add("j")
    for k in range(10):
        assert not [d for d in quiet.tick(t0 + k * gap) if d.status == "open"]
    assert 1 < len(reads) <= 1 + EXIT_MARGIN_S * S // gap + 1
