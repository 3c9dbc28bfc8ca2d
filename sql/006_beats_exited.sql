-- 006: a rank's last heartbeat says its process ended (ingest.records.Beat `exited`): the host
-- agent found the rank's ring without a live producer. Rows stored before this migration read
-- 0 (alive), as a beat without the column would.

ALTER TABLE beats ADD COLUMN IF NOT EXISTS exited Int64 DEFAULT 0 AFTER sched_wait_ns;
