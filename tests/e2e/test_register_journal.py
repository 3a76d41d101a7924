"""End to end: the client's registration journal across a SIGKILL of the agent.

A trainer keeps registering while the real `tierckpt serve` is down; nothing
raises, nothing blocks, and once the agent is back on the same config and
port every registration reaches the catalog and becomes durable.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from devsupport.agent import write_checkpoint
from devsupport.processes import agent_config
from tierckpt.client import CheckpointClient
from tierckpt.client.journal import PENDING_STATE, RegistrationJournal

pytestmark = pytest.mark.e2e


def test_registrations_survive_an_agent_restart(tmp_path: Path) -> None:
    config = agent_config(
        tmp_path, worker={"poll_interval": 0.1, "backoff_base": 0.2, "backoff_max": 2.0}
    )
    ssd, agent = config.ssd, config.serve()
    journal = tmp_path / "journal.jsonl"
    steps = [1, 2, 3, 4, 5]
    for step in steps:
        write_checkpoint(ssd / f"step-{step}", {"w.bin": 256 << 10, "meta.json": b"{}"})

    with agent, CheckpointClient(agent.url, retries=1, timeout=5, journal=journal) as client:
        for step in steps[:2]:
            assert client.register("demo", step, ssd / f"step-{step}").state != PENDING_STATE

        agent.kill()
        for step in steps[2:]:
            started = time.monotonic()
            answer = client.register("demo", step, ssd / f"step-{step}")
            assert time.monotonic() - started < 5
            assert answer.state == PENDING_STATE
        assert [b["step"] for b in RegistrationJournal(journal).pending()] == steps[2:]

        agent.start()
        assert client.flush_journal(timeout=60) == 3
        for step in steps:
            assert client.wait("demo", step, "durable", timeout=30).state in (
                "durable",
                "replicated",
            )
    assert journal.stat().st_size == 0
