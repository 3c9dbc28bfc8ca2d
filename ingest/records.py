"""The record contract: one pydantic model per record kind, and the column specs derived from them.

The models are the single source of truth for field names, types and validation rules
(docs/records.md). They are *not* the in-memory representation of a batch: a batch is a set of
numpy columns (see `ingest.batch`), validated column-wise by the rules these models declare. A
unit test checks that the vectorized rules accept and reject exactly what the models do.

Conventions (DESIGN.md, "The record contract"):
- timestamps are int64 nanoseconds of the producing host's realtime clock;
- a timestamp that does not exist yet (an op still in flight) is 0, never null;
- `step` is -1 when the producer does not know it; `peer` is -1 for collectives;
- names (comm_id, op, kernel, nic) are short strings, dictionary-encoded on the wire.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args, get_origin

import annotated_types
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

CONTRACT_VERSION = 1

Rank = Annotated[int, Field(ge=0, lt=1 << 31, json_schema_extra={"dtype": "int32"})]
Peer = Annotated[int, Field(ge=-1, lt=1 << 31, json_schema_extra={"dtype": "int32"})]
Count = Annotated[int, Field(ge=0)]
Small = Annotated[int, Field(ge=0, lt=1 << 31, json_schema_extra={"dtype": "int32"})]
Ns = Annotated[int, Field(ge=0)]
Step = Annotated[int, Field(ge=-1)]
Name = Annotated[str, Field(min_length=1, max_length=256)]
OptName = Annotated[str, Field(max_length=256)]

OpName = Literal[
    "AllReduce",
    "AllGather",
    "ReduceScatter",
    "Reduce",
    "Broadcast",
    "AllToAll",
    "Send",
    "Recv",
    "Barrier",
]
CommKind = Literal["tp", "pp", "dp", "ep", "cp", "world"]


class Record(BaseModel):
    """Base of every columnar record kind: strict types, no unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class Op(Record):
    """One collective or p2p call on one rank (Mycroft's op log; VenusTrace's NCCL API hook)."""

    rank: Rank
    comm_id: Name
    op_seq: Count  # per communicator, starts at 0, +1 per call on that communicator
    op: OpName
    bytes: Count
    peer: Peer = -1  # the other rank of a Send/Recv; -1 for collectives
    stream: Count = 0
    t_enqueue: Ns
    t_start: Ns
    t_end: Ns = 0  # 0 while in flight
    step: Step = -1


class Flow(Record):
    """One channel/peer connection of an op (Mycroft's flow log)."""

    rank: Rank
    comm_id: Name
    op_seq: Count
    channel: Small
    peer: Peer
    nic: OptName = ""
    bytes: Count
    t_start: Ns
    t_end: Ns = 0


class Chunk(Record):
    """A progress snapshot of an in-flight op on one channel, every ~100 ms (Mycroft §4.2, Table 4).

    Counters are cumulative for the op on that channel: chunks the GPU has made ready, chunks the
    NIC has posted (RDMA transmitted) and chunks whose completion came back (RDMA done).
    """

    rank: Rank
    comm_id: Name
    op_seq: Count
    channel: Small
    ts: Ns
    total_chunks: Count
    gpu_ready: Count
    rdma_transmitted: Count
    rdma_done: Count


class Stage(Record):
    """One rank's stage vector for one step (StageFrontier's six-stage contract), durations in ns.

    `t_start` is the step's start on that rank; the six durations sum to the step time because
    `step_other` is the residual. `device_ns` is sampled GPU time for the step, -1 when unsampled.
    `sched_wait_ns` is the time the rank's training thread spent runnable but waiting for a CPU
    during the step (Linux schedstat, read at its start and end; -1 when unknown).
    `cpu_pressure_ns` is the time during the step in which some runnable task of the rank's host
    waited for a CPU (Linux PSI, /proc/pressure/cpu `some` total, read at the step's start and
    end; -1 when unknown): new demand on the host's CPUs shows here whatever it crowds.
    """

    rank: Rank
    step: Count
    t_start: Ns
    data_next_wait: Count
    model_fwd_loss: Count
    model_backward: Count
    callbacks: Count
    optim_step: Count
    step_other: Count
    device_ns: Annotated[int, Field(ge=-1)] = -1
    sched_wait_ns: Annotated[int, Field(ge=-1)] = -1
    cpu_pressure_ns: Annotated[int, Field(ge=-1)] = -1


class Kernel(Record):
    """One GPU kernel execution (ARGUS §4, CUPTI concurrent-kernel activity)."""

    rank: Rank
    stream: Count
    kernel: Name
    t_start: Ns
    duration: Count


class WorkRequest(Record):
    """An RDMA work-request sample (VenusTrace/MegaTrace §4: in-flight WRs, completed bytes)."""

    rank: Rank
    nic: Name
    ts: Ns
    inflight: Count
    bytes_done: Count  # cumulative since the NIC's counters were opened


#: A beat's stage: StageFrontier's ordered stages (ingest.torch.events.STAGES), "" for none.
StageName = Literal["", "data.next_wait", "model.fwd_loss", "model.backward", "callbacks",
                    "optim.step"]


class Beat(Record):
    """A liveness heartbeat: one row per rank and communicator (comm_id "" for a rank with none).

    `sched_run_ns` / `sched_wait_ns`: how long the rank's training thread has run on a CPU and
    waited runnable for one (Linux schedstat, cumulative): a rank starved of CPU by its
    neighbours waits where its peers run.

    `step`, `stage` and `stage_ts` are the rank's position when the beat was taken, from its stage
    clock (ingest/torch/stages.py): the step it is in, the stage it is inside ("" between stages
    or unknown) and when it entered that stage — or left its last one, when "" (0: unknown). A
    rank hung inside a stage keeps beating with the same position.

    `exited` 1: the rank's process has ended — the host agent found its tracer's ring without a
    live producer (killed, crashed or finished). That row is the rank's last beat: `ts` is when
    the agent saw the process ended (to a few ms where it watches the process's pidfd, else the
    beat's time), the position the last one the process published. A job whose ranks end is
    analysed as of that moment (diagnosis.hang_rca.process_exit). `exit_status`, on that row:
    how the process ended, in waitpid's form (signal in the low 7 bits, exit code in the next
    8), as the kernel kept it until the launcher reaped the process; -1 unknown (reaped first,
    no pidfd, not an exit row).
    """

    rank: Rank
    ts: Ns
    comm_id: OptName = ""
    last_op_seq: Annotated[int, Field(ge=-1)] = -1
    dropped: Count = 0  # records the rank's tracepoints dropped so far (ring full)
    step: Step = -1
    stage: StageName = ""
    stage_ts: Ns = 0
    # the rank's main thread's scheduler counters (/proc/<pid>/schedstat): time on a CPU and
    # time runnable but waiting for one, cumulative ns; -1 unknown (another host's pid
    # namespace, the NCCL plugin's beats)
    sched_run_ns: Annotated[int, Field(ge=-1)] = -1
    sched_wait_ns: Annotated[int, Field(ge=-1)] = -1
    exited: Annotated[int, Field(ge=0, lt=2)] = 0
    exit_status: Annotated[int, Field(ge=-1, lt=1 << 16)] = -1


def exit_signal(status: int) -> int:
    """The signal that ended a process of exit status `status` (`Beat.exit_status`, waitpid's
    form): 0 when it exited, -1 when unknown."""
    return -1 if status < 0 else status & 0x7F


def exit_code(status: int) -> int:
    """The code a process of exit status `status` exited with; -1 when unknown or a signal
    ended it."""
    return -1 if status < 0 or status & 0x7F else (status >> 8) & 0xFF


class Communicator(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    comm_id: Name
    kind: CommKind
    members: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)


class JobTopology(BaseModel):
    """A job's topology: the one record of the compacted `rw.jobs` topic, keyed by job_id."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: Name
    ts: Ns
    world_size: Annotated[int, Field(ge=1)]
    tp: Annotated[int, Field(ge=1)] = 1
    pp: Annotated[int, Field(ge=1)] = 1
    dp: Annotated[int, Field(ge=1)] = 1
    ep: Annotated[int, Field(ge=1)] = 1
    cp: Annotated[int, Field(ge=1)] = 1
    rank_order: str = "tp-cp-ep-dp-pp"
    microbatches: Annotated[int, Field(ge=1)] = 1
    schedule: Literal["1f1b", "gpipe", "none"] = "1f1b"
    hosts: list[Name]  # hosts[rank] is the host that runs the rank
    communicators: list[Communicator] = []
    #: where each of tp, pp, dp, microbatches, schedule came from: "given" by the launcher
    #: (RANKWATCH_TP/PP/DP/MICROBATCHES), "inferred" from the ops (the p2p pattern,
    #: ingest/agent/shape.py) or "default" (assumed); empty when the producer does not say
    shape_source: dict[str, Literal["given", "inferred", "default"]] = {}

    @model_validator(mode="after")
    def _consistent(self) -> JobTopology:
        if self.tp * self.pp * self.dp * self.cp != self.world_size:
            raise ValueError(
                f"world_size={self.world_size} but tp*pp*dp*cp="
                f"{self.tp * self.pp * self.dp * self.cp}"
            )
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp}")
        if len(self.hosts) != self.world_size:
            raise ValueError(
                f"hosts has {len(self.hosts)} entries, world_size is {self.world_size}")
        for comm in self.communicators:
            bad = [m for m in comm.members if m >= self.world_size]
            if bad:
                raise ValueError(f"communicator {comm.comm_id}: members {bad[:5]} >= world_size")
            if len(set(comm.members)) != len(comm.members):
                raise ValueError(f"communicator {comm.comm_id}: duplicate members")
        return self


# ---------------------------------------------------------------------------------------------
# Which kind of communicator a comm_id is
#
# One decision, used by the derived streams (numpy and ClickHouse SQL), by diagnosis (the rules
# through `diagnosis.groups.Grid.kind_of`) and by the operator's queries (the SQL, reading the
# topology from the jobs table):
#   1. the kind the job's topology declares for the comm_id (`Communicator.kind`);
#   2. else the comm_id's name: its part before the first ':' when that part is a kind (the
#      naming the simulator, the topology synthesis and the pipeline inference use:
#      `dp:pp0:tp1`, `pp:inferred:0`); a name that merely begins with those letters
#      (`dp0`, `ppc`) says nothing;
#   3. else unknown ("").
# The derived tables store a kind as a small code (`Iteration` *_comm_ns columns): tp, pp and dp
# have their own; every other kind and unknown share COMM_KIND_OTHER.

COMM_KINDS: tuple[str, ...] = get_args(CommKind)
#: separator ending the kind part of a comm_id (rule 2)
COMM_KIND_SEP = ":"
COMM_KIND_CODES: dict[str, int] = {"tp": 0, "pp": 1, "dp": 2}
COMM_KIND_OTHER = 3


def comm_kind_by_name(comm_id: str) -> str:
    """Rule 2 alone: the kind a comm_id's name says, "" when it says none."""
    head = comm_id.split(COMM_KIND_SEP, 1)[0]
    return head if head in COMM_KINDS else ""


def comm_kind(comm_id: str, declared: Mapping[str, str]) -> str:
    """The kind of one communicator (rules above); `declared`: comm_id -> kind from the job's
    topology (empty when it has not arrived)."""
    kind = declared.get(comm_id)
    return kind if kind is not None else comm_kind_by_name(comm_id)


def comm_kinds(comm_ids: Iterable[object], declared: Mapping[str, str]) -> np.ndarray:
    """`comm_kind` of each id (object array); callers pass distinct ids (dictionary values)."""
    return np.asarray([comm_kind(str(c), declared) for c in comm_ids], dtype=object)


def comm_kind_codes(comm_ids: np.ndarray, declared: Mapping[str, str]) -> np.ndarray:
    """int8 kind code (COMM_KIND_CODES, else COMM_KIND_OTHER) of each of many ops' comm_ids:
    one decision per distinct id."""
    names, inverse = np.unique(np.asarray(comm_ids).astype(str), return_inverse=True)
    table = np.array([COMM_KIND_CODES.get(k, COMM_KIND_OTHER) for k in comm_kinds(names, declared)],
                     dtype=np.int8)
    return table[inverse.reshape(-1)] if len(names) else np.zeros(0, np.int8)


def comm_name_sql(column: str = "comm_id") -> str:
    """ClickHouse SQL: the part of `column` rule 2 reads (compare it with a kind)."""
    return f"splitByChar('{COMM_KIND_SEP}', toString({column}))[1]"


def kind_code_sql(kind: str) -> str:
    """ClickHouse SQL: the code (COMM_KIND_CODES, else COMM_KIND_OTHER) of the kind the SQL
    expression `kind` names."""
    known = ", ".join(f"'{k}'" for k in COMM_KIND_CODES)
    code = ", ".join(str(c) for c in COMM_KIND_CODES.values())
    return f"transform({kind}, [{known}], [{code}], {COMM_KIND_OTHER})"


def comm_kind_code_sql(column: str = "comm_id", ids: str = "{ids:Array(String)}",
                       codes: str = "{codes:Array(Int8)}") -> str:
    """ClickHouse SQL: the kind code (as `comm_kind_codes`) of `column`, given the topology's
    declared comm_ids and their codes as two arrays (`ids`, `codes`: query parameters by
    default, aligned with `declared_codes`; or SQL that reads them from the jobs table,
    diagnosis.engine.declared_codes_sql)."""
    return (f"toInt8(transform(toString({column}), {ids}, {codes}, "
            f"{kind_code_sql(comm_name_sql(column))}))")


def declared_codes(communicators: Iterable[tuple[str, str]]) -> tuple[list[str], list[int]]:
    """The (`ids`, `codes`) arrays `comm_kind_code_sql` takes, from (comm_id, kind) pairs."""
    ids: list[str] = []
    codes: list[int] = []
    for comm_id, kind in communicators:
        ids.append(str(comm_id))
        codes.append(COMM_KIND_CODES.get(str(kind), COMM_KIND_OTHER))
    return ids, codes


# ---------------------------------------------------------------------------------------------
# Column specs derived from the models


@dataclass(frozen=True)
class Column:
    """How one model field travels as a numpy column, with its vectorizable rules."""

    name: str
    kind: Literal["int", "str"]
    dtype: np.dtype[Any]
    required: bool
    default: Any
    ge: int | None = None
    lt: int | None = None
    min_len: int = 0
    max_len: int | None = None
    choices: frozenset[str] | None = None


def _column(name: str, info: Any) -> Column:
    ann = info.annotation
    required = info.is_required()
    default = None if required else info.default
    ge = lt = max_len = None
    min_len = 0
    dtype = "int64"
    for meta in info.metadata:
        if isinstance(meta, annotated_types.Ge):
            ge = int(meta.ge)  # type: ignore[call-overload]
        elif isinstance(meta, annotated_types.Lt):
            lt = int(meta.lt)  # type: ignore[call-overload]
        elif isinstance(meta, annotated_types.MinLen):
            min_len = meta.min_length
        elif isinstance(meta, annotated_types.MaxLen):
            max_len = meta.max_length
    extra = info.json_schema_extra
    if isinstance(extra, dict) and "dtype" in extra:
        dtype = str(extra["dtype"])
    if ann is int:
        return Column(name, "int", np.dtype(dtype), required, default, ge, lt)
    if ann is str:
        return Column(name, "str", np.dtype(object), required, default, None, None, min_len,
                      max_len)
    if get_origin(ann) is Literal:
        return Column(
            name, "str", np.dtype(object), required, default, choices=frozenset(get_args(ann))
        )
    raise TypeError(f"field {name}: unsupported column type {ann!r}")


def columns_of(model: type[Record]) -> tuple[Column, ...]:
    return tuple(_column(n, f) for n, f in model.model_fields.items())


# ---------------------------------------------------------------------------------------------
# Derived kinds: what the streams layer computes from raw records and publishes (rw.<kind>) and
# stores (a table of the same name). Same wire format and column rules as the raw kinds.

StepSource = Literal["stages", "dp_collective"]


class Progress(Record):
    """One rank and communicator in one short window of a job: the progress feed (rw.progress,
    keyed by job_id) that trigger agents read (Mycroft Alg. 1, VenusTrace heartbeats).

    Computed over the records of the job seen up to the window's end (`window_end`, ns, event
    time). `last_op_seq` is the highest op_seq completed on the communicator by then (−1: none
    yet); `completed_ops`, `bytes_per_s` (bytes of those ops / window length, integer) and
    `op_interval_ns` ((last end − first end) / (completed − 1) over the ops that completed inside
    the window; −1 below two) describe the window itself. `inflight_ops` counts ops started and
    not completed by `window_end`, `oldest_inflight_age_ns` is `window_end` minus the oldest one's
    t_start (0: none). `last_beat_ts` is the newest heartbeat's ts (0: none), `last_record_ts` the
    newest op/beat time seen from the rank on this communicator.
    """

    window_end: Ns
    rank: Rank
    comm_id: OptName = ""
    last_op_seq: Annotated[int, Field(ge=-1)] = -1
    completed_ops: Count = 0
    bytes_per_s: Count = 0
    op_interval_ns: Annotated[int, Field(ge=-1)] = -1
    inflight_ops: Count = 0
    oldest_inflight_age_ns: Count = 0
    last_beat_ts: Ns = 0
    last_record_ts: Ns = 0


class Iteration(Record):
    """One training step on one rank. `source` says where the step boundaries came from: the
    rank's `stages` record (StageFrontier's stage vector, exact), or the end of the DP gradient
    collective (VenusTrace's rule: step k ends when the rank's k-th DP AllReduce/ReduceScatter
    ends, and starts when step k−1 ended). The six stage durations are −1 without stage records.

    `tp_comm_ns`, `pp_comm_ns`, `dp_comm_ns` are the rank's exposed communication time per group
    kind inside the step (the union of its calls' [t_start, t_end) on communicators of that kind,
    clipped to the step); `compute_ns` is the step time minus the union over all kinds. `ops` and
    `op_bytes` count the completed calls that ended inside the step.
    """

    rank: Rank
    step: Count
    source: StepSource
    t_start: Ns
    t_end: Ns
    step_ns: Count
    data_next_wait: Step = -1
    model_fwd_loss: Step = -1
    model_backward: Step = -1
    callbacks: Step = -1
    optim_step: Step = -1
    step_other: Step = -1
    compute_ns: Count = 0
    tp_comm_ns: Count = 0
    pp_comm_ns: Count = 0
    dp_comm_ns: Count = 0
    ops: Count = 0
    op_bytes: Count = 0


class KernelSummary(Record):
    """One KDE cluster of one (rank, stream, kernel) in one window (ARGUS §5.2): the cluster's
    event count and its p50/p99 duration in ns (interpolated quantiles, rounded). `cluster` counts
    from 0 in ascending duration within the key and window; `window_start` is in ns."""

    window_start: Ns
    rank: Rank
    stream: Count
    kernel: Name
    cluster: Small
    count: Count
    p50_ns: Count
    p99_ns: Count


#: Columnar record kinds, by the name used in the wire format and topic names (rw.<kind>).
MODELS: dict[str, type[Record]] = {
    "ops": Op,
    "flows": Flow,
    "chunks": Chunk,
    "stages": Stage,
    "kernels": Kernel,
    "wr": WorkRequest,
    "beats": Beat,
}
#: Derived kinds the streams layer computes and publishes; raw agents do not subscribe to them.
DERIVED: dict[str, type[Record]] = {
    "progress": Progress,
    "iterations": Iteration,
    "kernel_summaries": KernelSummary,
}
#: Column specs of every columnar kind, raw and derived (the wire format covers both).
COLUMNS: dict[str, tuple[Column, ...]] = {
    k: columns_of(m) for k, m in {**MODELS, **DERIVED}.items()
}
#: Every raw kind, including the non-columnar topology record.
KINDS: tuple[str, ...] = ("jobs", *MODELS)
