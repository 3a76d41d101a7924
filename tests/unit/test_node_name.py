"""The client says so when its node name is not the agent's (client/_node.py)."""

from __future__ import annotations

import logging

import pytest

from tierckpt.client._node import _warned, check_node, default_node


def test_default_node_is_tierckpt_node_else_the_host_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    monkeypatch.setenv("TIERCKPT_NODE", "gpu-17")
    assert default_node() == "gpu-17"
    monkeypatch.delenv("TIERCKPT_NODE")
    assert default_node() == socket.gethostname()


def test_a_node_name_other_than_the_agents_is_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    _warned.clear()
    with caplog.at_level(logging.WARNING, logger="tierckpt.client"):
        assert check_node("node-a", "node-a")
        assert check_node("node-a", None)  # an agent that does not say
        assert not caplog.records
        assert not check_node("laptop", "node-a", "http://127.0.0.1:8470")
        assert not check_node("laptop", "node-a")
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "'laptop'" in message and "[server] node = 'node-a'" in message
    assert "TIERCKPT_NODE=node-a" in message and "http://127.0.0.1:8470" in message
