"""Two `tierckpt serve` processes (two nodes) on one PostgreSQL catalog and one
SeaweedFS region: a 2-rank checkpoint registered through both with the CLI,
restored whole and per rank, and its lineage printed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from devsupport.agent import s3_region, write_checkpoint
from devsupport.processes import ServeProcess, cli, node_config
from devsupport.seaweed import SeaweedServer

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]


def agent(
    tmp_path: Path, name: str, catalog: str, seaweed: SeaweedServer, bucket: str
) -> ServeProcess:
    return node_config(
        tmp_path,
        name,
        catalog_url=catalog,
        regions=[s3_region("east", seaweed.endpoint_url, bucket, prefix="two")],
        worker={"poll_interval": 0.1},
    ).serve()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_sharded_checkpoint_through_two_agent_processes(
    tmp_path: Path, postgres_url: str, seaweed: SeaweedServer, s3_bucket: str, s3_client: Any
) -> None:
    with (
        agent(tmp_path, "node-a", postgres_url, seaweed, s3_bucket) as a,
        agent(tmp_path, "node-b", postgres_url, seaweed, s3_bucket) as b,
    ):
        rank0 = write_checkpoint(
            tmp_path / "ssd-node-a" / "step-5", {"model-00.bin": 4 << 20, "meta.json": b"{}"}
        )
        rank1 = write_checkpoint(tmp_path / "ssd-node-b" / "step-5", {"model-01.bin": 3 << 20})
        first = cli(
            "register", "shard", "5", str(rank0), "--rank", "0", "--world-size", "2", server=a.url
        )
        assert first.returncode == 0, first.stderr
        # Only rank 0: not valid, so not the latest.
        assert cli("latest", "shard", server=b.url).returncode == 1
        second = cli(
            "register",
            "shard",
            "5",
            str(rank1),
            "--rank",
            "1",
            "--world-size",
            "2",
            "--wait",
            "--timeout",
            "120",
            server=b.url,
        )
        assert second.returncode == 0, second.stderr

        latest = json.loads(cli("--json", "latest", "shard", server=a.url).stdout)
        assert latest["step"] == 5 and {(s["rank"], s["node"]) for s in latest["shards"]} == {
            (0, "node-a"),
            (1, "node-b"),
        }
        manifest = json.loads(
            s3_client.get_object(Bucket=s3_bucket, Key="two/shard/step-000000000005/MANIFEST.json")[
                "Body"
            ].read()
        )
        assert {(f["rank"], f["path"]) for f in manifest["files"]} == {
            (0, "model-00.bin"),
            (0, "meta.json"),
            (1, "model-01.bin"),
        }

        whole = cli("restore", "shard", str(tmp_path / "whole"), server=b.url)
        assert whole.returncode == 0, whole.stderr
        assert digest(tmp_path / "whole" / "model-00.bin") == digest(rank0 / "model-00.bin")
        assert digest(tmp_path / "whole" / "model-01.bin") == digest(rank1 / "model-01.bin")
        one = cli("restore", "shard", str(tmp_path / "rank1"), "--rank", "1", server=a.url)
        assert one.returncode == 0, one.stderr
        assert sorted(p.name for p in (tmp_path / "rank1").iterdir()) == ["model-01.bin"]

        # A fork: a fine-tune run whose parent is shard:5; the tree shows it.
        fork = write_checkpoint(tmp_path / "ssd-node-a" / "ft-1", {"w": b"1"})
        assert (
            cli(
                "register", "ft", "1", str(fork), "--parent", "shard:5", "--wait", server=a.url
            ).returncode
            == 0
        )
        tree = cli("lineage", "ft", "1", server=b.url)
        assert tree.returncode == 0, tree.stderr
        assert tree.stdout.index("shard:5") < tree.stdout.index("ft:1")
        children = json.loads(cli("--json", "lineage", "shard", "5", server=b.url).stdout)[
            "children"
        ]
        assert [(c["run"], c["step"]) for c in children] == [("ft", 1)]
