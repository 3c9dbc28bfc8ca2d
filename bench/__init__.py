"""Benchmarks that print figures (DESIGN.md, "Performance principles")."""
