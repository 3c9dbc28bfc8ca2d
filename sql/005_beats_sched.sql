-- 005: the rank's scheduler counters in every heartbeat (ingest.records.Beat): cumulative ns its
-- training thread ran on a CPU and waited runnable for one (/proc/<pid>/schedstat). Rows stored
-- before this migration read -1 (unknown), as a beat without them would.

ALTER TABLE beats ADD COLUMN IF NOT EXISTS sched_run_ns Int64 DEFAULT -1 AFTER stage_ts;
ALTER TABLE beats ADD COLUMN IF NOT EXISTS sched_wait_ns Int64 DEFAULT -1 AFTER sched_run_ns;
