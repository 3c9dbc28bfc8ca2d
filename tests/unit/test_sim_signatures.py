"""Each fault family leaves its signature in the records, on the faulty rank(s) only; no-fault
runs are clean; the same seed gives the same batches; batches decode with the contract."""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
import pytest

from ingest.sim.config import JobConfig
from ingest.sim.simulation import Simulation, collect

#: every test simulates whole 64-rank jobs (seconds each): not in `make test-unit`
pytestmark = pytest.mark.slow

T2 = {"tp": 2, "pp": 4, "dp": 8}  # 64 ranks
T8 = {"tp": 8, "pp": 2, "dp": 4}  # 64 ranks, every DP/PP hop over a NIC
SEEDS = (1, 2, 3)
Tables = dict[str, dict[str, np.ndarray]]


@cache
def run(spec: str | None, seed: int = 1, steps: int = 25, layout: str = "t2",
        **extra: Any) -> tuple[Tables, Simulation]:
    shape: dict[str, Any] = dict(T8 if layout == "t8" else T2)
    cfg = JobConfig(steps=steps, seed=seed, hang_tail_s=5.0, **shape, **extra)
    sim = Simulation(cfg, [spec] if spec else [])
    return collect(sim.batches()), sim


def after(t: Tables, kind: str, col: str, at_s: float) -> np.ndarray:
    return np.asarray(t[kind][col] > JobConfig().epoch_ns + int(at_s * 1e9))


def is_dp(t: Tables) -> np.ndarray:
    return np.char.startswith(t["chunks"]["comm_id"].astype(str), "dp")


def per_rank_mean(ranks: np.ndarray, values: np.ndarray, world: int = 64) -> np.ndarray:
    n = np.bincount(ranks, minlength=world)
    return np.bincount(ranks, weights=values, minlength=world) / np.maximum(n, 1)


def kernel_ratio(t: Tables, name: str, at_s: float, q: float = 50) -> np.ndarray:
    """Per rank: q-th percentile of kernel `name` durations after `at_s`, over the median rank."""
    k = t["kernels"]
    m = (k["kernel"] == name) & after(t, "kernels", "t_start", at_s)
    per = np.array([np.percentile(k["duration"][m & (k["rank"] == r)], q) for r in range(64)])
    return np.asarray(per / np.median(per))


def dp_duration(t: Tables, comm_id: str, at_s: float = 6) -> float:
    ops = t["ops"]
    m = (ops["comm_id"] == comm_id) & after(t, "ops", "t_start", at_s)
    return float(np.median((ops["t_end"] - ops["t_start"])[m]))


# ------------------------------------------------------------------ clean runs


@pytest.mark.parametrize("seed", SEEDS)
def test_no_fault_run_is_clean(seed: int) -> None:
    t, sim = run(None, seed)
    ops, ch = t["ops"], t["chunks"]
    assert (ops["t_end"] > 0).all() and (ops["t_end"] >= ops["t_start"]).all()
    assert (ops["t_start"] >= ops["t_enqueue"]).all()
    assert sim.stalled_at is None and sim.steps_done == 25 and sim.truth == []
    assert (ch["gpu_ready"] <= ch["total_chunks"]).all()
    send = (ch["gpu_ready"] >= ch["rdma_transmitted"]) & (ch["rdma_transmitted"] >=
                                                           ch["rdma_done"])
    assert send.all()
    assert set(np.unique(t["stages"]["rank"])) == set(range(64))
    assert len(np.unique(t["stages"]["step"])) == 25
    # op_seq per (rank, comm) is 0..n-1 without gaps
    key = ops["rank"].astype(np.int64) * 1000 + np.unique(ops["comm_id"], return_inverse=True)[1]
    for k in np.unique(key)[:20]:
        seqs = np.sort(ops["op_seq"][key == k])
        assert (seqs == np.arange(len(seqs))).all()
    # step times realistic and stable: a few hundred ms, no rank stands out
    st = t["stages"]
    total = sum(st[c] for c in ("data_next_wait", "model_fwd_loss", "model_backward",
                                "callbacks", "optim_step", "step_other"))
    assert 0.3e9 < np.median(total) < 3e9
    assert kernel_ratio(t, "flash_fwd_kernel", 0).max() < 1.15


def test_same_seed_same_batches_and_different_seed_differs() -> None:
    cfg = JobConfig(steps=5, seed=11, tp=2, pp=4, dp=8)
    a = [d for _, _, d in Simulation(cfg, ["gpu_slow rank=3 factor=1.5"]).batches()]
    b = [d for _, _, d in Simulation(cfg, ["gpu_slow rank=3 factor=1.5"]).batches()]
    c = [d for _, _, d in Simulation(cfg.with_(seed=12), ["gpu_slow rank=3 factor=1.5"]).batches()]
    assert a == b and a != c


def test_batches_decode_with_the_contract_and_stay_in_size() -> None:
    from ingest.batch import decode_batch

    sim = Simulation(JobConfig(steps=4, tp=2, pp=4, dp=8))
    kinds = set()
    for _, kind, data in sim.batches():
        b = decode_batch(data)
        assert b.kind == kind and len(data) < 8 << 20
        kinds.add(kind)
    assert kinds == {"jobs", "ops", "flows", "chunks", "stages", "kernels", "wr", "beats"}


def test_clock_offsets_differ_per_host_within_skew() -> None:
    _, sim = run(None)
    off = sim.clock.offset
    assert len(set(off.tolist())) == len(off) and np.abs(off).max() <= 3e6


# ------------------------------------------------------------------ hangs and death


@pytest.mark.parametrize("seed", SEEDS)
def test_hang_faulty_rank_stops_peers_wait_in_collective(seed: int) -> None:
    t, sim = run("hang rank=13 stage=bwd mb=3 at=8s", seed)
    ops = t["ops"]
    assert sim.stalled_at is not None and sim.truth[0].stage == "bwd mb=3 pp=0"
    tp = ops["comm_id"] == "tp:pp0:dp6"  # rank 13's TP group: ranks 12, 13
    last13 = ops["op_seq"][tp & (ops["rank"] == 13)].max()
    last12 = ops["op_seq"][tp & (ops["rank"] == 12)].max()
    assert last12 == last13 + 1  # the peer entered a call the hung rank never started
    stuck = ops["t_end"] == 0
    assert not (stuck & (ops["rank"] == 13) & tp).any()
    assert (stuck & (ops["rank"] == 12) & tp).any()
    # the peer's stuck op keeps being snapshotted, mid-flight
    ch = t["chunks"]
    snap = (ch["rank"] == 12) & (ch["comm_id"] == "tp:pp0:dp6") & (ch["op_seq"] == last12)
    assert snap.sum() >= 10 and (ch["rdma_done"][snap] < ch["total_chunks"][snap]).all()
    # heartbeats continue after the stall, and show the hung rank behind
    beats = t["beats"]
    b13 = beats["last_op_seq"][(beats["rank"] == 13) & (beats["comm_id"] == "tp:pp0:dp6")]
    b12 = beats["last_op_seq"][(beats["rank"] == 12) & (beats["comm_id"] == "tp:pp0:dp6")]
    assert b12[-1] == b13[-1] + 1


def test_process_death_stops_records() -> None:
    t, sim = run("death rank=27 at=6s")
    death_ns = JobConfig().epoch_ns + 6_000_000_000 + 3_000_000
    for kind, col in (("beats", "ts"), ("ops", "t_start"), ("kernels", "t_start")):
        rows = t[kind]
        assert rows[col][rows["rank"] == 27].max() < death_ns
        assert rows[col][rows["rank"] == 26].max() > death_ns
    assert sim.truth[0].component == "software"


# ------------------------------------------------------------------ network


@pytest.mark.parametrize("seed", SEEDS)
def test_nic_bandwidth_limit_transmitted_lags_ready_on_that_rank(seed: int) -> None:
    t, _ = run("nic_bw rank=7 factor=0.2 at=5s", seed, layout="t8")
    ch = t["chunks"]
    m = is_dp(t) & after(t, "chunks", "ts", 6)
    lag = per_rank_mean(ch["rank"][m], (ch["gpu_ready"] - ch["rdma_transmitted"])[m])
    group = [7, 15, 23, 31]  # rank 7's DP ring
    others = [lag[r] for r in group if r != 7]
    assert lag[7] > 1.5 * max(others)
    base, _ = run(None, seed, layout="t8")
    assert dp_duration(t, "dp:pp0:tp7") > 2 * dp_duration(base, "dp:pp0:tp7")


@pytest.mark.parametrize("seed", SEEDS)
def test_receiver_failure_sender_not_delivered_receiver_all_equal(seed: int) -> None:
    t, sim = run("recv_fail rank=25 at=5s", seed, layout="t8")
    assert sim.stalled_at is not None
    ch = t["chunks"]
    last = ch["ts"] >= ch["ts"].max() - 2_000_000_000
    pp = last & (ch["comm_id"] == "pp:dp3:tp1")  # rank 25 (pp0) and its pp1 peer, rank 57
    sender, recv = pp & (ch["rank"] == 57), pp & (ch["rank"] == 25)
    assert sender.any() and recv.any()
    assert (ch["rdma_transmitted"][sender] > ch["rdma_done"][sender]).any()  # its Send
    assert (ch["gpu_ready"][recv] == ch["rdma_transmitted"][recv]).all()
    assert (ch["rdma_transmitted"][recv] == ch["rdma_done"][recv]).all()


def test_nic_down_faulty_rank_not_transmitted() -> None:
    t, sim = run("nic_down rank=9 at=5s", layout="t8")
    assert sim.stalled_at is not None and sim.truth[0].component == "nic"
    ch = t["chunks"]
    last = ch["ts"] >= ch["ts"].max() - 2_000_000_000
    me = last & (ch["rank"] == 9)
    stuck_sends = me & (ch["gpu_ready"] > ch["rdma_transmitted"])
    assert stuck_sends.any() and not (me & (ch["rdma_transmitted"] > ch["rdma_done"])).any()
    up = last & (ch["rank"] == 41) & (ch["comm_id"] == "pp:dp1:tp1")  # sends into the dead NIC
    assert (ch["rdma_transmitted"][up] > ch["rdma_done"][up]).any()  # its Send; its Recv waits


def test_background_traffic_done_lags_transmitted_on_that_host() -> None:
    t, _ = run("bg_traffic host=1 factor=6 at=5s", layout="t8")
    ch = t["chunks"]
    m = is_dp(t) & after(t, "chunks", "ts", 6)
    lag = per_rank_mean(ch["rank"][m], (ch["rdma_transmitted"] - ch["rdma_done"])[m])
    assert lag[8:16].min() > 3 * max(np.delete(lag, range(8, 16)).max(), 0.2)


# ------------------------------------------------------------------ device and host


@pytest.mark.parametrize("seed", SEEDS)
def test_gpu_slow_kernels_slow_on_that_rank_only(seed: int) -> None:
    t, sim = run("gpu_slow rank=19 factor=1.5 at=5s", seed)
    r = kernel_ratio(t, "flash_fwd_kernel", 6)
    assert r[19] > 1.35 and np.delete(r, 19).max() < 1.15
    assert sim.truth[0].component == "gpu"


def test_pcie_downgrade_slows_comm_not_kernels() -> None:
    t, _ = run("pcie rank=20 factor=0.1 at=5s", layout="t8")
    assert kernel_ratio(t, "flash_fwd_kernel", 6).max() < 1.15
    ch = t["chunks"]
    m = is_dp(t) & after(t, "chunks", "ts", 6) & (ch["rank"] == 20)
    assert m.sum() > 0 and (ch["rdma_transmitted"][m] >= ch["rdma_done"][m]).all()
    base, _ = run(None, layout="t8")
    assert dp_duration(t, "dp:pp0:tp4") > 1.5 * dp_duration(base, "dp:pp0:tp4")


def test_single_kernel_degradation_hits_one_kernel_name() -> None:
    t, _ = run("kernel_slow rank=12 kernel=attn factor=3 at=5s")
    assert kernel_ratio(t, "flash_fwd_kernel", 6)[12] > 2.5
    gemm = kernel_ratio(t, "vectorized_elementwise_kernel", 6)
    assert gemm.max() < 1.15


def test_ecc_jitter_puts_a_tail_on_gemm_of_that_rank() -> None:
    t, _ = run("ecc_jitter rank=33 p=0.1 factor=8 at=5s")
    name = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"
    p99 = kernel_ratio(t, name, 6, q=99)
    assert p99[33] > 3 and np.delete(p99, 33).max() < 2.6
    assert kernel_ratio(t, name, 6, q=50)[33] < 1.15  # intermittent: the median is normal


def test_host_contention_slows_every_rank_of_the_host() -> None:
    t, sim = run("host_compute host=3 factor=1.5 at=5s")
    r = kernel_ratio(t, "flash_fwd_kernel", 6)
    assert r[24:32].min() > 1.35 and np.delete(r, range(24, 32)).max() < 1.15
    assert sim.truth[0].ranks == list(range(24, 32))


def test_cpu_contention_slows_cpu_stages_not_kernels() -> None:
    t, _ = run("cpu_contention host=2 factor=4 at=5s")
    st = t["stages"]
    late = after(t, "stages", "t_start", 6)
    cb = per_rank_mean(st["rank"][late], st["callbacks"][late])
    assert cb[16:24].min() > 3 * np.delete(cb, range(16, 24)).max()
    assert kernel_ratio(t, "flash_fwd_kernel", 6).max() < 1.15


def test_data_stall_and_tail_show_in_data_next_wait() -> None:
    t, sim = run("data_stall rank=3 delay=2s at=5s")
    st = t["stages"]
    big = st["data_next_wait"] > 1e9
    assert set(st["rank"][big]) == {3} and big.sum() == 1
    assert sim.truth[0].component == "dataloader" and sim.truth[0].stage == "data"
    t, _ = run("data_tail rank=10 p=0.4 delay=150ms at=5s")
    st = t["stages"]
    tail = st["data_next_wait"] > 100e6
    assert set(st["rank"][tail]) == {10} and tail.sum() >= 4


def test_callback_spike_is_periodic_on_that_rank() -> None:
    t, _ = run("callback_spike rank=0 every=5 delay=400ms")
    st = t["stages"]
    spikes = st["callbacks"] > 300e6
    assert set(st["rank"][spikes]) == {0}
    assert set(st["step"][spikes]) == {0, 5, 10, 15, 20}


def test_proxy_delay_makes_some_collectives_start_late_on_the_wire() -> None:
    t, base = run("proxy_delay rank=30 p=0.3 delay=500ms at=2s", layout="t8")
    ops = t["ops"]
    dp = np.char.startswith(ops["comm_id"].astype(str), "dp:pp0:tp6")
    dur = (ops["t_end"] - ops["t_start"])[dp]
    assert (dur > 450e6).sum() >= 4  # peers wait for the sleeping proxy
    assert base.truth[0].component == "software"


def test_small_delay_absorbed_by_the_pipeline_bubble() -> None:
    spec = "hang rank=0 stage=fwd mb=2 at=5s for=12ms expect=no"
    t, sim = run(spec, noise_sigma=0.0, spike_p=0.0)
    b, _ = run(None, noise_sigma=0.0, spike_p=0.0)
    last_start = [tb["stages"]["t_start"][tb["stages"]["step"] == 24].max() for tb in (t, b)]
    assert abs(int(last_start[0]) - int(last_start[1])) < 1e6  # under 1 ms: fully absorbed
    assert sim.truth[0].expect_diagnosis is False


def test_wr_samples_flat_bytes_and_stuck_inflight_when_nic_down() -> None:
    t, _ = run("nic_down rank=9 at=5s", layout="t8")
    wr = t["wr"]
    me = wr["rank"] == 9
    last = wr["ts"] >= wr["ts"].max() - 3_000_000_000
    assert len(np.unique(wr["bytes_done"][me & last])) == 1
    ok = run(None, layout="t8")[0]["wr"]
    assert np.diff(ok["bytes_done"][ok["rank"] == 9]).max() > 0


@pytest.mark.slow
def test_4096_rank_smoke() -> None:
    cfg = JobConfig(tp=8, pp=8, dp=64, steps=2, kernel_every=2, hang_tail_s=2.0)
    sim = Simulation(cfg, ["hang rank=3001 stage=fwd mb=1 at=1s"])
    kinds: dict[str, int] = {}
    for _, kind, data in sim.batches():
        kinds[kind] = kinds.get(kind, 0) + 1
        assert len(data) < 64 << 20
    assert kinds["ops"] > 0 and sim.truth[0].ranks == [3001]
