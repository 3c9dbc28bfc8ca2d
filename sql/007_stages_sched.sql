-- 007: the time each step's training thread waited runnable for a CPU (ingest.records.Stage,
-- read by the tracer from /proc/thread-self/schedstat at the step's start and end). Rows stored
-- before this migration read -1 (unknown), as a step without it would.

ALTER TABLE stages ADD COLUMN IF NOT EXISTS sched_wait_ns Int64 DEFAULT -1 AFTER device_ns;
