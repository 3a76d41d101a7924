"""What the Lightning and Hugging Face e2e tests share: a real `tierckpt serve`
(SQLite catalog, one S3 region on SeaweedFS) and waiting for its uploads.

The trainers run in the test process (or a child for a kill -9); only the
agent is a separate process, as on a training node.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from devsupport.processes import ServeProcess
from tests.e2e.test_torch_resume import NODE, AgentFactory, start_agent
from tierckpt.client import CheckpointClient

__all__ = ["NODE", "start_agent"]


@dataclass
class RunningAgent:
    process: ServeProcess
    ssd: Path  # the agent's [local].roots entry
    client: CheckpointClient

    @property
    def url(self) -> str:
        return self.process.url


@pytest.fixture
def framework_agent(start_agent: AgentFactory) -> Iterator[RunningAgent]:
    """`tierckpt serve` on node NODE with one S3 region "east" (the torch
    tests' agent, test_torch_resume.start_agent); killed after the test."""
    process, ssd = start_agent()
    client = CheckpointClient(process.url)
    try:
        yield RunningAgent(process, ssd, client)
    finally:
        client.close()


def checkpoints(url: str, run: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{url}/v1/runs/{run}/checkpoints", params={"limit": 1000}, timeout=10)
    if answer.status_code == 404:
        return []
    answer.raise_for_status()
    return list(answer.json()["checkpoints"])


def settle(url: str, run: str, timeout: float = 120) -> dict[int, str]:
    """Wait until no checkpoint of ``run`` is still on its way to durable;
    returns step -> state."""
    deadline = time.monotonic() + timeout
    while True:
        found = checkpoints(url, run)
        if all(c["state"] not in ("registered", "uploading") for c in found):
            return {c["step"]: c["state"] for c in found}
        assert time.monotonic() < deadline, f"checkpoints of {run} not settled: {found}"
        time.sleep(0.05)
