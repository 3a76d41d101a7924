"""The clients leave no reference cycle behind a call (client/_responses.py).

Python's cyclic collector runs in the caller's process, the trainer's: what a
call leaves in a cycle brings the trainer's next collection closer, and the
oldest generation's walks its whole heap. Against a real agent, the calls a
trainer and an orchestrator make on their critical path (register, latest,
the checkpoint's detail, a 404) are made many times with the collector
saving what it finds: nothing of theirs may be there.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from devsupport.agent import write_checkpoint
from devsupport.garbage import cyclic_garbage, of_the_client
from devsupport.processes import agent_config
from tierckpt.client import AsyncCheckpointClient, CheckpointClient

pytestmark = pytest.mark.e2e

CALLS = 40


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    config = agent_config(tmp_path_factory.mktemp("garbage"), node="gc-node")
    # No worker: nothing becomes durable, so `latest` answers 404 (an error
    # answer is a call too) and the detail says "registered".
    with config.serve(worker=False).start() as serve:
        yield serve.url, config.ssd


def test_the_sync_client_leaves_no_cycle(agent: tuple[str, Path]) -> None:
    url, ssd = agent
    checkpoints = [
        write_checkpoint(ssd / "sync" / f"step-{n}", {"w.bin": 64}) for n in range(CALLS)
    ]
    with CheckpointClient(url) as client:
        client.register("warm", 1, write_checkpoint(ssd / "warm", {"w.bin": 64}))
        with cyclic_garbage() as found:
            for step, path in enumerate(checkpoints, start=1):
                assert client.register("sync", step, path).state == "registered"
                assert client.latest("sync") is None
                assert client.get("sync", step).step == step
    assert of_the_client(found) == Counter()


def test_the_async_client_leaves_no_cycle(agent: tuple[str, Path]) -> None:
    url, ssd = agent
    checkpoints = [
        write_checkpoint(ssd / "async" / f"step-{n}", {"w.bin": 64}) for n in range(CALLS)
    ]

    async def scenario() -> Counter[str]:
        async with AsyncCheckpointClient(url) as client:
            await client.register("warm-async", 1, write_checkpoint(ssd / "warm-a", {"w.bin": 64}))
            with cyclic_garbage() as found:
                for step, path in enumerate(checkpoints, start=1):
                    assert (await client.register("async", step, path)).state == "registered"
                    assert await client.latest("async") is None
                    assert (await client.get("async", step)).step == step
            return found

    assert of_the_client(asyncio.run(scenario())) == Counter()
