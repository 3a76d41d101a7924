"""The peer tier with real agent processes: two or three `tierckpt serve` on
one PostgreSQL catalog, each with its own T0 directory and port.

- a checkpoint registered on node A gets a verified copy on node B;
- a corrupted peer copy is skipped by a restore (the next copy is used),
  the scrubber marks it, and a new copy is made; the peer retention evicts
  older copies;
- node A's agent killed -9 and its T0 deleted before the upload finished,
  the region unreachable: restorable through B, bytes identical, and B's
  agent makes it durable once the region is back;
- a peer token can only push, and only a peer token may push;
- a dead peer's copy of a checkpoint not yet durable is made again on a live one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devsupport import postgres as pg
from devsupport.agent import posix_region, s3_region, write_checkpoint
from devsupport.processes import ServeProcess, cli, node_config
from devsupport.s3proxy import S3FaultProxy
from devsupport.seaweed import SeaweedServer

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]

PEER_TOKEN = "peer-secret-token-0123456789"
TRAINER_TOKEN = "trainer-secret-token-0123456789"
ADMIN_TOKEN = "admin-secret-token-0123456789"
READER_TOKEN = "reader-secret-token-0123456789"


@pytest.fixture
def catalog(postgres_admin_url: str) -> Iterator[str]:
    # A catalog of its own: the agents table must hold only this test's agents.
    with pg.temp_database(postgres_admin_url, prefix="tierckpt_peers_") as url:
        yield url


def token_entries() -> list[dict[str, Any]]:
    return [
        {"name": name, "sha256": hashlib.sha256(token.encode()).hexdigest(), "role": role}
        for name, token, role in (
            ("peers", PEER_TOKEN, "peer"),
            ("trainer", TRAINER_TOKEN, "trainer"),
            ("admin", ADMIN_TOKEN, "admin"),
            ("reader", READER_TOKEN, "reader"),
        )
    ]


def peer_agent(
    tmp_path: Path,
    name: str,
    catalog: str,
    region: dict[str, Any],
    *,
    tokens: bool = False,
    **sections: dict[str, Any],
) -> ServeProcess:
    tables: dict[str, Any] = {
        "worker": {"poll_interval": 0.1, "backoff_base": 0.1, "backoff_max": 1.0},
        "peers": {"copies": 1, "interval_seconds": 0.3, "lease_seconds": 3},
        "scrub": {"enabled": False},
    }
    if tokens:
        tables["peers"]["token"] = PEER_TOKEN
    for section, values in sections.items():
        tables.setdefault(section, {}).update(values)
    return node_config(
        tmp_path,
        name,
        catalog_url=catalog,
        regions=[region],
        tokens=token_entries() if tokens else (),
        **tables,
    ).serve()


def posix(tmp_path: Path) -> dict[str, Any]:
    return posix_region("east", tmp_path / "region")


def poll(what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last: {last}")


def detail(agent: ServeProcess, run: str, step: int, token: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    answer = httpx.get(f"{agent.url}/v1/runs/{run}/checkpoints/{step}", headers=headers)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def peer_state(agent: ServeProcess, run: str, step: int, node: str, **kw: Any) -> str | None:
    for peer in detail(agent, run, step, **kw)["peers"] or []:
        if peer["name"] == f"peer:{node}":
            return str(peer["state"])
    return None


def digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_copy_on_a_peer_corrupted_then_skipped_scrubbed_and_made_again(
    tmp_path: Path, catalog: str
) -> None:
    scrub = {"enabled": True, "interval_seconds": 0.5, "min_age_hours": 0}
    with (
        peer_agent(tmp_path, "node-a", catalog, posix(tmp_path)) as a,
        peer_agent(
            tmp_path,
            "node-b",
            catalog,
            posix(tmp_path),
            scrub=scrub,
            peers={"copies": 1, "interval_seconds": 0.3, "lease_seconds": 3, "keep_last": 1},
        ) as b,
    ):
        listed = poll(
            "both agents live",
            lambda: (
                [x["node"] for x in httpx.get(f"{a.url}/v1/agents").json()["agents"] if x["live"]]
                == ["node-a", "node-b"]
            ),
        )
        assert listed
        source = write_checkpoint(
            tmp_path / "ssd-node-a" / "step-1", {"model.bin": 300_000, "meta.json": b"{}"}
        )
        registered = cli("register", "pr", "1", str(source), "--wait", server=a.url)
        assert registered.returncode == 0, registered.stderr
        poll("peer:node-b committed", lambda: peer_state(a, "pr", 1, "node-b") == "committed")
        shown = detail(a, "pr", 1)
        assert shown["peer_safe"] is True
        status = cli("status", "pr", "1", server=a.url)
        assert status.returncode == 0 and "peer:node-b" in status.stdout, status.stdout
        page = httpx.get(f"{a.url}/ui/runs/pr").text
        assert 'data-peer-safe="yes"' in page and "peer:node-b" in page
        copy = next(c for c in shown["copies"] if c["tier"] == "peer")
        assert copy["node"] == "node-b"
        held = Path(copy["path"])
        assert held.is_relative_to(tmp_path / "ssd-node-b")
        assert digests(held) == digests(source)

        # Nearest first: the answering agent's own copy, the other agent's,
        # then the region.
        plan = httpx.get(f"{a.url}/v1/runs/pr/checkpoints/1/download").json()
        assert [s["region"] for s in plan["sources"]] == ["t0:node-a", "peer:node-b", "east"]
        plan = httpx.get(f"{b.url}/v1/runs/pr/checkpoints/1/download").json()
        assert [s["region"] for s in plan["sources"]] == ["peer:node-b", "t0:node-a", "east"]
        # The copy on B rots: a restore through B reads it first, finds the
        # mismatch and restores from the next copy instead (unverified, the
        # restored bytes would be the rotten ones).
        rotten = held / "model.bin"
        data = bytearray(rotten.read_bytes())
        data[1000] ^= 0xFF
        rotten.write_bytes(bytes(data))
        restored = cli("restore", "pr", str(tmp_path / "restored"), "--step", "1", server=b.url)
        assert restored.returncode == 0, restored.stderr
        assert digests(tmp_path / "restored") == digests(source)

        # B's scrubber finds it, marks it and a new copy is pushed by A.
        def scrubbed_and_made_again() -> bool:
            metrics = httpx.get(f"{b.url}/metrics").text
            seen = 'tierckpt_peer_checks_total{result="corrupt",where="scrub"} 1.0' in metrics
            return seen and peer_state(a, "pr", 1, "node-b") == "committed"

        poll("a corrupt copy scrubbed and pushed again", scrubbed_and_made_again)
        assert digests(held) == digests(source)

        # B keeps the newest copy per run ([peers] keep_last = 1): once step 2
        # is durable and copied, step 1's copy goes.
        newer = write_checkpoint(tmp_path / "ssd-node-a" / "step-2", {"model.bin": 1000})
        assert cli("register", "pr", "2", str(newer), "--wait", server=a.url).returncode == 0
        poll("step 1's copy evicted", lambda: peer_state(a, "pr", 1, "node-b") == "deleted")
        assert not held.exists()
        assert peer_state(a, "pr", 2, "node-b") == "committed"


def test_node_lost_before_upload_restorable_from_peer_which_makes_it_durable(
    tmp_path: Path, catalog: str, seaweed: SeaweedServer, s3_bucket: str, s3_client: Any
) -> None:
    # Short leases: a dead agent's jobs and its place are taken over quickly.
    worker = {"poll_interval": 0.1, "backoff_base": 0.1, "backoff_max": 1.0, "lease_seconds": 2}
    with S3FaultProxy(seaweed.endpoint_url) as proxy:
        region = s3_region("east", proxy.endpoint_url, s3_bucket, prefix="peers")
        a = peer_agent(tmp_path, "node-a", catalog, region, worker=worker).start()
        with peer_agent(tmp_path, "node-b", catalog, region, worker=worker) as b:
            proxy.fail(503, "ServiceUnavailable")  # the region goes down before the save
            try:
                source = write_checkpoint(tmp_path / "ssd-node-a" / "step-7", {"w.bin": 200_000})
                expected = digests(source)
                assert cli("register", "lost", "7", str(source), server=a.url).returncode == 0
                poll("copy on B", lambda: peer_state(b, "lost", 7, "node-b") == "committed")
                assert detail(b, "lost", 7)["state"] in ("registered", "uploading")
                # Nothing durable yet; asked explicitly, `latest` names the peer-safe one.
                assert cli("latest", "lost", server=b.url).returncode != 0
                safe = cli("latest", "lost", "--peer-safe", "--json", server=b.url)
                assert safe.returncode == 0, safe.stderr
                assert json.loads(safe.stdout)["step"] == 7
            finally:
                a.kill()
            shutil.rmtree(tmp_path / "ssd-node-a")

            # Not durable, node A gone: restorable from B's copy (A's T0
            # copy leaves the plan once A's heartbeat is older than its lease).
            plan = httpx.get(f"{b.url}/v1/runs/lost/checkpoints/7/download").json()
            assert plan["sources"][0]["region"] == "peer:node-b"
            assert "east" not in [s["region"] for s in plan["sources"]]
            target = tmp_path / "restored"
            restored = cli("restore", "lost", str(target), "--step", "7", server=b.url)
            assert restored.returncode == 0, restored.stderr
            assert digests(target) == expected

            # A's lease expires: B uploads from its copy once the region is back.
            poll(
                "B owns the shard",
                lambda: detail(b, "lost", 7)["shards"][0]["node"] == "node-b",
            )
            proxy.clear()
            poll("durable", lambda: detail(b, "lost", 7)["state"] in ("durable", "replicated"))
            # The bytes B uploaded are the registered ones.
            listed = s3_client.list_objects_v2(Bucket=s3_bucket, Prefix="peers/lost/")
            keys = [o["Key"] for o in listed.get("Contents", []) if o["Key"].endswith("/w.bin")]
            assert len(keys) == 1
            body = s3_client.get_object(Bucket=s3_bucket, Key=keys[0])["Body"].read()
            assert hashlib.sha256(body).hexdigest() == expected["w.bin"]


def test_peer_token_only_pushes_and_only_peer_tokens_push(tmp_path: Path, catalog: str) -> None:
    with (
        peer_agent(tmp_path, "node-a", catalog, posix(tmp_path), tokens=True) as a,
        peer_agent(tmp_path, "node-b", catalog, posix(tmp_path), tokens=True) as b,
    ):
        source = write_checkpoint(tmp_path / "ssd-node-a" / "step-3", {"w.bin": 50_000})
        trainer = {"TIERCKPT_TOKEN": TRAINER_TOKEN}
        registered = cli("register", "tok", "3", str(source), "--wait", server=a.url, env=trainer)
        assert registered.returncode == 0, registered.stderr
        # A presents its peer token: the push is accepted.
        poll(
            "copy on B",
            lambda: peer_state(a, "tok", 3, "node-b", token=READER_TOKEN) == "committed",
        )

        def call(method: str, path: str, token: str, **kw: Any) -> int:
            headers = {"Authorization": f"Bearer {token}"}
            return httpx.request(method, f"{a.url}{path}", headers=headers, **kw).status_code

        # The peer token can do nothing but push.
        body = {"run": "tok", "step": 4, "path": str(source)}
        assert call("POST", "/v1/checkpoints", PEER_TOKEN, json=body) == 403
        runs = httpx.get(f"{a.url}/v1/runs", headers={"Authorization": f"Bearer {PEER_TOKEN}"})
        assert runs.status_code == 200 and "tok" not in runs.text  # sees no run
        assert call("GET", "/v1/runs/tok/checkpoints", PEER_TOKEN) == 403
        assert call("GET", "/v1/runs/tok/checkpoints/3", PEER_TOKEN) == 403
        assert call("DELETE", "/v1/runs/tok/checkpoints/3", PEER_TOKEN) == 403
        assert call("GET", "/v1/runs/tok/checkpoints/3/download", PEER_TOKEN) == 403

        # Only a peer token may push: not a trainer's, an admin's or a reader's.
        copy = next(c for c in detail(a, "tok", 3, ADMIN_TOKEN)["copies"] if c["tier"] == "peer")
        url = httpx.get(
            f"{b.url}/v1/runs/tok/checkpoints/3/download",
            headers={"Authorization": f"Bearer {READER_TOKEN}"},
        ).json()["sources"][0]["files"][0]["url"]
        push_path = url.split(b.url, 1)[1]
        assert push_path.startswith("/v1/peers/shards/")
        for token in (TRAINER_TOKEN, ADMIN_TOKEN, READER_TOKEN):
            headers = {"Authorization": f"Bearer {token}"}
            answer = httpx.put(f"{b.url}{push_path}", content=b"x" * 50_000, headers=headers)
            assert answer.status_code == 403, answer.text
        commit = push_path.split("/files/", 1)[0] + "/commit"
        assert (
            httpx.post(
                f"{b.url}{commit}", headers={"Authorization": f"Bearer {TRAINER_TOKEN}"}
            ).status_code
            == 403
        )
        # A push of wrong bytes (even with the peer token) is refused, and
        # nothing of it is left behind; the committed copy is untouched.
        peer = {"Authorization": f"Bearer {PEER_TOKEN}"}
        wrong = httpx.put(f"{b.url}{push_path}", content=b"y" * 50_000, headers=peer)
        assert wrong.status_code == 422 and "SHA-256" in wrong.text
        short = httpx.put(f"{b.url}{push_path}", content=b"y" * 10, headers=peer)
        assert short.status_code == 422
        leftovers = [
            p for p in (tmp_path / "ssd-node-b" / ".peers").rglob("*") if ".partial" in str(p)
        ]
        assert all(p.is_dir() for p in leftovers), leftovers
        assert digests(Path(copy["path"])) == digests(source)
        # Readers restore from the peer with their own token: a token-less
        # read of a peer copy is refused.
        assert httpx.get(f"{b.url}{push_path}").status_code == 401
        restored = cli(
            "restore",
            "tok",
            str(tmp_path / "restored"),
            server=b.url,  # B's plan: its own peer copy first
            env={"TIERCKPT_TOKEN": READER_TOKEN},
        )
        assert restored.returncode == 0, restored.stderr
        assert digests(tmp_path / "restored") == digests(source)


def test_a_dead_peers_copy_is_made_again_on_a_live_one(
    tmp_path: Path, catalog: str, seaweed: SeaweedServer, s3_bucket: str
) -> None:
    with S3FaultProxy(seaweed.endpoint_url) as proxy:
        region = s3_region("east", proxy.endpoint_url, s3_bucket, prefix="peers")
        agents = {
            name: peer_agent(tmp_path, name, catalog, region).start()
            for name in ("node-a", "node-b", "node-c")
        }
        try:
            a = agents["node-a"]
            proxy.fail(503, "ServiceUnavailable")  # not durable: copies are its safety
            source = write_checkpoint(tmp_path / "ssd-node-a" / "step-9", {"w.bin": 20_000})
            assert cli("register", "top", "9", str(source), server=a.url).returncode == 0

            def holders() -> list[str]:
                return [
                    p["node"]
                    for p in detail(a, "top", 9)["peers"] or []
                    if p["state"] == "committed"
                ]

            (first,) = poll("one copy", holders)
            agents[first].kill()
            (other,) = {"node-b", "node-c"} - {first}
            # Once the holder's lease expires, A pushes to the live one.
            poll(f"a copy on {other}", lambda: other in holders())
            assert detail(a, "top", 9)["state"] in ("registered", "uploading")
        finally:
            for agent in agents.values():
                agent.kill()
