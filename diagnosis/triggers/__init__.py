"""Triggers: cheap always-on detectors over sampled ranks (Mycroft Alg. 1, VenusTrace heartbeat).

- `base.Trigger`: what every trigger returns.
- `sampling`: which ranks to watch (≥ 1 per DP group, ≤ 10 per job, deterministic).
- `mycroft`: Mycroft Alg. 1 — failure (no op completed in Δ) and straggler (throughput halved or
  op interval doubled) over the sampled ranks' op feed.
- `mycroft_progress`: Mycroft's straggler test on the progress feed (per sampled rank and comm,
  over spans of several steps against a running baseline).
- `heartbeat`: VenusTrace/MegaTrace hang timeout — no progress for n × expected step time.
"""

from diagnosis.triggers.base import TRIGGER_KINDS, Trigger, TriggerKind

__all__ = ["TRIGGER_KINDS", "Trigger", "TriggerKind"]
