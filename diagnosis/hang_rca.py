"""Root cause of a hang: Mycroft Alg. 2 + Table 4, VenusTrace's halt point, Table 3's flow rule.

Combination (each rule's own docstring states its assumptions):
1. `mycroft_hang.analyze_hang` over all ranks' ops at `now_ns` — the waits-for graph names
   min-op culprits (a rank that never reached the op its peers wait in) and tells process death
   (records stopped, beats too) from a live hang (beats continue); a stall with every member
   present is min-data, decided by the chunk counters (Table 4) → NIC/RDMA or GPU side.
   `stuck_ns` scales with the job: 1.5 × the median step time (≥ 1 s), since a trigger fires
   after 2 × step time and a fixed 5 s would hide the culprit for the first seconds;
   death needs a silence of 1.5 beat intervals beyond the others'.
2. `halt_point.halt_point` names the 1F1B node ("bwd mb=3 pp=1", "data") for a live min-op
   culprit; the stage is taken from the halt point whose culprit set contains the min-op rank.
3. Between steps: a culprit that issued no op of the hung step stopped after its previous
   step's DP collectives. If its `stages` record of that previous step is missing (peers have
   theirs) it never finished the optimizer → "optim"; if present, it stopped before its first
   call of the new step → "data" (the loader runs first). Neither paper has this; the stage
   record is what tells the two apart. Without a 1F1B schedule (a plain data-parallel job) the
   hung step is the one the waiting ranks' calls carry; only calls issued by the analysis
   moment count.
   Where the culprit's beats carry its position (`diagnosis.position`: the PyTorch tracer
   records stage entry), the stage it is inside names the stage ("bwd pp=1" for a rank hung
   in its backward), above the schedule's guess; a halt point of the same pass stays (it
   names the microbatch too).
4. `mycroft_flow.slow_flows`'s "flow_incomplete" corroborates NIC hangs (computed only on the
   min-data path: a min-op culprit is named by the ops alone).
5. A stall that already recovered (`past_stall`: the longest gap between op completions, at
   least max(3 s, 4 × step time)) is analysed as of 3/4 into it, from the rows written after:
   a call enqueued more than `stuck_ns` before that moment whose kernel started after it had
   not been reached (last_logs.reached), so the rank whose GPU hung is the min-op culprit,
   not a peer waiting beside it. The culprit's `stages` record of the stalled step, written once
   the step ended, confirms the stage when one stage holds at least half the stall.
   `stalled_steps` lists the steps that stall overlaps, for slowdown analyses that should not
   count the hang again as excess.
Per-window work (string codes, each rank's last record) is computed once and shared
(`columns.codes`, `Window.last_seen`).
A rank that only waits is never blamed: Alg. 2 blames sinks of the waits-for graph, Table 4 rows
by their own counters, the halt point ranks that did not complete a node their peers completed.
"""

from __future__ import annotations

import signal

import numpy as np

from diagnosis.columns import Columns, codes, col, distinct, ints
from diagnosis.conclusion import Conclusion
from diagnosis.position import current_stage
from diagnosis.rules.base import Component, Finding
from diagnosis.rules.halt_point import halt_point, hung_step
from diagnosis.rules.mycroft_flow import FlowConfig, slow_flows
from diagnosis.rules.mycroft_hang import HangConfig, analyze_hang
from diagnosis.window import Window
from ingest.records import exit_code, exit_signal
from ingest.units import MILLISECOND, SECOND


def normalize_stage(stage: str | None) -> str | None:
    """Alg. 2's "<kind> <op>" stage names in the diagnosis vocabulary (diagnosis.model)."""
    if stage is None:
        return None
    if stage.startswith("pp "):
        return "pp_p2p"
    if stage.startswith("tp ") or stage.startswith("cp ") or stage.startswith("ep "):
        return "tp_collectives"
    if stage.startswith("world "):
        return "collectives"
    return stage


def _between_steps(w: Window, rank: int, step: int, now_ns: int) -> str | None:
    ops = w.get("ops")
    if not ops or step < 0:
        return None
    # calls issued by now (a recovered stall is analysed at a past moment: later rows exist)
    mine = (ints(ops, "rank") == rank) & (ints(ops, "t_enqueue") <= now_ns)
    if (mine & (ints(ops, "step", -1) == step)).any():
        return None
    st = w.get("stages")
    if not st:
        return None
    have = (ints(st, "rank") == rank) & (ints(st, "step") == step - 1)
    peers = (ints(st, "step") == step - 1).any()
    return "data" if have.any() or not peers else "optim"


#: a stage the tracer reports a rank inside → (diagnosis stage, component); "{pp}" is the rank's
#: pipeline stage
POSITION_STAGE: dict[str, tuple[str, Component]] = {
    "data.next_wait": ("data", "data_loader"), "model.fwd_loss": ("fwd pp={pp}", "gpu_compute"),
    "model.backward": ("bwd pp={pp}", "gpu_compute"), "callbacks": ("callbacks", "host_software"),
    "optim.step": ("optim", "gpu_compute")}


def _inside_stage(w: Window, rank: int, step: int, now_ns: int | None = None
                  ) -> tuple[str, Component] | None:
    """The stage the hung rank is inside, from the position its beats carry
    (`diagnosis.position`: the tracer records stage entry, so an unfinished step still has a
    current stage): (stage, component), or None when its beats carry none or it is between
    stages. The position is read from the rank's ring at every beat, so a stage it names is
    where the rank is now — also when that is a step before the one its peers wait in (a rank
    stopped in its optimizer while its peers began the next step). In a pipeline, with
    `now_ns`, the pass's microbatch comes from the rank's own calls (`_pass_microbatch`):
    "bwd mb=1 pp=1"; a job without a pipeline or gradient accumulation runs one pass of each
    kind a step, microbatch 0."""
    pos = current_stage(w.get("beats"), rank, now_ns)
    if pos is None or pos[1] not in POSITION_STAGE:
        return None
    name, comp = POSITION_STAGE[pos[1]]
    name = name.format(pp=int(w.grid.stage[rank]))
    if name.startswith(("fwd ", "bwd ")) and w.grid.pp <= 1 and w.topo.microbatches <= 1 \
            and not _sends_p2p(w, rank):
        return f"{name[:3]} mb=0 {name[4:]}", comp  # one pass a step: microbatch 0
    if name.startswith(("fwd ", "bwd ")) and now_ns is not None:
        m = _pass_microbatch(w, rank, pos[0] if pos[0] >= 0 else step, name.startswith("fwd"),
                             now_ns)
        if m is not None:
            name = f"{name[:3]} mb={m} {name[4:]}"
    return name, comp


def _sends_p2p(w: Window, rank: int) -> bool:
    """Whether `rank` issued point-to-point calls in the window: a pipeline stage, also where
    the topology declares no pipeline (then its pass's stage index and microbatch are not
    known from the topology)."""
    ops = w.get("ops")
    if not ops or "peer" not in ops:
        return False
    return bool(((ints(ops, "rank") == rank) & (ints(ops, "peer", -1) >= 0)).any())


def _pass_microbatch(w: Window, rank: int, step: int, forward: bool, now_ns: int) -> int | None:
    """The microbatch of the `forward` (else backward) pass a pipeline rank is inside at `step`,
    counted from its own p2p calls of that step: every schedule runs one kind's passes in
    microbatch order, so a stage that sends after the pass (F: to stage s+1, B: to s−1) is in
    pass m once it issued m such Sends; a stage that does not (F on the last stage, B on the
    first) entered pass m when its m+1-th Recv of that kind (from s−1 for F, s+1 for B)
    completed. A forward with nothing sent after it (the last stage's) is also at least the
    count of backwards the stage completed (its gradient Sends to s−1): a microbatch's backward
    follows its forward on every schedule, so a rank inside a forward after k backwards is past
    forward k−1 — whether or not the Recv of the forward it is in was issued yet (a last stage
    of 1F1B stopped on entering forward 1, before its Recv, after backward 0: microbatch 1,
    not 0). Works for any schedule with that order (1F1B, GPipe) and needs no op_seq
    alignment — only calls that carry their step (the PyTorch tracer's). None when unknown;
    a lower bound where the calls cannot tell (GPipe's last stage stopped on entering a
    forward, before its Recv, reads one microbatch early)."""
    ops = w.get("ops")
    grid = w.grid
    if not ops or step < 0 or grid.pp <= 1 or "peer" not in ops:
        return None
    rows = np.flatnonzero((ints(ops, "rank") == rank) & (ints(ops, "step", -1) == step)
                          & (ints(ops, "t_enqueue") <= now_ns) & (ints(ops, "peer", -1) >= 0))
    s = int(grid.stage[rank])
    nxt, prev = (s + 1, s - 1) if forward else (s - 1, s + 1)
    sends_after = 0 <= nxt < grid.pp
    op = col(ops, "op", "")[rows].astype(str)
    peer = ints(ops, "peer", -1)[rows]
    ok = peer < grid.world
    peer_stage = np.full(peer.size, -1, dtype=np.int64)
    peer_stage[ok] = np.asarray(grid.stage)[peer[ok]]
    if sends_after:
        m = int(((op == "Send") & (peer_stage == nxt)).sum())
    else:
        done = ints(ops, "t_end", 0)[rows]
        m = int(((op == "Recv") & (peer_stage == prev) & (done > 0) & (done <= now_ns)).sum()) - 1
        if forward and s > 0:  # backwards done: their forwards are done too
            m = max(m, int(((op == "Send") & (peer_stage == s - 1)).sum()))
    microbatches = int(w.spec.microbatches or 0)
    return m if m >= 0 and (microbatches <= 0 or m < microbatches) else None


def _waiters_step(w: Window, top: Finding, now_ns: int) -> int:
    """The step the waiting ranks are in, from their calls issued by `now_ns` that carry a step
    (the Python tracer's; the NCCL plugin's ops have none): used when no 1F1B schedule is known
    to place the hang (a plain data-parallel job). -1 when none says."""
    ops = w.get("ops")
    waiters = np.asarray(top.evidence.get("direct_waiters") or [], dtype=np.int64)
    if not ops or waiters.size == 0:
        return -1
    step = ints(ops, "step", -1)
    keep = np.isin(ints(ops, "rank"), waiters) & (ints(ops, "t_enqueue") <= now_ns) & (step >= 0)
    return int(step[keep].max()) if keep.any() else -1


def _stall_stage(w: Window, ranks: tuple[int, ...], a: int, b: int) -> tuple[str, float] | None:
    """The stage that held a recovered stall [a, b) on the culprit: its `stages` record that
    overlaps the stall, and in it the stage with the largest time when that covers at least half
    of the stall. (stage column, seconds) or None. Only a recovered stall has this record: a
    step's record is written when the step ends."""
    st = w.get("stages")
    if not st or not ranks:
        return None
    cols = ("data_next_wait", "model_fwd_loss", "model_backward", "callbacks", "optim_step")
    start = ints(st, "t_start")
    parts = np.stack([ints(st, c, 0) for c in cols], axis=1)
    end = start + parts.sum(axis=1) + ints(st, "step_other", 0)
    rows = np.flatnonzero(np.isin(ints(st, "rank"), ranks) & (start < b) & (end > a))
    if rows.size == 0:
        return None
    best = np.unravel_index(int(np.argmax(parts[rows])), (rows.size, len(cols)))
    ns = int(parts[rows[best[0]], best[1]])
    return (cols[best[1]], ns / 1e9) if 2 * ns >= b - a else None


def process_exit(w: Window, now_ns: int) -> Conclusion | None:
    """A job whose processes ended with calls in flight: the rank whose process ended first
    and took the job down (rankwatch's rule, on Mycroft Alg. 2).

    The host agents' exit beats (`ingest.records.Beat` `exited`) say which ranks' processes
    ended and when each was seen gone. As of the last exit every call still in flight will
    never complete — the tracer records no end for a call that failed (ingest/torch/tracer.py)
    — so Alg. 2's waits-for graph over them, with any in-flight call counting as stuck, names
    the rank the others waited for: a min-op culprit never issued the call they are in. When
    that rank's own process ended and no waiter beat alive `stuck_ns` (1.5 steps, ≥ 1 s) into
    the wait, the wait did not precede the end: the culprit's process ended (killed, crashed,
    exited) and its peers' calls failed at once (gloo: "Connection closed by peer"; a
    launcher stops the rest within milliseconds). The death rule (records stopped 1.5 beat
    intervals before the others') cannot see this: every rank stops within one beat. A wait
    that outlived `stuck_ns` was a hang before the end, which `analyze` names as such.
    Several min-op culprits (the killed rank, and one the launcher stopped before it reached
    the call) are narrowed to the one whose process ended alone and first (`_first_alone`),
    else to those whose process had already ended when the wait began (the others were alive
    then and on their way to the call).

    Stage "process", component host_software; the evidence gives the stage and step the
    culprit's position last showed. A job that ends with nothing in flight (a normal end, or a
    rank killed before its peers reached a collective), or whose in-flight calls have every
    member inside (a job stopped from outside), has no min-op culprit: the order of the ends
    decides (`ended_alone`).
    """
    beats, ops = w.get("beats"), w.get("ops")
    if not beats or not ops or "exited" not in beats:
        return None
    bts, brank = ints(beats, "ts"), ints(beats, "rank")
    ex = (ints(beats, "exited", 0) == 1) & (bts <= now_ns)
    if not ex.any():
        return None
    exited = {int(r) for r in np.unique(brank[ex])}
    end_ns = int(bts[ex].max())
    alg2 = analyze_hang(ops, w.grid, end_ns, config=HangConfig(stuck_ns=0))
    min_op = [f for f in alg2 if f.rule == "mycroft.alg2.min_op"
              and set(f.culprit_ranks) <= exited]
    if not min_op:
        return ended_alone(w, now_ns)
    top = min_op[0]
    ranks = tuple(sorted({r for f in min_op for r in f.culprit_ranks}))
    t_end = ints(ops, "t_end")
    enq = ints(ops, "t_enqueue")

    def wait_began(found: list[Finding]) -> int | None:
        """When the first of `found`'s waiters entered a call still in flight at the end."""
        who = sorted({int(r) for f in found for r in _ints_of(f.evidence.get("direct_waiters"))})
        sel = np.isin(ints(ops, "rank"), who) & ((t_end == 0) | (t_end > end_ns)) \
            & (enq <= end_ns)
        return int(enq[sel].min()) if sel.any() else None

    if len(ranks) > 1:
        # several ranks never issued the call the others wait in: a killed one, and one the
        # launcher stopped on its way there. The one whose process ended alone and first
        # (`ended_alone`'s test, where the agent timed the ends) is the one that went; else
        # the ones whose process had already ended when the wait began: the others were
        # alive then, on their way to the call, and ended after it (the launcher stopping
        # them — over 17-20 ms under a 10 ms monitor, too close for the first test)
        first = _first_alone(beats, w.grid.world, now_ns)
        began = wait_began(min_op)
        gone = _ends(beats, w.grid.world, now_ns)
        if first is not None and first[0] in ranks:
            keep: tuple[int, ...] = (first[0],)
        elif began is not None:
            keep = tuple(r for r in ranks if 0 <= r < gone.size and gone[r] <= began)
        else:
            keep = ()
        if keep and len(keep) < len(ranks):
            ranks = keep
            min_op = [f for f in min_op if set(f.culprit_ranks) & set(keep)] or min_op
            top = min_op[0]
    waiters = sorted({int(r) for f in min_op
                      for r in _ints_of(f.evidence.get("direct_waiters"))})
    inflight = np.isin(ints(ops, "rank"), waiters) & ((t_end == 0) | (t_end > end_ns)) & (
        enq <= end_ns)
    if not inflight.any():
        return None
    t_wait = int(enq[inflight].min())
    stuck_ns = max(int(1.5 * w.step_ns), SECOND)
    alive = ~ex & np.isin(brank, waiters) & (bts >= t_wait + stuck_ns) & (bts <= end_ns)
    if alive.any():  # the waiters beat on, stuck: a hang that the job's end came after
        return None
    x = ranks[0]
    mine = np.flatnonzero(ex & (brank == x))
    last = mine[np.argmax(bts[mine])]
    step, stage = int(ints(beats, "step", -1)[last]), str(col(beats, "stage")[last]) \
        if "stage" in beats else ""
    seen = w.last_seen(end_ns)
    gone_at = int(bts[last])
    where = f"in {stage} of step {step}" if stage else f"in step {step}" if step >= 0 else ""
    status = int(_statuses(beats, w.grid.world, now_ns)[x]) if 0 <= x < w.grid.world else -1
    if how_ended(status):
        where = f"{where} ({how_ended(status)})" if where else f"({how_ended(status)})"
    waited = top.evidence.get("waited_in")
    what = (f"{waited['op']} #{waited['op_seq']} of {waited['comm_id']}"
            if isinstance(waited, dict) else "their calls")
    f = Finding(rule="rankwatch.process_exit", culprit_ranks=ranks, stage="process",
                component="host_software", score=1.0, kind="hang",
                labels=("process_exit", "min_op"),
                onset_ns=int(min(seen[x], t_wait)) if seen[x] > 0 else t_wait,
                evidence={"exited": sorted(exited)[:32], "waiters": waiters[:32],
                          "waited_in": waited, "last_position": {"step": step, "stage": stage},
                          "seen_gone_ns": gone_at, "wait_began_ns": t_wait,
                          "exit_status": status})
    return Conclusion(
        "hang", ranks, "process", "host_software", 0.85, onset_ns=f.onset_ns,
        stages=("process",), labels=("process_exit",), findings=(f, *min_op[:2]),
        summaries=((f.rule, f"rank(s) {list(ranks)[:8]}: the process ended "
                            f"{where + ' ' if where else ''}while rank(s) {waiters[:8]} waited "
                            f"for it in {what}; their calls never completed and the job ended "
                            f"{(end_ns - t_wait) / 1e9:.2f} s later: the process ending first "
                            "took the job down"),))


#: a rank ended alone: its process ended at least this long before every other rank's (more
#: than a job stopped from outside spreads its ends over, and than the agent's pass that may
#: see one end before the rest) ...
ALONE_MIN_NS = 20 * MILLISECOND
#: ... and this many times the spread of the others' ends (torchrun stops them one by one:
#: over 9-31 ms in five live runs of a 4-rank job, the killed rank 28-102 ms before them)
ALONE_K = 2.0
#: the signals a launcher or an operator stops a job's ranks with (torchrun: SIGTERM, SIGKILL
#: only after its grace, so never first; Ctrl-C; a lost session)
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
#: a rank whose process the kernel says went down on its own account (`went_down`)
DOWN_CONFIDENCE = 0.85
#: the confidence of a culprit named by the order of the ends alone (no waits-for edge)
ALONE_CONFIDENCE = 0.75


def ended_alone(w: Window, now_ns: int) -> Conclusion | None:
    """A job whose processes all ended, one of them alone and first, inside a step: that rank's
    process took the job down (rankwatch's rule).

    A rank killed while its peers were still computing leaves no call in flight for Alg. 2's
    waits-for graph: its peers had not reached the collective it never joined when the
    launcher stopped them (torchrun stops a job's other processes once one fails). The order
    of the ends is then the evidence, where the agent timed them (`ingest.agent.exits`: each
    exit row at the moment its process was seen ended, to a few ms): the rank whose process
    ended first, `ALONE_MIN_NS` and `ALONE_K` × the spread of the others' ends before every
    one of them — the others ended together, as a launcher stops them — while its last
    position was inside a stage of a step no other rank was behind. A job stopped from outside
    ends every process at once (no gap); a normal end leaves every rank between stages; exit
    rows timed at the beat (an agent without pidfds) all carry one time. A job already hung
    when its first process ended (a call in flight for 1.5 steps, at least 1 s) is stopped
    from outside: the order of its ends is its teardown's, and the hang `analyze`'s to name.
    Confidence `ALONE_CONFIDENCE`: the order of the ends says who ended first, not that it
    was a fault.

    Where the agent read how each process ended (`Beat.exit_status`, the kernel's account
    while the process was a zombie), a first end that went down on its own account — killed by
    a signal no launcher stops ranks with first (SIGKILL, SIGSEGV, SIGABRT…) or exited with an
    error — while no other rank ended that way is a fault's: it needs only the `ALONE_MIN_NS`
    gap, not `ALONE_K` × the others' spread, and says `DOWN_CONFIDENCE` (label `went_down`).
    The spread of three other ends is a poor yardstick: a launcher stopping them one by one
    over 33 ms left a killed rank's 49 ms lead unnamed in a live run. A job killed from outside
    as a whole (every rank SIGKILL) or whose ranks all failed alike is not singled out by it.
    """
    beats = w.get("beats")
    world = w.grid.world
    first = _first_alone(beats, world, now_ns)
    if first is None:
        return None
    x, end, gap, spread = first
    ops = w.get("ops")
    if ops:
        # the job was hung before its processes ended: a call in flight at the first end had
        # been waiting 1.5 steps (≥ 1 s) by then. The ends are the hang's teardown (a
        # launcher or an operator stopping the job; the first to go is whichever it stopped
        # first), and the hang is `analyze`'s to name (a rank inside a collective its peers
        # never joined, waited on for 13 s, was renamed to the rank stopped first)
        t_end, enq = ints(ops, "t_end"), ints(ops, "t_enqueue")
        stuck_ns = max(int(1.5 * w.step_ns), SECOND)
        if (((t_end == 0) | (t_end > end)) & (enq <= end - stuck_ns)).any():
            return None
    rank, ts = ints(beats, "rank"), ints(beats, "ts")
    last = np.flatnonzero((ints(beats, "exited", 0) == 1) & (ts <= now_ns) & (rank >= 0)
                          & (rank < world))
    step_of = np.full(world, -1, dtype=np.int64)
    step_of[rank[last]] = ints(beats, "step", -1)[last]
    mine = last[(rank[last] == x) & (ts[last] == end)][0]
    stage = str(col(beats, "stage")[mine]) if "stage" in beats else ""
    step = int(step_of[x])
    if not stage or step < 0 or (np.delete(step_of, x) < step).any():
        return None  # between stages (a normal end), or a peer behind it (it did not lead)
    status = _statuses(beats, world, now_ns)
    how = how_ended(int(status[x]))
    down = _down_alone(status, x)
    labels = ("process_exit", "ended_alone", *(("went_down",) if down else ()))
    f = Finding(rule="rankwatch.process_exit", culprit_ranks=(x,), stage="process",
                component="host_software", score=1.0, kind="hang",
                labels=labels, onset_ns=end,
                evidence={"ended_ns": end, "others_ended_after_ns": gap,
                          "others_spread_ns": spread,
                          "last_position": {"step": step, "stage": stage},
                          "exit_status": int(status[x]),
                          "others_exit_status": sorted({int(v) for v in np.delete(status, x)})})
    others = sorted({how_ended(int(v)) or "unknown" for v in np.delete(status, x)})
    said = f" ({how}; the others: {', '.join(others)})" if how else ""
    return Conclusion(
        "hang", (x,), "process", "host_software",
        DOWN_CONFIDENCE if down else ALONE_CONFIDENCE, onset_ns=f.onset_ns,
        stages=("process",), labels=labels, findings=(f,),
        summaries=((f.rule, f"rank {x}: its process ended in {stage} of step {step}{said}, "
                            f"alone, {gap / 1e6:.0f} ms before every other rank's (which ended "
                            f"within {spread / 1e6:.0f} ms of each other, stopped together); no "
                            "call was in flight: the process ending first took the job down"),))


def _first_alone(beats: Columns | None, world: int, now_ns: int
                 ) -> tuple[int, int, int, int] | None:
    """(rank, its end, how long before the next end, the spread of the others' ends) of the
    rank whose process ended alone and first (`ended_alone`: at least `ALONE_MIN_NS` and
    `ALONE_K` × the others' spread before every other end), once every rank of `world` has an
    exit row by `now_ns`; else None."""
    if not beats or "exited" not in beats or world < 2:
        return None
    ends = _ends(beats, world, now_ns)
    never = np.iinfo(np.int64).max
    if (ends == never).any():
        return None  # not every rank has ended (as the beats show so far)
    order = np.argsort(ends, kind="stable")
    x, rest = int(order[0]), ends[order[1:]]
    gap, spread = int(rest.min() - ends[x]), int(rest.max() - rest.min())
    # the kernel's account, where the agent read it: the first to end went down on its own
    # (killed by a signal no launcher stops ranks with first, crashed, exited with an error)
    # and no other rank ended that way — the others were stopped. Its gap need only be one
    # the agent's passes cannot make; the order of the ends alone must stand out of their
    # spread (three other ends give that spread little to go on)
    own = _down_alone(_statuses(beats, world, now_ns), x)
    if gap < (ALONE_MIN_NS if own else max(ALONE_MIN_NS, ALONE_K * spread)):
        return None
    return x, int(ends[x]), gap, spread


def went_down(status: int) -> bool:
    """Whether a process of exit status `status` (`Beat.exit_status`) ended on its own account:
    a signal other than the `STOP_SIGNALS` (SIGKILL from the OOM killer or an operator, SIGSEGV,
    SIGABRT, SIGBUS…) or a non-zero exit code. Unknown (-1), a stop signal or exit 0: no."""
    sig, code = exit_signal(status), exit_code(status)
    return (sig > 0 and sig not in STOP_SIGNALS) or code > 0


def _down_alone(status: np.ndarray, x: int) -> bool:
    """Whether rank `x`'s process went down on its own account (`went_down`) and no other
    rank's ended the same way (`status`: per rank, `_statuses`)."""
    return went_down(int(status[x])) and not (np.delete(status, x) == status[x]).any()


def how_ended(status: int) -> str:
    """`status` in words: "killed by SIGKILL", "exited with code 1", "" when unknown."""
    sig, code = exit_signal(status), exit_code(status)
    if sig > 0:
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exited with code {code}" if code >= 0 else ""


def _statuses(beats: Columns, world: int, now_ns: int) -> np.ndarray:
    """int64 [world]: each rank's exit status on its earliest exit row by `now_ns` (-1 unknown:
    no such row, no `exit_status` column, not read by the agent)."""
    out = np.full(world, -1, dtype=np.int64)
    if "exit_status" not in beats:
        return out
    rank, ts = ints(beats, "rank"), ints(beats, "ts")
    ex = np.flatnonzero((ints(beats, "exited", 0) == 1) & (ts <= now_ns) & (rank >= 0)
                        & (rank < world))
    ex = ex[np.lexsort((ts[ex], rank[ex]))]
    ranks, first = np.unique(rank[ex], return_index=True)  # per rank, its earliest row
    out[ranks] = ints(beats, "exit_status", -1)[ex[first]]
    return out


def _ends(beats: Columns | None, world: int, now_ns: int) -> np.ndarray:
    """int64 [world]: when each rank's process was first seen ended (its earliest exit row by
    `now_ns`), int64 max for a rank without one."""
    never = np.iinfo(np.int64).max
    ends = np.full(world, never, dtype=np.int64)
    if not beats or "exited" not in beats:
        return ends
    rank, ts = ints(beats, "rank"), ints(beats, "ts")
    ex = (ints(beats, "exited", 0) == 1) & (ts <= now_ns) & (rank >= 0) & (rank < world)
    np.minimum.at(ends, rank[ex], ts[ex])
    return ends


def _ints_of(v: object) -> list[int]:
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else []


def analyze(w: Window, now_ns: int) -> Conclusion | None:
    ops = w.get("ops")
    if not ops:
        return None
    ended = process_exit(w, now_ns)
    if ended is not None:
        return ended
    grid = w.grid
    stuck_ns = max(int(1.5 * w.step_ns), SECOND)
    gap = int(1.5 * w.beat_interval_ns())
    alg2 = analyze_hang(ops, grid, now_ns, chunks=w.get("chunks") or None,
                        beats=w.get("beats") or None, flows=w.get("flows") or None,
                        config=HangConfig(stuck_ns=stuck_ns, death_gap_ns=gap),
                        last_seen=w.last_seen(now_ns))
    if not alg2:
        return None
    dead = _dead_ranks(w, now_ns, gap)
    if dead.size and dead.size <= max(1, grid.world // 10):
        return _death(w, dead, alg2)
    try:
        halt = halt_point(ops, grid, w.spec, now_ns, stuck_ns=stuck_ns)
    except (ValueError, IndexError):
        halt = []
    min_op = [f for f in alg2 if f.rule == "mycroft.alg2.min_op"]
    if min_op and _catching_up(w, now_ns, stuck_ns, min_op):
        return None  # a stall the job recovered from: `analyze_past_stall` names it
    if min_op:
        return _min_op(w, now_ns, min_op, halt, alg2)
    cycle = next((f for f in alg2 if f.rule == "mycroft.alg2.deadlock"), None)
    if cycle is not None:
        desync = _desync(w, now_ns, stuck_ns, cycle, alg2)
        if desync is not None:
            return desync
    incomplete = _incomplete_flows(w, now_ns, stuck_ns)
    blamed = [f for f in alg2 if f.culprit_ranks]
    if not blamed:
        blamed = [p for f in alg2 if "no_counter_evidence" in f.labels
                  for p in [_p2p_stall(w, now_ns, f)] if p is not None]
    if blamed:
        return _min_data(blamed, halt, incomplete, grid.world)
    if incomplete:
        f = incomplete[0]
        return Conclusion("hang", f.culprit_ranks, "dp_allreduce", "nic_rdma", 0.6,
                          onset_ns=f.onset_ns, labels=("flow_incomplete",),
                          findings=(*incomplete, *alg2),
                          summaries=((f.rule, "a flow of the rank never completed"),))
    return None


def _catching_up(w: Window, now_ns: int, stuck_ns: int, min_op: list[Finding]) -> bool:
    """Whether every rank the min-op findings blame is moving again after a stall of the whole
    job (`past_stall`) that ended by `now_ns`: each completed a call since the stall's end,
    the newest less than `stuck_ns` ago. Read in the moments after a stall ends, the ranks that
    stalled are finishing their interrupted step while their peers still wait in the next
    collective for them: Alg. 2 blames them all for not having reached it (a pipeline replica
    catching up after its rank 5 recovered was named [0, 1, 4, 5], stage "fwd mb=4 pp=0", at
    0.95 — a broker's failover had delayed the analysis past the recovery). They are late, not
    hung; the stall is the one to name, and `analyze_past_stall` does. A rank blamed that has
    not moved for `stuck_ns` is hung again, and a job without a recovered stall (a rank
    looping on calls its peers never join) is judged as always."""
    gap = past_stall(w)
    if gap is None or gap[1] > now_ns:
        return False
    ops = w.get("ops")
    t_end, rank = ints(ops, "t_end"), ints(ops, "rank")
    blamed = distinct(np.array([r for f in min_op for r in f.culprit_ranks], dtype=np.int64))
    # each blamed rank's newest completion since the stall's end: one pass over the ops
    sel = (t_end >= gap[1]) & (t_end <= now_ns) & np.isin(rank, blamed)
    newest = np.full(blamed.size, -1, dtype=np.int64)
    np.maximum.at(newest, np.searchsorted(blamed, rank[sel]), t_end[sel])
    return bool(np.all((newest >= 0) & (now_ns - newest < stuck_ns)))


def _desync(w: Window, now_ns: int, stuck_ns: int, cycle: Finding, alg2: list[Finding]
            ) -> Conclusion | None:
    """A deadlock cycle where some ranks entered a collective most of its members never reach:
    each stuck op of the cycle's ranks is scored by the share of its communicator's members
    that reached it; when one op holds at most half its members and less than every other op
    of the cycle, its ranks left the program order the others follow (a collective the peers
    skip, or a different communicator than theirs) — they are the cause, the rest wait for them.
    Beside one peer (a 2-rank group) both sides hold half their members; then the side inside a
    collective on a communicator that has never completed one is the one that left (a real
    pipeline stage's rank entering an all-reduce on a copy of its DP group was named with its
    whole pipeline).
    Mycroft Alg. 2 reports a cycle as a deadlock of all its ranks; the arrival shares are our
    refinement: a desync has a minority side, a true ordering deadlock (two halves issuing two
    collectives in opposite order) has none and stays a deadlock."""
    from diagnosis.rules.last_logs import last_logs
    from diagnosis.rules.mycroft_hang import op_stage

    ops = w.get("ops")
    ll = last_logs(ops, now_ns, stuck_ns)
    cyc = np.isin(ll.rank, np.asarray(cycle.culprit_ranks, dtype=np.int64)) & ll.stuck
    ops_of: dict[tuple[str, int], list[int]] = {}
    for i in np.flatnonzero(cyc):
        ops_of.setdefault((str(ll.comm_id[i]), int(ll.op_seq[i])), []).append(int(ll.rank[i]))
    if len(ops_of) < 2:
        return None
    share: dict[tuple[str, int], float] = {}
    for (c, seq) in ops_of:
        here = np.flatnonzero(ll.comm_id.astype(str) == c)
        members = np.asarray(w.grid.comm_members.get(c, np.unique(ll.rank[here])), dtype=np.int64)
        arrived = np.unique(ll.rank[here][ll.op_seq[here] >= seq])
        share[(c, seq)] = np.isin(members, arrived).sum() / max(members.size, 1)
    least = min(share.values())
    lows = [k for k in share if share[k] == least]
    if least > 0.5:
        return None
    if len(lows) > 1:
        # a tie (two 2-member groups each half arrived): the side that left the program
        # order is the one inside a collective on a communicator that never completed one
        done = ints(ops, "t_end")
        finished = {str(c) for c in np.unique(col(ops, "comm_id")[(done > 0) & (done <= now_ns)])}
        fresh = [k for k in lows if k[0] not in finished]
        if len(fresh) != 1:
            return None
        lows = fresh
    low = lows[0]
    ranks = tuple(sorted(ops_of[low]))
    c, seq = low
    row = next(i for i in np.flatnonzero(cyc) if str(ll.comm_id[i]) == c
               and int(ll.op_seq[i]) == seq)
    stage = op_stage(w.grid, c, str(ll.op[row]))
    f = Finding(rule="rankwatch.collective_desync", culprit_ranks=ranks, stage=stage,
                component="host_software", score=1.0, kind="hang",
                labels=("deadlock_cycle", "collective_desync"),
                evidence={"comm_id": c, "op_seq": seq, "op": str(ll.op[row]),
                          "arrived_share": round(share[low], 3),
                          "others": {f"{k[0]}#{k[1]}": round(v, 3) for k, v in share.items()
                                     if k != low}})
    peers = sorted(set(cycle.culprit_ranks) - set(ranks))
    return Conclusion("hang", ranks, stage, "host_software", 0.75, onset_ns=cycle.onset_ns,
                      stages=(stage,), labels=f.labels, findings=(f, *alg2),
                      summaries=((f.rule, f"rank(s) {list(ranks)[:8]} sit in {ll.op[row]} "
                                  f"#{seq} on {c}, which {share[low]:.0%} of its members "
                                  f"reached; ranks {peers[:8]} wait in collectives those "
                                  "ranks never join: the program order diverged there"),))


def _incomplete_flows(w: Window, now_ns: int, stuck_ns: int) -> list[Finding]:
    """Table 3's "flow_incomplete" findings (only the min-data and no-culprit paths use them:
    a min-op culprit is named by the ops alone, so its hang does not pay for the flow scan)."""
    flows = w.get("flows")
    if not flows:
        return []
    return [f for f in slow_flows(flows, now_ns, FlowConfig(stuck_ns=stuck_ns))
            if "flow_incomplete" in f.labels]


def _dead_ranks(w: Window, now_ns: int, gap: int) -> np.ndarray:
    """Ranks whose records (ops, beats) stopped: last one older than `gap` before now and
    before the median rank's last record (Mycroft #1: the culprit "stops earlier")"""
    seen = w.last_seen(now_ns)
    if not w.get("beats") or not (seen > 0).any():
        return np.zeros(0, dtype=np.int64)
    med = int(np.median(seen[seen > 0]))
    return np.flatnonzero((seen > 0) & (now_ns - seen > gap) & (med - seen > gap))


def _death(w: Window, dead: np.ndarray, alg2: list[Finding]) -> Conclusion:
    ranks = tuple(int(r) for r in dead)
    f = Finding(rule="mycroft.alg2.records_stopped", culprit_ranks=ranks, stage="process",
                component="host_software", score=1.0, kind="hang",
                labels=("records_stopped", "process_death"),
                evidence={"ranks": list(ranks)[:32]})
    return Conclusion("hang", ranks, "process", "host_software", 0.9, stages=("process",),
                      labels=("records_stopped", "process_death"), findings=(f, *alg2[:2]),
                      summaries=((f.rule, f"rank(s) {list(ranks)[:8]} stopped sending records "
                                  "(ops and heartbeats) while their peers wait: the process is "
                                  "gone, not hung"),))


#: the most a hang conclusion says whose culprit has not beaten since the wait began
ALIVE_UNJUDGED_CONFIDENCE = 0.75


def _beat_unseen(w: Window, rank: int, since_ns: int | None) -> bool:
    """Whether the job's beats (when it has any) hold none of `rank` after `since_ns`."""
    beats = w.get("beats")
    if not beats or since_ns is None:
        return False
    return not bool(((ints(beats, "rank") == rank) & (ints(beats, "ts") > since_ns)).any())


def _min_op(w: Window, now_ns: int, min_op: list[Finding], halt: list[Finding],
            alg2: list[Finding]) -> Conclusion:
    top = min_op[0]
    x = top.culprit_ranks[0]
    dead = "records_stopped" in top.labels
    hp = next((h for h in halt if x in h.culprit_ranks), None)
    stage: str | None
    comp: Component | None
    if dead:
        stage, comp = "process", "host_software"
        alt = hp.stage if hp else normalize_stage(top.stage)
        conf = 0.9
    elif "no_records" in top.labels:  # nothing of the culprit is stored: name it, no more
        stage, comp, alt, conf = normalize_stage(top.stage), None, None, 0.3
    else:
        stage = hp.stage if hp and hp.stage else normalize_stage(top.stage)
        comp = hp.component if hp else top.component
        k = int(hp.evidence.get("step", -1)) if hp else -1  # type: ignore[call-overload]
        if k < 0:  # the step the waiting ranks' own calls name, else the schedule's guess
            k = _waiters_step(w, top, now_ns)
        if k < 0:
            try:
                k = hung_step(w.get("ops"), w.grid, w.spec)
            except (ValueError, IndexError):
                k = -1
        between = _between_steps(w, x, k, now_ns)
        inside = _inside_stage(w, x, k, now_ns)
        if inside is not None and (" mb=" in inside[0] or not (
                hp is not None and hp.stage
                and hp.stage.split(" ")[0] == inside[0].split(" ")[0])):
            # where the rank says it is beats where the schedule guesses it is; a halt point
            # of the same pass is kept when the rank's calls do not name the microbatch
            alt = stage
            stage, comp = inside
        elif between is not None and (hp is None or "min_tp_calls" in hp.labels
                                      or "no_tp_calls_in_pass" in hp.labels
                                      or hp.stage in ("between_steps", "data")):
            alt = stage
            stage, comp = between, "data_loader" if between == "data" else "gpu_compute"
        else:
            alt = normalize_stage(top.stage)
        # the stage is known when the rank says where it is (in a pipeline: with the pass's
        # microbatch from its own calls), or a pipeline's halt point places it; a data-parallel
        # job's "halt point" is the schedule's guess (no 1F1B to place it)
        placed = hp is not None and w.grid.pp > 1 and (inside is None or stage == hp.stage) \
            and not {"ambiguous_fwd_bwd", "data_or_fwd"} & set(hp.labels)
        observed = inside is not None and stage == inside[0] and (
            (w.grid.pp <= 1 and not _sends_p2p(w, x)) or " mb=" in inside[0]
            or not inside[0].startswith(("fwd", "bwd")))
        conf = 0.95 if placed or observed else 0.75
    # alive is known once the culprit beat after its peers began to wait; before that a killed
    # process and a hung one look alike (a rank killed in its step leaves the same calls in
    # flight as one hung there, and its exit beat may be stored a second later)
    unjudged = not dead and "no_records" not in top.labels and _beat_unseen(w, x, top.onset_ns)
    if unjudged:
        conf = min(conf, ALIVE_UNJUDGED_CONFIDENCE)
    ranks = tuple(sorted({int(r) for f in min_op for r in f.culprit_ranks}))
    labels = tuple(dict.fromkeys((*top.labels, *(hp.labels if hp else ()),
                                  *(("alive_unjudged",) if unjudged else ()))))
    summ = [(top.rule, f"rank {x} never reached the op its peers wait in "
             f"({top.evidence.get('waited_in')}); {top.evidence.get('ranks_waiting')} ranks wait"
             + ("; its records stopped (process gone)" if dead else
                "; none of its records is stored yet" if "no_records" in top.labels else
                "; no beat of it since the wait began: alive or gone is not known yet"
                if unjudged else "; it is alive (beats)"))]
    if hp is not None:
        summ.append((hp.rule, f"halt point {hp.evidence.get('node')} in replica "
                     f"{hp.evidence.get('replica')}, step {hp.evidence.get('step')}"))
    stages = tuple(s for s in dict.fromkeys((stage, alt)) if s)
    return Conclusion("hang", ranks, stage, comp, conf, onset_ns=top.onset_ns, stages=stages,
                      labels=labels, findings=(*min_op, *([hp] if hp else []),
                                               *[f for f in alg2 if f not in min_op]),
                      summaries=tuple(summ))


def _p2p_stall(w: Window, now_ns: int, f: Finding) -> Finding | None:
    """A Recv stuck while its sender posted the matching Send: Table 4 on the *sender's*
    counters of that transfer (p2p op_seq is per rank, so the pair is found by peer, not by
    op_seq): posts lagging staged data (1 > 2) → the sender's NIC; completions lagging posts
    (2 > 3) → the receiver's side does not complete (its NIC or link)."""
    ops, ch = w.get("ops"), w.get("chunks")
    if not ops or not ch:
        return None
    names, op = codes(col(ops, "op", "AllReduce"))
    t_end, enq = ints(ops, "t_end"), ints(ops, "t_enqueue")
    in_op = np.asarray(f.evidence.get("ranks_in_op", []), dtype=np.int64)
    recv = np.flatnonzero((names.astype(str) == "Recv")[op] & ((t_end == 0) | (t_end > now_ns))
                          & (enq <= now_ns) & np.isin(ints(ops, "rank"), in_op))
    if recv.size == 0:
        return None
    peer = ints(ops, "peer", -1)
    # the senders' chunk rows up to now, sorted by (sender, comm, ts, row): one binary search
    # per Recv
    cuniq, ccode = codes(col(ch, "comm_id"))
    cts, crank = ints(ch, "ts"), ints(ch, "rank")
    upto = np.flatnonzero((cts <= now_ns) & np.isin(crank, peer[recv]))
    order = upto[np.lexsort((upto, cts[upto], ccode[upto], crank[upto]))]
    skey = np.stack([crank[order], ccode[order]], axis=1)
    code_of = {str(c): i for i, c in enumerate(cuniq.tolist())}
    for i in recv.tolist():
        r, s, c = int(ops["rank"][i]), int(peer[i]), str(ops["comm_id"][i])
        j = code_of.get(c)
        if s < 0 or j is None:
            continue
        lo, hi = _segment(skey, s, j)
        ts = cts[order[lo:hi]]
        a, b = lo + int(np.searchsorted(ts, enq[i])), hi
        if a >= b:
            continue
        # the newest snapshot, the first row among equal times (as argmax in row order)
        last = int(order[lo + int(np.searchsorted(ts, ts[b - 1 - lo]))])
        g, t, d = (int(ints(ch, k)[last]) for k in ("gpu_ready", "rdma_transmitted",
                                                     "rdma_done"))
        if t > d:
            x, why = r, "the sender's RDMA posts are not completed: the receiver does not complete"
        elif g > t:
            x, why = s, "the sender's NIC does not post staged data"
        else:
            continue
        return Finding(rule="mycroft.table4.p2p", culprit_ranks=(x,), stage=f.stage,
                       component="nic_rdma", score=0.8, kind="hang",
                       labels=("min_data", "p2p_pair", "remote" if x == r else "local"),
                       evidence={"receiver": r, "sender": s, "comm_id": c,
                                 "sender_counters": [g, t, d], "states": [why]})
    return None


def _segment(skey: np.ndarray, rank: int, comm: int) -> tuple[int, int]:
    """[lo, hi) of the rows of (rank, comm) in `skey` (rows sorted by rank, then comm)."""
    lo = int(np.searchsorted(skey[:, 0], rank, side="left"))
    hi = int(np.searchsorted(skey[:, 0], rank, side="right"))
    sub = skey[lo:hi, 1]
    return lo + int(np.searchsorted(sub, comm, side="left")), \
        lo + int(np.searchsorted(sub, comm, side="right"))


#: a hang conclusion naming more than this share of the job's ranks has not narrowed the cause
#: down: a suspect set, not a culprit, said with at most `WIDE_CONFIDENCE`
WIDE_SHARE = 0.5
WIDE_CONFIDENCE = 0.5


def _min_data(blamed: list[Finding], halt: list[Finding],
              incomplete: list[Finding], world: int) -> Conclusion:
    """The hang named by the findings that blame ranks (chunk counters, flows, an Alg. 2
    cycle). One that names most of the job — a deadlock cycle through every rank, the moment
    before the one rank whose records stopped can be told dead (a simulated 64-rank job's
    first version named all 64 at 0.85) — has not found the rank to look at: its confidence
    is capped at `WIDE_CONFIDENCE`, labelled `culprit_not_narrowed`."""
    top = blamed[0]
    stage = normalize_stage(top.stage) or "dp_allreduce"
    ranks = top.culprit_ranks
    comp = top.component
    conf = 0.85 if "no_counter_evidence" not in top.labels else 0.3
    if incomplete and set(incomplete[0].culprit_ranks) & set(ranks):
        conf = min(1.0, conf + 0.1)
    labels = top.labels
    if len(ranks) > 1 and len(ranks) > WIDE_SHARE * world:
        conf = min(conf, WIDE_CONFIDENCE)
        labels = (*labels, "culprit_not_narrowed")
    summ = [(top.rule, f"all members sit in the same stalled op; chunk counters "
             f"{top.evidence.get('states')} blame rank(s) {list(ranks)}")]
    alt = [h.stage for h in halt if h.stage]
    if comp == "nic_rdma" and stage != "dp_allreduce":
        # convention: a NIC culprit's stage is the network-bound phase it carries, the DP ring
        # (also stalled behind it); the first stalled op (often a PP transfer) comes second
        alt = [stage, *alt]
        stage = "dp_allreduce"
    return Conclusion("hang", ranks, stage, comp, conf, onset_ns=top.onset_ns,
                      stages=tuple(dict.fromkeys([stage, *[a for a in alt if a]]))[:3],
                      labels=labels, findings=(*blamed, *halt, *incomplete),
                      summaries=tuple(summ))


def past_stall(w: Window) -> tuple[int, int] | None:
    """The longest gap between consecutive op completions in the window, if it is a stall
    (≥ max(3 s, 4 × step time)): (start, end) ns."""
    return w.completion_gap(max(3 * SECOND, int(4 * w.step_ns)))


def stalled_steps(w: Window) -> np.ndarray:
    """Steps (ascending) whose `stages` record on some rank overlaps the window's recovered
    stall (`past_stall`); empty when there is none. A recovered stall is a transient hang
    (`analyze_past_stall`): per-step excess measured over these steps is that hang again, so a
    slowdown analysis that wants what remains leaves them out."""
    gap = past_stall(w)
    st = w.get("stages")
    if gap is None or not st:
        return np.zeros(0, dtype=np.int64)
    a, b = gap
    start = ints(st, "t_start")
    end = start + sum(ints(st, c, 0) for c in ("data_next_wait", "model_fwd_loss",
                                                "model_backward", "callbacks", "optim_step",
                                                "step_other"))
    return distinct(ints(st, "step")[(start < b) & (end > a)])


def analyze_past_stall(w: Window, now_ns: int) -> Conclusion | None:
    """A stall that already recovered, analysed as of 3/4 into it (the records then in flight
    are the ones that ended after that moment): a transient hang."""
    gap = past_stall(w)
    if gap is None:
        return None
    a, b = gap
    c = analyze(w, a + (b - a) * 3 // 4)
    if c is None:
        return None
    from dataclasses import replace
    summaries = (*c.summaries, ("rankwatch.past_stall", f"the job stalled "
                                f"{(b - a) / 1e9:.1f} s and recovered"))
    held = _stall_stage(w, c.ranks, a, b)
    if held is not None:
        summaries = (*summaries, ("rankwatch.stall_stage", f"the culprit's own stage record of "
                                  f"the stalled step shows {held[1]:.1f} s in {held[0]}"))
    return replace(c, labels=(*c.labels, "transient", "recovered"), summaries=summaries)


def stuck_ranks(w: Window, now_ns: int) -> np.ndarray:
    """Ranks with an op in flight for longer than the hang threshold (for resolution checks)."""
    ops = w.get("ops")
    if not ops:
        return np.zeros(0, dtype=np.int64)
    t_end, enq = ints(ops, "t_end"), ints(ops, "t_enqueue")
    # an end after now_ns was not there yet (a window read at a past moment holds later rows)
    stuck = ((t_end == 0) | (t_end > now_ns)) & (enq <= now_ns) & (
        now_ns - enq > max(int(1.5 * w.step_ns), SECOND))
    return distinct(ints(ops, "rank")[stuck])
