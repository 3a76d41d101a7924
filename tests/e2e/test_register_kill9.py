"""End to end: SIGKILL the agent while many registrations are in flight.

Registrations are group-committed (service/checkpoints/batching.py): each
request is answered only after the transaction holding it committed. So
every registration answered 202 must be in the catalog after a kill -9, with
its shard, files and upload job; one that got no answer may or may not be
there, but never half of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from devsupport.catalog_lock import catalog_write_lock, rows
from devsupport.processes import AgentConfig, agent_config
from tierckpt.service.storage.layout import object_key

pytestmark = pytest.mark.e2e

COUNT = 400
CLIENTS = 32


def _config(tmp_path: Path, catalog_url: str, **catalog: str) -> AgentConfig:
    return agent_config(
        tmp_path,
        node="kill-node",
        catalog_url=catalog_url,
        server={"rate_limit_per_second": 0},
        catalog=catalog,
    )


async def _register_until_killed(
    url: str, dirs: list[Path], kill: threading.Event
) -> dict[int, int]:
    """step -> status for every answered registration (others: no answer)."""
    answered: dict[int, int] = {}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for step in range(len(dirs)):
        queue.put_nowait(step)
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as http:

        async def worker() -> None:
            while not queue.empty():
                step = queue.get_nowait()
                try:
                    answer = await http.post(
                        "/v1/checkpoints",
                        json={"run": "k", "step": step, "path": str(dirs[step])},
                    )
                except httpx.HTTPError:
                    return  # the agent is gone
                answered[step] = answer.status_code
                if len(answered) >= COUNT // 4:
                    kill.set()

        await asyncio.gather(*(worker() for _ in range(CLIENTS)))
    return answered


def test_kill9_during_concurrent_registrations_loses_no_202(
    catalog_url: str, tmp_path: Path
) -> None:
    config = _config(tmp_path, catalog_url)
    dirs = []
    for step in range(COUNT):
        d = config.ssd / f"step-{step}"
        d.mkdir()
        (d / "w.bin").write_bytes(b"w" * (step + 1))
        (d / "meta.json").write_bytes(b"{}")
        dirs.append(d)

    agent = config.serve(worker=False).start()
    kill = threading.Event()

    def killer() -> None:
        kill.wait(120)
        agent.kill()  # SIGKILL, with registrations still in flight

    thread = threading.Thread(target=killer)
    thread.start()
    try:
        answered = asyncio.run(_register_until_killed(agent.url, dirs, kill))
    finally:
        kill.set()
        thread.join()
    accepted = sorted(step for step, status in answered.items() if status == 202)
    assert len(accepted) >= COUNT // 4, f"only {len(accepted)} answered before the kill"
    assert all(status == 202 for status in answered.values()), answered
    assert len(answered) < COUNT, "the kill came too late to land mid-flight"

    with config.serve(worker=False).start() as again:
        with httpx.Client(base_url=again.url, timeout=30) as http:
            listed = http.get("/v1/runs/k/checkpoints", params={"limit": 1000}).json()
            present = {c["step"]: c for c in listed["checkpoints"]}
            missing = [step for step in accepted if step not in present]
            assert not missing, f"202 answered but lost after kill -9: {missing[:10]}"
            # Whatever is there is whole: its shard, files and upload job.
            for step in sorted(present)[:: max(1, len(present) // 40)]:
                detail = http.get(f"/v1/runs/k/checkpoints/{step}").json()
                assert detail["file_count"] == 2 and detail["total_bytes"] == step + 3
                assert [f["path"] for f in detail["files"]] == ["meta.json", "w.bin"]
                assert [j["kind"] for j in detail["jobs"]] == ["upload"], detail["jobs"]
                assert len(detail["shards"]) == 1 and len(detail["replicas"]) == 1
            # A registration that got no answer can simply be sent again.
            unanswered = [step for step in range(COUNT) if step not in answered]
            for step in unanswered[:20]:
                answer = http.post(
                    "/v1/checkpoints", json={"run": "k", "step": step, "path": str(dirs[step])}
                )
                assert answer.status_code in (200, 202), answer.text


def _wait_durable(url: str, run: str, step: int, timeout: float = 60) -> None:
    """Until the restarted agent at ``url`` reports ``run``:``step`` durable."""
    with httpx.Client(base_url=url, timeout=30) as http:
        deadline = time.monotonic() + timeout
        while True:
            detail = http.get(f"/v1/runs/{run}/checkpoints/{step}")
            if detail.status_code == 200 and detail.json()["state"] == "durable":
                return
            assert time.monotonic() < deadline, detail.text
            time.sleep(0.1)


def test_kill9_after_an_answer_only_recorded_on_the_node(catalog_url: str, tmp_path: Path) -> None:
    """`[catalog] register_ack = "recorded"` (the default on SQLite): a 202 given while the
    catalog's write lock is held from outside (so the catalog cannot have
    the registration yet), then kill -9 of the agent: the restarted agent
    takes the record up, and the checkpoint becomes durable with its bytes."""
    config = _config(tmp_path, catalog_url, register_ack="recorded")
    ssd = config.ssd
    source = ssd / "step-3"
    source.mkdir()
    (source / "w.bin").write_bytes(b"recorded" * 1000)
    agent = config.serve().start()
    try:
        with catalog_write_lock(catalog_url):
            answer = httpx.post(
                f"{agent.url}/v1/checkpoints",
                json={"run": "rec", "step": 3, "path": str(source)},
                timeout=30,
            )
            assert answer.status_code == 202, answer.text
            assert rows(catalog_url, "SELECT count(*) FROM checkpoints") == [(0,)]
            agent.kill()
    finally:
        agent.kill()
    assert rows(catalog_url, "SELECT count(*) FROM checkpoints") == [(0,)]
    with config.serve().start() as again:
        _wait_durable(again.url, "rec", 3)
        stored = tmp_path / "region" / object_key("rec", 3, 0, "w.bin")
        assert stored.read_bytes() == b"recorded" * 1000
    assert not list((ssd / ".tierckpt-inbox").rglob("*.json"))


def test_a_full_ssd_answers_at_the_commit_and_loses_nothing(
    tmp_path: Path, tmpfs: Callable[[str, str], Path]
) -> None:
    """The inbox's SSD (the first local root) has no inode left: the record
    cannot be written, so the registration goes the writer's way and is
    answered at its commit, in the catalog before the answer. A kill -9
    right after loses nothing; once restarted, the agent uploads it."""
    full = tmpfs("full", "size=4m,nr_inodes=16")
    ssd = tmp_path / "ssd"
    catalog_url = f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}"
    config = agent_config(
        tmp_path,
        node="full-node",
        catalog_url=catalog_url,
        ssd=ssd,
        catalog={"register_ack": "recorded"},
        local={"roots": [str(full), str(ssd)]},
    )
    source = ssd / "step-5"
    source.mkdir()
    (source / "w.bin").write_bytes(b"full disk" * 1000)
    log = tmp_path / "serve.log"
    agent = config.serve(log, worker=False).start()
    try:
        inbox = next((full / ".tierckpt-inbox").iterdir())
        filler = 0
        with contextlib.suppress(OSError):  # ENOSPC: no inode left
            while True:
                (full / f"filler-{filler}").touch()
                filler += 1
        with pytest.raises(OSError):
            (inbox / "probe.json").write_text("{}")
        answer = httpx.post(
            f"{agent.url}/v1/checkpoints",
            json={"run": "full", "step": 5, "path": str(source)},
            timeout=30,
        )
        assert answer.status_code == 202, answer.text
        assert rows(catalog_url, "SELECT count(*) FROM checkpoints") == [(1,)]
        agent.kill()
    finally:
        agent.kill()
    assert "cannot record a registration" in log.read_text()
    assert list(inbox.iterdir()) == []

    with config.serve(log).start() as again:
        _wait_durable(again.url, "full", 5)
    stored = tmp_path / "region" / object_key("full", 5, 0, "w.bin")
    assert stored.read_bytes() == b"full disk" * 1000
