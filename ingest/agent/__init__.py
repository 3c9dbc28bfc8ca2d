"""The per-host agent (`rankwatch agent`): local rings → columnar record batches → Kafka."""
