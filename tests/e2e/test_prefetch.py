"""Prefetch before a restart, end to end: two `tierckpt serve` processes (two
nodes) on one PostgreSQL catalog, one SeaweedFS region behind a proxy that
records every S3 request. A 2-rank DCP checkpoint saved on node A is
prefetched to node B with the CLI; B's `latest?node=` answers B's verified
copy of both ranks; a 2-rank load on B through TierckptReader reads only
that copy, and neither the load nor a second prefetch sends a single request
for the checkpoint's objects to the region (which answers every request
with an error meanwhile)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devsupport.agent import s3_region
from devsupport.processes import ServeProcess, cli, node_config
from devsupport.s3proxy import S3FaultProxy
from devsupport.seaweed import SeaweedServer
from tests.e2e.test_dcp_plugin import job
from tests.e2e.test_torch_resume import settle
from tierckpt.service.prefetch.copies import DIRECTORY

pytest.importorskip("torch")

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]

RUN = "plugin"  # the run devsupport/dcp_plugin_job.py saves


def agent(tmp_path: Path, name: str, catalog: str, endpoint: str, bucket: str) -> ServeProcess:
    return node_config(
        tmp_path,
        name,
        catalog_url=catalog,
        regions=[s3_region("east", endpoint, bucket, prefix="pre")],
        worker={"poll_interval": 0.1, "backoff_base": 0.2},
        upload={"chunk_size_mb": 1},
    ).serve()


def object_requests(proxy: S3FaultProxy, since: int) -> list[str]:
    return [f"{s.method} {s.path}" for s in proxy.log[since:] if f"/{RUN}/step-" in s.path]


def test_prefetch_to_another_node_then_restore_there_reads_no_region(
    tmp_path: Path, postgres_url: str, seaweed: SeaweedServer, s3_bucket: str
) -> None:
    with (
        S3FaultProxy(seaweed.endpoint_url) as proxy,
        agent(tmp_path, "node-a", postgres_url, proxy.endpoint_url, s3_bucket) as a,
        agent(tmp_path, "node-b", postgres_url, proxy.endpoint_url, s3_bucket) as b,
    ):
        saved = job(a.url, tmp_path / "ssd-node-a", "save", 2, "--step", "10")
        assert all(r["registered"] for r in saved)
        assert [c["state"] for c in settle(a.url, RUN)] == ["durable"]
        done = cli("prefetch", RUN, "--node", "node-b", "--wait", "--timeout", "120", server=b.url)
        assert done.returncode == 0, done.stderr
        assert "plugin:10 on node-b: succeeded" in done.stdout

        latest = json.loads(cli("--json", "latest", RUN, "--node", "node-b", server=b.url).stdout)
        copy = tmp_path / "ssd-node-b" / DIRECTORY / RUN / "step-000000000010"
        assert latest["step"] == 10 and latest["local"]["node"] == "node-b"
        assert latest["local"]["ranks"] == {
            "0": str(copy / "rank-00000"),
            "1": str(copy / "rank-00001"),
        }

        # From here on the region refuses everything: a read would fail.
        proxy.fail(status=503, code="ServiceUnavailable")
        since = len(proxy.log)
        loaded = job(b.url, tmp_path / "restore-b", "load", 2, "--node", "node-b")
        print("bytes per rank on node-b:", [r["by_source"] for r in loaded])
        for r in loaded:
            assert r["equal"] and r["step"] == 10, r
            assert set(r["by_source"]) == {"local"}, r
        again = cli("--json", "prefetch", RUN, "--node", "node-b", "--wait", server=a.url)
        assert again.returncode == 0, again.stderr
        assert [j["state"] for j in json.loads(again.stdout)["jobs"]] == ["succeeded"]
        # A plain restore on node B copies B's verified copy.
        restore = cli("restore", RUN, str(tmp_path / "plain"), "--node", "node-b", server=b.url)
        assert restore.returncode == 0, restore.stderr
        assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
        ]
        assert object_requests(proxy, since) == []
        proxy.clear()

        # Asked on node A's agent, node B's copy is not A's to vouch for.
        on_a = json.loads(cli("--json", "latest", RUN, "--node", "node-b", server=a.url).stdout)
        assert on_a["local"] is None
