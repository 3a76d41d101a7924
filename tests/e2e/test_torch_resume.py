"""End to end with PyTorch: the real agent (`tierckpt serve`), real SeaweedFS,
and examples/torch_train.py as the trainer process.

- Resume benchmark: an uninterrupted run against one SIGKILLed at random
  steps twice and restarted each time from the service's latest valid
  checkpoint (once from the node's T0 copy, once from the region); the final
  weights are bit-identical.
- Preemption: SIGTERM while the agent's uploads are blocked behind a queue of
  normal checkpoints; the trainer's urgent checkpoint becomes durable before
  every normal one that was still queued, and the trainer exits 0.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import httpx
import pytest

from devsupport.agent import s3_region
from devsupport.processes import ServeProcess, agent_config, cli
from devsupport.seaweed import SeaweedServer

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from safetensors.torch import load_file  # noqa: E402

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TORCH_TRAIN = REPO / "examples" / "torch_train.py"
NODE = "torch-node"


class Trainer:
    """A trainer subprocess; its JSON-line events arrive on a queue."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = open(log, "ab")  # closed in wait()
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=self.log,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        assert self.proc.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[bytes]) -> None:
        for raw in stream:
            self.log.write(b"stdout: " + raw)
            with contextlib.suppress(ValueError):
                self.events.put(json.loads(raw))
        stream.close()
        self.events.put(None)

    def next(self, timeout: float = 60) -> dict[str, Any] | None:
        event = self.events.get(timeout=timeout)
        if event is not None:
            self.seen.append(event)
        return event

    def until(self, name: str, timeout: float = 60, **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            event = self.next(timeout=max(0.1, deadline - time.monotonic()))
            if event is None:
                raise AssertionError(f"trainer ended before {name} {match}: {self.seen[-5:]}")
            if event["event"] == name and all(event.get(k) == v for k, v in match.items()):
                return event

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.stop()

    def stop(self) -> None:
        """Killed if still running, reaped, its log closed (again: harmless)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(10)
        self.log.close()


def trainer_argv(url: str, ssd: Path, run: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(TORCH_TRAIN),
        "--server",
        url,
        "--run",
        run,
        "--root",
        str(ssd),
        "--node",
        NODE,
        *extra,
    ]


AgentFactory = Callable[..., tuple[ServeProcess, Path]]


@pytest.fixture
def start_agent(tmp_path: Path, seaweed: SeaweedServer, s3_bucket: str) -> Iterator[AgentFactory]:
    """Starts `tierckpt serve` (SQLite catalog, one S3 region "east" on
    SeaweedFS, node NODE); keyword arguments are merged into config sections.
    Returns (agent, local root); the agent is killed after the test."""
    started: list[ServeProcess] = []

    def start(**extra: dict[str, Any]) -> tuple[ServeProcess, Path]:
        sections: dict[str, dict[str, Any]] = {
            "worker": {"poll_interval": 0.05, "lease_seconds": 10, "backoff_base": 0.2},
        }
        for name, values in extra.items():
            sections.setdefault(name, {}).update(values)
        config = agent_config(
            tmp_path,
            node=NODE,
            catalog_url=f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}",
            regions=[s3_region("east", seaweed.endpoint_url, s3_bucket, prefix="torch")],
            **sections,
        )
        ssd = config.ssd
        agent = config.serve(tmp_path / "serve.log")
        started.append(agent)
        return agent.start(), ssd

    yield start
    for agent in started:
        agent.kill()


def checkpoints(url: str, run: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{url}/v1/runs/{run}/checkpoints", params={"limit": 1000}, timeout=10)
    if answer.status_code == 404:
        # A run the catalog does not know yet: its first save may still be
        # staged in the agent's memory, not registered.
        return []
    answer.raise_for_status()
    return list(answer.json()["checkpoints"])


def unclaimed(url: str, run: str) -> list[int]:
    """Steps whose upload job is still queued: not claimed by the worker yet.
    A checkpoint stays `registered` for a moment after its upload is claimed
    (until the upload's first transaction marks it `uploading`), so its
    state alone does not say it waits its turn; its jobs in the detail do."""
    steps = []
    for c in checkpoints(url, run):
        if c["state"] != "registered":
            continue
        answer = httpx.get(f"{url}/v1/runs/{run}/checkpoints/{c['step']}", timeout=10)
        answer.raise_for_status()
        jobs = answer.json()["jobs"] or []
        if any(j["kind"] == "upload" and j["state"] == "queued" for j in jobs):
            steps.append(c["step"])
    return steps


def settle(url: str, run: str, timeout: float = 60) -> list[dict[str, Any]]:
    """Wait until no checkpoint of ``run`` is still on its way to durable."""
    deadline = time.monotonic() + timeout
    while True:
        found = checkpoints(url, run)
        if found and all(c["state"] not in ("staged", "registered", "uploading") for c in found):
            return found
        assert time.monotonic() < deadline, f"checkpoints of {run} not settled: {found}"
        time.sleep(0.05)


def latest_step(url: str, run: str) -> int | None:
    answer = httpx.get(f"{url}/v1/runs/{run}/latest", timeout=10)
    return None if answer.status_code == 404 else int(answer.json()["step"])


def live(
    url: str, ssd: Path, run: str, kill_at: int | None, log: Path, *extra: str
) -> list[dict[str, Any]]:
    """One life of the trainer: SIGKILLed once it reports step ``kill_at``
    (None: runs to the end). Returns its events."""
    argv = trainer_argv(url, ssd, run, "--steps", "60", "--every", "5", "--step-events", *extra)
    trainer = Trainer(argv, log)
    try:
        while True:
            event = trainer.next()
            if event is None:
                break
            if kill_at is not None and event["event"] == "step" and event["step"] >= kill_at:
                trainer.signal(signal.SIGKILL)
                break
    finally:
        code = trainer.wait()
    if kill_at is None:
        assert code == 0, log.read_text()[-3000:]
    else:
        assert code == -signal.SIGKILL
    return trainer.seen


def test_resume_after_sigkills_is_bit_identical(start_agent: AgentFactory, tmp_path: Path) -> None:
    # No memory tier: the trainer stages on disk by itself, and resumes from
    # T0 or a region (tests/e2e/test_memory_tier.py resumes from memory).
    agent, ssd = start_agent(memory={"bytes": 0})
    run = "resume"
    reference = tmp_path / "reference.safetensors"
    subprocess.run(
        [
            *trainer_argv(agent.url, tmp_path / "unused", run),
            "--steps",
            "60",
            "--no-register",
            "--final-out",
            str(reference),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    why = f"(kill steps drawn with random.Random({seed}))"
    first_kill = rng.randrange(11, 30)
    events = live(agent.url, ssd, run, first_kill, tmp_path / "trainer-1.log")
    assert events[0]["event"] == "fresh", why

    # Restart 1: from the latest valid checkpoint, read from this node's T0 copy.
    settle(agent.url, run)
    expected = latest_step(agent.url, run)
    assert expected is not None and expected >= 5, why
    second_kill = rng.randrange(expected + 8, 55)
    events = live(agent.url, ssd, run, second_kill, tmp_path / "trainer-2.log")
    resumed = events[0]
    assert resumed["event"] == "resumed", (resumed, why)
    assert (resumed["step"], resumed["source"]) == (expected, "local"), why
    after = [e for e in events if e["event"] == "checkpoint"]
    assert after and after[0]["step"] > expected, why

    # Restart 2: the T0 copy is gone (a new node): restored from the region.
    settle(agent.url, run)
    expected = latest_step(agent.url, run)
    assert expected is not None and expected > resumed["step"], why
    shutil.rmtree(ssd / run / f"step-{expected}")
    final = tmp_path / "final.safetensors"
    events = live(agent.url, ssd, run, None, tmp_path / "trainer-3.log", "--final-out", str(final))
    resumed = events[0]
    assert resumed["event"] == "resumed", (resumed, why)
    assert (resumed["step"], resumed["source"], resumed["region"]) == (expected, "region", "east")
    done = events[-1]
    assert done["event"] == "done" and done["step"] == 60

    # Bit for bit: every tensor of the final weights.
    ours, theirs = load_file(str(final)), load_file(str(reference))
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), (name, why)
        assert ours[name].numpy().tobytes() == tensor.numpy().tobytes(), (name, why)
    assert done["sha256"] == weights_sha256(theirs), why

    # Lineage: the first checkpoint after each resume descends from the resumed step.
    detail = httpx.get(f"{agent.url}/v1/runs/{run}/checkpoints/{after[0]['step']}").json()
    assert detail["parent"] == {"run": run, "step": after[0]["step"] - 5}

    # The run's observed costs feed the interval advice.
    advice = cli("--json", "advise", run, "--mtbf-hours", "12", server=agent.url)
    assert advice.returncode == 0, advice.stderr
    answer = json.loads(advice.stdout)
    write = next(s for s in answer["scenarios"] if s["basis"] == "write")
    assert 0 < write["cost_seconds"] < 5 and write["young"]["interval_seconds"] > 0


def weights_sha256(weights: dict[str, Any]) -> str:
    """The hash torch_train.py reports for its final weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(weights.items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def _at(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _sigterm_between_saves(trainer: Trainer, every: int) -> None:
    """SIGTERM the trainer where it will save urgently: at a step it has not
    just saved (it checks for preemption after a step's save, and a step
    just saved is not saved again). Its events reach the test late on a busy
    machine, so once it writes the step after a save the trainer is stopped
    (SIGSTOP) while the test reads every event it has written; the signal
    goes only if the last step written leaves the check at a step that is no
    multiple of ``every`` (the check of the step written last, or, if that
    one has passed, of the next)."""
    for _ in range(20 * every):
        last = trainer.until("step", timeout=30)["step"]
        if last % every != 1:
            continue
        trainer.signal(signal.SIGSTOP)
        try:
            time.sleep(0.2)  # the reader thread takes what is in the pipe
            while True:
                try:
                    event = trainer.next(timeout=0.1)
                except queue.Empty:
                    break
                if event is not None and event["event"] in ("step", "checkpoint"):
                    last = event["step"]
            if last % every not in (0, every - 1):
                trainer.signal(signal.SIGTERM)
                return
        finally:
            trainer.signal(signal.SIGCONT)
    raise AssertionError("never stopped the trainer between two saves")


def test_sigterm_saves_urgently_ahead_of_queued_uploads(
    start_agent: AgentFactory, seaweed: SeaweedServer, tmp_path: Path
) -> None:
    # One job at a time, one part in flight: the queue order is the upload order.
    agent, ssd = start_agent(
        worker={"concurrency": 1},
        upload={"parts_in_flight": 1, "files_in_flight": 1, "part_size_mb": 5},
    )
    run = "preempt"
    trainer = Trainer(
        trainer_argv(
            agent.url,
            ssd,
            run,
            *("--steps", "100000", "--every", "4", "--sleep", "0.05", "--step-events"),
            *("--urgent-wait", "60"),
        ),
        tmp_path / "trainer.log",
    )
    assert seaweed.pid is not None
    stopped = False
    try:
        trainer.until("checkpoint", timeout=60)
        deadline = time.monotonic() + 30
        while [c["state"] for c in checkpoints(agent.url, run)[-1:]] != ["durable"]:
            assert time.monotonic() < deadline, "the first checkpoint never became durable"
            time.sleep(0.05)
        # The object store stalls (SIGSTOP): the worker blocks inside its
        # current upload while the trainer keeps registering normal checkpoints.
        os.kill(seaweed.pid, signal.SIGSTOP)
        stopped = True
        queued: list[int] = []
        while len(queued) < 3:  # waiting for their turn: not even claimed
            trainer.until("checkpoint", timeout=30)
            queued = unclaimed(agent.url, run)
        _sigterm_between_saves(trainer, every=4)
        urgent = trainer.until("checkpoint", timeout=30, priority="urgent")
        # Staged: in the agent's memory tier, on its way to T0 and the catalog.
        assert urgent["step"] % 4 != 0 and urgent["state"] in ("staged", "registered", "uploading")
        os.kill(seaweed.pid, signal.SIGCONT)
        stopped = False
        preempted = trainer.until("preempted", timeout=90)
        code = trainer.wait(timeout=30)
    finally:
        if stopped:
            os.kill(seaweed.pid, signal.SIGCONT)
        trainer.stop()
    assert code == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    assert preempted["step"] == urgent["step"] and preempted["reason"] == "SIGTERM"
    assert preempted["state"] in ("durable", "replicated")

    done = {c["step"]: c for c in settle(agent.url, run, timeout=120)}
    assert done[urgent["step"]]["priority"] == "urgent"
    assert all(c["state"] == "durable" for c in done.values()), done
    urgent_at = _at(done[urgent["step"]]["durable_at"])
    for step in queued:
        assert _at(done[step]["durable_at"]) > urgent_at, (step, done[step], urgent_at)
    # Nothing after the urgent save: the trainer stopped there.
    assert max(done) == urgent["step"]
