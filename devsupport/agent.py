"""An in-process agent for integration tests: real catalog, real stores, real worker.

The FastAPI app runs its own lifespan (engine, stores, worker) and is reached
through ``httpx.ASGITransport``; the catalog is migrated with Alembic first,
so every integration test also exercises the migrations.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tierckpt.service.agent import AgentProcess
from tierckpt.service.app import create_app
from tierckpt.service.config import Settings
from tierckpt.service.memory.service import MemoryTier
from tierckpt.service.migrate import upgrade
from tierckpt.service.resources import Resources


@dataclass
class Agent:
    http: httpx.AsyncClient
    resources: Resources
    ssd: Path
    settings: Settings
    process: AgentProcess  # worker, registration writer, periodic passes

    async def register(
        self, run: str, step: int, path: Path, *, settle: bool = True, **extra: Any
    ) -> httpx.Response:
        """POST the registration; with ``settle`` (tests that go on to other
        features), a 202 answered from the agent's inbox also waits until the
        catalog holds it, so that what they read next does not race its
        write. ``settle=False``: the answer alone, as a trainer sees it."""
        answer = await self.http.post(
            "/v1/checkpoints", json={"run": run, "step": step, "path": str(path), **extra}
        )
        if settle and answer.status_code == 202:
            await self.in_catalog(run)
        return answer

    async def in_catalog(self, run: str) -> None:
        """Wait until the run's registrations answered from the agent's inbox
        are in the catalog (for a test that reads the catalog itself)."""
        inbox = self.process.inbox
        assert inbox is None or await inbox.settled(run, timeout=30)

    async def hold_persister(self) -> MemoryTier:
        """Stop the memory tier's persister: nothing staged leaves memory (for
        the catalog or T0) until the test starts it again. The memory tier."""
        memory = self.process.memory
        assert memory is not None, "the agent has no memory tier"
        await memory.persister.stop()
        return memory

    async def wait_on_t0(self, directory: Path, timeout: float = 30) -> None:
        """Wait for a memory-staged checkpoint's T0 directory: written once its
        upload has ended (service/memory/upload_first.py), renamed into place
        whole, and its segment marked persisted."""
        memory = self.process.memory

        def written() -> bool:
            staged = memory.arena.staged() if memory is not None else []
            pending = any((s.registration or {}).get("path") == str(directory) for s in staged)
            return directory.is_dir() and not pending

        deadline = asyncio.get_running_loop().time() + timeout
        while not written():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"{directory} not written to T0 in {timeout} s")
            await asyncio.sleep(0.02)

    async def wait_state(
        self,
        run: str,
        step: int,
        states: tuple[str, ...] = ("durable", "replicated"),
        timeout: float = 60,
    ) -> dict[str, Any]:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            answer = (await self.http.get(f"/v1/runs/{run}/checkpoints/{step}")).json()
            if answer.get("state") in states:
                return answer
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"{run}/{step} stuck in {answer.get('state')}: {answer}")
            await asyncio.sleep(0.05)


def s3_region(name: str, endpoint_url: str, bucket: str, prefix: str = "prod") -> dict[str, Any]:
    return {
        "name": name,
        "kind": "s3",
        "endpoint_url": endpoint_url,
        "bucket": bucket,
        "prefix": prefix,
        "access_key_id": "tierckpt",
        "secret_access_key": "tierckpt-secret",
    }


def posix_region(name: str, root: Path) -> dict[str, Any]:
    return {"name": name, "kind": "posix", "root": str(root)}


# `catalog=AT_COMMIT`: registrations answered at their commit, for tests of the
# group commit's own path (the default on PostgreSQL); `catalog=RECORDED`: a
# new checkpoint answered from the agent's inbox, committed behind the answer
# (checkpoints/inbox.py; the default on SQLite).
AT_COMMIT = {"register_ack": "committed"}
RECORDED = {"register_ack": "recorded"}


def make_settings(
    catalog_url: str,
    ssd: Path,
    regions: list[dict[str, Any]],
    *,
    tokens: list[dict[str, Any]] | None = None,
    **sections: Any,
) -> Settings:
    """Settings of a test agent; ``tokens`` are ``[[tokens]]`` entries (use
    ``token_entry`` to build one from a plain token)."""
    data: dict[str, Any] = {
        "server": {"node": "node-test"},
        "catalog": {"url": catalog_url},
        "local": {"roots": [str(ssd)]},
        "regions": regions,
        "worker": {
            "poll_interval": 0.05,
            "backoff_base": 0.1,
            "backoff_max": 1.0,
            "lease_seconds": 5,
        },
        "upload": {"part_size_mb": 5},
        # The memory tier beside the SSD, not in /dev/shm (segments kept for
        # fast restarts would outlive the test).
        "memory": {"dir": str(ssd.parent / "memory")},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    if tokens is not None:
        data["tokens"] = tokens
    return Settings.model_validate(data)


def token_entry(name: str, token: str, role: str, runs: str = "*") -> dict[str, Any]:
    """A ``[[tokens]]`` entry for ``token``: only its SHA-256 is configured."""
    return {
        "name": name,
        "sha256": hashlib.sha256(token.encode()).hexdigest(),
        "role": role,
        "runs": runs,
    }


@asynccontextmanager
async def running_agent(
    catalog_url: str,
    tmp_path: Path,
    regions: list[dict[str, Any]] | None = None,
    *,
    start_worker: bool = True,
    worker_process: bool = False,
    ssd: Path | None = None,
    tokens: list[dict[str, Any]] | None = None,
    **sections: Any,
) -> AsyncIterator[Agent]:
    ssd = ssd or tmp_path / "ssd"
    ssd.mkdir(parents=True, exist_ok=True)
    regions = regions or [posix_region("local", tmp_path / "region-local")]
    settings = make_settings(catalog_url, ssd, regions, tokens=tokens, **sections)
    await asyncio.to_thread(upgrade, catalog_url)
    # worker_process: the worker runs in a child process, as under `tierckpt serve`.
    app = create_app(settings, start_worker=start_worker, worker_process=worker_process)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://agent") as http:
            yield Agent(
                http=http,
                resources=app.state.resources,
                ssd=ssd,
                settings=settings,
                process=app.state.agent,
            )


def write_checkpoint(directory: Path, files: dict[str, bytes | int]) -> Path:
    """Create a checkpoint directory; an int value means that many random bytes."""
    for relative, content in files.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, int):
            with open(path, "wb") as handle:
                remaining = content
                while remaining:
                    chunk = os.urandom(min(remaining, 8 << 20))
                    handle.write(chunk)
                    remaining -= len(chunk)
        else:
            path.write_bytes(content)
    return directory


class AgentOrNetwork(httpx.AsyncBaseTransport):
    """Requests to ``http://agent`` go to the in-process app, the rest (the
    presigned S3 URLs a restore plan hands out) to the real network."""

    def __init__(self, app_transport: httpx.AsyncBaseTransport) -> None:
        self._app = app_transport
        self._network = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == "agent":
            return await self._app.handle_async_request(request)
        return await self._network.handle_async_request(request)

    async def aclose(self) -> None:
        await self._network.aclose()
