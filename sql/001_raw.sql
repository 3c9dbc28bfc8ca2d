-- 001: raw record tables (one per columnar kind of ingest.records.COLUMNS), job topologies,
-- the dead-letter table and the writers' own metrics.
--
-- Raw tables: the contract's columns with the contract's names, plus
--   job_id                     the batch's job;
--   src_partition, src_offset  the Kafka message the row came from (-1: not from Kafka); the raw
--                              sink reads its stored-offset watermark from them (minmax indexed);
--   ingest_ts                  when the writer stored the row (default: now).
-- Timestamps are the producer's int64 nanoseconds stored as DateTime64(9, 'UTC') ticks (an
-- unknown t_end is 0 = 1970-01-01). Ordered for diagnosis's main read, one job's time window
-- across all ranks; partitioned by day of the record time. Kept 1 day after the record's time or
-- its storage, whichever is later (whole parts are dropped): a TTL on the record time alone
-- would delete imported old traces (or a host's records whose clock is a day behind) moments
-- after they are stored.
-- non_replicated_deduplication_window makes insert_deduplication_token work on a plain MergeTree.
-- Every statement is idempotent (IF NOT EXISTS): ClickHouse DDL is not transactional.

CREATE TABLE IF NOT EXISTS ops
(
    job_id         LowCardinality(String),
    rank           Int32,
    comm_id        LowCardinality(String),
    op_seq         Int64,
    op             LowCardinality(String),
    bytes          Int64,
    peer           Int32,
    stream         Int64,
    t_enqueue      DateTime64(9, 'UTC') CODEC(Delta, ZSTD),
    t_start        DateTime64(9, 'UTC') CODEC(Delta, ZSTD),
    t_end          DateTime64(9, 'UTC') CODEC(Delta, ZSTD),
    step           Int64,
    src_partition  Int32 DEFAULT -1,
    src_offset     Int64 DEFAULT -1,
    ingest_ts      DateTime64(9, 'UTC') DEFAULT now64(9) CODEC(Delta, ZSTD),
    INDEX src_partition_idx src_partition TYPE minmax GRANULARITY 1,
    INDEX src_offset_idx src_offset TYPE minmax GRANULARITY 1
)
ENGINE = MergeTree
PARTITION BY toDate(t_start)
ORDER BY (job_id, t_start, rank)
TTL greatest(t_start, ingest_ts) + INTERVAL 1 DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS flows
(
    job_id         LowCardinality(String),
    rank           Int32,
    comm_id        LowCardinality(String),
    op_seq         Int64,
    channel        Int32,
    peer           Int32,
    nic            LowCardinality(String),
    bytes          Int64,
    t_start        DateTime64(9, 'UTC') CODEC(Delta, ZSTD),
    t_end          DateTime64(9, 'UTC') CODEC(Delta, ZSTD),
    src_partition  Int32 DEFAULT -1,
    src_offset     Int64 DEFAULT -1,
    ingest_ts      DateTime64(9, 'UTC') DEFAULT now64(9) CODEC(Delta, ZSTD),
    INDEX src_partition_idx src_partition TYPE minmax GRANULARITY 1,
    INDEX src_offset_idx src_offset TYPE minmax GRANULARITY 1
)
ENGINE = MergeTree
PARTITION BY toDate(t_start)
ORDER BY (job_id, t_start, rank)
TTL greatest(t_start, ingest_ts) + INTERVAL 1 DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS chunks
(
    job_id            LowCardinality(String),
    rank              Int32,
    comm_id           LowCardinality(String),
    op_seq            Int64,
    channel           Int32,
    ts                DateTime64(9, 'UTC') CODEC(Delta, ZSTD),
    total_chunks      Int64,
    gpu_ready         Int64,
    rdma_transmitted  Int64,
    rdma_done         Int64,
    src_partition     Int32 DEFAULT -1,
    src_offset        Int64 DEFAULT -1,
    ingest_ts         DateTime64(9, 'UTC') DEFAULT now64(9) CODEC(Delta, ZSTD),
    INDEX src_partition_idx src_partition TYPE minmax GRANULARITY 1,
    INDEX src_offset_idx src_offset TYPE minmax GRANULARITY 1
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (job_id, ts, rank)
TTL greatest(ts, ingest_ts) + INTERVAL 1 DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS stages
(
    job_id          LowCardinality(String),
    rank            Int32,
    step            Int64,
    t_start         DateTime64(9, 'UTC') CODEC(Delta, ZSTD),
    data_next_wait  Int64,
    model_fwd_loss  Int64,
    model_backward  Int64,
    callbacks       Int64,
    optim_step      Int64,
    step_other      Int64,
    device_ns       Int64,
    src_partition   Int32 DEFAULT -1,
    src_offset      Int64 DEFAULT -1,
    ingest_ts       DateTime64(9, 'UTC') DEFAULT now64(9) CODEC(Delta, ZSTD),
    INDEX src_partition_idx src_partition TYPE minmax GRANULARITY 1,
    INDEX src_offset_idx src_offset TYPE minmax GRANULARITY 1
)
ENGINE = MergeTree
PARTITION BY toDate(t_start)
ORDER BY (job_id, t_start, rank)
TTL greatest(t_start, ingest_ts) + INTERVAL 1 DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS kernels
(
    job_id         LowCardinality(String),
    rank           Int32,
    stream         Int64,
    kernel         LowCardinality(String),
    t_start        DateTime64(9, 'UTC') CODEC(Delta, ZSTD),
    duration       Int64,
    src_partition  Int32 DEFAULT -1,
    src_offset     Int64 DEFAULT -1,
    ingest_ts      DateTime64(9, 'UTC') DEFAULT now64(9) CODEC(Delta, ZSTD),
    INDEX src_partition_idx src_partition TYPE minmax GRANULARITY 1,
    INDEX src_offset_idx src_offset TYPE minmax GRANULARITY 1
)
ENGINE = MergeTree
PARTITION BY toDate(t_start)
ORDER BY (job_id, t_start, rank)
TTL greatest(t_start, ingest_ts) + INTERVAL 1 DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS wr
(
    job_id         LowCardinality(String),
    rank           Int32,
    nic            LowCardinality(String),
    ts             DateTime64(9, 'UTC') CODEC(Delta, ZSTD),
    inflight       Int64,
    bytes_done     Int64,
    src_partition  Int32 DEFAULT -1,
    src_offset     Int64 DEFAULT -1,
    ingest_ts      DateTime64(9, 'UTC') DEFAULT now64(9) CODEC(Delta, ZSTD),
    INDEX src_partition_idx src_partition TYPE minmax GRANULARITY 1,
    INDEX src_offset_idx src_offset TYPE minmax GRANULARITY 1
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (job_id, ts, rank)
TTL greatest(ts, ingest_ts) + INTERVAL 1 DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;

CREATE TABLE IF NOT EXISTS beats
(
    job_id         LowCardinality(String),
    rank           Int32,
    ts             DateTime64(9, 'UTC') CODEC(Delta, ZSTD),
    comm_id        LowCardinality(String),
    last_op_seq    Int64,
    dropped        Int64,
    src_partition  Int32 DEFAULT -1,
    src_offset     Int64 DEFAULT -1,
    ingest_ts      DateTime64(9, 'UTC') DEFAULT now64(9) CODEC(Delta, ZSTD),
    INDEX src_partition_idx src_partition TYPE minmax GRANULARITY 1,
    INDEX src_offset_idx src_offset TYPE minmax GRANULARITY 1
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (job_id, ts, rank)
TTL greatest(ts, ingest_ts) + INTERVAL 1 DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;

-- Job topologies (the compacted rw.jobs topic): the newest ts per job wins (read with FINAL or
-- argMax). Communicators are parallel arrays for SQL (arrayJoin); `topology` is the JobTopology
-- JSON document for code (JobTopology.model_validate_json). hosts[rank + 1] is a rank's host.
CREATE TABLE IF NOT EXISTS jobs
(
    job_id        String,
    ts            DateTime64(9, 'UTC'),
    world_size    UInt32,
    tp            UInt32,
    pp            UInt32,
    dp            UInt32,
    ep            UInt32,
    cp            UInt32,
    rank_order    LowCardinality(String),
    microbatches  UInt32,
    schedule      LowCardinality(String),
    hosts         Array(LowCardinality(String)),
    comm_ids      Array(String),
    comm_kinds    Array(LowCardinality(String)),
    comm_members  Array(Array(UInt32)),
    topology      String CODEC(ZSTD),
    ingest_ts     DateTime64(9, 'UTC') DEFAULT now64(9)
)
ENGINE = ReplacingMergeTree(ts)
ORDER BY job_id
SETTINGS non_replicated_deduplication_window = 10000;

-- Rejected batches (the rw.dlq topic): where the bad message was, the first violation (field,
-- row, reason; row -1 = the whole batch) and the message itself. Kept 30 days.
CREATE TABLE IF NOT EXISTS dlq
(
    ts         DateTime64(9, 'UTC') CODEC(Delta, ZSTD),
    topic      LowCardinality(String),
    partition  Int32,
    offset     Int64,
    field      String,
    row        Int64,
    reason     String,
    payload    String CODEC(ZSTD(3))
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (topic, ts)
TTL ts + INTERVAL 30 DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;

-- What the writers stored, per worker, topic partition and flush: rows, batches (Kafka messages)
-- and end-to-end lag (ingest time minus each row's record time). Kept 30 days.
CREATE TABLE IF NOT EXISTS ingest_metrics
(
    ts          DateTime64(3, 'UTC') CODEC(Delta, ZSTD),
    worker      LowCardinality(String),
    topic       LowCardinality(String),
    partition   Int32,
    rows        UInt64,
    batches     UInt32,
    lag_p50_ms  Float64,
    lag_max_ms  Float64
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (topic, partition, ts)
TTL ts + INTERVAL 30 DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;
