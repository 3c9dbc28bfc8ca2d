"""diagnosis.slow.context.demand_rose: a rank's starvation that came with new demand on its host.

The tracer records in every stage record the host's CPU pressure over the step
(`cpu_pressure_ns`, Linux PSI's `some` time). A rank whose CPU wait rose while its host's
pressure rose with it, by enough to account for the rise, has a cause — something new wants
the host's CPUs — and is named after the usual `onset_steps` of its change. One whose wait rose
while the host's pressure could have risen and did not is the scheduler moving the waiting
between the host's tasks: no verdict. Where the counter is missing, or the host's pressure was
saturated before (no room to rise), the change is held as before (`CPU_HOLD` onsets)."""

from __future__ import annotations

import numpy as np

from diagnosis.slow import SlowConfig, context, cpu, peer_stages
from diagnosis.slow.context import Ctx, judged_steps
from diagnosis.window import Window
from ingest.records import Communicator, JobTopology
from ingest.units import MILLISECOND as MS

STEPS = 50


def job(onset: int, wait_ms: float = 20.0, pressure: tuple[float, float] | None = (0.3, 0.9),
        n_steps: int = STEPS, seed: int = 0, pressure_from: int | None = None) -> Ctx:
    """4 DDP ranks, steps of ~60 ms started 70 ms apart; from step `onset` rank 1's thread
    waits `wait_ms` more a step and its step (the job's too: its peers wait for it in the
    all-reduce) is that much longer. Every rank's CPU wait scatters by ~1 ms a step. The host's
    CPU pressure is (before, from `pressure_from`, default the onset) a share of each step's
    time, scattered by 0.05; None: the records lack the counter (-1)."""
    rng = np.random.default_rng(seed)
    since = onset if pressure_from is None else pressure_from
    rows = []
    for s in range(n_steps):
        late = s >= onset
        total = int(60 * MS + rng.normal(0, 1.0) * MS + (wait_ms * MS if late else 0))
        for r in range(4):
            wait = abs(rng.normal(2.0, 1.0)) * MS + (wait_ms * MS if r == 1 and late else 0)
            if pressure is None:
                psi = -1
            else:
                share = (pressure[1] if s >= since else pressure[0]) + rng.normal(0, 0.05)
                psi = int(min(max(share, 0.0), 1.0) * total)
            rows.append((r, s, s * 70 * MS, total, int(wait), psi))
    names = ("rank", "step", "t_start", "model_backward", "sched_wait_ns", "cpu_pressure_ns")
    stages = {k: np.array(x, dtype=np.int64) for k, x in zip(names, zip(*rows, strict=True),
                                                             strict=True)}
    z = np.zeros(stages["rank"].size, np.int64)
    stages.update(data_next_wait=z, model_fwd_loss=z, callbacks=z, optim_step=z, step_other=z)
    topo = JobTopology(job_id="j", ts=0, world_size=4, dp=4, hosts=["h"] * 4,
                       communicators=[Communicator(comm_id="world", kind="dp",
                                                   members=[0, 1, 2, 3])])
    w = Window(topo, {"stages": stages}, 0, n_steps * 70 * MS)
    cfg = SlowConfig()
    steps, step_ns, job_step = judged_steps(w, cfg)
    return Ctx(w, cfg, steps, step_ns, peer_stages(w), 0, job_step)


def named(c: Ctx) -> list[tuple[tuple[int, ...], str | None]]:
    return [(s.ranks, s.stage) for s in cpu.suspects(c)]


def test_a_wait_rise_with_new_demand_on_the_host_is_named_after_the_onset() -> None:
    """Six steps of rank 1 waiting 20 ms more while the host's pressure went 0.3 → 0.9 of each
    step: named. Without the counter, or on a host whose pressure was saturated before, six
    steps are no verdict — a change of the wait holds `CPU_HOLD` onsets (12) — and 13 are.
    Where the pressure could have risen and stayed flat, the scheduler moved the waiting:
    no verdict however long it holds."""
    onset = STEPS - 6
    assert named(job(onset)) == [((1,), "host cpu")]
    assert context.CPU_HOLD * SlowConfig().onset_steps > 6
    for unknown in (None, (0.95, 0.95)):
        assert named(job(onset, pressure=unknown)) == []
        assert named(job(STEPS - 13, pressure=unknown)) == [((1,), "host cpu")]
    assert named(job(onset, pressure=(0.3, 0.3))) == []
    assert named(job(STEPS - 13, pressure=(0.3, 0.3))) == []
    assert not context.pressure_could_rise(job(onset, pressure=None), 1, 6)
    assert not context.pressure_could_rise(job(onset, pressure=(0.95, 0.95)), 1, 6)
    assert context.pressure_could_rise(job(onset, pressure=(0.3, 0.3)), 1, 6)


def test_new_demand_must_account_for_half_the_rise() -> None:
    """A pressure rise of 0.3 → 0.5 of a ~80 ms step is ~16 ms: at least half of a 20 ms rise,
    not of a 60 ms one. And a longer step at the same share is no rise: the pressure is judged
    as a share of the step's time, not in ns (a contended host's steady pressure would rise
    with any slowdown)."""
    onset = STEPS - 8
    c = job(onset, pressure=(0.3, 0.5))
    since = STEPS - onset
    assert context.demand_rose(c, 1, since, 20 * MS)
    assert not context.demand_rose(c, 1, since, 60 * MS)
    steady = job(onset, pressure=(0.6, 0.6))  # steps 20 ms longer: 12 ms more pressure in ns
    assert not context.demand_rose(steady, 1, since, 20 * MS)


def test_a_pressure_rise_that_is_not_at_the_onset_is_no_new_demand() -> None:
    """The host's pressure rose 20 steps before rank 1's wait did: over the change's steps it
    is where it has been for a while, not a rise (the baseline has both levels)."""
    onset = STEPS - 6
    c = job(onset, pressure_from=onset - 20)
    assert not context.demand_rose(c, 1, STEPS - onset, 20 * MS)
    assert named(c) == []
    # at the onset it is
    assert context.demand_rose(job(onset), 1, STEPS - onset, 20 * MS)


def test_too_few_steps_give_no_verdict() -> None:
    """Fewer than `onset_steps` steps since, or `min_baseline` before: no judgement."""
    c = job(STEPS - 6)
    cfg = SlowConfig()
    assert not context.demand_rose(c, 1, cfg.onset_steps - 1, 20 * MS)
    assert not context.demand_rose(c, 1, c.steps.size - cfg.min_baseline + 1, 20 * MS)
    assert not context.demand_rose(c, 1, 0, 20 * MS)
    assert not context.demand_rose(c, 7, 6, 20 * MS)  # no such rank


def test_a_starved_suspect_with_new_demand_is_relabelled_after_the_onset() -> None:
    """`refine_steps`: another analysis' suspect that its rank's CPU wait explains is held as
    the wait's change is — `onset_steps` where the host's pressure rose with it (8 steps
    here), `CPU_HOLD` onsets where it did not (None: no verdict yet)."""
    from dataclasses import replace

    from diagnosis.conclusion import Suspicion

    onset = STEPS - 8
    top = Suspicion((1,), "bwd pp=0", "gpu_compute", 18e6, ("rankwatch.excess.model_backward",),
                    "rank 1: model_backward 1.3x its peers", 9.0, "change", onset)
    out, judged = cpu.refine_steps(job(onset), top)
    assert judged and out is not None and out.stage == "host cpu"
    held, judged = cpu.refine_steps(job(onset, pressure=(0.3, 0.3)), top)
    assert judged and held is None
    assert cpu.refine_steps(job(onset, pressure=(0.3, 0.3)), replace(top, how="confirm"))[0] \
        is not None
