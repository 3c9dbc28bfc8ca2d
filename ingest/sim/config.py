"""Simulator configuration: one frozen dataclass of job shape, timing model and record options."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ingest.sim.realism import RealismParams, validate
from ingest.sim.topology import Layout

EPOCH_NS = 1_700_000_000_000_000_000  # default job start (fixed, so runs are reproducible)


@dataclass(frozen=True)
class JobConfig:
    """Defaults give steps of ~0.7 s: 8 microbatches on 4 PP stages of 20 ms forward and 40 ms
    backward each, then a DP AllReduce of 256 MiB over 25 GB/s NICs."""

    job_id: str = "sim-job"
    seed: int = 0
    tp: int = 2
    pp: int = 4
    dp: int = 8
    ep: int = 1
    ranks_per_host: int = 8
    microbatches: int = 8
    steps: int = 200
    # compute model, per microbatch pass on one stage (ms)
    fwd_ms: float = 20.0
    bwd_ms: float = 40.0
    data_ms: float = 8.0
    optim_ms: float = 25.0
    callbacks_ms: float = 3.0
    other_ms: float = 4.0
    noise_sigma: float = 0.03  # log-normal sigma of every duration
    spike_p: float = 0.002  # probability a compute pass spikes (normal jitter)
    spike_factor: float = 2.0
    # communication model
    tp_collectives: int = 2  # TP AllReduces per forward/backward pass
    tp_mib: float = 8.0
    act_mib: float = 16.0  # PP activation / gradient per microbatch
    grad_mib: float = 256.0  # DP AllReduce per rank
    nic_gbps: float = 25.0  # GB/s per NIC
    nvlink_gbps: float = 150.0
    reduce_gbps: float = 400.0  # GPU reduction/copy bandwidth of a slice
    nic_lat_us: float = 8.0
    nvlink_lat_us: float = 2.0
    slices: int = 2  # pipelined slices per ring step
    window: int = 8  # outstanding slices per connection (NCCL_STEPS)
    channels: int = 2
    # clocks and records
    clock_skew_ms: float = 3.0  # per-host clock offsets are uniform in +-clock_skew_ms
    epoch_ns: int = EPOCH_NS
    chunk_interval_ms: float = 100.0
    wr_interval_ms: float = 200.0
    beat_interval_s: float = 1.0
    kernel_every: int = 1  # emit kernel events every k-th step (1 = all)
    hang_tail_s: float = 30.0  # simulated time recorded after the job stalls for good
    batch_rows: int = 32768  # rows per record batch (~0.3-1 MiB encoded)
    #: producers the hosts' spread kinds (ingest/keys.py) are published as: host % uploaders
    #: (1: one producer for the whole job, as one uploader would)
    uploaders: int = 1
    # realism (ingest/sim/realism.py; all off by default: the clean model above)
    tail_p: float = 0.0  # probability per rank and phase of a heavy-tailed (Lomax) slowdown
    tail_alpha: float = 1.7  # its Pareto shape (smaller: heavier tail)
    tail_scale: float = 0.25  # slowdown = 1 + tail_scale * Lomax(tail_alpha)
    os_pause_rate: float = 0.0  # OS-noise pauses per second of a phase's run time, each ...
    os_pause_min_ms: float = 2.0  # ... log-uniform between these
    os_pause_max_ms: float = 40.0
    core_group: int = 1  # consecutive ranks sharing cores (1: none)
    core_sigma: float = 0.0  # log-normal sigma of a core group's common per-step slowdown
    core_quantum_ms: float = 0.0  # a pass waits k quanta for its turn on the group's cores
    ring_sigma: float = 0.0  # per-communicator transfer speed, log-normal, drawn once per run
    xfer_sigma: float = 0.0  # per-call transfer-time noise, log-normal
    kernels: bool = True  # emit kernel records (False: a CPU job, ops and stages only)
    declared_shape: bool = True  # False: topology as traced without RANKWATCH_TP/PP/DP/...

    def __post_init__(self) -> None:
        positive = ("microbatches", "steps", "tp_collectives", "slices", "window", "channels",
                    "kernel_every", "batch_rows", "uploaders")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("fwd_ms", "bwd_ms", "nic_gbps", "nvlink_gbps", "reduce_gbps",
                     "chunk_interval_ms", "wr_interval_ms", "beat_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        Layout(self.tp, self.pp, self.dp, self.ep, self.ranks_per_host)
        validate(self.realism)

    @property
    def realism(self) -> RealismParams:
        return RealismParams(**{f.name: getattr(self, f.name) for f in fields(RealismParams)})

    @property
    def layout(self) -> Layout:
        return Layout(self.tp, self.pp, self.dp, self.ep, self.ranks_per_host)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def with_(self, **changes: Any) -> JobConfig:
        return replace(self, **changes)

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]
