-- Slowest ranks of a job over the last 10 minutes of its steps (by mean step time), with how far
-- above the job's median they are and where the extra time went (exposed comm vs compute).
-- Parameters: {job:String}
SELECT rank,
       count() AS steps,
       round(avg(step_ns) / 1e6, 2) AS mean_step_ms,
       round(avg(step_ns) / (SELECT median(step_ns) FROM iterations FINAL
                             WHERE job_id = {job:String}
                               AND t_end > (SELECT max(t_end) FROM iterations
                                            WHERE job_id = {job:String}) - INTERVAL 10 MINUTE),
             3) AS vs_job_median,
       round(avg(compute_ns) / 1e6, 2) AS compute_ms,
       round(avg(tp_comm_ns + pp_comm_ns + dp_comm_ns) / 1e6, 2) AS exposed_comm_ms
FROM iterations FINAL
WHERE job_id = {job:String}
  AND t_end > (SELECT max(t_end) FROM iterations WHERE job_id = {job:String}) - INTERVAL 10 MINUTE
GROUP BY rank
ORDER BY mean_step_ms DESC
LIMIT 10
