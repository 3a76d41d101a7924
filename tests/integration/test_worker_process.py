"""The worker in a child process of the agent (`tierckpt serve`'s default):
it runs the jobs the agent's registrations enqueue, its counts reach the
agent's ``/metrics``, and its death is seen like any component's."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path

import pytest

from devsupport.agent import Agent, running_agent, write_checkpoint
from tests.integration.test_agent_supervision import unhealthy
from tests.integration.test_memory_tier import stage
from tierckpt.service.worker_process import WorkerChild

# "auto" runs it with either catalog; "yes" says so where a test depends on it.
SEPARATE = {"separate_process": "yes"}
UPLOADS_DONE = 'tierckpt_job_runs_total{kind="upload",outcome="succeeded"}'
UPLOADED = 'tierckpt_uploaded_bytes_total{region="local"}'


def _value(text: str, series: str) -> float:
    """A series' value in Prometheus text (0 when absent). Other tests of this
    process may have counted in the same registry: compare differences."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


async def _metrics_when(agent: Agent, series: str, value: float, timeout: float = 30.0) -> str:
    """The agent's /metrics once ``series`` reached ``value`` (the worker
    process reports about once a second)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        text = (await agent.http.get("/metrics")).text
        if _value(text, series) >= value:
            return text
        assert asyncio.get_running_loop().time() < deadline, f"{series} < {value} in:\n{text}"
        await asyncio.sleep(0.1)


async def _niced(pid: int, niceness: int, timeout: float = 10.0) -> None:
    """The process's main thread reaches ``niceness``. Not at once: while it
    holds the catalog's write lock it runs at the agent's niceness
    (lock_holder.py), and the child's passes write at any moment."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (seen := os.getpriority(os.PRIO_PROCESS, pid)) != niceness:
        assert asyncio.get_running_loop().time() < deadline, f"niceness {seen}, not {niceness}"
        await asyncio.sleep(0.01)


async def test_the_worker_process_runs_the_jobs_and_reports_its_metrics(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path, worker_process=True, worker=SEPARATE) as agent:
        child = agent.process.worker
        assert isinstance(child, WorkerChild) and child.alive
        # The passes run in the child too.
        assert agent.process.passes == []
        before = (await agent.http.get("/metrics")).text
        source = write_checkpoint(agent.ssd / "step-1", {"model.bin": 300_000})
        assert (await agent.register("child-run", 1, source)).status_code == 202
        await agent.wait_state("child-run", 1)
        text = await _metrics_when(agent, UPLOADS_DONE, _value(before, UPLOADS_DONE) + 1)
        # One series per family: the child's values are added to the agent's.
        assert text.count("# HELP tierckpt_uploaded_bytes_total ") == 1
        assert _value(text, UPLOADED) == _value(before, UPLOADED) + 300_000
        assert (await agent.http.get("/healthz")).json() == {"status": "ok"}
        # Niced: the agent's requests get a CPU first.
        assert child.pid is not None
        nice = agent.settings.worker.process_nice
        assert nice > 0
        own = os.getpriority(os.PRIO_PROCESS, 0)
        await _niced(child.pid, min(19, own + nice))
    assert not child.alive
    assert agent.process.failures == []


async def test_auto_runs_the_worker_process_with_either_catalog(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path, worker_process=True) as agent:
        assert isinstance(agent.process.worker, WorkerChild)
    no = {"separate_process": "no"}
    async with running_agent(catalog_url, tmp_path, worker_process=True, worker=no) as agent:
        assert not isinstance(agent.process.worker, WorkerChild)


async def test_a_killed_worker_process_fails_the_liveness_probe(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path, worker_process=True, worker=SEPARATE) as agent:
        child = agent.process.worker
        assert isinstance(child, WorkerChild) and child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        error = await unhealthy(agent)
        assert error["code"] == "agent_component_died"
        assert "worker (RuntimeError: the worker process exited with status -9)" in error["message"]
        # Registrations are still written (a restart is the orchestrator's call).
        source = write_checkpoint(agent.ssd / "step-1", {"model.bin": b"x"})
        assert (await agent.register("orphan-run", 1, source)).status_code == 202


def _threads_cpus(pid: int) -> dict[int, str]:
    """Each thread of ``pid`` and the CPUs it may run on (kernel list format)."""
    out: dict[int, str] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(task.name)] = line.split(":", 1)[1].strip()
    return out


async def test_worker_cpus_confine_the_worker_process_and_the_t0_writer(
    catalog_url: str, tmp_path: Path
) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one CPU: nothing to confine the worker away from")
    background = str(allowed[-1])
    worker = {**SEPARATE, "cpus": background}
    memory = {"bytes": 4 << 20}
    async with running_agent(
        catalog_url, tmp_path, worker_process=True, worker=worker, memory=memory
    ) as agent:
        child = agent.process.worker
        assert isinstance(child, WorkerChild) and child.pid is not None
        # A checkpoint through the worker (its pools' threads started) and a
        # memory segment through the T0 writer.
        source = write_checkpoint(agent.ssd / "step-1", {"model.bin": 300_000})
        assert (await agent.register("cpus-run", 1, source)).status_code == 202
        await agent.wait_state("cpus-run", 1)
        staged = await stage(agent, "cpus-mem", 1)
        await agent.wait_state("cpus-mem", 1)
        await agent.wait_on_t0(staged["target"])  # the T0 writer has run
        threads = _threads_cpus(child.pid)
        assert len(threads) > 1 and set(threads.values()) == {background}, threads
        writers = [t for t in threading.enumerate() if t.name.startswith("memory-t0-writer")]
        assert writers and all(
            os.sched_getaffinity(t.native_id or 0) == {int(background)} for t in writers
        )
        # The agent's own threads (its event loop, this test) keep every CPU.
        assert os.sched_getaffinity(0) == set(allowed)
