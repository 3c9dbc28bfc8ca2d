"""Exports of a job's records to other tools' formats (`rankwatch export`)."""
