-- 008: how a rank's process ended, on its last heartbeat (ingest.records.Beat `exit_status`):
-- waitpid's form, as the host agent read it from /proc while the process was a zombie. Rows
-- stored before this migration read -1 (unknown), as a beat without the column would.

ALTER TABLE beats ADD COLUMN IF NOT EXISTS exit_status Int64 DEFAULT -1 AFTER exited;
