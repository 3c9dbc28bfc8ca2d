-- 004: the rank's position in every heartbeat (ingest.records.Beat): the step it is in, the stage
-- it is inside ('' between stages or unknown) and when it entered it. Rows stored before this
-- migration read step -1, stage '' and stage_ts 0 (unknown), as a beat without them would.

ALTER TABLE beats ADD COLUMN IF NOT EXISTS step Int64 DEFAULT -1 AFTER dropped;
ALTER TABLE beats ADD COLUMN IF NOT EXISTS stage LowCardinality(String) DEFAULT '' AFTER step;
ALTER TABLE beats ADD COLUMN IF NOT EXISTS stage_ts DateTime64(9, 'UTC') DEFAULT 0 CODEC(Delta, ZSTD) AFTER stage;
