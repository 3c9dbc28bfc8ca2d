"""Turn active faults into per-step arrays over the rank grid [dp, pp, tp] for the engine.

A fault acts on a step when its window [at, end) overlaps the step's span. Multiplicative
effects compose (two slowdowns multiply); blocking effects (NIC down, receiver failure) become
(from, until) pairs: any post/completion at or after `from` waits until `until` (inf: forever).
Hangs and process death act on single passes and are kept as lists for the engine to match.
The fault model keeps the little state faults need (a one-shot stall that already fired) and
draws its randomness from the step's generator, so a run is a pure function of its seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ingest.sim import faults as F
from ingest.sim.config import JobConfig
from ingest.sim.faults import FaultSet

N_KERNEL_CLASSES = len(F.KERNEL_CLASSES)


@dataclass
class StepEffects:
    """Per-grid-position modifiers for one step. Shapes [dp, pp, tp] unless noted."""

    gpu: np.ndarray  # compute time multiplier
    kernel: np.ndarray  # [classes, dp, pp, tp] per-class kernel multiplier
    ecc_p: np.ndarray
    ecc_factor: np.ndarray
    cpu: np.ndarray  # CPU-side time multiplier
    data_extra: np.ndarray  # seconds added to data.next_wait
    cb_extra: np.ndarray  # seconds added to callbacks
    nic_bw: np.ndarray  # fraction of NIC bandwidth left
    lat: np.ndarray  # network latency multiplier
    pcie: np.ndarray  # fraction of PCIe bandwidth left
    block_from: np.ndarray  # NIC down: posts/receipts at or after this ...
    block_until: np.ndarray  # ... wait until this
    rblock_from: np.ndarray  # receiver failure: completions into the rank at or after this ...
    rblock_until: np.ndarray  # ... wait until this
    proxy_p: np.ndarray
    proxy_delay: np.ndarray
    stage_mult: np.ndarray  # [4, dp, pp, tp] time multiplier of data, fwd, bwd, optim
    any_stage: bool = False  # some stage_mult differs from 1
    any_block: bool = False
    any_proxy: bool = False
    hangs: list[tuple[int, F.Hang, np.ndarray]] = field(default_factory=list)


class FaultModel:
    """Stateful (one-shot faults) translator from a FaultSet to StepEffects."""

    def __init__(self, faults: FaultSet, cfg: JobConfig) -> None:
        self.faults = faults
        self.cfg = cfg
        layout = cfg.layout
        self.masks = [np.isin(layout.grid, t) for t in faults.targets]
        self.fired: set[int] = set()
        self.hang_fired: dict[int, np.ndarray] = {}
        shape = layout.grid.shape
        self.death = np.full(shape, math.inf)
        for i, f in enumerate(faults.faults):
            if isinstance(f, F.Death):
                self.death = np.where(self.masks[i], np.minimum(self.death, f.at), self.death)

    def step(self, step: int, t_lo: float, t_hi: float, rng: np.random.Generator) -> StepEffects:
        shape = self.cfg.layout.grid.shape
        ones, zeros = np.ones(shape), np.zeros(shape)
        inf = np.full(shape, math.inf)
        fx = StepEffects(
            gpu=ones.copy(), kernel=np.ones((N_KERNEL_CLASSES, *shape)), ecc_p=zeros.copy(),
            ecc_factor=ones.copy(), cpu=ones.copy(), data_extra=zeros.copy(),
            cb_extra=zeros.copy(), nic_bw=ones.copy(), lat=ones.copy(), pcie=ones.copy(),
            block_from=inf.copy(), block_until=-inf, rblock_from=inf.copy(), rblock_until=-inf,
            proxy_p=zeros.copy(), proxy_delay=zeros.copy(),
            stage_mult=np.ones((len(F.SLOW_STAGES), *shape)),
        )
        for i, f in enumerate(self.faults.faults):
            m = self.masks[i]
            if isinstance(f, F.Hang):
                fired = self.hang_fired.setdefault(i, np.zeros(shape, bool))
                fx.hangs.append((i, f, fired))
                continue
            if not (f.at < t_hi and f.end > t_lo):
                continue
            handler = _HANDLERS.get(type(f))
            if handler is not None:
                handler(self, i, f, m, fx, step, rng)
        return fx


def _mul(arr: np.ndarray, m: np.ndarray, factor: float) -> None:
    arr[m] *= factor


def _gpu(fm: FaultModel, i: int, f: F.Fault, m: np.ndarray, fx: StepEffects, step: int,
         rng: np.random.Generator) -> None:
    assert isinstance(f, F.GpuSlow)
    _mul(fx.gpu, m, f.factor)


def _kernel(fm: FaultModel, i: int, f: F.Fault, m: np.ndarray, fx: StepEffects, step: int,
            rng: np.random.Generator) -> None:
    assert isinstance(f, F.KernelSlow)
    _mul(fx.kernel[F.KERNEL_CLASSES.index(f.kernel)], m, f.factor)


def _ecc(fm: FaultModel, i: int, f: F.Fault, m: np.ndarray, fx: StepEffects, step: int,
         rng: np.random.Generator) -> None:
    assert isinstance(f, F.EccJitter)
    fx.ecc_p[m] = f.p
    fx.ecc_factor[m] = f.factor


def _cpu(fm: FaultModel, i: int, f: F.Fault, m: np.ndarray, fx: StepEffects, step: int,
         rng: np.random.Generator) -> None:
    assert isinstance(f, F.CpuContention)
    _mul(fx.cpu, m, f.factor)


def _data_stall(fm: FaultModel, i: int, f: F.Fault, m: np.ndarray, fx: StepEffects, step: int,
                rng: np.random.Generator) -> None:
    assert isinstance(f, F.DataStall)
    if isinstance(f, F.DataTail):
        hit = m & (rng.random(m.shape) < f.p)
        fx.data_extra[hit] += f.delay
    elif i not in fm.fired:
        fm.fired.add(i)
        fx.data_extra[m] += f.delay


def _callback(fm: FaultModel, i: int, f: F.Fault, m: np.ndarray, fx: StepEffects, step: int,
              rng: np.random.Generator) -> None:
    assert isinstance(f, F.CallbackSpike)
    if step % f.every == 0:
        fx.cb_extra[m] += f.delay


def _nic_bw(fm: FaultModel, i: int, f: F.Fault, m: np.ndarray, fx: StepEffects, step: int,
            rng: np.random.Generator) -> None:
    assert isinstance(f, F.NicBandwidth)
    _mul(fx.nic_bw, m, f.factor)


def _traffic(fm: FaultModel, i: int, f: F.Fault, m: np.ndarray, fx: StepEffects, step: int,
             rng: np.random.Generator) -> None:
    assert isinstance(f, F.BackgroundTraffic)
    _mul(fx.lat, m, f.factor)


def _pcie(fm: FaultModel, i: int, f: F.Fault, m: np.ndarray, fx: StepEffects, step: int,
          rng: np.random.Generator) -> None:
    assert isinstance(f, F.PcieDowngrade)
    _mul(fx.pcie, m, f.factor)


def _nic_down(fm: FaultModel, i: int, f: F.Fault, m: np.ndarray, fx: StepEffects, step: int,
              rng: np.random.Generator) -> None:
    fx.block_from[m] = np.minimum(fx.block_from[m], f.at)
    fx.block_until[m] = np.maximum(fx.block_until[m], f.end)
    fx.any_block = True


def _recv_fail(fm: FaultModel, i: int, f: F.Fault, m: np.ndarray, fx: StepEffects, step: int,
               rng: np.random.Generator) -> None:
    fx.rblock_from[m] = np.minimum(fx.rblock_from[m], f.at)
    fx.rblock_until[m] = np.maximum(fx.rblock_until[m], f.end)
    fx.any_block = True


def _proxy(fm: FaultModel, i: int, f: F.Fault, m: np.ndarray, fx: StepEffects, step: int,
           rng: np.random.Generator) -> None:
    assert isinstance(f, F.ProxyDelay)
    fx.proxy_p[m] = f.p
    fx.proxy_delay[m] = f.delay
    fx.any_proxy = True


def _stage_slow(fm: FaultModel, i: int, f: F.Fault, m: np.ndarray, fx: StepEffects, step: int,
                rng: np.random.Generator) -> None:
    assert isinstance(f, F.StageSlow)
    _mul(fx.stage_mult[F.SLOW_STAGES.index(f.stage)], m, f.factor)
    fx.any_stage = True


_HANDLERS = {
    F.GpuSlow: _gpu, F.HostCompute: _gpu, F.KernelSlow: _kernel, F.EccJitter: _ecc,
    F.CpuContention: _cpu, F.DataStall: _data_stall, F.DataTail: _data_stall,
    F.CallbackSpike: _callback, F.NicBandwidth: _nic_bw, F.BackgroundTraffic: _traffic,
    F.PcieDowngrade: _pcie, F.NicDown: _nic_down, F.ReceiverFailure: _recv_fail,
    F.ProxyDelay: _proxy, F.StageSlow: _stage_slow,
}
