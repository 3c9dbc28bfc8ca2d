"""A simulation run: engine steps → records → encoded batches, window by window.

    sim = Simulation(JobConfig(tp=2, pp=4, dp=8, steps=50), ["hang rank=13 stage=bwd mb=3 at=10s"])
    for release_s, kind, data in sim.batches():   # data: one encoded record batch (bytes)
        ...
    sim.truth                                       # ground truth, complete after the run

Each step's records are released at the step's end in simulated time (`release_s`), which is what
real-time pacing waits for. Periodic records (heartbeats, WR samples, chunk snapshots of ops that
never finish) are produced per window: from the previous step's earliest end to this step's
earliest end, because no later step can put an event before it. After the job stalls for good the
run records `hang_tail_s` more seconds of heartbeats and snapshots, then ends.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Iterator, Sequence

import numpy as np

from ingest.batch import encode_batch, encode_topology
from ingest.keys import SPREAD_KINDS
from ingest.records import MODELS, JobTopology
from ingest.sim.config import JobConfig
from ingest.sim.emit import Clock, Cols, StepEmitter, anonymous_topology, comm_dictionary
from ingest.sim.engine import PASS_F, PASS_OPT, Engine, OpGroup, StepResult, fault_onsets
from ingest.sim.faults import Fault, FaultSet, parse_fault
from ingest.sim.inferred import AgentShape
from ingest.sim.progress import ChunkSnapshots, Timeline, ticks_between, wr_events
from ingest.sim.truth import TruthRecord, truth_records

Record = tuple[float, str, Cols]

#: the stage names a beat's position uses (ingest.records.Beat.stage; "" between stages)
POSITION_STAGES = ("", "data.next_wait", "model.fwd_loss", "model.backward", "callbacks",
                   "optim.step")
_DATA, _FWD, _BWD, _CB, _OPT = 1, 2, 3, 4, 5


class Positions:
    """Each rank's position over time, as its stage clock publishes it into every beat
    (ingest.records.Beat `step`, `stage`, `stage_ts`): a transition when the rank enters the
    data stage (its step's start), a forward or backward pass (the pass's first compute
    segment; the DP all-reduce after the last backward pass stays in backward, as DDP's does),
    the optimizer and then callbacks. A rank hung inside a stage keeps its last transition;
    transitions no beat can need any more are dropped as windows close."""

    def __init__(self) -> None:
        self.rank = np.zeros(0, np.int64)
        self.t = np.zeros(0)
        self.step = np.zeros(0, np.int64)
        self.stage = np.zeros(0, np.int64)

    def observe(self, res: StepResult, ranks: np.ndarray) -> None:
        parts = [(ranks, res.t0.ravel(), _DATA)]
        for g in res.segments:
            if g.kind == PASS_OPT:
                parts += [(ranks[g.pos], g.start, _OPT), (ranks[g.pos], g.start + g.dur, _CB)]
            elif g.index == 0:
                parts.append((ranks[g.pos], g.start, _FWD if g.kind == PASS_F else _BWD))
        r = np.concatenate([p[0] for p in parts])
        t = np.concatenate([p[1] for p in parts])
        c = np.concatenate([np.full(p[0].size, p[2], np.int64) for p in parts])
        ok = np.isfinite(t)
        self.rank = np.concatenate([self.rank, r[ok]])
        self.t = np.concatenate([self.t, t[ok]])
        self.stage = np.concatenate([self.stage, c[ok]])
        self.step = np.concatenate([self.step, np.full(int(ok.sum()), res.step, np.int64)])

    def at(self, ranks: np.ndarray, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(step, stage code, time entered) of each (rank, ts): the rank's last transition at
        or before ts; (-1, 0, nan) where it has none yet."""
        if not self.rank.size:
            return (np.full(ranks.size, -1, np.int64), np.zeros(ranks.size, np.int64),
                    np.full(ranks.size, np.nan))
        span = 1.0 + float(max(np.abs(self.t).max(), np.abs(ts).max(initial=0.0)))
        key = self.rank * span + self.t  # one sorted axis: rank-major, then time
        order = np.argsort(key, kind="stable")
        i = np.searchsorted(key[order], ranks * span + ts, side="right") - 1
        j = order[np.maximum(i, 0)]
        ok = (i >= 0) & (self.rank[j] == ranks)
        return (np.where(ok, self.step[j], -1), np.where(ok, self.stage[j], 0),
                np.where(ok, self.t[j], np.nan))

    def forget_before(self, t: float) -> None:
        """Drop transitions before `t` except each rank's last one before it."""
        old = self.t < t
        if not old.any():
            return
        idx = np.flatnonzero(old)
        order = idx[np.lexsort((self.t[idx], self.rank[idx]))]
        last = order[np.r_[self.rank[order][1:] != self.rank[order][:-1], True]]
        keep = ~old
        keep[last] = True
        self.rank, self.t = self.rank[keep], self.t[keep]
        self.step, self.stage = self.step[keep], self.stage[keep]


class Simulation:
    def __init__(self, cfg: JobConfig, faults: Sequence[str | Fault] = ()) -> None:
        self.cfg = cfg
        self.layout = cfg.layout
        parsed = [parse_fault(f) if isinstance(f, str) else f for f in faults]
        self.faults = FaultSet.resolve(parsed, self.layout)
        self.engine = Engine(cfg, self.faults)
        self.clock = Clock(cfg, self.layout)
        death = self.engine.fm.death.ravel()
        self.emitter = StepEmitter(cfg, self.layout, death, self.clock)
        self.ranks = self.layout.grid.ravel()
        self.death_by_rank = np.empty(self.layout.world)
        self.death_by_rank[self.ranks] = death
        self.chunks = ChunkSnapshots(cfg, self.ranks, death, self.clock)
        self.comm_names, self.comm_codes = comm_dictionary(self.layout, not cfg.declared_shape)
        world = self.layout.world
        self.kinds = [k for k, n in (("tp", cfg.tp), ("pp", cfg.pp), ("dp", cfg.dp)) if n > 1]
        self.seq_lines = {k: Timeline(world, 1, "last") for k in self.kinds}
        self.wr_line = Timeline(world, 2, "sum")
        self.wait_line = Timeline(world, 1, "sum")  # ns waited for a CPU (`StepResult`)
        self.stuck: list[OpGroup] = []
        self.positions = Positions()
        self.steps_done = 0
        self.stalled_at: float | None = None
        self.t_last = 0.0
        self.truth: list[TruthRecord] = []
        self.rows = 0
        self.rows_by_kind: Counter[str] = Counter()

    def topology(self) -> JobTopology:
        topo = self.layout.topology(self.cfg.job_id, self.cfg.epoch_ns, self.cfg.microbatches)
        return topo if self.cfg.declared_shape else anonymous_topology(topo, self.layout)

    # ------------------------------------------------------------------ records
    def records(self) -> Iterator[Record]:
        """(release time s, kind, columns) for the whole run, in release order."""
        w0 = 0.0
        for step in range(self.cfg.steps):
            res = self.engine.step(step)
            release = self._observe(res)
            for kind, cols in self.emitter.step_records(res):
                yield release, kind, cols
            for g in res.ops:
                if (g.ring is not None or g.transfer is not None) and (
                        c := self.chunks.rows(g, -math.inf, math.inf, self.comm_names,
                                              self.comm_codes[g.comm])) is not None:
                    yield release, "chunks", c
            ends = res.end[np.isfinite(res.end)]
            if res.stalled or not len(ends):
                break
            self.steps_done = step + 1
            w1 = float(ends.min())
            yield from self._window(w0, w1, max(release, w1))
            w0 = w1
        else:
            self._finish()
            return
        self.stalled_at = self.t_last
        horizon = self.t_last + self.cfg.hang_tail_s
        while w0 < horizon:
            w1 = min(horizon, math.floor(w0) + 1.0)
            yield from self._window(w0, w1, w1)
            w0 = w1
        self._finish()

    def _observe(self, res: StepResult) -> float:
        """Feed timelines from a step; returns the step's release time."""
        step_max = -math.inf
        self.positions.observe(res, self.ranks)
        if res.sched_wait is not None:
            wait = res.sched_wait.ravel()  # nan for a rank that never ended its step (hung)
            wait = np.rint(np.where(np.isfinite(wait), wait, 0.0) * 1e9).astype(np.int64)
            self.wait_line.add(self.ranks, res.end.ravel(), wait[:, None])
        for g in res.ops:
            alive = np.isfinite(g.t_start) & (g.t_start < self.emitter.death[g.pos])
            ranks = self.ranks[g.pos]
            if g.comm in self.seq_lines:
                self.seq_lines[g.comm].add(ranks[alive], g.t_start[alive],
                                           np.full((int(alive.sum()), 1), g.seq))
            size = self.cfg.dp if g.comm == "dp" else self.cfg.tp
            slices = self.cfg.slices if g.comm == "dp" else 1
            for r, t, v in wr_events(g, self.ranks, size, slices):
                self.wr_line.add(r, t, v)
            if (alive & ~np.isfinite(g.t_end)).any():
                self.stuck.append(g)
            for arr in (g.t_start, g.t_end):
                f = arr[np.isfinite(arr)]
                if len(f):
                    step_max = max(step_max, float(f.max()))
        f = res.end[np.isfinite(res.end)]
        if len(f):
            step_max = max(step_max, float(f.max()))
        self.t_last = max(self.t_last, step_max)
        return max(self.t_last, 0.0)

    def _window(self, w0: float, w1: float, release: float) -> Iterator[Record]:
        for g in self.stuck:
            c = self.chunks.rows(g, w0, w1, self.comm_names, self.comm_codes[g.comm], True)
            if c is not None:
                yield release, "chunks", c
        yield from self._beats(w0, w1, release)
        yield from self._wr(w0, w1, release)

    def _tick_rows(self, w0: float, w1: float, interval: float) -> tuple[np.ndarray, np.ndarray]:
        world = self.layout.world
        lo = np.full(world, w0 - 1e-9)
        hi = np.minimum(np.full(world, w1), self.death_by_rank)
        return ticks_between(lo, hi, interval)

    def _beats(self, w0: float, w1: float, release: float) -> Iterator[Record]:
        ranks, ts = self._tick_rows(w0, w1, self.cfg.beat_interval_s)
        if not len(ranks):
            return
        host_ts = self.clock.ns(ts, ranks)
        step, stage, entered = self.positions.at(ranks, ts)
        known = np.isfinite(entered)
        position = {"step": step, "stage": (stage, list(POSITION_STAGES)),
                    "stage_ts": np.where(known, self.clock.ns(entered, ranks), 0)}
        self.positions.forget_before(w0)
        # the scheduler's counters of each rank's training thread, cumulative from its start
        wait = self.wait_line.sample(ranks, ts, w1)[:, 0]
        position["sched_wait_ns"] = wait
        position["sched_run_ns"] = np.maximum(np.rint(ts * 1e9).astype(np.int64) - wait, 0)
        for kind in self.kinds:
            seq = self.seq_lines[kind].sample(ranks, ts, w1)[:, 0]
            pos = np.empty(self.layout.world, np.int64)
            pos[self.ranks] = np.arange(self.layout.world)
            codes = self.comm_codes[kind][pos[ranks]]
            yield release, "beats", {"rank": ranks, "ts": host_ts,
                                     "comm_id": (codes, self.comm_names), "last_op_seq": seq,
                                     **position}

    def _wr(self, w0: float, w1: float, release: float) -> Iterator[Record]:
        ranks, ts = self._tick_rows(w0, w1, self.cfg.wr_interval_ms / 1e3)
        if not len(ranks):
            return
        v = self.wr_line.sample(ranks, ts, w1)
        nics = [self.layout.nic_name(i) for i in range(self.layout.ranks_per_host)]
        yield release, "wr", {"rank": ranks, "nic": (ranks % self.layout.ranks_per_host, nics),
                              "ts": self.clock.ns(ts, ranks), "inflight": np.maximum(v[:, 0], 0),
                              "bytes_done": v[:, 1]}

    def _finish(self) -> None:
        onsets = fault_onsets(self.engine, self.faults)
        self.truth = truth_records(self.cfg.job_id, self.layout, self.faults, onsets,
                                   self.cfg.epoch_ns)

    # ------------------------------------------------------------------ batches
    def batches(self, producer: str = "", kinds: Collection[str] | None = None,
                framing: str = "json") -> Iterator[tuple[float, str, bytes]]:
        """Encoded record batches of at most `batch_rows` rows, merged per kind across calls
        and flushed at each release time; the topology batch comes first. `kinds` keeps only
        those raw kinds (the others are simulated, not encoded or counted in `rows`);
        `framing` is encode_batch's ("binary": framed batches, for Kafka)."""
        for release, kind, _, data in self.uploads(producer, kinds, framing):
            yield release, kind, data

    def uploads(self, producer: str = "", kinds: Collection[str] | None = None,
                framing: str = "json") -> Iterator[tuple[float, str, str, bytes]]:
        """`batches` with the producer of each: `producer` (default `sim/<job>`), or for the
        spread kinds (ingest/keys.py) with `uploaders` > 1, `<producer>/<host % uploaders>`
        — each such batch holds the records of that group of hosts only."""
        producer = producer or f"sim/{self.cfg.job_id}"
        if kinds is not None:
            unknown = set(kinds) - set(MODELS)
            if unknown:
                raise ValueError(f"unknown record kinds {sorted(unknown)}; "
                                 f"expected some of {', '.join(MODELS)}")
        topo = self.topology()
        yield 0.0, "jobs", producer, encode_topology(topo, producer=producer)
        agent = None if self.cfg.declared_shape else AgentShape(
            topo, self.ranks[self.layout.host_of[self.ranks] == self.layout.host_of[0]])
        seq = 0
        pending: dict[str, list[Cols]] = {}
        sizes: dict[str, int] = {}
        current = 0.0
        for release, kind, cols in self.records():
            if release != current:
                for k in list(pending):
                    for who, data in self._encode(k, pending.pop(k), producer, seq, framing):
                        seq += 1
                        yield current, k, who, data
                sizes.clear()
                # what the agent has drained by now: a beat's shape, after this release's data
                if agent is not None and (
                        inferred := agent.topology(current, self.cfg.epoch_ns)) is not None:
                    yield current, "jobs", producer, encode_topology(inferred,
                                                                     producer=producer)
                current = release
            if agent is not None and kind == "ops":
                agent.observe(cols)
            if kinds is not None and kind not in kinds:
                continue
            pending.setdefault(kind, []).append(cols)
            sizes[kind] = sizes.get(kind, 0) + len(cols["rank"])
            if sizes[kind] >= self.cfg.batch_rows:
                for who, data in self._encode(kind, pending.pop(kind), producer, seq, framing):
                    seq += 1
                    yield current, kind, who, data
                sizes[kind] = 0
        for k in list(pending):
            for who, data in self._encode(k, pending.pop(k), producer, seq, framing):
                seq += 1
                yield current, k, who, data

    def _encode(self, kind: str, parts: list[Cols], producer: str, seq: int,
                framing: str = "json") -> Iterator[tuple[str, bytes]]:
        cols = _concat(parts)
        n = len(cols["rank"])
        self.rows += n
        self.rows_by_kind[kind] += n
        groups: list[tuple[str, Cols]] = [(producer, cols)]
        if self.cfg.uploaders > 1 and kind in SPREAD_KINDS:
            host = np.asarray(cols["rank"]) // self.cfg.ranks_per_host % self.cfg.uploaders
            groups = [(f"{producer}/{u}", _take(cols, np.flatnonzero(host == u)))
                      for u in range(self.cfg.uploaders)]
        step = self.cfg.batch_rows
        for who, g in groups:
            m = len(g["rank"])
            for lo in range(0, m, step):
                part = {k: (v[0][lo:lo + step], v[1]) if isinstance(v, tuple)
                        else v[lo:lo + step] for k, v in g.items()}
                yield who, encode_batch(kind, self.cfg.job_id, part, producer=who, seq=seq,
                                        validate=False, framing=framing)
                seq += 1


def _take(cols: Cols, idx: np.ndarray) -> Cols:
    return {k: (v[0][idx], v[1]) if isinstance(v, tuple) else v[idx] for k, v in cols.items()}


def _concat(parts: list[Cols]) -> Cols:
    if len(parts) == 1:
        return parts[0]
    out: Cols = {}
    for k, v in parts[0].items():
        if isinstance(v, tuple):
            out[k] = (np.concatenate([p[k][0] for p in parts]), v[1])
        else:
            out[k] = np.concatenate([p[k] for p in parts])
    return out


def collect(batches: Iterator[tuple[float, str, bytes]] | Sequence[tuple[float, str, bytes]]
            ) -> dict[str, dict[str, np.ndarray]]:
    """Decode (validating) every batch and concatenate columns per kind — for tests and
    notebooks. The topology is under "jobs" as {"topology": array of one JobTopology}."""
    from ingest.batch import decode_batch

    parts: dict[str, list[dict[str, np.ndarray]]] = {}
    for _, kind, data in batches:
        b = decode_batch(data)
        if kind == "jobs":
            parts.setdefault(kind, []).append({"topology": np.array(b.topologies, dtype=object)})
        else:
            parts.setdefault(kind, []).append(b.cols)
    return {k: {c: np.concatenate([p[c] for p in v]) for c in v[0]} for k, v in parts.items()}
