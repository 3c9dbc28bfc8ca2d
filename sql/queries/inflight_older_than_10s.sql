-- Ops in flight for more than 10 s in the job's latest progress window: the hang candidates.
-- Parameters: {job:String}
SELECT window_end, rank, comm_id, last_op_seq, inflight_ops,
       round(oldest_inflight_age_ns / 1e9, 1) AS oldest_age_s, last_beat_ts
FROM progress FINAL
WHERE job_id = {job:String}
  AND window_end = (SELECT max(window_end) FROM progress WHERE job_id = {job:String})
  AND oldest_inflight_age_ns > 10000000000
ORDER BY oldest_inflight_age_ns DESC, rank
