"""What every scenario gets: one SeaweedFS server, one `tierckpt serve` agent,
the shared dataset, and helpers to start more agents and S3 clients.

`environment()` starts everything and, whatever happens, stops every process
it started and removes its temporary directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devsupport.processes import ServeProcess, free_port, write_config
from devsupport.seaweed import SeaweedServer, boto3_client

from . import leftovers
from .data import Dataset, make_dataset

REPO = Path(__file__).resolve().parents[1]

BUCKET = "bench"
REGION_PREFIX = "tierckpt"  # the agent's objects: bench/tierckpt/{run}/step-…/
BASELINE_PREFIX = "boto3"  # the baselines' objects: bench/boto3/{variant}/…
# Larger than the test suite's 64 MB: a GB-scale run would otherwise grow a
# new SeaweedFS volume every few dozen parts, and that pause is pure noise.
VOLUME_SIZE_LIMIT_MB = 1024


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def settle() -> None:
    """Call before each timed measurement: no dirty pages of the previous one
    (SeaweedFS volume files, downloaded files) are left to write back, so one
    variant does not pay for another's writes."""
    os.sync()


@dataclass
class Agent:
    """One `tierckpt serve` subprocess and the settings it was started with."""

    process: ServeProcess
    settings: dict[str, Any]

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def pid(self) -> int:
        assert self.process.proc is not None
        return self.process.proc.pid

    @property
    def log_path(self) -> Path:
        return self.process.log


@dataclass
class BenchContext:
    quick: bool
    reps: int
    work: Path
    seaweed: SeaweedServer
    agent: Agent
    dataset: Dataset
    ssd: Path
    bucket: str = BUCKET
    # Scenarios leave results for later ones here (e.g. the uploaded steps).
    shared: dict[str, Any] = field(default_factory=dict)
    _agents: list[Agent] = field(default_factory=list)
    _step: int = 0

    def next_step(self) -> int:
        self._step += 1
        return self._step

    def s3(self, **config: Any) -> Any:
        """A boto3 client configured as a user of a third-party store would
        (devsupport.seaweed.boto3_client: CRC checksums only when required)."""
        return boto3_client(self.seaweed.endpoint_url, **config)

    def start_agent(
        self,
        name: str,
        *,
        worker: bool = True,
        regions: list[dict[str, Any]] | None = None,
        worker_settings: dict[str, Any] | None = None,
        **overrides: dict[str, Any],
    ) -> Agent:
        """Another `tierckpt serve` with its own catalog (and port), the same
        local root and by default the same region; `overrides` are merged into
        the config's sections. Stopped with everything else at the end."""
        agent = start_agent(
            name,
            work=self.work,
            ssd=self.ssd,
            seaweed=self.seaweed,
            worker=worker,
            regions=regions,
            worker_settings=worker_settings,
            **overrides,
        )
        self._agents.append(agent)
        return agent

    def start_agents(self, specs: dict[str, dict[str, Any]]) -> dict[str, Agent]:
        """Several agents at once (``{name: start_agent keyword arguments}``):
        each start is mostly a Python interpreter importing the service, and
        they overlap on the two cores. Agents may share a catalog: their
        migrations take turns (migrations/env.py)."""
        with ThreadPoolExecutor(max_workers=len(specs) or 1) as pool:
            futures = {
                name: pool.submit(self.start_agent, name, **kw) for name, kw in specs.items()
            }
            return {name: future.result() for name, future in futures.items()}

    def stop_agent(self, agent: Agent) -> None:
        stop_agent(agent)
        if agent in self._agents:
            self._agents.remove(agent)


def s3_region(name: str, seaweed: SeaweedServer, prefix: str = REGION_PREFIX) -> dict[str, Any]:
    """A region entry of the agent's config: `BUCKET` on `seaweed`, under `prefix`."""
    return {
        "name": name,
        "kind": "s3",
        "endpoint_url": seaweed.endpoint_url,
        "bucket": BUCKET,
        "prefix": prefix,
        "access_key_id": "tierckpt",
        "secret_access_key": "tierckpt-secret",
    }


# The memory tier's budget: room for two of trainer_stall's largest state
# (~2 GB: the newest kept for restarts plus the next save) and to spare.
MEMORY_BYTES = 6 << 30


def memory_dir(work: Path) -> Path:
    """The agents' memory tier: in /dev/shm (RAM) as in production, one
    directory per benchmark run, removed at its end."""
    shm = Path("/dev/shm")
    return shm / work.name if shm.is_dir() else work / "memory"


def agent_settings(work: Path, ssd: Path, seaweed: SeaweedServer, name: str) -> dict[str, Any]:
    """The agent's configuration: service defaults except where noted."""
    return {
        "server": {"host": "127.0.0.1", "port": free_port(), "node": "bench-node"},
        "catalog": {"url": f"sqlite+aiosqlite:///{work / f'{name}-catalog.db'}"},
        # keep_last: T0 eviction must never remove the shared benchmark files.
        "local": {"roots": [str(ssd)], "keep_last": 1000},
        # dedup off: the scenarios re-register the same dataset (hard links,
        # see data.link_copy) every repetition, which dedup would copy
        # server-side instead of uploading; they measure the pipeline on new
        # bytes. The `dedup` scenario starts its own agents with it on.
        "upload": {"dedup": False},
        # No drain on SIGTERM: a scenario's agent stops at once and gives
        # back what is left, so each scenario starts from a quiet agent.
        "worker": {"drain_seconds": 0},
        "memory": {"bytes": MEMORY_BYTES, "dir": str(memory_dir(work))},
        "regions": [s3_region("bench-east", seaweed)],
    }


def start_agent(
    name: str,
    *,
    work: Path,
    ssd: Path,
    seaweed: SeaweedServer,
    worker: bool = True,
    regions: list[dict[str, Any]] | None = None,
    worker_settings: dict[str, Any] | None = None,
    **overrides: dict[str, Any],
) -> Agent:
    """``worker_settings``: the ``[worker]`` section's overrides (``worker``
    itself says whether the worker runs at all)."""
    settings = agent_settings(work, ssd, seaweed, name)
    for section, values in {**overrides, "worker": worker_settings or {}}.items():
        settings.setdefault(section, {}).update(values)
    regions = regions or settings.pop("regions")
    settings.pop("regions", None)
    config = write_config(work / f"{name}.toml", settings, regions)
    settings["regions"] = regions
    port = settings["server"]["port"]
    # worker=False starts it with TIERCKPT_WORKER__ENABLED=false.
    process = ServeProcess(config, port, work / f"{name}.log", worker=worker)
    agent = Agent(process=process, settings=settings)
    try:
        process.start(timeout=90)
    except BaseException:
        process.kill()
        raise
    return agent


def stop_agent(agent: Agent) -> None:
    """SIGTERM (graceful: the worker gives its jobs back), SIGKILL if it hangs."""
    process = agent.process
    if process.proc is None or process.proc.poll() is not None:
        return
    try:
        process.terminate(timeout=20)
    except Exception:
        process.kill()


@contextlib.contextmanager
def environment(quick: bool, reps: int, workdir: str | None, keep: bool) -> Iterator[BenchContext]:
    work = Path(tempfile.mkdtemp(prefix="tierckpt-bench-", dir=workdir))
    # Removes what a SIGKILLed run (the OOM killer) would leave behind.
    leftovers.watch(work, keep=keep)
    seaweed = SeaweedServer(work / "seaweed", volume_size_limit_mb=VOLUME_SIZE_LIMIT_MB)
    ctx: BenchContext | None = None
    agents: list[Agent] = []
    try:
        log(f"work directory {work}")
        began = time.monotonic()
        seaweed.start()
        seaweed.create_bucket(BUCKET)
        log(f"SeaweedFS up on {seaweed.endpoint_url} in {time.monotonic() - began:.1f}s")
        ssd = work / "ssd"
        ssd.mkdir()
        began = time.monotonic()
        dataset = make_dataset(ssd / "dataset", quick)
        log(
            f"dataset: {len(dataset.files)} files, {dataset.total_bytes / 1e6:.0f} MB "
            f"(random bytes) in {time.monotonic() - began:.1f}s"
        )
        agent = start_agent("agent", work=work, ssd=ssd, seaweed=seaweed)
        agents.append(agent)
        log(f"tierckpt serve up on {agent.url} (pid {agent.pid})")
        ctx = BenchContext(
            quick=quick,
            reps=reps,
            work=work,
            seaweed=seaweed,
            agent=agent,
            dataset=dataset,
            ssd=ssd,
            _agents=agents,
        )
        yield ctx
    finally:
        for started in reversed(agents):
            with contextlib.suppress(Exception):
                stop_agent(started)
            with contextlib.suppress(Exception):
                started.process.kill()
        with contextlib.suppress(Exception):
            seaweed.stop()
        # The memory tier keeps each run's newest checkpoint: never left in RAM.
        shutil.rmtree(memory_dir(work), ignore_errors=True)
        if keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
