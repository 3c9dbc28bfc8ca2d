-- A kernel's KDE summaries across ranks (ARGUS §5.2): per window and rank, its clusters as
-- (count, p50, p99), ranks with the highest p99 first.
-- Parameters: {job:String}, {kernel:String}
SELECT window_start, rank, stream,
       groupArray((cluster, count, p50_ns, p99_ns)) AS clusters,
       max(p99_ns) AS worst_p99_ns
FROM kernel_summaries FINAL
WHERE job_id = {job:String} AND kernel = {kernel:String}
GROUP BY window_start, rank, stream
ORDER BY window_start, worst_p99_ns DESC
