"""End to end: a preempted node, the agent and the trainer signalled together.

The real `tierckpt serve` and a real trainer process (the client and its
PreemptionGuard) receive SIGTERM at the same moment. The trainer then writes
and registers its urgent checkpoint; the agent, draining, must accept it,
upload and commit it (and the normal work of its node) and only then exit.
Durability is read afterwards from an agent whose worker is off, so nothing
could have finished the work after the first agent exited, and the objects
are re-hashed with an independent S3 client.

The second test drains into a partitioned region: the drain ends at its
deadline, the running upload is given back (no job left `running`), and the
next agent start finishes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from devsupport.agent import s3_region, write_checkpoint
from devsupport.processes import AgentConfig, ServeProcess, agent_config, wait_for
from devsupport.seaweed import SeaweedServer
from devsupport.tcpproxy import TcpProxy
from tierckpt.client import CheckpointClient
from tierckpt.client.errors import ServerError

pytestmark = pytest.mark.e2e

RUN = "drain"
PREFIX = "e2e"

# The trainer: trap SIGTERM, and once it arrives save and register an urgent
# checkpoint, as a training loop under PreemptionGuard does.
TRAINER = r"""
import json, os, sys, time
from pathlib import Path
from tierckpt.client import CheckpointClient
from tierckpt.client.preemption import PreemptionGuard

url, directory, run = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
client = CheckpointClient(url, retries=0)
with PreemptionGuard() as guard:
    print("ready", flush=True)
    while not guard.preempted:
        time.sleep(0.005)
    directory.mkdir(parents=True)
    for name, size in (("model.bin", 24 << 20), ("state.json", 1 << 10)):
        with open(directory / name, "wb") as handle:
            handle.write(os.urandom(size))
            handle.flush()
            os.fsync(handle.fileno())
    checkpoint = client.register(run, 2, str(directory), priority="urgent")
    print(json.dumps({"state": checkpoint.state, "priority": checkpoint.priority}), flush=True)
"""


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sha256_object(s3_client: Any, bucket: str, key: str) -> str:
    return hashlib.sha256(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()).hexdigest()


def start_hung_upload(agent: ServeProcess, proxy: TcpProxy, ckpt: Path) -> None:
    """Register step 1 with the region partitioned, and wait until its upload
    runs: it is then hung mid-flight, neither done nor failed."""
    proxy.stall()
    answer = httpx.post(
        f"{agent.url}/v1/checkpoints", json={"run": RUN, "step": 1, "path": str(ckpt)}
    )
    assert answer.status_code == 202, answer.text
    wait_for(
        f"{agent.url}/v1/runs/{RUN}/checkpoints/1",
        lambda a: any(j["state"] == "running" for j in a["jobs"] or []),
    )


def config(
    tmp_path: Path, catalog: str, endpoint: str, bucket: str, worker: dict[str, Any]
) -> AgentConfig:
    return agent_config(
        tmp_path,
        node="drain-node",
        catalog_url=catalog,
        regions=[s3_region("east", endpoint, bucket, prefix=PREFIX)],
        # One 5 MiB part in flight: the normal upload is still running
        # when the signal arrives.
        upload={"part_size_mb": 5, "parts_in_flight": 1, "files_in_flight": 1},
        worker={"poll_interval": 0.1, "backoff_base": 0.2, "backoff_max": 1.0, **worker},
        scrub={"enabled": False},
    )


def object_key(step: int, name: str) -> str:
    return f"{PREFIX}/{RUN}/step-{step:012d}/rank-00000/{name}"


def assert_in_region(s3_client: Any, bucket: str, step: int, directory: Path) -> None:
    """Every file of the checkpoint is in the region with the right bytes, and
    its manifest (the commit marker) lists them all."""
    manifest = json.loads(
        s3_client.get_object(Bucket=bucket, Key=f"{PREFIX}/{RUN}/step-{step:012d}/MANIFEST.json")[
            "Body"
        ].read()
    )
    names = sorted(p.name for p in directory.iterdir())
    assert sorted(f["path"] for f in manifest["files"]) == names
    for name in names:
        assert sha256_object(s3_client, bucket, object_key(step, name)) == sha256_file(
            directory / name
        )


def test_sigterm_to_agent_and_trainer_urgent_checkpoint_durable_before_exit(
    tmp_path: Path, catalog_url: str, seaweed: SeaweedServer, s3_client: Any, s3_bucket: str
) -> None:
    drain_seconds = 40.0
    configured = config(
        tmp_path,
        catalog_url,
        seaweed.endpoint_url,
        s3_bucket,
        {"drain_seconds": drain_seconds, "drain_linger_seconds": 3},
    )
    ssd = configured.ssd
    agent = configured.serve(tmp_path / "serve.log").start()
    trainer = None
    try:
        normal = write_checkpoint(ssd / RUN / "step-1", {"weights.bin": 60 << 20})
        answer = httpx.post(
            f"{agent.url}/v1/checkpoints", json={"run": RUN, "step": 1, "path": str(normal)}
        )
        assert answer.status_code == 202, answer.text
        wait_for(f"{agent.url}/v1/runs/{RUN}/checkpoints/1", lambda a: a["state"] == "uploading")

        trainer = subprocess.Popen(
            [sys.executable, "-c", TRAINER, agent.url, str(ssd / RUN / "step-2"), RUN],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert trainer.stdout is not None
        assert trainer.stdout.readline().strip() == "ready"

        # The node is preempted: both get SIGTERM at once.
        assert agent.proc is not None
        signalled = time.monotonic()
        os.kill(agent.proc.pid, signal.SIGTERM)
        os.kill(trainer.pid, signal.SIGTERM)

        # While it drains the agent serves: a normal registration is refused
        # with its code; reads, `latest` and the probes answer.
        late = write_checkpoint(ssd / RUN / "step-3", {"w.bin": b"late"})
        refused = httpx.post(
            f"{agent.url}/v1/checkpoints", json={"run": RUN, "step": 3, "path": str(late)}
        )
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "draining"
        assert "urgent" in refused.json()["error"]["message"]
        assert int(refused.headers["Retry-After"]) >= 1
        with CheckpointClient(agent.url, retries=0) as client, pytest.raises(ServerError) as raised:
            client.register(RUN, 3, str(late))
        assert raised.value.code == "draining" and raised.value.status == 503
        assert httpx.get(f"{agent.url}/healthz").json()["status"] == "draining"
        ready = httpx.get(f"{agent.url}/readyz")
        assert ready.status_code == 200 and ready.json()["status"] == "draining"
        assert httpx.get(f"{agent.url}/v1/runs/{RUN}/latest").status_code in (200, 404)
        assert httpx.get(f"{agent.url}/v1/runs/{RUN}/checkpoints/1").status_code == 200

        out, err = trainer.communicate(timeout=60)
        assert trainer.returncode == 0, err
        registered = json.loads(out.strip().splitlines()[-1])
        assert registered == {"state": "registered", "priority": "urgent"}

        status = agent.proc.wait(drain_seconds + 15)
        elapsed = time.monotonic() - signalled
        assert status in (0, -signal.SIGTERM)
        assert elapsed < drain_seconds + 15
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
        agent.kill()
    log = (tmp_path / "serve.log").read_text()
    assert "drain done: no work of this node left" in log, log[-3000:]

    # Read back by an agent that runs no jobs: what is durable now was made
    # durable by the drained agent before it exited.
    with configured.serve(tmp_path / "check.log", worker=False).start() as check:
        for step in (1, 2):
            detail = httpx.get(f"{check.url}/v1/runs/{RUN}/checkpoints/{step}").json()
            assert detail["state"] == "durable", detail
            assert all(job["state"] == "succeeded" for job in detail["jobs"]), detail["jobs"]
        urgent = httpx.get(f"{check.url}/v1/runs/{RUN}/checkpoints/2").json()
        assert urgent["priority"] == "urgent"
        assert httpx.get(f"{check.url}/v1/runs/{RUN}/latest").json()["step"] == 2
        missing = httpx.get(f"{check.url}/v1/runs/{RUN}/checkpoints/3")
        assert missing.status_code == 404  # the refused registration left nothing
    assert_in_region(s3_client, s3_bucket, 1, normal)
    assert_in_region(s3_client, s3_bucket, 2, ssd / RUN / "step-2")


# The worker in the agent's process (SQLite's default) and in its own.
@pytest.mark.parametrize("separate", ["no", "yes"], ids=["worker-in-agent", "worker-process"])
def test_drain_ends_at_its_deadline_and_the_next_start_finishes(
    tmp_path: Path, seaweed: SeaweedServer, s3_client: Any, s3_bucket: str, separate: str
) -> None:
    drain_seconds = 4.0
    with TcpProxy("127.0.0.1", seaweed.ports["s3"]) as proxy:
        configured = config(
            tmp_path,
            f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}",
            f"http://127.0.0.1:{proxy.port}",
            s3_bucket,
            {
                "drain_seconds": drain_seconds,
                "drain_linger_seconds": 1,
                "lease_seconds": 60,
                "separate_process": separate,
            },
        )
        ssd = configured.ssd
        ckpt = write_checkpoint(ssd / RUN / "step-1", {"weights.bin": 12 << 20})
        agent = configured.serve(tmp_path / "serve.log").start()
        try:
            start_hung_upload(agent, proxy, ckpt)
            assert agent.proc is not None
            signalled = time.monotonic()
            agent.proc.send_signal(signal.SIGTERM)
            status = agent.proc.wait(drain_seconds + 15)
            elapsed = time.monotonic() - signalled
        finally:
            agent.kill()
        assert status in (0, -signal.SIGTERM)
        # It drained until its deadline (work was left), then exited promptly.
        assert drain_seconds <= elapsed < drain_seconds + 15
        log = (tmp_path / "serve.log").read_text()
        assert "drain out of time with 1 job(s) of this node left" in log, log[-3000:]

        # The lease was given back: the job is queued, not left running (read
        # by an agent that runs no jobs; it checks the region at start).
        proxy.restore()
        with configured.serve(tmp_path / "check.log", worker=False).start() as check:
            detail = httpx.get(f"{check.url}/v1/runs/{RUN}/checkpoints/1").json()
            assert detail["state"] in ("registered", "uploading"), detail
            assert [(j["kind"], j["state"]) for j in detail["jobs"]] == [("upload", "queued")]

        with configured.serve(tmp_path / "serve.log").start() as again:
            done = wait_for(
                f"{again.url}/v1/runs/{RUN}/checkpoints/1",
                lambda a: a["state"] in ("durable", "failed"),
            )
            assert done["state"] == "durable", done
    assert_in_region(s3_client, s3_bucket, 1, ckpt)


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_second_signal_ends_the_drain_at_once(
    tmp_path: Path, seaweed: SeaweedServer, s3_bucket: str, second: signal.Signals
) -> None:
    drain_seconds = 120.0
    with TcpProxy("127.0.0.1", seaweed.ports["s3"]) as proxy:
        configured = config(
            tmp_path,
            f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}",
            f"http://127.0.0.1:{proxy.port}",
            s3_bucket,
            {"drain_seconds": drain_seconds, "lease_seconds": 60},
        )
        ssd = configured.ssd
        ckpt = write_checkpoint(ssd / RUN / "step-1", {"weights.bin": 12 << 20})
        agent = configured.serve(tmp_path / "serve.log").start()
        try:
            # The upload hangs: the drain would last its 120 s.
            start_hung_upload(agent, proxy, ckpt)
            assert agent.proc is not None
            agent.proc.send_signal(signal.SIGTERM)
            wait_for(f"{agent.url}/healthz", lambda a: a["status"] == "draining")
            agent.proc.send_signal(second)
            status = agent.proc.wait(drain_seconds / 4)
        finally:
            agent.kill()
            proxy.restore()
    assert status != -signal.SIGKILL
    log = (tmp_path / "serve.log").read_text()
    assert "drain ended by a second signal with 1 job(s) of this node left" in log, log[-3000:]
