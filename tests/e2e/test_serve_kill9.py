"""End to end: the real `tierckpt serve` and CLI as processes, SIGKILL mid-upload.

Registered checkpoints must survive a kill -9 of the agent at any moment:
the job is reclaimed by the restarted agent and redone, and the bytes in the
store are checked with an independent S3 client and hashlib.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from devsupport.agent import s3_region, write_checkpoint
from devsupport.processes import AgentConfig, agent_config, cli, free_port, wait_for
from devsupport.seaweed import SeaweedServer, boto3_client, overwrite_object

pytestmark = pytest.mark.e2e


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_object(s3_client: Any, bucket: str, key: str) -> str:
    body = s3_client.get_object(Bucket=bucket, Key=key)["Body"]
    digest = hashlib.sha256()
    for chunk in iter(lambda: body.read(1 << 20), b""):
        digest.update(chunk)
    return digest.hexdigest()


def open_uploads(s3_client: Any, bucket: str, prefix: str = "e2e/") -> list[str]:
    """Keys with a multipart upload still open under the test's prefix."""
    answer = s3_client.list_multipart_uploads(Bucket=bucket, Prefix=prefix)
    return sorted(u["Key"] for u in answer.get("Uploads", []))


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (the agent's worker process)."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def gone(pid: int, timeout: float = 30) -> bool:
    """True once ``pid`` has exited (or is a zombie nobody reaps yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def config(tmp_path: Path, catalog_url: str, seaweed: SeaweedServer, s3_bucket: str) -> AgentConfig:
    return agent_config(
        tmp_path,
        catalog_url=catalog_url,
        regions=[s3_region("east", seaweed.endpoint_url, s3_bucket, prefix="e2e")],
        # One 5 MiB part in flight: the upload takes long enough to be
        # killed in the middle of it.
        upload={"part_size_mb": 5, "parts_in_flight": 1, "files_in_flight": 1},
        worker={"poll_interval": 0.1, "lease_seconds": 10, "backoff_base": 0.2, "backoff_max": 2.0},
    )


def test_kill9_mid_upload_loses_nothing(
    config: AgentConfig,
    tmp_path: Path,
    s3_client: Any,
    s3_bucket: str,
    catalog_url: str,
) -> None:
    ssd = config.ssd
    files: dict[str, bytes | int] = {
        "model/weights.bin": 110 << 20,
        "model/nested/deep/optim.bin": 3 << 20,
        "empty.txt": b"",
        "données-é.json": b'{"ok": true}',
    }
    ckpt = write_checkpoint(ssd / "run" / "step-100", files)
    agent = config.serve(tmp_path / "serve.log")
    with agent.start():
        registered = cli(
            "--json", "register", "gpt", "100", str(ckpt), "--metric", "loss=0.25", server=agent.url
        )
        assert registered.returncode == 0, registered.stderr
        assert json.loads(registered.stdout)["state"] in ("registered", "uploading")

        detail_url = f"{agent.url}/v1/runs/gpt/checkpoints/100"
        wait_for(detail_url, lambda a: a["shards"][0]["state"] == "uploading")
        # Kill it with a multipart upload open (the 110 MiB file, in 5 MiB parts).
        deadline = time.monotonic() + 60
        while not open_uploads(s3_client, s3_bucket) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        assert agent.proc is not None
        workers = children(agent.proc.pid)
        # The worker process (worker_process.py): by default with either catalog.
        assert len(workers) == 1
        agent.kill()
        # The worker process does not outlive the agent (PR_SET_PDEATHSIG).
        assert all(gone(worker) for worker in workers)
    # Read the catalog as the kill left it: the shard was mid-upload.
    with config.serve(tmp_path / "serve.log", worker=False).start() as frozen:
        before = httpx.get(f"{frozen.url}/v1/runs/gpt/checkpoints/100").json()
    assert before["shards"][0]["state"] == "uploading", "the kill must land mid-upload"
    left = open_uploads(s3_client, s3_bucket)
    assert left == ["e2e/gpt/step-000000000100/rank-00000/model/weights.bin"], left

    with config.serve(tmp_path / "serve.log").start() as again:
        done = wait_for(
            f"{again.url}/v1/runs/gpt/checkpoints/100",
            lambda a: a["state"] in ("durable", "failed"),
        )
        assert done["state"] == "durable", done
        upload_jobs = [j for j in done["jobs"] if j["kind"] == "upload"]
        assert upload_jobs and upload_jobs[0]["attempts"] >= 2  # redone after the kill
        # The killed attempt's upload was aborted by the retry, not left open
        # (unseen, and billed by most stores) for ever.
        assert open_uploads(s3_client, s3_bucket) == []

        for entry in done["files"]:
            local = sha256_file(ckpt / entry["path"])
            remote = sha256_object(
                s3_client, s3_bucket, f"e2e/gpt/step-000000000100/rank-00000/{entry['path']}"
            )
            assert local == remote == entry["sha256"], entry["path"]
        manifest = json.loads(
            s3_client.get_object(Bucket=s3_bucket, Key="e2e/gpt/step-000000000100/MANIFEST.json")[
                "Body"
            ].read()
        )
        assert {f["path"] for f in manifest["files"]} == set(files)

        latest = cli("--json", "latest", "gpt", server=again.url)
        assert latest.returncode == 0 and json.loads(latest.stdout)["step"] == 100
        restored = cli("--json", "restore", "gpt", str(tmp_path / "restored"), server=again.url)
        assert restored.returncode == 0, restored.stderr
        for relative in files:
            assert sha256_file(tmp_path / "restored" / relative) == sha256_file(ckpt / relative)

        # verify: intact (exit 0); then garbage behind tierckpt's back is
        # found (exit 4) and repaired from the local T0 copy.
        intact = cli("--json", "verify", "gpt", "100", "--timeout", "120", server=again.url)
        assert intact.returncode == 0, intact.stderr
        assert json.loads(intact.stdout)["replicas"][0]["verified_at"], intact.stdout
        bad_key = "e2e/gpt/step-000000000100/rank-00000/empty.txt"
        overwrite_object(s3_client, s3_bucket, bad_key, b"not empty")
        found = cli("--json", "verify", "gpt", "100", "--timeout", "120", server=again.url)
        assert found.returncode == 4, found.stdout + found.stderr
        assert "empty.txt" in json.loads(found.stdout)["replicas"][0]["error"]
        wait_for(
            f"{again.url}/v1/runs/gpt/checkpoints/100",
            lambda a: a["state"] == "durable" and a["replicas"][0]["state"] == "committed",
        )
        assert sha256_object(s3_client, s3_bucket, bad_key) == sha256_file(ckpt / "empty.txt")


def test_kill9_mid_replication_leaves_no_open_upload(
    config: AgentConfig,
    tmp_path: Path,
    seaweed_west: SeaweedServer,
) -> None:
    """A replicate job killed mid-copy leaves a multipart upload open in the
    target region; its retry aborts it, then copies, and nothing is lost."""
    ssd = config.ssd
    west_bucket = seaweed_west.create_bucket(f"west-{uuid.uuid4().hex[:12]}")
    west = boto3_client(seaweed_west.endpoint_url)
    text = config.path.read_text()
    # West is filled by a replicate job (no upload from T0 into it), which
    # streams between the two servers in 5 MiB parts, one at a time.
    text = text.replace("[upload]\n", "[upload]\nfan_out = false\n", 1)
    text += (
        '\n[[regions]]\nname = "west"\nkind = "s3"\n'
        f'endpoint_url = "{seaweed_west.endpoint_url}"\nbucket = "{west_bucket}"\n'
        'prefix = "e2e"\naccess_key_id = "tierckpt"\nsecret_access_key = "tierckpt-secret"\n'
    )
    config.path.write_text(text)
    ckpt = write_checkpoint(ssd / "run" / "step-7", {"weights.bin": 110 << 20, "m.json": b"{}"})
    key = "e2e/rep/step-000000000007/rank-00000/weights.bin"
    agent = config.serve(tmp_path / "serve.log")
    with agent.start():
        assert cli("register", "rep", "7", str(ckpt), server=agent.url).returncode == 0
        deadline = time.monotonic() + 120
        while not open_uploads(west, west_bucket) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        agent.kill()
    assert open_uploads(west, west_bucket) == [key], "the kill must land mid-replication"

    with config.serve(tmp_path / "serve.log").start() as again:
        done = wait_for(
            f"{again.url}/v1/runs/rep/checkpoints/7",
            lambda a: a["state"] in ("replicated", "failed"),
            timeout=180,
        )
        assert done["state"] == "replicated", done
        replicate = [j for j in done["jobs"] if j["kind"] == "replicate"]
        assert replicate and replicate[0]["attempts"] >= 2  # redone after the kill
        assert open_uploads(west, west_bucket) == []
        assert sha256_object(west, west_bucket, key) == sha256_file(ckpt / "weights.bin")


def test_sigterm_releases_work_and_cli_exit_codes(config: AgentConfig, tmp_path: Path) -> None:
    ssd = config.ssd
    # No drain (tests/e2e/test_drain.py has it): SIGTERM gives the job back.
    text = config.path.read_text()
    config.path.write_text(text.replace("[worker]\n", "[worker]\ndrain_seconds = 0\n"))
    ckpt = write_checkpoint(ssd / "run" / "step-1", {"w.bin": 60 << 20})
    agent = config.serve(tmp_path / "serve.log").start()
    try:
        assert cli("register", "job", "1", str(ckpt), server=agent.url).returncode == 0
        wait_for(f"{agent.url}/v1/runs/job/checkpoints/1", lambda a: a["state"] == "uploading")
        # Graceful: uvicorn runs the lifespan shutdown (the worker gives its
        # job back) and then re-raises SIGTERM, so the exit status is -15.
        assert agent.terminate(timeout=60) in (0, -15)
        log = (tmp_path / "serve.log").read_text()
        assert "Application shutdown complete" in log
        assert "draining" not in log
    finally:
        agent.kill()

    with config.serve(tmp_path / "serve.log").start() as again:
        wait_for(f"{again.url}/v1/runs/job/checkpoints/1", lambda a: a["state"] == "durable")
        missing = cli("latest", "no-such-run", server=again.url)
        assert missing.returncode == 1
        bad = cli("register", "job", "2", str(tmp_path / "not-under-roots"), server=again.url)
        assert bad.returncode == 2 and "outside the local roots" in bad.stderr
        usage = cli("register", "job", "minus-one", str(ckpt), server=again.url)
        assert usage.returncode == 2
    down = cli("latest", "job", server=f"http://127.0.0.1:{free_port()}")
    assert down.returncode == 3
