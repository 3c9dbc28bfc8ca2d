"""Scoring diagnoses against the simulator's ground truth, and the in-process pipeline.

`score_scenario(truth, diagnoses, expect_kinds)` matches each injected fault with the incidents
published for its job and `summarize` turns many scenarios into the figures `rankwatch eval`
prints. The same scoring serves the real pipeline (diagnoses read back from rw.diagnoses) and
the fast in-process mode (`run_in_process`: the simulator's batches decoded in release order,
`JobWatch` on the sampled ranks — fed their ops, beats, steps and, as on the real pipeline,
1 s progress rows (`ProgressRows`, computed here in numpy) —, `Analyst` over a window of
everything released so far, the clock = simulated time), which is the development loop;
reported figures come from the real pipeline (`rankwatch eval`, not `--in-process`).

Matching, per fault with expect_diagnosis: an incident matches when its culprit ranks (or a
suspect's) overlap the fault's ranks and it opened no earlier than 2 s before the onset; the
earliest-opened incident naming the fault as its primary culprit (else the earliest naming it
as a suspect) is scored, on its last version before resolution; latency is from the onset to the
first matching incident's opening. rank exact = primary culprit ranks ⊆ fault ranks;
stage top-1 = `stage_match(fault stage, diagnosis stage)`, top-2 = a match among the first two
ranked stages; component by `COMPONENT_OF_TRUTH`. An incident that matches no expected fault is
a false alarm (controls and "too small to matter" faults expect none). Hang figures count faults
whose job stops (hang, death, nic_down, recv_fail lasting ≥ 5 s or forever).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diagnosis.analyst import Analyst, AnalystConfig
from diagnosis.columns import Columns, codes, col, ints
from diagnosis.model import Diagnosis
from diagnosis.triggers.watch import JobWatch, steps_from_stages
from diagnosis.window import (
    Window,
    latest_op_rows,
    with_delivered_sends,
    without_superseded_in_flight,
)
from ingest.units import SECOND

COMPONENT_OF_TRUTH = {"gpu": "gpu_compute", "nic": "nic_rdma", "pcie": "pcie_host",
                      "dataloader": "data_loader", "host": "host_software",
                      "software": "host_software"}
HANG_FAMILIES = ("hang", "death", "nic_down", "recv_fail")


def stage_match(truth: str, diag: str | None) -> bool:
    """Whether a diagnosis' stage names the truth's. A network fault of the simulator (its
    stage ``dp_allreduce``, a host's NIC) slows the DP ring and the PP hops crossing that NIC
    alike: naming either stage, where the slower transfers were measured, is right."""
    if diag is None:
        return False
    if truth == diag:
        return True
    if truth == "compute":
        return diag.startswith(("fwd ", "bwd "))
    if truth == "dp_allreduce":
        return diag == "pp_p2p"
    return False


def is_hang_truth(t: Any) -> bool:
    if t.fault not in HANG_FAMILIES:
        return False
    return bool(t.end_ns == 0 or (t.end_ns - t.start_ns) >= 5 * SECOND)


@dataclass
class FaultScore:
    scenario: str
    fault: str
    hang: bool
    detected: bool = False
    hang_kind: bool = False
    rank_exact: bool = False
    stage_top1: bool = False
    stage_top2: bool = False
    component: bool = False
    latency_s: float | None = None
    diagnosis: dict[str, Any] | None = None


@dataclass
class ScenarioScore:
    scenario: str
    tags: tuple[str, ...]
    faults: list[FaultScore] = field(default_factory=list)
    false_alarms: int = 0
    hang_diagnoses: int = 0
    false_hangs: int = 0
    incidents: int = 0
    wall_s: float = 0.0
    analysis_ms: list[float] = field(default_factory=list)
    #: (confidence, right) of every published version but resolutions (`grade_versions`)
    graded: list[tuple[float, bool]] = field(default_factory=list)


def _incidents(diags: Sequence[Diagnosis]) -> dict[str, list[Diagnosis]]:
    out: dict[str, list[Diagnosis]] = {}
    for d in sorted(diags, key=lambda d: (d.incident_id, d.version)):
        out.setdefault(d.incident_id, []).append(d)
    return out


def score_scenario(name: str, tags: Sequence[str], truth: Sequence[Any],
                   diags: Sequence[Diagnosis]) -> ScenarioScore:
    sc = ScenarioScore(name, tuple(tags))
    inc = _incidents(diags)
    sc.incidents = len(inc)
    used: set[str] = set()
    for t in truth:
        if not t.expect_diagnosis:
            continue
        fs = FaultScore(name, t.spec, is_hang_truth(t))
        truth_ranks = set(t.ranks)
        by_primary = False  # scored from an incident's primary culprit (not a suspect)
        for iid, versions in sorted(inc.items(), key=lambda kv: kv[1][0].detected_ns):
            first = versions[0]
            final = next((v for v in reversed(versions) if v.status != "resolved"), versions[-1])
            if first.detected_ns < t.start_ns - 2 * SECOND:
                continue
            cands = [(final.culprit_ranks, final.stage, final.stages, final.component, True)]
            cands += [(s.ranks, s.stage, [s.stage] if s.stage else [], s.component, False)
                      for s in final.suspects]
            for ranks, stage, stages, comp, primary in cands:
                if not set(ranks) & truth_ranks:
                    continue
                used.add(iid)
                if fs.latency_s is None or first.detected_ns - t.start_ns < fs.latency_s * SECOND:
                    fs.latency_s = (first.detected_ns - t.start_ns) / SECOND
                if fs.detected and (by_primary or not primary):
                    continue  # the earliest incident naming the fault as primary is scored
                by_primary = primary
                fs.detected = True
                fs.hang_kind = final.kind == "hang"
                fs.rank_exact = bool(ranks) and set(ranks) <= truth_ranks
                fs.stage_top1 = stage_match(t.stage, stage)
                fs.stage_top2 = any(stage_match(t.stage, s) for s in list(stages)[:2])
                fs.component = comp == COMPONENT_OF_TRUTH[t.component]
                fs.diagnosis = {"kind": final.kind, "ranks": ranks[:16], "stage": stage,
                                "stages": list(stages)[:3], "component": comp,
                                "version": final.version, "primary": primary}
                break
        sc.faults.append(fs)
    sc.graded = grade_versions(truth, diags)
    hang_truth = {r for t in truth if t.expect_diagnosis for r in t.ranks}
    for iid, versions in inc.items():
        final = next((v for v in reversed(versions) if v.status != "resolved"), versions[-1])
        if final.kind == "hang":
            sc.hang_diagnoses += 1
            if not set(final.culprit_ranks) & hang_truth:
                sc.false_hangs += 1
        if iid not in used:
            sc.false_alarms += 1
    return sc


def grade_versions(truth: Sequence[Any], diags: Sequence[Diagnosis]) -> list[tuple[float, bool]]:
    """(confidence, right) for every published version except resolutions: right when some
    expected fault active by then (started at most 2 s after the version) has the version's
    culprit ranks among its ranks, its stage (`stage_match`) and its component. A version of a
    job without such a fault (a control, a fault too small to matter) is wrong: what the
    calibration table (`calibration`) measures is how often a version of a given confidence
    is right as published."""
    out = []
    for d in diags:
        if d.status == "resolved":
            continue
        ok = any(t.expect_diagnosis and t.start_ns <= d.detected_ns + 2 * SECOND
                 and d.culprit_ranks and set(d.culprit_ranks) <= set(t.ranks)
                 and stage_match(t.stage, d.stage)
                 and d.component == COMPONENT_OF_TRUTH.get(t.component, t.component)
                 for t in truth)
        out.append((float(d.confidence), bool(ok)))
    return out


CONFIDENCE_BINS = (0.0, 0.5, 0.7, 0.8, 0.9, 1.01)


def calibration(graded: Sequence[tuple[float, bool]]) -> list[dict[str, Any]]:
    """Per confidence bin: versions published and the share of them that were right."""
    rows = []
    for lo, hi in itertools.pairwise(CONFIDENCE_BINS):
        sel = [ok for c, ok in graded if lo <= c < hi]
        rows.append({"confidence": f"[{lo:.2f}, {min(hi, 1.0):.2f}]" if hi > 1 else
                     f"[{lo:.2f}, {hi:.2f})", "versions": len(sel),
                     "right": round(float(np.mean(sel)), 3) if sel else None})
    return rows


def _pct(x: list[bool]) -> float | None:
    return round(float(np.mean(x)), 3) if x else None


def summarize(scores: Sequence[ScenarioScore]) -> dict[str, Any]:
    faults = [f for s in scores for f in s.faults]
    hang = [f for f in faults if f.hang]
    slow = [f for f in faults if not f.hang]
    tp_h = sum(f.detected and f.hang_kind for f in hang)
    hang_diags = sum(s.hang_diagnoses for s in scores)
    false_h = sum(s.false_hangs for s in scores)
    tp_s = sum(f.detected for f in slow)
    fa_slow = sum(s.false_alarms for s in scores)
    prec_s = tp_s / max(tp_s + fa_slow, 1)
    rec_s = tp_s / max(len(slow), 1)
    lat = [f.latency_s for f in faults if f.latency_s is not None]
    det = [f for f in faults if f.detected]
    controls = [s for s in scores if "control" in s.tags]
    small = [s for s in scores if "small" in s.tags]
    return {
        "scenarios": len(scores), "faults": len(faults),
        "hang": {"faults": len(hang), "recall": round(tp_h / max(len(hang), 1), 3),
                 "precision": round((hang_diags - false_h) / max(hang_diags, 1), 3),
                 "rank_exact": _pct([f.rank_exact for f in hang if f.detected]),
                 "stage_exact": _pct([f.stage_top1 for f in hang if f.detected]),
                 "rank_and_stage": _pct([f.rank_exact and f.stage_top1 for f in hang])},
        "slowdown": {"faults": len(slow), "detected": tp_s, "false_alarms": fa_slow,
                     "precision": round(prec_s, 3), "recall": round(rec_s, 3),
                     "f1": round(2 * prec_s * rec_s / max(prec_s + rec_s, 1e-9), 3),
                     "rank_exact": _pct([f.rank_exact for f in slow if f.detected])},
        "stage_top1": _pct([f.stage_top1 for f in det]),
        "stage_top2": _pct([f.stage_top2 for f in det]),
        "component": _pct([f.component for f in det]),
        "latency_s": {"p50": round(float(np.percentile(lat, 50)), 2) if lat else None,
                      "p90": round(float(np.percentile(lat, 90)), 2) if lat else None},
        "false_alarms_controls": sum(s.incidents for s in controls),
        "false_alarms_small": sum(s.incidents for s in small),
        "analysis_ms_p50": round(float(np.median([m for s in scores for m in s.analysis_ms]
                                                  or [0.0])), 1),
        "calibration": calibration([g for s in scores for g in s.graded]),
    }


# ------------------------------------------------------------------------- in-process pipeline


class _Store:
    """Decoded record columns released so far, per kind (concatenated lazily)."""

    def __init__(self) -> None:
        self.parts: dict[str, list[dict[str, np.ndarray]]] = {}
        self.cache: dict[str, dict[str, np.ndarray]] = {}

    def add(self, kind: str, cols: dict[str, np.ndarray]) -> None:
        self.parts.setdefault(kind, []).append(cols)
        self.cache.pop(kind, None)

    def table(self, kind: str) -> dict[str, np.ndarray]:
        if kind not in self.cache:
            p = self.parts.get(kind)
            if not p:
                return {}
            merged = {c: np.concatenate([x[c] for x in p]) for c in p[0]}
            self.parts[kind] = [merged]
            self.cache[kind] = merged
        return self.cache[kind]


TIME_COL = {"ops": "t_start", "flows": "t_start", "stages": "t_start", "kernels": "t_start",
            "chunks": "ts", "wr": "ts", "beats": "ts"}


def window_of(store: _Store, topo: Any, start_ns: int, now_ns: int,
              kinds: Collection[str] | None = None) -> Window:
    tables: dict[str, Columns] = {}
    for kind, tc in TIME_COL.items():
        if kinds is not None and kind not in kinds:
            continue
        t = store.table(kind)
        if not t:
            continue
        ts = t[tc]
        keep = (ts >= start_ns) & (ts <= now_ns)
        if kind == "ops":
            keep |= (t["t_end"] == 0) & (ts <= now_ns)
        tables[kind] = {c: v[keep] for c, v in t.items()}
    if "ops" in tables:  # as the worker reads it (diagnosis.agents.read_window)
        tables["ops"] = with_delivered_sends(
            without_superseded_in_flight(tables["ops"], now_ns), start_ns, now_ns)
    return Window(topo, tables, start_ns, now_ns)


class ProgressRows:
    """The progress feed of the sampled ranks for the in-process mode: what streams/progress.py
    computes in ClickHouse (completed calls, their bytes/s and interval, calls in flight and the
    oldest one's age) for every (rank, comm_id) seen, one row per `window_ns` window, a window
    `lag_ns` after its end (the real feed waits for the records' lateness)."""

    def __init__(self, window_ns: int = SECOND, lag_ns: int = SECOND) -> None:
        self.window_ns, self.lag_ns = window_ns, lag_ns
        self.ops: dict[str, np.ndarray] = {}
        self.keys: dict[tuple[int, str], None] = {}
        self.next_ws = -1

    def add(self, ops: Columns, ranks: np.ndarray) -> None:
        keep = np.isin(ints(ops, "rank"), ranks)
        if not keep.any():
            return
        new = {k: np.asarray(ops[k])[keep] for k in ("rank", "comm_id", "op_seq", "bytes",
                                                      "t_start", "t_end")}
        for r, c in zip(new["rank"].tolist(), new["comm_id"].tolist(), strict=True):
            self.keys.setdefault((int(r), str(c)), None)
        self.ops = {k: np.concatenate([self.ops[k], v]) for k, v in new.items()} if self.ops \
            else new
        if self.next_ws < 0:
            self.next_ws = int(new["t_start"].min()) // self.window_ns * self.window_ns

    def windows(self, now_ns: int) -> dict[str, np.ndarray] | None:
        parts = []
        while self.ops and self.next_ws >= 0 and self.next_ws + self.window_ns + self.lag_ns \
                <= now_ns:
            parts.append(self._window(self.next_ws, self.next_ws + self.window_ns))
            self.next_ws += self.window_ns
        if self.ops:  # keep one row per op, and only what a later window can still count
            ops = latest_op_rows(self.ops)
            e = ints(ops, "t_end")
            live = (e == 0) | (e >= self.next_ws)
            self.ops = {k: np.asarray(v)[live] for k, v in ops.items()}
        if not parts:
            return None
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def _window(self, ws: int, we: int) -> dict[str, np.ndarray]:
        kr = np.asarray([k[0] for k in self.keys], np.int64)
        kc = np.asarray([k[1] for k in self.keys], dtype=object)
        n = kr.size
        ops = latest_op_rows(self.ops)
        _, code = codes(np.concatenate([kc, col(ops, "comm_id")]).astype(object))
        key = (code.astype(np.int64) << 32) | np.concatenate([kr, ints(ops, "rank")])
        order = np.argsort(key[:n])
        pos = order[np.searchsorted(key[:n], key[n:], sorter=order)]
        t0, t1, nb = ints(ops, "t_start"), ints(ops, "t_end"), ints(ops, "bytes", 0)
        done = (t1 >= ws) & (t1 < we)
        infl = (t0 < we) & ((t1 == 0) | (t1 >= we))
        completed = np.bincount(pos[done], minlength=n)
        done_bytes = np.bincount(pos[done], weights=nb[done].astype(np.float64), minlength=n)
        first = np.full(n, np.iinfo(np.int64).max)
        last = np.zeros(n, np.int64)
        np.minimum.at(first, pos[done], t1[done])
        np.maximum.at(last, pos[done], t1[done])
        many = completed > 1
        interval = np.full(n, -1, np.int64)
        interval[many] = (last[many] - first[many]) // (completed[many] - 1)
        oldest = np.full(n, we, np.int64)
        np.minimum.at(oldest, pos[infl], t0[infl])
        return {"window_end": np.full(n, we, np.int64), "rank": kr, "comm_id": kc,
                "completed_ops": completed.astype(np.int64),
                "bytes_per_s": (done_bytes * SECOND / (we - ws)).astype(np.int64),
                "op_interval_ns": interval,
                "inflight_ops": np.bincount(pos[infl], minlength=n).astype(np.int64),
                "oldest_inflight_age_ns": we - oldest}


def run_in_process(scenario: Any, config: AnalystConfig | None = None
                   ) -> tuple[list[Diagnosis], list[Any], list[float]]:
    """Simulate `scenario`, run triggers + engine on its records in release order; returns
    (diagnoses, truth, analysis ms per engine run)."""
    from ingest.sim.simulation import Simulation

    sim = Simulation(scenario.config, scenario.faults)
    diags, ms = run_batches(sim.batches(framing="binary"), scenario.config.epoch_ns, config)
    return diags, sim.truth, ms


def capture_batches(path: Any, lag_s: float = 0.5) -> tuple[list[tuple[float, str, bytes]], int]:
    """The batches of an agent capture file (`rankwatch agent --capture`) as (release s, kind,
    data), released `lag_s` after their newest record (the agent's linger and publish), and
    the epoch (ns) their release times count from: a real job replayed in its own time."""
    from ingest.agent.capture import read_capture
    from ingest.batch import decode_batch

    out: list[tuple[int, str, bytes]] = []
    for f in read_capture(path):
        b = decode_batch(f.data)
        if f.kind == "jobs":
            out.append((int(b.topologies[0].ts), f.kind, f.data))
            continue
        t = np.asarray(b.cols.get(TIME_COL.get(f.kind, "ts"), ()), dtype=np.int64)
        if f.kind == "ops" and "t_end" in b.cols:
            t = np.maximum(t, np.asarray(b.cols["t_end"], dtype=np.int64))
        if t.size:
            out.append((int(t.max()), f.kind, f.data))
    if not out:
        return [], 0
    epoch = min(t for t, _, _ in out)
    lag = int(lag_s * SECOND)
    # the topology comes first: the agent publishes it before its ranks' records matter
    rel = sorted(((0 if k == "jobs" else t - epoch + lag) / SECOND, k, d) for t, k, d in out)
    return rel, epoch


def run_batches(batches: Any, epoch: int, config: AnalystConfig | None = None
                ) -> tuple[list[Diagnosis], list[float]]:
    """Triggers + engine over (release s, kind, data) batches in release order, the clock =
    `epoch` + release time: the in-process pipeline for simulated and captured jobs."""
    from ingest.batch import decode_batch

    store = _Store()
    topo: list[Any] = []
    analyst = Analyst(lambda job, a, b, kinds=None: window_of(store, topo[0], a, b, kinds)
                      if topo else None,
                      config or AnalystConfig())
    watch: list[JobWatch] = []
    feed = ProgressRows()
    fresh: dict[str, list[dict[str, np.ndarray]]] = {}
    diags: list[Diagnosis] = []

    def process(release_s: float) -> None:
        now = epoch + int(release_s * SECOND)
        if not watch:
            return
        new = {k: {c: np.concatenate([p[c] for p in v]) for c in v[0]} for k, v in fresh.items()}
        fresh.clear()
        steps = steps_from_stages(new["stages"]) if "stages" in new else None
        if "ops" in new:
            feed.add(new["ops"], watch[0].ranks)
        for t in watch[0].observe(now, ops=new.get("ops"), beats=new.get("beats"), steps=steps,
                                  progress=feed.windows(now), stages=new.get("stages")):
            diags.extend(analyst.on_trigger(t, now))
        diags.extend(analyst.tick(now))

    current = 0.0
    for release, kind, data in batches:
        if release != current:
            process(current)
            while release - current > 1.0:  # the trigger agents' timer between releases
                current += 1.0
                process(current)
            current = release
        b = decode_batch(data)
        if kind == "jobs":
            if not topo:
                topo.append(b.topologies[0])
                watch.append(JobWatch(b.topologies[0]))
                analyst.jobs.add(b.topologies[0].job_id)
            else:  # a later topology (a shape the agent inferred since) replaces it
                topo[0] = b.topologies[0]
            continue
        store.add(kind, b.cols)
        analyst.seen(b.job_id, kind)  # as the worker's raw sink tells it (Analyst.seen)
        fresh.setdefault(kind, []).append(b.cols)
    process(current)
    for extra in (1.0, 2.0, 5.0, 9.0):  # let open incidents resolve after the job ends
        diags.extend(analyst.tick(epoch + int((current + extra) * SECOND)))
    return diags, analyst.analysis_ms


def evaluate_in_process(names: Sequence[str] | None = None, progress: Any = None,
                        catalog: str = "standard") -> tuple[list[ScenarioScore], dict[str, Any]]:
    """In-process scores of `names` (default: all) of a named scenario catalog."""
    from ingest.sim.scenario import load_catalog

    cat = load_catalog(catalog)
    scores = []
    for name in names or list(cat):
        sc = cat[name]
        t0 = time.perf_counter()
        diags, truth, ms = run_in_process(sc)
        s = score_scenario(name, sc.tags, truth, diags)
        s.wall_s = time.perf_counter() - t0
        s.analysis_ms = ms
        scores.append(s)
        if progress:
            progress(s, diags)
    return scores, summarize(scores)
