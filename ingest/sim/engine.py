"""Step-by-step timing of a hybrid-parallel job: arrays over the rank grid [dp, pp, tp].

Per step and rank: data loading, then the stage's 1F1B passes in `schedule.global_order`, then
the DP gradient AllReduce, the optimizer, callbacks and a residual. A pass is

    Recv (from the previous stage for F, the next for B)  →  K compute segments, each followed
    by a TP AllReduce over the TP group  →  Send to the next (F) or previous (B) stage

A rank enters a collective when its compute is done and leaves when the ring says the op is
complete for it (`ring.ring_progress`), so a slow or hung rank stalls its TP group, then its PP
neighbours (their Recv waits), then every DP peer (the AllReduce cannot finish): Mycroft Fig. 2.
Sends do not block the sender; a Recv completes when the transfer does. Times are float seconds
since job start; `inf` is "never", which propagates through max and + so a hang spreads exactly
as far as the dependencies carry it. The loop runs over schedule slots, never over ranks.

Realism (ingest/sim/realism.py, off unless configured) acts through `_Real`: heavy-tailed and
core-group factors and OS pauses on every compute phase, turns on shared cores at each pass,
and per-communicator and per-call factors on every link's times. It draws from its own
generators, so with realism off a run is exactly the clean model's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ingest.sim import faults as F
from ingest.sim.comm import MIB, Transfer, p2p, ring_collective
from ingest.sim.config import JobConfig
from ingest.sim.effects import FaultModel, StepEffects
from ingest.sim.faults import FaultSet
from ingest.sim.realism import (
    comm_speed,
    core_groups,
    group_factor,
    heavy_tail,
    interleave,
    lognormal,
    os_pauses,
    run_rng,
    step_rng,
)
from ingest.sim.ring import RingResult
from ingest.sim.schedule import global_order

KERNEL_FRACTIONS = np.array([0.6, 0.25, 0.15])  # gemm, attn, elementwise share of a pass
PASS_F, PASS_B, PASS_OPT = 0, 1, 2


@dataclass
class OpGroup:
    """One call (collective or p2p) made by several ranks at once; arrays are per member."""

    comm: str  # "tp" | "pp" | "dp"
    op: str
    pos: np.ndarray  # flat grid positions
    seq: int  # op_seq on each member's communicator
    nbytes: int
    stream: int
    t_enqueue: np.ndarray
    t_start: np.ndarray
    t_end: np.ndarray
    step: int
    peer_pos: np.ndarray | None = None
    ring: RingResult | None = None  # event matrices [units, members]
    transfer: Transfer | None = None
    net: np.ndarray | None = None  # member's outgoing link crosses hosts


@dataclass
class Segment:
    """A compute segment (kernels on the compute stream) of one pass on every rank of a stage."""

    kind: int  # PASS_F / PASS_B / PASS_OPT
    index: int
    pos: np.ndarray
    start: np.ndarray
    dur: np.ndarray
    kmult: np.ndarray  # [classes, members] per-kernel-class multiplier


@dataclass
class StepResult:
    step: int
    t0: np.ndarray  # [dp, pp, tp] step start
    end: np.ndarray  # [dp, pp, tp] step end (inf: never finished)
    stages: dict[str, np.ndarray]  # six StageFrontier durations, seconds, [dp, pp, tp]
    device: np.ndarray
    ops: list[OpGroup] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    #: [dp, pp, tp] seconds each rank was runnable but waited for a CPU in this step (its
    #: CPU-side work stretched by host contention: the scheduler's account, as in the beats)
    sched_wait: np.ndarray | None = None

    @property
    def stalled(self) -> bool:
        return not np.isfinite(self.end).any()


class _Real:
    """The realism draws of a run (module docstring); every method returns a neutral value
    (1 / 0 / None) when its effect is off."""

    def __init__(self, cfg: JobConfig, grid: np.ndarray) -> None:
        self.p = p = cfg.realism
        self.compute = p.compute
        self.comm = p.comm
        self.cfg = cfg
        self.groups = core_groups(grid, p.core_group)  # [dp, pp, tp]
        self.rng = step_rng(cfg.seed, 0)
        self.gf = np.ones(grid.shape)
        shape = grid.shape
        if p.ring_sigma > 0:  # one factor per communicator, broadcast to its members
            r = run_rng(cfg.seed)
            dp_, pp_, tp_ = shape
            self.speed = {
                "dp": np.broadcast_to(comm_speed(r, pp_ * tp_, p.ring_sigma)
                                      .reshape(1, pp_, tp_), shape).copy(),
                "tp": np.broadcast_to(comm_speed(r, dp_ * pp_, p.ring_sigma)
                                      .reshape(dp_, pp_, 1), shape).copy(),
                "F": comm_speed(r, grid.size, p.ring_sigma).reshape(shape),  # PP link, up
                "B": comm_speed(r, grid.size, p.ring_sigma).reshape(shape),  # PP link, down
            }
        else:
            self.speed = {}

    def begin_step(self, step: int) -> None:
        p = self.p
        self.rng = step_rng(self.cfg.seed, step)
        if p.core_group > 1 and p.core_sigma > 0:
            self.gf = group_factor(self.rng, self.groups, p.core_sigma)

    def factor(self, shape: tuple[int, ...], sel: tuple[slice | int, ...] = ()) -> np.ndarray:
        """Heavy-tail × core-group factor of one phase on the grid positions `sel`."""
        p = self.p
        f = self.gf[sel] if sel else self.gf
        if p.tail_p > 0:
            f = f * heavy_tail(self.rng, shape, p.tail_p, p.tail_alpha, p.tail_scale)
        return np.asarray(f)

    def pause(self, dur: np.ndarray) -> np.ndarray | float:
        """OS-noise seconds added to phases lasting `dur`."""
        p = self.p
        if p.os_pause_rate <= 0:
            return 0.0
        return os_pauses(self.rng, dur, p.os_pause_rate, p.os_pause_min_ms, p.os_pause_max_ms)

    def turn(self, s: int) -> np.ndarray | float:
        """Seconds each rank of stage `s` waits for its turn on shared cores."""
        p = self.p
        if p.core_group <= 1 or p.core_quantum_ms <= 0:
            return 0.0
        g = self.groups[:, s, :]
        return interleave(self.rng, g.ravel(), p.core_quantum_ms / 1e3).reshape(g.shape)

    def link(self, kind: str, sel: tuple[slice | int, ...], shape: tuple[int, ...]
             ) -> np.ndarray | None:
        """Per-member link factor for one call: the communicator's speed × transfer noise."""
        p = self.p
        if not self.comm:
            return None
        f = self.speed[kind][sel].reshape(shape) if kind in self.speed else np.ones(shape)
        if p.xfer_sigma > 0:
            f = f * lognormal(self.rng, shape, p.xfer_sigma)
        return np.asarray(f)


class Engine:
    """Computes one StepResult per call; deterministic for (config, faults)."""

    def __init__(self, cfg: JobConfig, faults: FaultSet) -> None:
        self.cfg = cfg
        self.layout = cfg.layout
        self.shape = self.layout.grid.shape
        self.fm = FaultModel(faults, cfg)
        self.order = global_order(cfg.pp, cfg.microbatches)
        self.free = np.zeros(self.shape)
        self.host = self.layout.host_grid.ravel()
        self.posg = np.arange(self.layout.world).reshape(self.shape)
        self.seq = {k: [0] * cfg.pp for k in ("tp", "pp", "dp")}
        self.last_dur = (cfg.microbatches + cfg.pp - 1) * (cfg.fwd_ms + cfg.bwd_ms) / 1e3
        self.onsets: dict[int, float] = {}
        self.real = _Real(cfg, self.layout.grid)

    def _noise(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return np.exp(self.cfg.noise_sigma * rng.standard_normal(shape))

    def _stall(self, start: np.ndarray, dur: np.ndarray, s: int | None, label: str,
               fx: StepEffects) -> np.ndarray:
        """Apply process death and hangs of `label` to a phase starting at `start`."""
        death = self.fm.death if s is None else self.fm.death[:, s, :]
        dur = np.where(start >= death, math.inf, dur)
        for i, f, fired in fx.hangs:
            if f.stage != label.split()[0] or (f.stage in ("fwd", "bwd") and
                                               label != f"{f.stage} {f.mb}"):
                continue
            m = self.fm.masks[i] if s is None else self.fm.masks[i][:, s, :]
            fd = fired if s is None else fired[:, s, :]
            hit = m & ~fd & (start >= f.at)
            if hit.any():
                fd |= hit
                dur = np.where(hit, dur + (math.inf if f.duration is None else f.duration), dur)
                self.onsets.setdefault(i, float(start[hit].min()))
        return dur

    def step(self, step: int) -> StepResult:
        with np.errstate(invalid="ignore"):  # inf - inf of hung ranks: nan, never emitted
            return self._step(step)

    def _step(self, step: int) -> StepResult:
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, step])
        t0 = self.free.copy()
        fin = np.isfinite(t0)
        t_lo = float(t0[fin].min()) if fin.any() else math.inf
        fx = self.fm.step(step, t_lo, t_lo + self.last_dur, rng)
        res = StepResult(step, t0, t0, {}, np.zeros(self.shape))
        real = self.real
        real.begin_step(step)
        data = cfg.data_ms / 1e3 * self._noise(rng, self.shape) * fx.cpu + fx.data_extra
        data += cfg.data_ms / 1e3 * 0.25 * (1.0 / fx.pcie - 1.0)  # host-to-device copies
        if fx.any_stage:
            data = data * fx.stage_mult[0]
        if real.compute:
            data = data * real.factor(self.shape)
            data = data + real.pause(data)
        data = self._stall(t0, data, None, "data", fx)
        cur = t0 + data
        acc = {"F": np.zeros(self.shape), "B": np.zeros(self.shape)}
        pending: dict[tuple[int, str, int], tuple[np.ndarray, int]] = {}
        for s, kind, m in self.order:
            c = cur[:, s, :].copy()
            begin = c.copy()
            src = s - 1 if kind == "F" else s + 1
            if 0 <= src < cfg.pp:
                c = self._recv(res, fx, rng, step, src, s, kind, m, c, pending)
            c = self._pass(res, fx, rng, step, s, kind, m, c)
            dst = s + 1 if kind == "F" else s - 1
            if 0 <= dst < cfg.pp:
                pending[(dst, kind, m)] = (c.copy(), self.seq["pp"][s])  # send, issued now
                self.seq["pp"][s] += 1
            acc[kind][:, s, :] += c - begin
            cur[:, s, :] = c
        bwd_end = cur.copy()
        cur = self._dp_allreduce(res, fx, rng, step, cur)
        opt = cfg.optim_ms / 1e3 * self._noise(rng, self.shape) * (0.6 * fx.gpu + 0.4 * fx.cpu)
        if fx.any_stage:
            opt = opt * fx.stage_mult[3]
        if real.compute:
            opt = opt * real.factor(self.shape)
            opt = opt + real.pause(opt)
        opt = self._stall(cur, opt, None, "optim", fx)
        res.segments.append(Segment(PASS_OPT, 0, self.posg.ravel(), cur.ravel(), opt.ravel(),
                                    np.ones((1, self.layout.world))))
        res.device += opt
        cur = cur + opt
        cb = cfg.callbacks_ms / 1e3 * self._noise(rng, self.shape) * fx.cpu + fx.cb_extra
        if real.compute:
            cb = cb + real.pause(cb)
        other = cfg.other_ms / 1e3 * self._noise(rng, self.shape) * fx.cpu
        if real.compute:
            other = other + real.pause(other)
        end = cur + cb + other
        res.end = end
        # CPU-side work stretched by a factor f was runnable and waiting (f - 1) / f of it;
        # the optimizer's CPU share as in `opt` above
        starved = 1.0 - 1.0 / fx.cpu
        res.sched_wait = (data + 0.4 * opt + cb + other) * starved
        res.stages = {
            "data_next_wait": data, "model_fwd_loss": acc["F"],
            "model_backward": acc["B"] + (cur - opt - bwd_end), "callbacks": cb,
            "optim_step": opt, "step_other": other,
        }
        fin = np.isfinite(end) & np.isfinite(t0)
        if fin.any():
            self.last_dur = float(np.median(end[fin] - t0[fin]))
        self.free = end
        return res

    def _recv(self, res: StepResult, fx: StepEffects, rng: np.random.Generator, step: int,
              src: int, s: int, kind: str, m: int, c: np.ndarray,
              pending: dict[tuple[int, str, int], tuple[np.ndarray, int]]) -> np.ndarray:
        send_start, send_seq = pending.pop((s, kind, m))
        spos, rpos = self.posg[:, src, :].ravel(), self.posg[:, s, :].ravel()
        nbytes = int(self.cfg.act_mib * MIB)
        slow = self.real.link(kind, (slice(None), src, slice(None)), spos.shape)
        tr = p2p(self.cfg, fx, self.host, spos, rpos, send_start.ravel(), c.ravel(),
                 nbytes, rng, slow)
        lead = 20e-6
        res.ops.append(OpGroup("pp", "Send", spos, send_seq, nbytes, 2,
                               send_start.ravel() - lead, send_start.ravel(), tr.done, step,
                               peer_pos=rpos, transfer=tr, net=tr.net))
        res.ops.append(OpGroup("pp", "Recv", rpos, self.seq["pp"][s], nbytes, 2,
                               c.ravel() - lead, c.ravel(), tr.done, step, peer_pos=spos,
                               transfer=tr, net=tr.net))
        self.seq["pp"][s] += 1
        return np.asarray(tr.done.reshape(c.shape))

    def _pass(self, res: StepResult, fx: StepEffects, rng: np.random.Generator, step: int,
              s: int, kind: str, m: int, c: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        k_n = cfg.tp_collectives
        base = (cfg.fwd_ms if kind == "F" else cfg.bwd_ms) / 1e3 / k_n
        base *= 1.05 if s in (0, cfg.pp - 1) and cfg.pp > 1 else 1.0  # embedding / loss
        label = f"{'fwd' if kind == 'F' else 'bwd'} {m}"
        pos = self.posg[:, s, :]
        dt = (cfg.dp, cfg.tp)
        real = self.real
        smult = fx.stage_mult[1 if kind == "F" else 2][:, s, :] if fx.any_stage else 1.0
        if real.compute:
            c = c + real.turn(s)
        for k in range(k_n):
            kmult = fx.kernel[:, :, s, :].copy()
            ecc = rng.random(dt) < fx.ecc_p[:, s, :]
            kmult[0] = np.where(ecc, kmult[0] * fx.ecc_factor[:, s, :], kmult[0])
            spike = rng.random(dt) < cfg.spike_p
            kmult = np.where(spike, kmult * cfg.spike_factor, kmult)
            mix = np.tensordot(KERNEL_FRACTIONS, kmult, axes=1)
            dur = base * self._noise(rng, dt) * fx.gpu[:, s, :] * mix * smult
            if real.compute:
                dur = dur * real.factor(dt, (slice(None), s, slice(None)))
                dur = dur + real.pause(dur)
            dur += 50e-6 * fx.cpu[:, s, :]  # launch gap: CPU-side
            if k == 0:
                dur = self._stall(c, dur, s, label, fx)
            res.segments.append(Segment(PASS_F if kind == "F" else PASS_B, k, pos.ravel(),
                                        c.ravel(), dur.ravel(), kmult.reshape(3, -1)))
            res.device[:, s, :] += np.where(np.isfinite(dur), dur, 0.0)
            c = c + dur
            if cfg.tp > 1:
                c = self._tp_allreduce(res, fx, rng, step, s, c, c - dur)
        return c

    def _tp_allreduce(self, res: StepResult, fx: StepEffects, rng: np.random.Generator,
                      step: int, s: int, c: np.ndarray, launched: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        pos = self.posg[:, s, :]
        nbytes = cfg.tp_mib * MIB
        slow = self.real.link("tp", (slice(None), s, slice(None)), pos.shape)
        r = ring_collective(cfg, fx, self.host, pos, c, nbytes, 2 * (cfg.tp - 1), 1, rng, slow)
        flat = pos.ravel()
        res.ops.append(OpGroup("tp", "AllReduce", flat, self.seq["tp"][s], int(nbytes), 1,
                               np.minimum(launched.ravel() + 30e-6, c.ravel()), c.ravel(),
                               r.end.ravel(), step,
                               ring=_flat_ring(r), net=self.host[flat] != self.host[
                                   np.roll(pos, -1, axis=1).ravel()]))
        self.seq["tp"][s] += 1
        return r.end

    def _dp_allreduce(self, res: StepResult, fx: StepEffects, rng: np.random.Generator,
                      step: int, cur: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        if cfg.dp == 1:
            return cur
        pos = self.posg.transpose(1, 2, 0).reshape(-1, cfg.dp)  # groups (pp, tp), ring over dp
        start = cur.transpose(1, 2, 0).reshape(pos.shape)
        death = self.fm.death.transpose(1, 2, 0).reshape(pos.shape)
        start = np.where(start >= death, math.inf, start)
        nbytes = cfg.grad_mib * MIB
        slow = self.real.link("dp", (), self.shape)
        if slow is not None:
            slow = slow.transpose(1, 2, 0).reshape(pos.shape)
        r = ring_collective(cfg, fx, self.host, pos, start, nbytes, 2 * (cfg.dp - 1),
                            cfg.slices, rng, slow)
        flat = pos.ravel()
        seq = self.seq["dp"][0]
        res.ops.append(OpGroup("dp", "AllReduce", flat, seq, int(nbytes), 3,
                               start.ravel() - 100e-6, start.ravel(), r.end.ravel(), step,
                               ring=_flat_ring(r), net=self.host[flat] != self.host[
                                   np.roll(pos, -1, axis=1).ravel()]))
        self.seq["dp"] = [x + 1 for x in self.seq["dp"]]
        out = np.empty(self.shape)
        out.transpose(1, 2, 0)[...] = r.end.reshape(cfg.pp, cfg.tp, cfg.dp)
        return out


def _flat_ring(r: RingResult) -> RingResult:
    u = r.units
    return RingResult(r.ready.reshape(u, -1), r.xmit.reshape(u, -1), r.done.reshape(u, -1),
                      r.end.ravel())


def fault_onsets(engine: Engine, faults: FaultSet) -> dict[int, float]:
    """When each fault first acted: hangs when their pass stalled, others at `at`."""
    out = {}
    for i, f in enumerate(faults.faults):
        out[i] = engine.onsets.get(i, f.at) if isinstance(f, F.Hang) else f.at
    return out
