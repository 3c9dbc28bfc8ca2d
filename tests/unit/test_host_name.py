"""The host a traced rank reports: RANKWATCH_NODE_NAME when set (a container whose own hostname is
not its node's), else the machine's name; blank means unset."""

from __future__ import annotations

import socket

import pytest

from ingest.torch.comms import host_name


def test_the_host_is_the_machines_unless_rankwatch_host_names_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANKWATCH_NODE_NAME", raising=False)
    assert host_name() == socket.gethostname()
    monkeypatch.setenv("RANKWATCH_NODE_NAME", "node-17")
    assert host_name() == "node-17"
    monkeypatch.setenv("RANKWATCH_NODE_NAME", "  ")
    assert host_name() == socket.gethostname()
