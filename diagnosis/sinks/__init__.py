"""Diagnosis sinks: turn rw.diagnoses versions into what on-call tooling speaks.

- `config`: the notify configuration file (sinks, routes) and routing — pure;
- `alertmanager`, `pagerduty`, `slack`, `webhook`: one module per sink, each building the HTTP
  requests for one diagnosis version and classifying the answers (pure);
- `state`: the delivery ledger (ids delivered per sink, active alerts) in SQLite;
- `delivery`: one worker thread per sink that sends, retries with backoff and jitter, and
  dead-letters after N failures;
- `notifier`: the Kafka side (`rankwatch notify`): its own consumer group, offsets committed
  only after every routed sink delivered or dead-lettered the version.
"""
