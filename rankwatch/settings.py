"""One frozen, typed settings object, built once at start-up and passed down.

Sources, lowest to highest precedence: defaults, environment variables `RANKWATCH_<FIELD>`
(upper case), explicit overrides (CLI flags). Nothing reads the environment at import time.
"""

from __future__ import annotations

import calendar
import difflib
import os
import warnings
from collections.abc import Mapping
from datetime import date
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from ingest.topics import Topics
from ingest.units import SECOND

Port = Annotated[int, Field(ge=1, le=65535)]
#: Node i (1-based) of a local Kafka cluster listens on kafka_port and kafka_controller_port plus
#: KAFKA_NODE_PORT_STRIDE·(i-1): 9092/9093, 9192/9193, 9292/9293 by default.
KAFKA_NODE_PORT_STRIDE = 100


def _default_home() -> Path:
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "rankwatch"


def _default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rankwatch"


class SettingsError(ValueError):
    """Bad settings: names the variable, the value and what was expected."""


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Where the local stack keeps its state: broker logs, embedded ClickHouse, pid files.
    home: Path = Field(default_factory=_default_home)
    #: Where downloaded jars are cached (outside the repo, shared by clones).
    cache_dir: Path = Field(default_factory=_default_cache)
    #: Address the local services bind to; loopback unless deliberately opened.
    bind_host: str = "127.0.0.1"
    kafka_port: Port = 9092
    kafka_controller_port: Port = 9093
    #: Kafka bootstrap servers; empty means the local broker at bind_host:kafka_port.
    kafka_bootstrap: str = ""
    kafka_version: str = "3.9.1"
    kafka_partitions: Annotated[int, Field(ge=1, le=1024)] = 6
    kafka_heap: str = "512m"
    #: Local Kafka nodes `rankwatch up` runs as one KRaft cluster (`--brokers`): node i listens
    #: on kafka_port + 100·(i-1) (and the controller port likewise). 3 gives topics three
    #: copies with two in sync, so one broker may be lost.
    kafka_brokers: Annotated[int, Field(ge=1, le=9)] = 1
    #: The worker's consumer-group session: a worker killed without leaving the group holds its
    #: partitions this long, so its replacement waits this long to consume (Faust's 60 s made a
    #: restart after a crash take a minute).
    kafka_session_timeout_s: Annotated[float, Field(ge=6, le=300)] = 20.0
    #: ClickHouse: `chdb:///path` (embedded, default <home>/clickhouse) or `http(s)://host:port`.
    clickhouse_url: str = ""
    clickhouse_database: str = "rankwatch"
    #: A cluster of the server's remote_servers: the schema goes ON CLUSTER as replicated tables
    #: behind Distributed ones sharded by job (streams/cluster.py). Needs a server URL.
    clickhouse_cluster: Annotated[str, Field(pattern=r"^([A-Za-z_][A-Za-z0-9_]*)?$")] = ""
    #: The worker's SQL endpoint (read-only unless sql_writable) for `rankwatch sql`.
    sql_port: Port = 8124
    sql_writable: bool = False
    #: The worker's Prometheus metrics at http://bind_host:metrics_port/metrics (0: off).
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 8125
    #: The worker's incident pages at http://bind_host:page_port/ (0: off).
    page_port: Annotated[int, Field(ge=0, le=65535)] = 8128
    #: With several local workers (`rankwatch up --workers N`): the loopback port where the
    #: store process serves the embedded ClickHouse to the workers (streams/store_server.py),
    #: and the token they present (`up` makes a random one when empty).
    store_port: Port = 8127
    store_token: SecretStr = SecretStr("")
    #: The token the SQL endpoint requires of every query (required to bind beyond loopback).
    sql_token: SecretStr = SecretStr("")
    #: Limits of one query through the endpoint (set before readonly=1: a query cannot raise
    #: them) and how many run at once, each on its own thread.
    sql_max_execution_time_s: Annotated[int, Field(ge=1, le=86400)] = 60
    sql_max_memory_mb: Annotated[int, Field(ge=16, le=1 << 20)] = 2048
    sql_max_result_mb: Annotated[int, Field(ge=1, le=1 << 20)] = 512
    sql_concurrency: Annotated[int, Field(ge=1, le=64)] = 2
    #: On a ClickHouse server: the user the SQL endpoint's queries run as (empty: the writer's
    #: own). Give it SELECT on the database and nothing else, and the `rankwatch_sql` settings
    #: profile (docs/architecture.md, "On a ClickHouse server"): the server then refuses writes,
    #: file/url/remote/s3 and limits above the profile's, whatever a query asks.
    sql_clickhouse_user: str = ""
    sql_clickhouse_password: SecretStr = SecretStr("")
    #: How much lower the CPU priority (Linux nice) of the endpoint's queries is than the
    #: worker's own threads: ingest, windows and diagnosis get the CPU first under a storm.
    sql_nice: Annotated[int, Field(ge=0, le=19)] = 10
    #: A query still running this long past its time limit is reported stuck (/ping, status).
    sql_stuck_grace_s: Annotated[float, Field(ge=0, le=86400)] = 30.0
    #: A batch not stored, or a partition with messages waiting and no commit, for this long
    #: is a stalled consumer (/ping answers 503, `rankwatch status` says unhealthy).
    worker_stall_s: Annotated[float, Field(ge=1, le=86400)] = 120.0
    topic_prefix: str = "rw"
    #: Writer batching: one insert per partition for at most this many Kafka messages (each a
    #: record batch of up to ~1 MiB) or what arrived within this many seconds, whichever first.
    writer_max_messages: Annotated[int, Field(ge=1, le=100_000)] = 256
    writer_max_seconds: Annotated[float, Field(gt=0, le=60)] = 0.5
    #: … and for the kinds a diagnosis waits on (ops, stages, beats, jobs:
    #: `streams.app.LATENCY_KINDS`) at most this many seconds: a batch waits for the writer's
    #: timer, on average half of it (0.5 s cost the real catalog's slowdowns 3 steps at the
    #: median). Fewer seconds, more inserts: at most one per this many seconds per kind while
    #: records trickle in.
    writer_latency_seconds: Annotated[float, Field(gt=0, le=60)] = 0.1
    worker_id: str = "worker-1"
    #: Derived streams (streams/derived.py): event-time windows close at max event time seen
    #: minus this lateness; window widths of the progress feed, iterations and kernel summaries.
    derived_lateness_s: Annotated[float, Field(ge=0, le=3600)] = 2.0
    progress_window_s: Annotated[float, Field(gt=0, le=3600)] = 1.0
    iteration_window_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    kernel_window_s: Annotated[float, Field(gt=0, le=3600)] = 60.0
    #: Loggers whose debug lines the worker writes, comma-separated (`diagnosis.analyst`: every
    #: trigger's analysis, slowdown try and sweep, with the moment it read up to, how far that
    #: was behind the wall clock and what it cost), above the worker's --loglevel.
    debug_loggers: Annotated[str, Field(pattern=r"^([A-Za-z_][\w.]*(,[A-Za-z_][\w.]*)*)?$",
                                        max_length=1000)] = ""
    #: A stretch of a job's event time longer than this without a record of a derived kind's
    #: inputs is skipped by its windows, not closed one by one (streams/windows.py, "Gaps"): a
    #: batch a year older than the rest of its job costs a few windows, not 31 M.
    derived_gap_s: Annotated[float, Field(gt=0, le=86400)] = 600.0
    #: `rankwatch notify`'s configuration file (diagnosis/sinks/config.py); empty: the file
    #: <home>/notify.toml if it exists. `rankwatch up` starts notify when there is one.
    notify_config: str = ""
    #: Plausible event times (streams.raw_sink.TimeBounds): a batch with a nonzero time before
    #: event_time_min (a UTC date), more than event_time_future_s ahead of its producer's clock
    #: (the Kafka message timestamp), more than event_time_past_s behind it (0: no bound, so
    #: imports and replays of old traces pass), or whose record times span more than
    #: event_time_span_s is dead-lettered: it is never stored and never drives a window.
    event_time_min: date = date(2000, 1, 1)
    event_time_future_s: Annotated[float, Field(ge=0, le=10 * 365 * 86400)] = 600.0
    event_time_past_s: Annotated[float, Field(ge=0, le=100 * 365 * 86400)] = 0.0
    event_time_span_s: Annotated[float, Field(gt=0, le=90 * 86400)] = 86400.0

    @field_validator("clickhouse_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if v and not v.startswith(("chdb://", "http://", "https://")):
            raise ValueError("must start with chdb://, http:// or https://")
        return v

    @model_validator(mode="after")
    def _cluster_needs_a_server(self) -> Settings:
        if self.clickhouse_cluster and not self.clickhouse_url.startswith(("http://", "https://")):
            raise ValueError("RANKWATCH_CLICKHOUSE_CLUSTER needs a ClickHouse server: set "
                             "RANKWATCH_CLICKHOUSE_URL=http(s)://host:8123 (the embedded engine "
                             "is one node)")
        return self

    @property
    def bootstrap(self) -> str:
        """The configured cluster, else every local node (rankwatch.kafka.broker.node_ports)."""
        return self.kafka_bootstrap or ",".join(
            f"{self.bind_host}:{self.kafka_port + KAFKA_NODE_PORT_STRIDE * i}"
            for i in range(self.kafka_brokers))

    @property
    def clickhouse(self) -> str:
        return self.clickhouse_url or f"chdb://{self.home / 'clickhouse'}"

    @property
    def topics(self) -> Topics:
        return Topics() if self.topic_prefix == "rw" else Topics.with_prefix(self.topic_prefix)

    @property
    def event_time_min_ns(self) -> int:
        return calendar.timegm(self.event_time_min.timetuple()) * SECOND

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build settings from `env` (default: os.environ) and explicit overrides."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            key = f"RANKWATCH_{name.upper()}"
            if key in env:
                values[name] = env[key]
        known = sorted(f"RANKWATCH_{n.upper()}" for n in cls.model_fields)
        for key in env:
            # other parts of rankwatch read their own RANKWATCH_* variables (the tracer's
            # RANKWATCH_JOB_ID, the native settings): only a near miss of a setting is a typo
            if key.startswith("RANKWATCH_") and key not in known:
                near = difflib.get_close_matches(key, known, n=1, cutoff=0.85)
                if near:
                    warnings.warn(f"{key} is not a setting; did you mean {near[0]}?",
                                  stacklevel=2)
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            lines = []
            for err in e.errors():
                if not err["loc"]:  # a rule across settings: its message names them
                    lines.append(str(err["msg"]).removeprefix("Value error, "))
                    continue
                name = str(err["loc"][0])
                src = (f"--{name.replace('_', '-')}" if overrides.get(name) is not None
                       else f"RANKWATCH_{name.upper()}")
                lines.append(f"{src}={values.get(name)!r}: {err['msg']}")
            raise SettingsError("invalid settings:\n  " + "\n  ".join(lines)) from None
