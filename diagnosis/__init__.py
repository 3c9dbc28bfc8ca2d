"""Triggers and root-cause rules (pure functions), the agents that run them, diagnosis sinks."""
