"""A registered T0 directory that disappears (the Hugging Face Trainer's
`save_total_limit` rotation deletes `checkpoint-N` with rmtree) never
corrupts anything: before its upload the checkpoint fails with the reason
and `latest` keeps the previous one; after it, the durable copy stays the
answer, the agent no longer offers the vanished T0 copy, and restores come
from the region. This is why tierckpt.client.hf registers hard links in a
directory of its own rather than the Trainer's directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from devsupport.agent import running_agent, write_checkpoint
from tierckpt.client import AsyncCheckpointClient


async def test_a_directory_deleted_before_its_upload_fails_only_that_checkpoint(
    catalog_url: str, tmp_path: Path
) -> None:
    # Registered while no worker runs; the directory goes before any upload.
    async with running_agent(catalog_url, tmp_path, start_worker=False) as agent:
        kept = write_checkpoint(agent.ssd / "r" / "checkpoint-2", {"model.safetensors": 4096})
        rotated = write_checkpoint(agent.ssd / "r" / "checkpoint-4", {"model.safetensors": 4096})
        assert (await agent.register("r", 2, kept)).status_code == 202
        assert (await agent.register("r", 4, rotated)).status_code == 202
    shutil.rmtree(rotated)
    async with running_agent(catalog_url, tmp_path) as agent:
        await agent.wait_state("r", 2)
        failed = await agent.wait_state("r", 4, states=("failed",))
        assert failed["error"] and "model.safetensors" in failed["error"]
        assert (await agent.http.get("/v1/runs/r/latest")).json()["step"] == 2


async def test_a_directory_deleted_after_its_upload_is_restored_from_the_region(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path) as agent:
        node = agent.settings.server.node
        ckpt = write_checkpoint(agent.ssd / "r" / "checkpoint-2", {"model.safetensors": 4096})
        assert (await agent.register("r", 2, ckpt)).status_code == 202
        await agent.wait_state("r", 2)
        here = await agent.http.get("/v1/runs/r/latest", params={"node": node})
        assert here.json()["local"] == {"node": node, "path": str(ckpt), "ranks": {"0": str(ckpt)}}

        shutil.rmtree(ckpt)
        gone = (await agent.http.get("/v1/runs/r/latest", params={"node": node})).json()
        assert gone["step"] == 2 and gone["state"] == "durable" and gone["local"] is None

        # Retention's T0 eviction of the vanished copy is harmless.
        assert (await agent.http.post("/v1/runs/r/retention/apply")).status_code < 300
        async with AsyncCheckpointClient("http://agent", transport=agent.http._transport) as c:
            restored = await c.restore("r", tmp_path / "restored")
        assert (restored / "model.safetensors").stat().st_size == 4096
