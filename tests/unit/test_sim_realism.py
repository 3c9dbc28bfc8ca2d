"""Simulator realism: the noise models as distributions (seeded, with tolerances a wrong model
fails), and what they do to a run — the clean model untouched when off, uneven DP rings, stage
times that contain waiting, no kernels for a CPU job."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from ingest.batch import decode_batch
from ingest.sim import realism as R
from ingest.sim.config import JobConfig
from ingest.sim.engine import Engine, StepResult
from ingest.sim.faults import FaultSet, parse_fault
from ingest.sim.scenario import load_catalog
from ingest.sim.simulation import Simulation, collect

N = 200_000


def rng(seed: int = 1) -> np.random.Generator:
    return np.random.default_rng(seed)


# ---------------------------------------------------------------- pure noise models


def test_heavy_tail_hit_rate_and_pareto_exponent() -> None:
    p, alpha, scale = 0.1, 1.7, 0.25
    f = R.heavy_tail(rng(), (N,), p, alpha, scale)
    hit = f > 1.0
    # hit rate: binomial, 5 standard errors
    assert abs(hit.mean() - p) < 5 * np.sqrt(p * (1 - p) / N)
    x = (f[hit] - 1.0) / scale  # Lomax(alpha) samples
    # maximum-likelihood alpha of a Lomax with unit scale: n / sum(log(1 + x))
    a_hat = x.size / np.log1p(x).sum()
    assert a_hat == pytest.approx(alpha, rel=0.03)
    # the survival function at a few points, against (1 + x)^-alpha
    for q in (0.5, 2.0, 10.0):
        assert (x > q).mean() == pytest.approx((1 + q) ** -alpha, rel=0.08)
    # a heavy tail: a log-normal of the same median and IQR has no sample this far out
    assert np.quantile(f, 0.9999) > 1 + scale * 50


def test_heavy_tail_off_is_exactly_one() -> None:
    assert np.all(R.heavy_tail(rng(), (1000,), 0.0, 1.7, 0.25) == 1.0)


def test_os_pauses_arrive_with_run_time_and_are_log_uniform() -> None:
    rate, lo, hi = 2.0, 2.0, 40.0
    for d in (0.005, 0.05):  # a phase ten times longer is hit about ten times more often
        s = R.os_pauses(rng(2), np.full(N, d), rate, lo, hi)
        p = -np.expm1(-rate * d)
        assert abs((s > 0).mean() - p) < 5 * np.sqrt(p * (1 - p) / N)
    s = R.os_pauses(rng(2), np.full(N, 0.05), rate, lo, hi)
    ms = s[s > 0] * 1e3
    assert ms.min() >= lo and ms.max() <= hi
    u = (np.log(ms) - np.log(lo)) / (np.log(hi) - np.log(lo))
    assert stats.kstest(u, "uniform").pvalue > 0.01
    # the same test rejects pauses uniform in linear ms: it can tell the two apart
    lin = rng(3).uniform(lo, hi, ms.size)
    u_lin = (np.log(lin) - np.log(lo)) / (np.log(hi) - np.log(lo))
    assert stats.kstest(u_lin, "uniform").pvalue < 1e-6
    assert np.all(R.os_pauses(rng(4), np.full(100, 1.0), 0.0, lo, hi) == 0.0)


def test_core_groups_are_consecutive_ranks() -> None:
    assert R.core_groups(np.arange(8), 4).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert R.core_groups(np.arange(4), 1).tolist() == [0, 1, 2, 3]


def test_group_factor_is_shared_within_a_group_and_log_normal() -> None:
    groups = R.core_groups(np.arange(4 * 20_000), 4)
    f = R.group_factor(rng(4), groups, 0.2)
    by_group = f.reshape(-1, 4)
    assert np.all(by_group == by_group[:, :1])  # members slow down together
    logs = np.log(by_group[:, 0])
    assert logs.std() == pytest.approx(0.2, rel=0.03)
    assert stats.kstest(logs / 0.2, "norm").pvalue > 0.01


def test_interleave_gives_each_group_member_one_turn() -> None:
    groups = np.array([0, 0, 0, 5, 5, 9])
    turns = np.array([R.interleave(rng(s), groups, 1e-3) for s in range(3000)])
    for g in (0, 5, 9):
        m = groups == g
        per_draw = np.sort(turns[:, m], axis=1)
        assert np.allclose(per_draw, np.arange(m.sum()) * 1e-3)  # a permutation of turns
    # every member of group 0 is first, second and third about equally often
    first = (turns[:, :3] == 0).mean(axis=0)
    assert np.allclose(first, 1 / 3, atol=0.04)


def test_comm_speed_and_lognormal_have_median_one_and_sigma() -> None:
    c = R.comm_speed(rng(5), N, 0.3)
    assert np.median(c) == pytest.approx(1.0, abs=0.01)
    assert np.log(c).std() == pytest.approx(0.3, rel=0.02)
    x = R.lognormal(rng(6), (N,), 0.15)
    assert np.log(x).std() == pytest.approx(0.15, rel=0.02)


def test_bad_realism_values_say_what_is_expected() -> None:
    with pytest.raises(ValueError, match=r"tail_p=1\.5: expected a probability"):
        JobConfig(tail_p=1.5)
    with pytest.raises(ValueError, match=r"os_pause_max_ms=1\.0: expected >= os_pause_min_ms"):
        JobConfig(os_pause_rate=1.0, os_pause_max_ms=1.0)
    with pytest.raises(ValueError, match="realism='loud'"):
        from ingest.sim.scenario import _scenario
        _scenario("x", {"realism": "loud"}, {})


# ---------------------------------------------------------------- effects on a run

PP2DP2 = JobConfig(tp=1, pp=2, dp=2, microbatches=4, steps=40, seed=3, fwd_ms=4.0, bwd_ms=8.0,
                   data_ms=2.0, optim_ms=3.0, grad_mib=8.0, act_mib=1.0, nvlink_gbps=1.5,
                   nvlink_lat_us=50.0)


def _steps(cfg: JobConfig, faults: tuple[str, ...] = (), n: int | None = None
           ) -> list[StepResult]:
    eng = Engine(cfg, FaultSet.resolve([parse_fault(f) for f in faults], cfg.layout))
    return [eng.step(i) for i in range(n or cfg.steps)]


def test_realism_off_draws_exactly_the_clean_model() -> None:
    """Realism has its own random streams: turning on only the communicator effects leaves every
    compute draw of the clean model as it was."""
    clean = _steps(PP2DP2, n=5)
    comm = _steps(PP2DP2.with_(ring_sigma=0.3, xfer_sigma=0.1), n=5)
    assert np.array_equal(clean[0].stages["data_next_wait"], comm[0].stages["data_next_wait"])
    for a, b in zip(clean[0].segments, comm[0].segments, strict=True):
        assert np.array_equal(a.dur, b.dur)
    assert not np.array_equal(clean[0].end, comm[0].end)  # transfers did change


def _ring_transfer(res: list[StepResult], cfg: JobConfig) -> np.ndarray:
    """[steps, DP rings]: the shortest member time in each ring's all-reduce (the transfer time
    the diagnosis compares across rings)."""
    out = []
    for r in res:
        g = next(o for o in r.ops if o.comm == "dp")
        out.append((g.t_end - g.t_start).reshape(-1, cfg.dp).min(axis=1))
    return np.array(out)


def test_two_dp_rings_one_persistently_slower() -> None:
    cfg = PP2DP2.with_(ring_sigma=0.3, xfer_sigma=0.15)
    ratios = []
    for seed in range(12):
        m = _ring_transfer(_steps(cfg.with_(seed=seed)), cfg)
        ratios.append(m[:, 1].mean() / m[:, 0].mean())
        halves = m[:20].mean(axis=0), m[20:].mean(axis=0)
        if abs(np.log(ratios[-1])) > 0.2:  # the slower ring stays the slower one
            assert np.argmax(halves[0]) == np.argmax(halves[1])
    r = np.abs(np.log(ratios))
    assert (r > np.log(1.2)).sum() >= 4  # often 1.2x or more apart, as on real pp2 x dp2 runs
    clean = _ring_transfer(_steps(PP2DP2), PP2DP2)
    assert abs(np.log(clean[:, 1].mean() / clean[:, 0].mean())) < 0.05  # the clean model: equal


def test_backward_stage_contains_the_wait_for_a_slow_peer() -> None:
    """Rank 3's backward 4x slower: its DP peer (rank 1) and its upstream stage's rank (2)
    spend about as long in model_backward — waiting — while only rank 3's compute grew."""
    res = _steps(PP2DP2, ("stage_slow rank=3 stage=bwd factor=4",), 10)
    lay = PP2DP2.layout
    bwd = np.mean([r.stages["model_backward"] for r in res[2:]], axis=0)
    dev = np.mean([r.device for r in res[2:]], axis=0)
    pos = {rank: lay.position(rank) for rank in range(4)}  # (dp, pp, tp) by rank
    b = {rank: float(bwd[pos[rank][0], pos[rank][1], pos[rank][2]]) for rank in range(4)}
    d = {rank: float(dev[pos[rank][0], pos[rank][1], pos[rank][2]]) for rank in range(4)}
    assert d[3] > 2.5 * d[1]  # its own compute is the slow one ...
    assert b[1] == pytest.approx(b[3], rel=0.15)  # ... but its peer's backward looks the same
    assert b[2] > 2 * float(np.mean([r.stages["model_backward"] for r in
                                     _steps(PP2DP2, (), 10)[2:]], axis=0)[pos[2]])


def test_preset_gives_heavy_tailed_steps() -> None:
    """Quantile ratios (kurtosis would not do: the clean model's rare 2x spikes give it one)."""
    cfg = PP2DP2.with_(steps=150)
    def times(c: JobConfig) -> tuple[np.ndarray, np.ndarray]:
        res = _steps(c)
        passes = np.concatenate([s.dur for r in res for s in r.segments if s.kind == 1])
        return np.array([float(np.max(r.end - r.t0)) for r in res]), passes
    def tail(x: np.ndarray, q: float) -> float:
        return float(np.quantile(x, q) / np.median(x))
    (clean_steps, clean_pass), (steps, passes) = times(cfg), times(cfg.with_(**R.PRESETS["cpu"]))
    assert tail(clean_steps, 0.99) < 1.1 and tail(clean_pass, 0.99) < 1.2
    assert tail(steps, 0.9) > 1.1 and tail(steps, 0.99) > 1.3
    assert tail(passes, 0.99) > 1.6 and passes.max() / np.median(passes) > 5


def test_cpu_job_has_no_kernel_records() -> None:
    tables = collect(Simulation(PP2DP2.with_(steps=3, kernels=False)).batches())
    assert "kernels" not in tables and len(tables["stages"]["rank"]) == 12
    assert "kernels" in collect(Simulation(PP2DP2.with_(steps=3)).batches())


def test_stage_slow_spec_and_truth() -> None:
    f = parse_fault("stage_slow rank=3 stage=bwd factor=4 at=1s")
    assert f.stage_label(PP2DP2.layout) == "bwd pp=1"
    sim = Simulation(PP2DP2.with_(steps=20), ["stage_slow rank=0 stage=data factor=10 at=0.2s"])
    collect(sim.batches())
    (t,) = sim.truth
    assert t.stage == "data" and t.component == "dataloader" and t.ranks == [0]


# ---------------------------------------------------------------- catalogs


def test_realistic_catalog_is_realistic_and_standard_is_clean() -> None:
    real, std = load_catalog("realistic"), load_catalog("standard")
    assert not set(real) & set(std)
    assert all(sc.config.realism.on and not sc.config.kernels for sc in real.values())
    assert not any(sc.config.realism.on for sc in std.values())
    controls = [sc for sc in real.values() if "control" in sc.tags]
    shapes = {(sc.config.tp, sc.config.pp, sc.config.dp) for sc in controls}
    assert {(1, 2, 2), (1, 1, 4), (2, 2, 2), (1, 1, 8)} <= shapes
    assert len({sc.config.steps for sc in controls}) >= 2
    assert any(sc.faults for sc in real.values())


def test_undeclared_shape_publishes_what_a_tracer_without_the_shape_knows() -> None:
    tables = collect(Simulation(PP2DP2.with_(steps=3, declared_shape=False)).batches())
    topo = tables["jobs"]["topology"][0]
    assert (topo.tp, topo.pp, topo.dp, topo.microbatches, topo.schedule) == (1, 1, 4, 1, "none")
    comms = {c.comm_id: c for c in topo.communicators}
    assert comms.pop("world").members == [0, 1, 2, 3]
    assert all(c.kind == "dp" and c.comm_id.startswith("pg") and len(c.members) == 2
               for c in comms.values())
    # the records name the same groups; the PP pairs (0,2), (1,3) are among them, unnamed
    assert set(np.unique(tables["ops"]["comm_id"]).tolist()) == set(comms)
    assert {tuple(c.members) for c in comms.values()} == {(0, 2), (1, 3), (0, 1), (2, 3)}


def test_undeclared_shape_is_then_published_as_the_agent_infers_it() -> None:
    """Like the host agent of rank 0 (ingest.agent.shape, topology.build), the simulator reads
    the pipeline from the point-to-point calls of rank 0's host and, at the next beat after
    them, publishes the topology with the inferred shape — the sizes and microbatches the job
    runs, each marked "inferred"."""
    cfg = PP2DP2.with_(steps=30, declared_shape=False)
    sim = Simulation(cfg)
    jobs = [(release, data) for release, kind, data in sim.batches() if kind == "jobs"]
    assert len(jobs) == 2 and jobs[0][0] == 0.0 and jobs[1][0] >= 1.0, [j[0] for j in jobs]
    topo = decode_batch(jobs[1][1]).topologies[0]
    assert (topo.tp, topo.pp, topo.dp, topo.microbatches, topo.schedule) == (
        1, 2, 2, cfg.microbatches, "1f1b")
    assert {topo.shape_source[k] for k in ("tp", "pp", "dp", "microbatches")} == {"inferred"}
    # the agent sees its own host's rings only: rank 0's host (ranks 0, 1: stage 0) shows the
    # links to stage 1, not the chains' far ends — a 4-stage pipeline over hosts is not inferred
    spread = Simulation(cfg.with_(pp=4, ranks_per_host=2))
    assert [k for _, k, _ in spread.batches()].count("jobs") == 1
