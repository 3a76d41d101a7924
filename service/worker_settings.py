"""The `[worker]` section of the agent's settings (service/config.py): the
background worker, its process, its CPUs, its retries and its drain."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from . import cpu_affinity
from .settings_base import BaseModel


class WorkerSettings(BaseModel):
    """The background worker that runs jobs (upload, replicate, verify, delete)."""

    enabled: bool = True
    """Run jobs in this agent; false: it only serves the API."""
    separate_process: Literal["auto", "yes", "no"] = "auto"
    """Whether `tierckpt serve` runs the worker and the periodic passes
    (scrub, retention) in a child process of the agent, with its own event
    loop and GIL, so the Python of uploads, replication and verification
    does not delay a registration or a `latest`. The child dies with the
    agent. `auto` (the default) means yes, with either catalog: on SQLite
    the two processes share the one write lock, which each transaction
    holds only for its statements (the commit's fsync comes after it);
    benchmarks/README.md has the figures. `no`: in the agent's process."""
    process_nice: int = Field(10, ge=0, le=19)
    """Niceness added to the worker process (`nice`): when the agent and its
    worker both want a CPU, the agent's requests get it first. Uploads still
    get every CPU the requests leave idle. While the worker holds SQLite's
    write lock, the holding thread takes the agent's niceness back (a
    registration waiting for the lock would otherwise wait for a niced
    thread to be scheduled); that needs CAP_SYS_NICE, and without it the log
    says so once. 0: equal shares."""
    cpus: str = "auto"
    """The CPUs the worker process and the memory tier's T0 writer may run
    on. `auto` (the default): the highest quarter of the CPUs the agent may
    use, rounded up (its container's or job's cpuset; on 2 to 4 CPUs the
    last one), none on a one-CPU agent: one setting for nodes of different
    sizes. Confined, uploads, hashing and commits compete for those cores
    with each other, not with the trainer's work nor with the calls on its
    critical path: the agent's requests and the registration writer run on
    any CPU. `all`: any CPU the agent may use, so uploads go as fast as the
    CPUs allow, and registrations meet them there. A list such as `2`, `2-5`
    or `0,2,4-7` (Linux; the kernel's list format, as `taskset -c` takes)
    names them: leave out the trainer's cores. On 2-CPU machines confining
    took the p99 of registrations paced as trainers make them to 0.45-0.86×
    in most runs, for 0.77-1.04× of the uploads' pace (benchmarks/README.md).
    CPUs outside the agent's own set are ignored; none left is an error at
    start. An empty value means `all`."""
    concurrency: int = Field(4, ge=1, le=64)
    """Jobs run at once."""
    poll_interval: float = Field(0.5, gt=0)
    """Seconds between claims when the queue is empty (new work also wakes the worker)."""
    lease_seconds: float = Field(30.0, ge=1)
    """A claimed job's lease, extended while it runs; a job whose lease expires
    (its agent died) is claimed again by any agent."""
    max_attempts: int = Field(10, ge=1)
    """Attempts of an upload job before its shard is failed; the other job
    kinds have their own retry policy."""
    backoff_base: float = Field(1.0, gt=0)
    """First retry delay in seconds, doubling with each attempt (full jitter)."""
    backoff_max: float = Field(300.0, gt=0)
    """Longest retry delay in seconds."""
    shutdown_timeout: float = Field(10.0, ge=0)
    """At shutdown, seconds running jobs get to finish before they are given
    back to the queue (after a drain: at most what is left of it)."""
    drain_seconds: float = Field(25.0, ge=0, le=3600)
    """On SIGTERM (a preempted node), seconds the agent keeps serving and
    keeps running its own node's work (urgent first) before it exits: the
    trainer's urgent checkpoint, saved in that moment, is uploaded before the
    node goes. New normal registrations get 503 `draining`; urgent ones are
    still accepted. Keep it below the orchestrator's kill deadline with a few
    seconds to spare (Kubernetes `terminationGracePeriodSeconds`, 30 by
    default; Docker `stop_grace_period`; Slurm `KillWait`, 30 by default).
    0: no drain, stop claiming at once. A second SIGTERM or SIGINT ends a
    drain at once."""
    drain_linger_seconds: float = Field(5.0, ge=0)
    """A drain lasts at least this long after SIGTERM, and after the last
    registration it accepted, even once its node's work is done: the trainer,
    signalled at the same moment, may still be writing its urgent checkpoint.
    It should cover the trainer's save (write + register); each registration
    accepted restarts it. Never beyond `drain_seconds`."""

    @field_validator("cpus", mode="before")
    @classmethod
    def _cpu_list(cls, value: object) -> str:
        # `cpus = 2`, `cpus = [2, 3]` in TOML and TIERCKPT_WORKER__CPUS=2 (read
        # as TOML) mean the list they spell.
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        elif isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            value = ",".join(str(v) for v in value)
        if not isinstance(value, str):
            raise ValueError(f"{value!r} is not a CPU list: write a string such as '2-5'")
        value = value.strip()
        if value.lower() in _WORDS:
            return value.lower()
        cpu_affinity.parse(value)  # ValueError says what is wrong
        return value or "all"  # empty, as before `all` existed: no confinement

    @model_validator(mode="after")
    def _cpus_need_a_process(self) -> WorkerSettings:
        if self.cpus not in _WORDS and self.separate_process == "no":
            raise ValueError(
                "worker.cpus confines the worker's process, and worker.separate_process = "
                "'no' runs the worker in the agent's: set separate_process to 'auto' or "
                "'yes', or cpus to 'auto' or 'all'"
            )
        return self

    @property
    def cpu_set(self) -> frozenset[int]:
        """``cpus`` as CPU numbers; empty: no confinement (``all``, or
        ``auto`` with the worker in the agent's process or on one CPU)."""
        if self.cpus == "all":
            return frozenset()
        if self.cpus == "auto":
            if self.separate_process == "no":
                return frozenset()
            return cpu_affinity.background_share(cpu_affinity.allowed_cpus())
        return cpu_affinity.parse(self.cpus)


# The values of `cpus` that are not lists.
_WORDS = ("auto", "all")
