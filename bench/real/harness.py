"""Run the real catalog through the whole path and score it (`rankwatch eval --real`).

One private stack (broker + worker with the diagnosis agents) for the whole run; per case, in
turn: a fresh job id, `rankwatch agent` on the case's rings (traced cases), the job under
``torch.distributed.run`` (``-m ingest.torch.run -m bench.real.workload`` when traced), the
diagnoses of that job read back from rw.diagnoses, and the ground truth the job wrote.

A case ends when the job ends, or — when its rank hangs for good — `HANG_OBSERVE_S` after the
fault's onset (the harness then stops the job). Its agent drains for `DRAIN_S` more and is
stopped; the next case starts while the worker may still be diagnosing this one (diagnoses are
kept per job id), and after the last case the harness reads rw.diagnoses for `SETTLE_S` more
before it scores every case (a resolution or a late false alarm counts wherever it falls).

Scoring (per fault case): the incidents of the job are grouped by id; an incident can be about
the fault when it opened after the onset (the job writes the onset itself, so nothing earlier
can be), its kind fits (`kind_compatible`) and its culprit ranks (or a suspect's) overlap the
faulty rank; of those the earliest naming the rank as primary culprit is scored (else the
earliest naming it as a suspect), on its last version before resolution. ranks right =
culprit ranks equal the faulty rank(s); stage right = the diagnosis's stage is one the truth
accepts (`bench.real.labels.expected`); component and kind right likewise; latency = onset →
the scored incident's first version on rw.diagnoses (its Kafka timestamp; in a replay its
`detected_ns`), in seconds and in steps: how many steps rank 0 finished between the two
(`steps_after`). Every other incident of a case is a false alarm (a
duplicate of the scored one included); on controls every incident is. Precision = scored
incidents / all incidents; recall = faults with a scored incident / faults.

Overhead: the ``ovh-…`` cases run the same job untraced (no tracer, no agent) and traced with a
live agent, interleaved; the report compares rank 0's median step time. While an overhead
case trains, the stack's worker (and store) processes are paused (SIGSTOP) and resumed as soon
as it ends, so they catch up on its records then: on a training host only the tracer and the
agent run beside the ranks, while here the worker — 0.5–0.6 of a core while a traced 4-rank
job's records flow, measured from /proc — would share the machine's two cores with them and
be counted as the tracer's overhead. The broker stays up (the agent publishes to it) and is
counted. The agent's CPU time is read from /proc/<pid>/stat (utime + stime) once it is up
(start-up: imports, Kafka producer) and just before it is stopped; the difference over its
record count (its own final ``--json`` stats) is its CPU per record.

Priorities: everything of the training host — the ranks, its agent, the CPU hogs of the
contended cases and of the hog fault — starts under `nice -n HOST_NICE` (`--host-nice`), and
the stack (broker, store, worker) at the harness's own priority. In a deployment the stack runs
on machines of its own, while here an 8-rank job alone keeps both cores busy: at equal
priority the worker waits for a core behind the ranks, and the time to a diagnosis measures
that wait more than the diagnosis (the first trigger of an 8-rank pipeline case was analysed
1.7 s after the moment it read up to). The ranks still contend with one another and
with their agent and hogs exactly as before — the noise the rules are judged against is the
same — and a stack with nothing to do costs the ranks nothing. `--host-nice 0` runs
everything at one priority.

With a kept work directory (`--workdir`) each agent also writes what it published to
``cases/<job>/cap.rwcap`` (`rankwatch agent --tee`); `rescore` replays those captures through
the in-process diagnosis path (diagnosis.evaluate.run_batches) and scores them the same way —
the rules re-judged on the same real jobs in seconds, without training again. The live figures
stay the reported ones: replay times triggers from the records' own clocks, not the broker's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.real.catalog import HOG, Case
from diagnosis.evaluate import calibration
from diagnosis.model import Diagnosis
from ingest.units import SECOND
from rankwatch.settings import Settings

HANG_OBSERVE_S = 12.0
SETTLE_S = 10.0
DRAIN_S = 2.0
#: Linux nice of the training host's processes (module docstring, "Priorities")
HOST_NICE = 10
CAPTURE = "cap.rwcap"
#: a slowdown the job's user feels: its median step time at least this much longer
#: (`CaseResult.job_slowdown`; the rest the job absorbed)
FELT = 1.05
ROOT = Path(__file__).resolve().parents[2]
Say = Callable[[str], None]


@dataclass
class CaseResult:
    case: str
    job: str
    shape: str
    nproc: int
    description: str
    control: bool
    traced: bool
    truth: dict[str, Any] | None = None
    run: dict[str, Any] | None = None
    wall_s: float = 0.0
    job_s: float = 0.0
    exit_code: int | None = None
    error: str = ""
    incidents: int = 0
    false_alarms: int = 0
    detected: bool = False
    kind_ok: bool = False
    ranks_ok: bool = False
    stage_ok: bool = False
    component_ok: bool = False
    latency_s: float | None = None
    latency_steps: float | None = None
    confidence: float | None = None
    resolved: bool = False
    got: dict[str, Any] | None = None
    diagnoses: list[dict[str, Any]] = field(default_factory=list)
    step_ms_p50: float | None = None
    #: when rank 0 finished each step from the onset on, in ms after it (`steps_after`)
    step_ends_ms: list[float] = field(default_factory=list)
    #: the job's median step time over the 30 steps from the onset over the 30 before it
    #: (`step_ratio`): how much slower the fault made the job, as its user sees it
    job_slowdown: float | None = None
    agent_cpu_s: float | None = None
    agent_start_cpu_s: float | None = None
    agent_records: int | None = None


def step_ratio(run: dict[str, Any], onset_step: int, n: int = 30) -> float | None:
    """Rank 0's median step time over the `n` steps from `onset_step` over the `n` before it
    (None without both)."""
    steps = np.asarray(run.get("step_ns") or [], dtype=np.float64)
    before, after = steps[max(onset_step - n, 0):onset_step], steps[onset_step:onset_step + n]
    if not before.size or not after.size or float(np.median(before)) <= 0:
        return None
    return round(float(np.median(after)) / float(np.median(before)), 3)


def steps_after(run: dict[str, Any], onset_ns: int, limit: int = 400) -> list[float]:
    """When rank 0 finished each step after `onset_ns`, in ms after it (at most `limit`).

    From the job's own step end times (``step_end_ns``); a run written before they were kept
    has only step durations, and its end times are rebuilt backwards from the job's end (the
    steps run back to back, so this is off by the final barrier's few ms at most)."""
    ends = np.asarray(run.get("step_end_ns") or [], dtype=np.int64)
    if not ends.size:
        dur = np.asarray(run.get("step_ns") or [], dtype=np.int64)
        if not dur.size or not run.get("end_ns"):
            return []
        ends = int(run["end_ns"]) - np.concatenate([np.cumsum(dur[::-1])[::-1][1:], [0]])
    after = ends[ends > onset_ns][:limit]
    return [round(float(x), 1) for x in (after - onset_ns) / 1e6]


def stage_ok(accept: Sequence[str], stage: str | None) -> bool:
    if stage is None:
        return False
    return any(stage == a or (a.endswith("*") and stage.startswith(a[:-1])) for a in accept)


def kind_compatible(truth: dict[str, Any], kind: str) -> bool:
    """Whether an incident of `kind` can be about the fault: a hang is named a hang, a slowdown
    a slowdown (or jitter, regression); a stall that recovers may be either."""
    if truth.get("fault") == "stall":
        return True
    return kind == "hang" if truth["kind"] == "hang" else kind != "hang"


def score(res: CaseResult, diags: Sequence[Diagnosis],
          published: Mapping[str, int] | None = None) -> None:
    """Fill `res`'s scores from the job's diagnoses (module docstring). `published`: each
    version's moment on rw.diagnoses (its Kafka timestamp, ns, by version id), where a
    user's tooling gets it; a diagnosis's latency is counted to then, not to its
    `detected_ns` (the moment its analysis began: the read and the analysis, seconds on a
    loaded worker, come after). Without it (replays in process) to `detected_ns`."""
    published = published or {}
    res.detected = res.kind_ok = res.ranks_ok = res.stage_ok = res.component_ok = False
    res.resolved, res.got, res.latency_s, res.latency_steps, res.confidence = (
        False, None, None, None, None)
    inc: dict[str, list[Diagnosis]] = {}
    for d in sorted(diags, key=lambda d: (d.incident_id, d.version)):
        inc.setdefault(d.incident_id, []).append(d)
    res.incidents = len(inc)
    res.diagnoses = [{"incident": d.incident_id, "version": d.version, "status": d.status,
                      "kind": d.kind, "ranks": d.culprit_ranks[:16], "stage": d.stage,
                      "component": d.component, "confidence": d.confidence,
                      "detected_ns": d.detected_ns, "published_ns": published.get(d.id),
                      "rules": d.rules,
                      "suspects": [s.ranks[:8] for s in d.suspects][:4]}
                     for v in inc.values() for d in v]
    t = res.truth
    used: set[str] = set()
    if t is not None and res.control is False:
        onset, ranks = int(t["onset_ns"]), set(t["ranks"])
        best: tuple[bool, int, str] | None = None  # (not primary, opened, incident)
        for iid, versions in inc.items():
            first = versions[0]
            if first.detected_ns < onset:  # opened before the fault began: not about it
                continue
            final = next((v for v in reversed(versions) if v.status != "resolved"), versions[-1])
            if not kind_compatible(t, final.kind):
                continue
            primary = bool(set(final.culprit_ranks) & ranks) or bool(
                set(first.culprit_ranks) & ranks)
            suspect = any(set(s.ranks) & ranks for s in final.suspects)
            if not (primary or suspect):
                continue
            key = (not primary, first.detected_ns, iid)
            best = key if best is None or key < best else best
        if best is not None:
            used.add(best[2])
            versions = inc[best[2]]
            first = versions[0]
            final = next((v for v in reversed(versions) if v.status != "resolved"), versions[-1])
            res.detected = True
            res.latency_s = round((published.get(first.id, first.detected_ns) - onset)
                                  / SECOND, 2)
            res.kind_ok = final.kind == t["kind"] or (t["fault"] == "stall"
                                                       and final.kind == "slowdown")
            res.ranks_ok = sorted(final.culprit_ranks) == sorted(ranks)
            res.stage_ok = stage_ok(t["accept"], final.stage)
            res.component_ok = final.component == t["component"]
            res.confidence = final.confidence
            res.resolved = versions[-1].status == "resolved"
            res.got = {"kind": final.kind, "ranks": final.culprit_ranks[:16],
                       "stage": final.stage, "stages": final.stages[:3],
                       "component": final.component, "confidence": final.confidence,
                       "version": final.version, "rules": final.rules,
                       "first": {"ranks": first.culprit_ranks[:16], "stage": first.stage,
                                 "component": first.component,
                                 "confidence": first.confidence}}
            if res.step_ends_ms:  # the job's steps finished between onset and diagnosis
                res.latency_steps = float(np.searchsorted(
                    res.step_ends_ms, res.latency_s * 1000, side="right"))
    res.false_alarms = len([i for i in inc if i not in used])


def _pct(xs: list[bool]) -> float | None:
    return round(float(np.mean(xs)), 3) if xs else None


def _q(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 2) if xs else None


def summarize(results: Sequence[CaseResult]) -> dict[str, Any]:
    faults = [r for r in results if r.truth is not None and not r.control]
    det = [r for r in faults if r.detected]
    controls = [r for r in results if r.control and not r.error]
    ctl_h = sum(r.job_s for r in controls) / 3600
    ctl_fa = sum(r.false_alarms for r in controls)
    incidents = sum(r.incidents for r in results)
    matched = sum(r.incidents - r.false_alarms for r in results)
    hangs = [r for r in det if r.truth and r.truth["kind"] == "hang"]
    slows = [r for r in det if r.truth and r.truth["kind"] == "slowdown"]
    felt = [r for r in slows if r.job_slowdown is not None and r.job_slowdown >= FELT]
    right = [r for r in det if r.kind_ok and r.ranks_ok and r.stage_ok and r.component_ok]
    wrong = [r for r in det if r not in right]
    out: dict[str, Any] = {
        "cases": len(results), "faults": len(faults), "controls": len(controls),
        "errors": [f"{r.case}: {r.error}" for r in results if r.error],
        "recall": _pct([r.detected for r in faults]),
        "precision": round(matched / incidents, 3) if incidents else None,
        "kind_right": _pct([r.kind_ok for r in det]),
        "ranks_right": _pct([r.ranks_ok for r in det]),
        "stage_right": _pct([r.stage_ok for r in det]),
        "component_right": _pct([r.component_ok for r in det]),
        "all_right": _pct([r in right for r in faults]),
        "hang_latency_s": {"p50": _q([r.latency_s for r in hangs if r.latency_s is not None],
                                     50),
                           "p90": _q([r.latency_s for r in hangs if r.latency_s is not None],
                                     90)},
        "slowdown_latency_steps": {
            "p50": _q([r.latency_steps for r in slows if r.latency_steps is not None], 50),
            "p90": _q([r.latency_steps for r in slows if r.latency_steps is not None], 90)},
        # the slowdowns the job's own step time shows (≥ FELT slower): a fault the job absorbs
        # (a pipeline bubble hides a slower optimizer) is named, but its user waits for nothing
        "felt_slowdown_latency_steps": {
            "p50": _q([r.latency_steps for r in felt if r.latency_steps is not None], 50),
            "p90": _q([r.latency_steps for r in felt if r.latency_steps is not None], 90),
            "cases": len(felt), "absorbed": len(slows) - len(felt)},
        "control_hours": round(ctl_h, 4),
        "control_false_alarms": ctl_fa,
        "false_alarms_per_control_hour": round(ctl_fa / ctl_h, 1) if ctl_h else None,
        "fault_case_false_alarms": sum(r.false_alarms for r in faults),
        "confidence_right_mean": _q([r.confidence for r in right if r.confidence is not None],
                                    50),
        "confidence_wrong_mean": _q([r.confidence for r in wrong if r.confidence is not None],
                                    50),
    }
    fams: dict[str, list[CaseResult]] = {}
    for r in faults:
        fams.setdefault(str((r.truth or {}).get("fault")), []).append(r)
    out["by_fault"] = {k: {"cases": len(v), "detected": sum(r.detected for r in v),
                           "ranks_right": sum(r.ranks_ok for r in v),
                           "stage_right": sum(r.stage_ok for r in v),
                           "component_right": sum(r.component_ok for r in v),
                           "all_right": sum(r in right for r in v)}
                       for k, v in sorted(fams.items())}
    out["overhead"] = overhead(results)
    out["calibration"] = calibration(graded_versions(results))
    return out


def graded_versions(results: Sequence[CaseResult]) -> list[tuple[float, bool]]:
    """(confidence, right) of every published version: right when its kind, culprit ranks,
    stage and component all match the truth of a fault case; on a control every version is
    wrong. Resolutions carry no claim and are left out."""
    out: list[tuple[float, bool]] = []
    for r in results:
        t = r.truth if not r.control else None
        for d in r.diagnoses:
            if d.get("status") == "resolved" or d.get("confidence") is None:
                continue
            ok = t is not None and kind_compatible(t, str(d["kind"])) and \
                sorted(d["ranks"]) == sorted(t["ranks"]) and \
                stage_ok(t["accept"], d.get("stage")) and d.get("component") == t["component"]
            out.append((float(d["confidence"]), bool(ok)))
    return out


def overhead(results: Sequence[CaseResult]) -> dict[str, Any]:
    """Step time untraced vs traced with a live agent (the ``ovh-`` pairs), and the agent's CPU
    per 1,000 records over every traced case."""
    out: dict[str, Any] = {}
    for shape in ("ddp", "pipeline"):
        plain = [r.step_ms_p50 for r in results if r.case.startswith("ovh-") and
                 r.shape == shape and not r.traced and r.step_ms_p50]
        traced = [r.step_ms_p50 for r in results if r.case.startswith("ovh-") and
                  r.shape == shape and r.traced and r.step_ms_p50]
        if plain and traced:
            p, t = float(np.median(plain)), float(np.median(traced))
            out[shape] = {"untraced_step_ms_p50": round(p, 2), "traced_step_ms_p50": round(t, 2),
                          "overhead_pct": round(100 * (t - p) / p, 1), "runs": len(plain)
                          + len(traced)}
    cpu = [(r.agent_cpu_s - (r.agent_start_cpu_s or 0.0), r.agent_records, r.job_s,
            r.agent_start_cpu_s or 0.0) for r in results
           if r.agent_cpu_s is not None and r.agent_records]
    if cpu:
        c = sum(x[0] for x in cpu)
        n = sum(x[1] or 0 for x in cpu)
        js = sum(x[2] for x in cpu)
        out["agent"] = {"cpu_s": round(c, 2), "records": n,
                        "cpu_s_per_1000_records": round(1000 * c / n, 4),
                        "cpu_s_per_job_s": round(c / js, 4) if js else None, "runs": len(cpu),
                        "startup_cpu_s_p50": round(float(np.median([x[3] for x in cpu])), 2)}
    return out


# ------------------------------------------------------------------------------------- running


def _cpu_s(pid: int) -> float | None:
    """utime + stime of `pid` from /proc/<pid>/stat, in seconds."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _resume(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _stop(p: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        p.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _reap(tag: str) -> int:
    """SIGKILL every process whose command line names `tag` (a case's truth dir), but this one.

    torchrun starts each rank in a session of its own and stops them itself; a torchrun stopped
    while it is still spawning ranks, or killed after the grace while a hung rank ignores its
    SIGTERM, leaves ranks no process group reaches. Returns how many were killed."""
    n = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if tag.encode() not in (d / "cmdline").read_bytes():
                continue
            os.kill(int(d.name), signal.SIGKILL)
            n += 1
        except OSError:
            continue
    return n


class Runner:
    """The stack and the per-case processes."""

    def __init__(self, home: Path, say: Say, settings: Settings | None = None,
                 tee: bool = False, host_nice: int = HOST_NICE) -> None:
        from rankwatch import stack

        self.home, self.say, self.tee = home, say, tee
        #: the training host's processes (ranks, agent, hogs) start under `nice -n host_nice`
        self.host = ["nice", "-n", str(host_nice)] if host_nice else []
        self.settings = settings or stack.private_settings(home / "stack",
                                                           topic_prefix="realeval")
        self.prefix = f"/rwr{uuid.uuid4().hex[:8]}"
        self.ring_dir = home / "rings"
        self.consumer: Any = None
        self.diags: dict[str, list[Diagnosis]] = {}
        #: version id -> its first Kafka timestamp on rw.diagnoses, ns (`score`)
        self.published: dict[str, int] = {}

    def __enter__(self) -> Runner:
        from confluent_kafka import Consumer

        from rankwatch import stack

        try:  # an up failing part-way may leave its broker running: stopped here
            stack.up(self.settings, progress=self.say)
            self.consumer = Consumer({"bootstrap.servers": self.settings.bootstrap,
                                      "group.id": f"real-eval-{uuid.uuid4().hex[:6]}",
                                      "auto.offset.reset": "earliest"})
            self.consumer.subscribe([self.settings.topics.diagnoses])
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        from ingest import ring
        from rankwatch import stack

        if self.consumer is not None:
            self.consumer.close()
        stack.down(self.settings, progress=self.say)
        for name in ring.list_rings(self.prefix):
            ring.load_library().rw_ring__unlink(name.encode())

    def poll(self, seconds: float) -> None:
        from confluent_kafka import TIMESTAMP_NOT_AVAILABLE

        end = time.monotonic() + seconds
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return
            m = self.consumer.poll(min(0.5, left))
            if m is None or m.error():
                continue
            try:
                d = Diagnosis.model_validate_json(m.value() or b"{}")
            except ValueError:
                continue
            self.diags.setdefault(d.job_id, []).append(d)
            kind, ms = m.timestamp()
            if kind != TIMESTAMP_NOT_AVAILABLE and d.id not in self.published:
                self.published[d.id] = int(ms) * 1_000_000

    def env(self, case: Case, job: str, truth: Path) -> dict[str, str]:
        from ingest.torch.provision import pythonpath_with_torch
        from rankwatch import stack

        env = pythonpath_with_torch({**stack.child_env(self.settings), "OMP_NUM_THREADS": "1"})
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        if case.traced:
            env.update({"RANKWATCH_JOB_ID": job, "RANKWATCH_RING_DIR": str(self.ring_dir),
                        "RANKWATCH_RING_PREFIX": self.prefix})
            if case.declare:
                world = case.nproc
                sizes = {"ddp": {"DP": world},
                         "pipeline": {"PP": case.pp, "DP": world // case.pp,
                                      "MICROBATCHES": case.microbatches},
                         "tp": {"TP": case.tp, "DP": world // case.tp}}[case.shape]
                env.update({f"RANKWATCH_{k}": str(v) for k, v in sizes.items()})
        return env

    def _pause_backend(self) -> list[int]:
        """SIGSTOP the stack's workers and store (module docstring, "Overhead"); their pids."""
        from rankwatch import stack

        pids = []
        for d in [*stack.worker_daemons(self.settings), stack.store_daemon(self.settings)]:
            pid = d.pid()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                    pids.append(pid)
        return pids

    def host_process(self, cmd: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        """Start one of the training host's processes (module docstring, "Priorities")."""
        return subprocess.Popen([*self.host, *cmd], **kw)

    def run_case(self, case: Case) -> CaseResult:
        from rankwatch import stack

        job = f"{case.name}-{uuid.uuid4().hex[:6]}"
        res = CaseResult(case.name, job, case.shape, case.nproc, case.describe(), case.control,
                         case.traced)
        cdir = self.home / "cases" / job
        cdir.mkdir(parents=True)
        env = self.env(case, job, cdir)
        t0 = time.monotonic()
        agent = None
        if case.traced:
            aenv = {k: v for k, v in stack.child_env(self.settings).items()}
            agent = self.host_process(
                [sys.executable, "-m", "rankwatch.cli", "agent", "--sidecar-dir",
                 str(self.ring_dir), "--prefix", self.prefix, "--job", job, "--json",
                 *(["--tee", str(cdir / CAPTURE)] if self.tee else [])],
                env=aenv, stdout=open(cdir / "agent.json", "wb"),  # noqa: SIM115
                stderr=open(cdir / "agent.log", "wb"),  # noqa: SIM115
                start_new_session=True, cwd=ROOT)
        if agent is not None:  # its start-up (imports, producer) is not per-record work
            up = time.monotonic() + 30
            while time.monotonic() < up and agent.poll() is None and \
                    b"rings ->" not in (cdir / "agent.log").read_bytes():
                time.sleep(0.1)
            res.agent_start_cpu_s = _cpu_s(agent.pid)
            if agent.poll() is not None:  # nothing would reach the worker: not a miss
                res.error = f"the agent exited at start (exit {agent.returncode}; see agent.log)"
                res.error += f" [{cdir}]"
                score(res, [])
                return res
        paused = self._pause_backend() if "overhead" in case.tags else []
        # busy until their parent (this process) is gone, however it ends
        hogs = [self.host_process([sys.executable, "-c", HOG], start_new_session=True)
                for _ in range(case.contention)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(case.nproc), "--master-port", str(stack.free_port())]
        if case.monitor_s is not None:
            cmd += ["--monitor-interval", str(case.monitor_s)]
        cmd += ["-m", "ingest.torch.run", "-m"] if case.traced else ["-m"]
        cmd += ["bench.real.workload", "--shape", case.shape, "--steps", str(case.steps),
                "--pp", str(case.pp), "--tp", str(case.tp), "--microbatches",
                str(case.microbatches), "--truth-dir", str(cdir), "--job", job]
        if case.device_scale != 1.0:
            cmd += ["--device-scale", str(case.device_scale)]
        if case.fault:
            cmd += ["--fault", json.dumps(case.fault)]
        train = self.host_process(cmd, env=env,
                                  stdout=open(cdir / "train.log", "wb"),  # noqa: SIM115
                                  stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        limit = 120 + case.steps * 0.05 * 4
        fault_file = cdir / "fault.json"
        onset_mono: float | None = None
        try:
            while train.poll() is None:
                self.poll(0.5)
                if onset_mono is None and fault_file.exists():
                    onset_mono = time.monotonic()
                if case.hangs and onset_mono is not None and \
                        time.monotonic() - onset_mono >= HANG_OBSERVE_S:
                    break
                if time.monotonic() - t0 > limit:
                    res.error = f"did not finish within {limit:.0f} s"
                    break
            res.job_s = time.monotonic() - t0
            _stop(train)
            res.exit_code = train.returncode
            _resume(paused)
            if agent is not None:
                self.poll(DRAIN_S)
        finally:
            _resume(paused)
            for h in hogs:
                h.kill()
                h.wait()
            _stop(train, grace=5)
            if agent is not None:
                res.agent_cpu_s = _cpu_s(agent.pid)
                _stop(agent)
            if _reap(str(cdir)):
                self.say(f"  {job}: killed ranks torchrun left running")
        res.wall_s = round(time.monotonic() - t0, 1)
        res.job_s = round(res.job_s, 1)
        for name, attr in (("fault.json", "truth"), ("run.json", "run")):
            with contextlib.suppress(OSError, ValueError):
                setattr(res, attr, json.loads((cdir / name).read_text()))
        if res.run is not None:
            steps = np.asarray(res.run.get("step_ns", []), dtype=np.float64)
            res.step_ms_p50 = round(float(np.median(steps)) / 1e6, 2) if steps.size else None
            if res.truth is not None:
                res.step_ends_ms = steps_after(res.run, int(res.truth["onset_ns"]))
                if res.truth.get("onset_step") is not None:
                    res.job_slowdown = step_ratio(res.run, int(res.truth["onset_step"]))
            res.run["step_ns"] = res.run["step_end_ns"] = []  # keep the report small
        try:
            stats = json.loads((cdir / "agent.json").read_text().strip().splitlines()[-1])
            res.agent_records = int(stats.get("read", 0))
        except (OSError, ValueError, IndexError):
            pass
        if case.fault is not None and res.truth is None and not res.error:
            res.error = "the fault never began (see train.log)"
        if case.fault is None and res.exit_code not in (0, None) and not res.error:
            res.error = f"the job failed (exit {res.exit_code}; see train.log)"
        if res.error:
            res.error += f" [{cdir}]"
        score(res, self.diags.get(job, []), self.published)
        return res


def line(r: CaseResult) -> str:
    def b(x: bool) -> str:
        return "y" if x else "."
    if r.control or r.truth is None:
        got = f"incidents {r.incidents}" if r.traced else "untraced"
        if r.diagnoses:
            d = r.diagnoses[0]
            got += f": {d['kind']} {d['ranks'][:4]} {d['stage']} {d['component']} " \
                   f"{d['confidence']:.2f}"
        return f"  {r.case:<24} {'-':<38} {got}{'  ERROR ' + r.error if r.error else ''}"
    t = r.truth
    exp = f"{t['kind'][:4]} {t['ranks']} {t['stage']} {t['component']}"
    if not r.detected:
        return f"  {r.case:<24} {exp[:38]:<38} MISSED (incidents {r.incidents})" + \
            (f"  ERROR {r.error}" if r.error else "")
    g = r.got or {}
    got = f"{g['kind'][:4]} {g['ranks'][:4]} {g['stage']} {g['component']} {g['confidence']:.2f}"
    lat = "" if r.latency_s is None else f"{r.latency_s:.1f}s"
    return (f"  {r.case:<24} {exp[:38]:<38} {b(r.kind_ok)}{b(r.ranks_ok)}{b(r.stage_ok)}"
            f"{b(r.component_ok)} {lat:>6} FA={r.false_alarms}  {got}")


def table(results: Sequence[CaseResult], s: dict[str, Any]) -> str:
    out = [f"  {'case':<24} {'expected (kind ranks stage component)':<38} KRSC  lat_s FA  got",
           *[line(r) for r in results], ""]
    rows = [
        ("cases / faults / controls", f"{s['cases']} / {s['faults']} / {s['controls']}"),
        ("recall / precision", f"{s['recall']} / {s['precision']}"),
        ("kind / ranks / stage / component right",
         f"{s['kind_right']} / {s['ranks_right']} / {s['stage_right']} / "
         f"{s['component_right']} (of detected)"),
        ("all four right", f"{s['all_right']} (of faults)"),
        ("hang onset -> diagnosis p50 / p90 (s)",
         f"{s['hang_latency_s']['p50']} / {s['hang_latency_s']['p90']}"),
        ("slowdown onset -> diagnosis p50 / p90 (steps)",
         f"{s['slowdown_latency_steps']['p50']} / {s['slowdown_latency_steps']['p90']}"),
        (f"  of jobs {FELT - 1:.0%}+ slower (p50 / p90, cases)",
         f"{s['felt_slowdown_latency_steps']['p50']} / "
         f"{s['felt_slowdown_latency_steps']['p90']} ({s['felt_slowdown_latency_steps']['cases']}"
         f"; {s['felt_slowdown_latency_steps']['absorbed']} absorbed by the job)"),
        ("false alarms: controls (per control-hour)",
         f"{s['control_false_alarms']} in {s['control_hours'] * 3600:.0f} s "
         f"({s['false_alarms_per_control_hour']}/h)"),
        ("false alarms in fault cases", f"{s['fault_case_false_alarms']}"),
        ("confidence median: right / wrong",
         f"{s['confidence_right_mean']} / {s['confidence_wrong_mean']}"),
    ]
    if s.get("calibration"):
        rows.append(("versions right, by confidence", ", ".join(
            f"{b['confidence']}: {b['right']} of {b['versions']}"
            for b in s["calibration"] if b["versions"])))
    ov = s.get("overhead", {})
    for shape in ("ddp", "pipeline"):
        if shape in ov:
            o = ov[shape]
            rows.append((f"step p50 untraced / traced+agent ({shape})",
                         f"{o['untraced_step_ms_p50']} / {o['traced_step_ms_p50']} ms "
                         f"({o['overhead_pct']:+.1f} %, {o['runs']} runs)"))
    if "agent" in ov:
        a = ov["agent"]
        rows.append(("agent CPU per 1,000 records", f"{a['cpu_s_per_1000_records']} s "
                     f"({a['records']} records, {a['cpu_s']} CPU-s after start-up, "
                     f"{a['cpu_s_per_job_s']} CPU-s per job-s; start-up "
                     f"{a['startup_cpu_s_p50']} CPU-s)"))
    w = max(len(a) for a, _ in rows)
    out += [f"  {a:<{w}}  {b}" for a, b in rows]
    if s.get("by_fault"):
        out += ["", "  fault      cases detected ranks stage component all-right"]
        out += [f"  {k:<10} {v['cases']:>5} {v['detected']:>8} {v['ranks_right']:>5} "
                f"{v['stage_right']:>5} {v['component_right']:>9} {v['all_right']:>9}"
                for k, v in s["by_fault"].items()]
    if s["errors"]:
        out += ["", "  errors:", *[f"    {e}" for e in s["errors"]]]
    return "\n".join(out)


def run_catalog(cases: Sequence[Case], say: Say, home: Path | None = None,
                settings: Settings | None = None, host_nice: int = HOST_NICE
                ) -> tuple[list[CaseResult], dict[str, Any]]:
    """Run `cases` in turn on one stack (a private one unless `settings` are given: then its
    worker is started on them, its broker used); returns the results and the summary.
    `host_nice`: module docstring, "Priorities"."""
    from ingest.torch import provision

    if provision.torch_site() is None:
        raise RuntimeError(f"no CPU torch for the training processes: {provision.last_error}")
    if any(c.traced for c in cases):
        from ingest import ring
        try:  # without it every traced case runs untraced and scores as missed
            ring.load_library()
        except ring.RingLibraryMissing as e:
            raise RuntimeError(f"the tracer cannot attach: {e} (`make build` builds "
                               "everything)") from None
    results: list[CaseResult] = []
    with tempfile.TemporaryDirectory(prefix="rankwatch-real-") as tmp:
        base = home or Path(tmp)
        with Runner(base, say, settings, tee=home is not None, host_nice=host_nice) as runner:
            for i, case in enumerate(cases, 1):
                say(f"[{i}/{len(cases)}] {case.name}: {case.shape} x{case.nproc}, "
                    f"{case.steps} steps, {case.describe()}")
                r = runner.run_case(case)
                results.append(r)
                say(line(r) + f"   ({r.wall_s:.0f} s; diagnoses so far)")
            say(f"reading the last diagnoses ({SETTLE_S:.0f} s)…")
            runner.poll(SETTLE_S)
            for r in results:
                score(r, runner.diags.get(r.job, []), runner.published)
    return results, summarize(results)


def report(results: Sequence[CaseResult], summary: dict[str, Any]) -> dict[str, Any]:
    return {"mode": "real training (gloo, CPU) through tracer, agent, broker, worker",
            "summary": summary, "cases": [asdict(r) for r in results]}


def rescore(doc: dict[str, Any], workdir: Path, say: Say
            ) -> tuple[list[CaseResult], dict[str, Any]]:
    """Re-score a kept run (`report`'s document, its `--workdir`) from the captures its agents
    wrote: each traced case's batches replayed in process (module docstring). Cases without a
    capture keep their recorded scores (untraced cases have none)."""
    from diagnosis.evaluate import capture_batches, run_batches

    names = {f.name for f in CaseResult.__dataclass_fields__.values()}
    results: list[CaseResult] = []
    cases = doc.get("cases") or []
    for i, c in enumerate(cases, 1):
        r = CaseResult(**{k: v for k, v in c.items() if k in names})
        if not r.step_ends_ms and r.truth is not None:  # a report from before they were kept
            with contextlib.suppress(OSError, ValueError, KeyError):
                run = json.loads((workdir / "cases" / r.job / "run.json").read_text())
                r.step_ends_ms = steps_after(run, int(r.truth["onset_ns"]))
                if r.truth.get("onset_step") is not None:
                    r.job_slowdown = step_ratio(run, int(r.truth["onset_step"]))
        cap = workdir / "cases" / r.job / CAPTURE
        if r.traced and cap.exists():
            batches, epoch = capture_batches(cap)
            diags, _ = run_batches(batches, epoch)
            score(r, diags)
            say(f"[{i}/{len(cases)}] " + line(r))
        elif r.traced:
            say(f"[{i}/{len(cases)}] {r.case}: no capture at {cap}; recorded scores kept")
        results.append(r)
    return results, summarize(results)
