"""End to end: an object (a file of the upload, or the commit's marker) that
lands after its checkpoint was deleted, with the agent killed -9 before it
hears that it landed.

tests/integration/test_delete_races.py drives the races of a deletion with
an upload, a commit or a replication in process, with the fault injected in
the store's call. Here the moment is made with real processes: a `tierckpt
serve` (its worker in a process of its own) writes the object through a
proxy that stops the request before the store until the checkpoint has been
deleted and its region swept, lets it land, and holds back the store's
answer; the agent is killed -9 then. The object is in the region, its job is
still running, nothing recorded it. After a restart the job runs again,
finds the checkpoint deleted and takes the object back: no commit marker
outlives its checkpoint (a catalog rebuild would read it), no object is left
that nobody owns, no replica says committed, `latest` has nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from devsupport.agent import s3_region
from devsupport.processes import agent_config, wait_for
from devsupport.s3proxy import S3FaultProxy
from devsupport.seaweed import SeaweedServer

pytestmark = pytest.mark.e2e


def _objects(s3_client: Any, bucket: str) -> list[str]:
    listed = s3_client.list_objects_v2(Bucket=bucket)
    return sorted(o["Key"] for o in listed.get("Contents", []))


def _succeeded(kind: str) -> Callable[[dict[str, Any]], bool]:
    """Whether a checkpoint detail shows its ``kind`` job succeeded."""
    return lambda detail: any(
        j["kind"] == kind and j["state"] == "succeeded" for j in detail["jobs"] or []
    )


# moment: (the object held, the job writing it)
MOMENTS = {"upload": ("w.bin", "upload"), "commit": ("MANIFEST.json", "commit")}


@pytest.mark.parametrize("moment", sorted(MOMENTS))
def test_an_object_landed_after_the_deletion_is_taken_back_after_a_kill9(
    seaweed: SeaweedServer,
    s3_client: Any,
    s3_bucket: str,
    catalog_url: str,
    tmp_path: Path,
    moment: str,
) -> None:
    name, kind = MOMENTS[moment]
    ssd = tmp_path / "ssd"
    checkpoint = ssd / "step-1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "w.bin").write_bytes(b"w" * 1000)
    with S3FaultProxy(seaweed.endpoint_url) as proxy:
        config = agent_config(
            tmp_path,
            node="race-node",
            catalog_url=catalog_url,
            regions=[s3_region("east", proxy.endpoint_url, s3_bucket)],
            server={"rate_limit_per_second": 0},
            worker={"poll_interval": 0.05, "backoff_base": 0.1, "backoff_max": 1.0},
            scrub={"enabled": False},
        )
        hold = proxy.hold(
            lambda request: request.method == "PUT" and request.path.endswith(f"/{name}")
        )
        agent = config.serve(tmp_path / "serve.log").start()
        try:
            with httpx.Client(base_url=agent.url, timeout=30) as http:
                registered = http.post(
                    "/v1/checkpoints", json={"run": "r", "step": 1, "path": str(checkpoint)}
                )
                assert registered.status_code == 202, registered.text
                # The object is stopped before the store.
                assert hold.arrived.wait(60)
                deleted = http.delete("/v1/runs/r/checkpoints/1")
                assert deleted.status_code == 202, deleted.text
                wait_for(f"{agent.url}/v1/runs/r/checkpoints/1", _succeeded("delete"), 60)
                assert _objects(s3_client, s3_bucket) == []  # swept
                hold.go.set()
                assert hold.landed.wait(60)
            landed = _objects(s3_client, s3_bucket)
            assert [key.rsplit("/", 1)[-1] for key in landed] == [name]
        finally:
            agent.kill()  # before it hears that the object landed
            hold.release.set()

        with (
            config.serve(tmp_path / "serve.log").start() as again,
            httpx.Client(base_url=again.url, timeout=30) as http,
        ):
            # The job, whose worker died with the agent, runs again.
            wait_for(f"{again.url}/v1/runs/r/checkpoints/1", _succeeded(kind), 60)
            assert _objects(s3_client, s3_bucket) == []
            detail = http.get("/v1/runs/r/checkpoints/1").json()
            assert detail["state"] == "deleted"
            assert all(r["state"] != "committed" for r in detail["replicas"]), detail
            assert http.get("/v1/runs/r/latest").status_code == 404
