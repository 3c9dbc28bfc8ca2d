-- 009: the host's CPU pressure during each step (ingest.records.Stage `cpu_pressure_ns`): the time
-- in which some runnable task of the host waited for a CPU, read by the tracer from
-- /proc/pressure/cpu at the step's start and end. Rows stored before this migration read -1
-- (unknown), as a step without it would.

ALTER TABLE stages ADD COLUMN IF NOT EXISTS cpu_pressure_ns Int64 DEFAULT -1 AFTER sched_wait_ns;
