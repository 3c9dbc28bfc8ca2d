-- 003: diagnoses (diagnosis/agents.py): every published version of every incident, the public
-- output of rw.diagnoses kept for a year. One row per (job_id, incident_id, version); `json` is the
-- whole Diagnosis (schema v1, docs/diagnoses.md), the other columns are for SQL. A version
-- published twice (redelivered trigger after a restart) is one row (ReplacingMergeTree on the
-- key). Incident state is rebuilt from this table when the worker starts: the newest version of
-- an incident whose status is not 'resolved' is open.

CREATE TABLE IF NOT EXISTS diagnoses
(
    job_id         LowCardinality(String),
    incident_id    String,
    version        UInt32,
    id             String,
    status         LowCardinality(String),
    kind           LowCardinality(String),
    culprit_ranks  Array(Int32),
    culprit_hosts  Array(String),
    stage          String,
    component      LowCardinality(String),
    confidence     Float32,
    labels         Array(String),
    rules          Array(String),
    onset_ns       Int64,
    detected_ns    Int64,
    detected_ts    DateTime64(9, 'UTC') MATERIALIZED fromUnixTimestamp64Nano(detected_ns),
    summary        String,
    json           String CODEC(ZSTD),
    ingest_ts      DateTime64(9, 'UTC') DEFAULT now64(9) CODEC(Delta, ZSTD)
)
ENGINE = ReplacingMergeTree(ingest_ts)
PARTITION BY toYYYYMM(fromUnixTimestamp64Nano(detected_ns))
ORDER BY (job_id, incident_id, version)
TTL toDateTime(fromUnixTimestamp64Nano(detected_ns)) + INTERVAL 1 YEAR
SETTINGS non_replicated_deduplication_window = 10000;
