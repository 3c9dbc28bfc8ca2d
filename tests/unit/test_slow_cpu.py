"""diagnosis.slow.cpu: a culprit re-labelled as its host's CPU only when the scheduler's
counters in its beats say it waited for a CPU since the onset — more than before, more than
its peers."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from diagnosis.conclusion import Suspicion
from diagnosis.slow import cpu
from ingest.units import SECOND as S


def beats(share: dict[int, tuple[float, float]], comms: int = 2) -> dict[str, np.ndarray]:
    """4 ranks, a beat every 0.5 s for 20 s (one row per communicator, same counters); rank r
    waits share[r] = (before 10 s, after) of the wall time (default 5 %)."""
    ts = np.arange(0, 20 * S + 1, S // 2)
    rows: list[tuple[int, int, int]] = []
    for r in range(4):
        b, a = share.get(r, (0.05, 0.05))
        wait = np.where(ts < 10 * S, ts * b, 10 * S * b + (ts - 10 * S) * a).astype(np.int64)
        rows += [(r, int(t), int(w)) for t, w in zip(ts, wait, strict=True) for _ in range(comms)]
    rank, t, w = (np.array(x) for x in zip(*rows, strict=True))
    return {"rank": rank, "ts": t, "sched_wait_ns": w, "sched_run_ns": t - w}


TOP = Suspicion((1,), "data", "data_loader", 30e6, ("rankwatch.excess.data_next_wait",),
                "rank 1: data_next_wait 3x its peers", 9.0, "change", 40)


def test_a_rank_waiting_for_a_cpu_since_the_onset_is_its_hosts_cpu() -> None:
    out = cpu.refine(beats({1: (0.05, 0.6)}), TOP, 10 * S)
    assert (out.stage, out.component) == ("host cpu", "host_software")
    assert out.rules == (*TOP.rules, cpu.RULE) and "60%" in out.summary
    ranks, before, after = cpu.wait_shares(beats({1: (0.05, 0.6)}), 10 * S)
    assert ranks.tolist() == [0, 1, 2, 3]
    assert np.allclose(before, 0.05) and np.allclose(after, [0.05, 0.6, 0.05, 0.05])


def test_no_relabel_without_a_rise_against_peers_and_itself() -> None:
    # every rank starved alike (more runnable processes than cores): its work, not its CPU
    assert cpu.refine(beats({r: (0.05, 0.6) for r in range(4)}), TOP, 10 * S) == TOP
    # starved before the onset already: not what changed
    assert cpu.refine(beats({1: (0.6, 0.6)}), TOP, 10 * S) == TOP
    # a small rise
    assert cpu.refine(beats({1: (0.05, 0.15)}), TOP, 10 * S) == TOP
    # no counters (another pid namespace, an old agent), no onset, a host-level suspect
    unknown = beats({1: (0.05, 0.6)})
    unknown["sched_wait_ns"] = np.full(unknown["rank"].size, -1)
    assert cpu.refine(unknown, TOP, 10 * S) == TOP
    assert cpu.refine(beats({1: (0.05, 0.6)}), TOP, None) == TOP
    host = Suspicion((0, 1), "data", "data_loader", 30e6)
    assert cpu.refine(beats({1: (0.05, 0.6)}), host, 10 * S) == host


def test_a_host_whose_ranks_all_wait_for_a_cpu_is_its_cpu() -> None:
    """A suspect naming a host's ranks is its CPU when each of them was starved (the least
    starved one is judged), against the ranks outside it."""
    host = Suspicion((0, 1), "optim", "gpu_compute", 30e6, ("rankwatch.excess.optim_step",),
                     "ranks 0, 1: optim_step 2x their peers", 9.0, "change", 40)
    out = cpu.refine(beats({0: (0.05, 0.5), 1: (0.05, 0.6)}), host, 10 * S)
    assert (out.stage, out.component) == ("host cpu", "host_software")
    assert "each of ranks 0, 1" in out.summary and "50%" in out.summary
    assert cpu.refine(beats({0: (0.05, 0.08), 1: (0.05, 0.6)}), host, 10 * S) == host


def test_an_open_culprit_rechecked_is_judged_against_its_peers() -> None:
    """The re-check of an open culprit ("confirm") may judge steps that all lie after the onset:
    the rank was starved through its whole "before" too. Its peers are then the reference; a
    new verdict ("change") still needs its own rise."""
    starved = beats({1: (0.6, 0.6)})
    again = replace(TOP, how="confirm")
    assert cpu.refine(starved, TOP, 10 * S) == TOP
    assert cpu.refine(starved, again, 10 * S).stage == "host cpu"
    assert cpu.refine(beats({r: (0.6, 0.6) for r in range(4)}), again, 10 * S) == again


def test_the_baseline_is_the_judged_steps_not_the_start_up() -> None:
    """Every rank waited 75 % of the time for its first 6 s (processes starting on shared
    cores), then 5 %; from 10 s rank 1 waits 40 %. Judged from the start-up on, its baseline
    (about 0.47) hides the rise; judged from the first baseline step (7 s) it is starved."""
    ts = np.arange(0, 20 * S + 1, S // 2)
    rows: list[tuple[int, int, int]] = []
    for r in range(4):
        after = 0.4 if r == 1 else 0.05
        rate = np.where(ts < 6 * S, 0.75, np.where(ts < 10 * S, 0.05, after))
        wait = np.concatenate([[0], np.cumsum(rate[:-1] * np.diff(ts))]).astype(np.int64)
        rows += [(r, int(t), int(w)) for t, w in zip(ts, wait, strict=True)]
    rank, t, w = (np.array(x) for x in zip(*rows, strict=True))
    b = {"rank": rank, "ts": t, "sched_wait_ns": w, "sched_run_ns": t - w}
    assert cpu.refine(b, TOP, 10 * S) == TOP  # the start-up in the baseline
    out = cpu.refine(b, TOP, 10 * S, 7 * S)
    assert (out.stage, out.component) == ("host cpu", "host_software")
    _, before, _ = cpu.wait_shares(b, 10 * S, 7 * S)
    assert np.allclose(before, 0.05)
    # a baseline start before every beat: from the first beat, as without one
    assert cpu.refine(b, TOP, 10 * S, -S) == TOP


def test_with_the_step_time_the_extra_waiting_must_explain_the_excess() -> None:
    """TOP's excess is 30 ms a step. At 100 ms steps, waiting 20 % of the time where it and its
    peers waited 5 % costs 15 ms a step: half the excess, starved (a share the fixed 20 % floor
    alone would not have admitted at 19 %). At 100 ms steps a rise from 5 % to 15 % costs
    10 ms: a third of the excess, not its cause."""
    out = cpu.refine(beats({1: (0.05, 0.2)}), TOP, 10 * S, step_ns=100e6)
    assert (out.stage, out.component) == ("host cpu", "host_software")
    assert cpu.refine(beats({1: (0.05, 0.19)}), TOP, 10 * S) == TOP  # no step time: the floor
    assert cpu.refine(beats({1: (0.05, 0.15)}), TOP, 10 * S, step_ns=100e6) == TOP
    # a longer step makes the same shares a bigger cost
    assert cpu.refine(beats({1: (0.05, 0.16)}), TOP, 10 * S, step_ns=400e6).stage == "host cpu"
    # every rank starved alike is still no relabel, whatever the cost
    alike = beats({r: (0.05, 0.6) for r in range(4)})
    assert cpu.refine(alike, TOP, 10 * S, step_ns=400e6) == TOP


def test_a_culprit_with_one_beat_since_the_onset_has_its_cpu_unjudged() -> None:
    """With counters but a single beat since the onset, a starved CPU and slower work cannot be
    told apart yet; with two or more they can (refine decides); without counters there is
    nothing to wait for."""
    b = beats({})
    assert cpu.unjudged(b, TOP, 19_800_000_000)  # one beat (20 s) since the onset
    assert not cpu.unjudged(b, TOP, 10 * S)  # 21 beats since
    no_counters = {k: v for k, v in b.items() if k != "sched_wait_ns"}
    assert not cpu.unjudged(no_counters, TOP, 19_800_000_000)
    host = Suspicion((1, 2), "data", "data_loader", 30e6, (), "", 9.0, "change", 40)
    assert not cpu.unjudged(b, host, 19_800_000_000)  # a host-level suspect: refine skips it


def shares(per_interval: dict[int, np.ndarray], dt: int = S) -> dict[str, np.ndarray]:
    """Beats every `dt` from 0 s; rank r waits per_interval[r][i] of interval i."""
    rows: list[tuple[int, int, int]] = []
    for r, sh in per_interval.items():
        wait = np.concatenate([[0], np.cumsum(np.asarray(sh) * dt)]).astype(np.int64)
        rows += [(r, i * dt, int(w)) for i, w in enumerate(wait)]
    rank, t, w = (np.array(x) for x in zip(*rows, strict=True))
    return {"rank": rank, "ts": t, "sched_wait_ns": w, "sched_run_ns": t - w}


def test_the_rise_is_judged_against_the_shares_own_scatter() -> None:
    """A real job's numbers: rank 1 shares its core with two busy processes from 10 s and waits
    10-15 % of each second; its peers wait 3-7 %, as it did before. The rise (about 7 points)
    is several times the scatter (~2 points): its CPU, where a ratio of 2x its peers' share
    plus 5 % missed it by a point. The same mean rise among shares scattered 3x wider is
    noise."""
    rng = np.random.default_rng(7)

    def job(sd: float) -> dict[str, np.ndarray]:
        return shares({r: np.clip(np.concatenate([
            0.05 + sd * rng.standard_normal(10),
            (0.12 if r == 1 else 0.05) + sd * rng.standard_normal(10)]), 0, 1)
            for r in range(4)})

    small = replace(TOP, score=3e6)  # its excess: 3 ms of a 60 ms step
    out = cpu.refine(job(0.015), small, 10 * S, step_ns=60e6)
    assert (out.stage, out.component) == ("host cpu", "host_software")
    assert cpu.refine(job(0.045), small, 10 * S, step_ns=60e6) == small


def test_since_ends_with_the_judged_steps() -> None:
    """The job's end after the judged steps: every rank runnable as it tears down, and a
    counter that went back (a new process behind the rank) are not read as its share."""
    per = {r: np.asarray([0.05] * 10 + [0.6 if r == 1 else 0.05] * 8 + [0.55, 0.55])
           for r in range(4)}
    b = shares(per)
    b["sched_wait_ns"][(b["rank"] == 1) & (b["ts"] == 20 * S)] = 0  # a reset at the end
    _, _, after = cpu.wait_shares(b, 10 * S, until_ns=18 * S)
    assert np.allclose(after, [0.05, 0.6, 0.05, 0.05])
    _, _, whole = cpu.wait_shares(b, 10 * S)
    assert whole[0] > 0.1 and whole[1] < 0.6  # the end read in: the peers look starved too
    out = cpu.refine(b, TOP, 10 * S, until_ns=18 * S)
    assert out.stage == "host cpu" and "60%" in out.summary
