-- Derived tables (streams/derived.py): the progress feed, iterations, kernel summaries, the
-- per-window kernel compression ratio, the derived runner's checkpoint, and dashboard rollups.
-- Columns of progress / iterations / kernel_summaries are the record contract's derived kinds
-- (ingest.records.DERIVED) under the same names, plus job_id and ingest_ts. See sql/README.md.

-- One row per (job, window, rank, comm_id): the feed trigger agents read (also rw.progress).
-- A window recomputed after a restart replaces its rows (same key; newest ingest_ts wins).
CREATE TABLE IF NOT EXISTS progress
(
    job_id                  LowCardinality(String),
    window_end              DateTime64(9, 'UTC') CODEC(Delta, ZSTD),
    rank                    Int32,
    comm_id                 LowCardinality(String),
    last_op_seq             Int64,
    completed_ops           Int64,
    bytes_per_s             Int64,
    op_interval_ns          Int64,
    inflight_ops            Int64,
    oldest_inflight_age_ns  Int64,
    last_beat_ts            DateTime64(9, 'UTC') CODEC(Delta, ZSTD),
    last_record_ts          DateTime64(9, 'UTC') CODEC(Delta, ZSTD),
    ingest_ts               DateTime64(9, 'UTC') DEFAULT now64(9) CODEC(Delta, ZSTD)
)
ENGINE = ReplacingMergeTree(ingest_ts)
PARTITION BY toDate(window_end)
ORDER BY (job_id, window_end, rank, comm_id)
TTL greatest(window_end, ingest_ts) + INTERVAL 1 DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;

-- One row per (job, rank, step). A step recomputed after late records replaces the earlier row
-- (ReplacingMergeTree on the sorting key, newest ingest_ts wins): read with FINAL.
CREATE TABLE IF NOT EXISTS iterations
(
    job_id          LowCardinality(String),
    rank            Int32,
    step            Int64,
    source          LowCardinality(String),
    t_start         DateTime64(9, 'UTC') CODEC(Delta, ZSTD),
    t_end           DateTime64(9, 'UTC') CODEC(Delta, ZSTD),
    step_ns         Int64,
    data_next_wait  Int64,
    model_fwd_loss  Int64,
    model_backward  Int64,
    callbacks       Int64,
    optim_step      Int64,
    step_other      Int64,
    compute_ns      Int64,
    tp_comm_ns      Int64,
    pp_comm_ns      Int64,
    dp_comm_ns      Int64,
    ops             Int64,
    op_bytes        Int64,
    ingest_ts       DateTime64(9, 'UTC') DEFAULT now64(9) CODEC(Delta, ZSTD),
    INDEX t_end_idx t_end TYPE minmax GRANULARITY 1
)
ENGINE = ReplacingMergeTree(ingest_ts)
ORDER BY (job_id, rank, step)
TTL greatest(t_end, ingest_ts) + INTERVAL 30 DAY
SETTINGS non_replicated_deduplication_window = 10000;

-- One row per (job, window, rank, stream, kernel, cluster): ARGUS §5.2 summaries.
CREATE TABLE IF NOT EXISTS kernel_summaries
(
    job_id        LowCardinality(String),
    window_start  DateTime64(9, 'UTC') CODEC(Delta, ZSTD),
    rank          Int32,
    stream        Int64,
    kernel        LowCardinality(String),
    cluster       Int32,
    count         Int64,
    p50_ns        Int64,
    p99_ns        Int64,
    ingest_ts     DateTime64(9, 'UTC') DEFAULT now64(9) CODEC(Delta, ZSTD)
)
ENGINE = ReplacingMergeTree(ingest_ts)
PARTITION BY toDate(window_start)
ORDER BY (job_id, window_start, kernel, rank, stream, cluster)
TTL greatest(window_start, ingest_ts) + INTERVAL 30 DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;

-- One row per (job, kernel window): events in, summary rows out, and their byte ratio.
CREATE TABLE IF NOT EXISTS kernel_windows
(
    job_id             LowCardinality(String),
    window_start       DateTime64(9, 'UTC') CODEC(Delta, ZSTD),
    events             Int64,
    keys               Int64,
    summary_rows       Int64,
    compression_ratio  Float64,
    ingest_ts          DateTime64(9, 'UTC') DEFAULT now64(9) CODEC(Delta, ZSTD)
)
ENGINE = ReplacingMergeTree(ingest_ts)
PARTITION BY toDate(window_start)
ORDER BY (job_id, window_start)
TTL greatest(window_start, ingest_ts) + INTERVAL 30 DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;

-- The derived runner's checkpoint: per job and derived kind, the first window not yet closed and
-- the largest event time seen. Newest `updated` wins.
CREATE TABLE IF NOT EXISTS stream_state
(
    job_id      String,
    kind        LowCardinality(String),
    next_start  Int64,
    max_ns      Int64,
    updated     DateTime64(9, 'UTC') DEFAULT now64(9)
)
ENGINE = ReplacingMergeTree(updated)
ORDER BY (job_id, kind);

-- In-flight ops (t_end = 0) are rare: a minmax index on t_end lets the progress feed find them
-- without reading t_end of every granule.
ALTER TABLE ops ADD INDEX IF NOT EXISTS t_end_idx t_end TYPE minmax GRANULARITY 1;

-- Dashboard rollup: per job and minute (of step end), step-time percentiles over every
-- (rank, step), throughput (steps/s, op bytes/s) and the five slowest ranks by mean step time.
-- Computed on read from iterations FINAL, so late recomputed steps are counted once.
CREATE VIEW IF NOT EXISTS job_minute AS
SELECT job_id,
       minute,
       sum(n) AS rank_steps,
       uniqExactMerge(steps_state) AS steps,
       round(uniqExactMerge(steps_state) / 60, 3) AS steps_per_s,
       quantilesMerge(0.5, 0.9, 0.99)(q_state) AS step_ns_p50_p90_p99,
       max(max_ns) AS step_ns_max,
       toInt64(sum(bytes) / 60) AS op_bytes_per_s,
       arraySlice(arrayReverseSort(x -> x.2, groupArray((rank, mean_ns))), 1, 5)
           AS slowest_ranks
FROM
(
    SELECT job_id, toStartOfMinute(t_end) AS minute, rank,
           count() AS n, uniqExactState(step) AS steps_state,
           quantilesState(0.5, 0.9, 0.99)(step_ns) AS q_state,
           max(step_ns) AS max_ns, sum(op_bytes) AS bytes, toInt64(avg(step_ns)) AS mean_ns
    FROM iterations FINAL
    GROUP BY job_id, minute, rank
)
GROUP BY job_id, minute;
