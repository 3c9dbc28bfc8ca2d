-- One rank's StageFrontier stage vector over time (ms per stage per step).
-- Parameters: {job:String}, {rank:Int32}
SELECT step, t_start, source,
       round(step_ns / 1e6, 2) AS step_ms,
       round(data_next_wait / 1e6, 2) AS data_ms,
       round(model_fwd_loss / 1e6, 2) AS fwd_ms,
       round(model_backward / 1e6, 2) AS bwd_ms,
       round(callbacks / 1e6, 2) AS callbacks_ms,
       round(optim_step / 1e6, 2) AS optim_ms,
       round(step_other / 1e6, 2) AS other_ms
FROM iterations FINAL
WHERE job_id = {job:String} AND rank = {rank:Int32}
ORDER BY step
