"""The incident page: one HTML page per incident that a person reads in 30 seconds (summary,
every rank's progress around the onset, stage shares culprit vs peers, suspects, evidence, the
next SQL). `data` reads what it shows through a query function (the worker's database or its
SQL endpoint); `svg` draws the plots; `render` writes the self-contained HTML."""
