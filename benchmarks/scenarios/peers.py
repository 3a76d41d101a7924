"""The peer tier: restore from a peer agent against from the region, in the
same run, and what peer copies cost the saving node.

Two agents, ``peer-a`` and ``peer-b``, on one catalog, each with its own T0
directory, ``[peers] copies = 1``. The dataset is registered on A while the
region is unreachable (a fault proxy answers 503), so what A spends between
the registration and the copy being committed on B is the peer push alone
(plus the SHA-256 pass the upload would have done first, and A's failing
upload attempts, which cost little): CPU seconds per GB of A's process
and of its worker process. Time register → peer-safe
is the catalog's clock (created_at → the copy's committed_at). Once the
checkpoint is durable (files hashed, A idle) the copy is marked corrupt and
pushed again, as the scrubber does: A's CPU per GB then is the push alone,
B's the receipt (hash, fsync, commit). Then the region comes back, the checkpoint becomes durable,
and the same checkpoint is restored, alternately, from B's copy (the plan's
peer source) and from the region (its region source, presigned URLs straight
to SeaweedFS), each read and verified by the client in full.

Everything runs on one machine: "the network" between agents is loopback, so
the peer figure is a LAN at memory speed, not a real one; what it shows is
what the restore costs when the bytes come from another agent's T0.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from datetime import datetime
from typing import Any

import httpx
from sqlalchemy import create_engine, select, update

from devsupport.s3proxy import S3FaultProxy
from tierckpt.client.models import RestorePlan
from tierckpt.client.restore import restore_from_plan
from tierckpt.service.jobs import kinds, queue
from tierckpt.service.models import Checkpoint, PeerCopy, Run, Shard

from ..context import BenchContext, log, s3_region, settle
from ..data import link_copy
from ..procstat import tree_cpu_seconds
from ..stats import GB, row

NAME = "peers"
TITLE = "Peer tier: restore from a peer vs from the region; cost of peer copies"
REQUIRES: list[str] = []
RUN = "bench-peers"
TIMEOUT = 600


def _poll(what: str, check: Any) -> Any:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise RuntimeError(f"{what}: not after {TIMEOUT}s")


def _seconds(start: str, end: str) -> float:
    return (datetime.fromisoformat(end[:-1]) - datetime.fromisoformat(start[:-1])).total_seconds()


def _restore(base_url: str, plan: RestorePlan, dest: Any) -> float:
    async def go() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
            await restore_from_plan(plan, dest, http=http, token=None)

    settle()
    started = time.perf_counter()
    asyncio.run(go())
    return time.perf_counter() - started


def _push_again(catalog_url: str, step: int) -> None:
    """Mark the peer copy corrupt and queue its push, in the catalog."""
    engine = create_engine(catalog_url.replace("+aiosqlite", ""))
    try:
        with engine.begin() as conn:
            shard_id, checkpoint_id, node = conn.execute(
                select(Shard.id, Shard.checkpoint_id, Shard.node)
                .join(Checkpoint, Checkpoint.id == Shard.checkpoint_id)
                .join(Run, Run.id == Checkpoint.run_id)
                .where(Run.name == RUN, Checkpoint.step == step)
            ).one()
            conn.execute(
                update(PeerCopy).where(PeerCopy.shard_id == shard_id).values(state="corrupt")
            )
            queue.enqueue_many(
                conn, [kinds.peer_push_row(checkpoint_id, shard_id=shard_id, node=node)]
            )
    finally:
        engine.dispose()


def run(ctx: BenchContext) -> dict[str, Any]:
    catalog = {"url": f"sqlite+aiosqlite:///{ctx.work / 'peers-catalog.db'}"}
    peers = {"copies": 1, "interval_seconds": 0.5}
    ssd_b = ctx.work / "ssd-peer-b"
    ssd_b.mkdir(exist_ok=True)
    size = ctx.dataset.total_bytes
    with S3FaultProxy(ctx.seaweed.endpoint_url) as proxy:
        proxy.fail(503, "ServiceUnavailable")
        agents = ctx.start_agents(
            {
                "peer-a": {
                    "regions": [
                        {**s3_region("bench-east", ctx.seaweed), "endpoint_url": proxy.endpoint_url}
                    ],
                    "server": {"node": "peer-a"},
                    "catalog": catalog,
                    "peers": peers,
                },
                "peer-b": {
                    "server": {"node": "peer-b"},
                    "catalog": catalog,
                    "local": {"roots": [str(ssd_b)]},
                    "peers": peers,
                },
            }
        )
        a, b = agents["peer-a"], agents["peer-b"]
        with httpx.Client(timeout=30) as http:
            _poll(
                "both agents live",
                lambda: (
                    sum(x["live"] for x in http.get(f"{a.url}/v1/agents").json()["agents"]) == 2
                ),
            )
            step = ctx.next_step()
            data = link_copy(ctx.dataset, ctx.ssd / RUN / f"step-{step}")
            settle()
            cpu_a, cpu_b = tree_cpu_seconds(a.pid), tree_cpu_seconds(b.pid)
            answer = http.post(
                f"{a.url}/v1/checkpoints", json={"run": RUN, "step": step, "path": str(data.root)}
            )
            answer.raise_for_status()
            url = f"{a.url}/v1/runs/{RUN}/checkpoints/{step}"
            detail = _poll("peer-safe", lambda: (d := http.get(url).json())["peer_safe"] and d)
            cpu_a, cpu_b = tree_cpu_seconds(a.pid) - cpu_a, tree_cpu_seconds(b.pid) - cpu_b
            committed = max(p["committed_at"] for p in detail["peers"])
            to_peer_safe = _seconds(detail["created_at"], committed)
            log(f"peers: register → peer-safe {to_peer_safe:.2f}s, A {cpu_a:.2f} CPU s")
            proxy.clear()
            _poll("durable", lambda: http.get(url).json()["state"] in ("durable", "replicated"))
            # The push alone: the files hashed, the upload done, A idle. B's
            # copy is marked corrupt and a push queued, as the scrubber does.
            settle()
            cpu_a2, cpu_b2 = tree_cpu_seconds(a.pid), tree_cpu_seconds(b.pid)
            started = time.perf_counter()
            _push_again(catalog["url"], step)
            _poll(
                "pushed again",
                lambda: (
                    (d := http.get(url).json())["peer_safe"]
                    and max(p["committed_at"] for p in d["peers"]) > committed
                ),
            )
            push_seconds = time.perf_counter() - started
            cpu_a2, cpu_b2 = tree_cpu_seconds(a.pid) - cpu_a2, tree_cpu_seconds(b.pid) - cpu_b2
            log(f"peers: push alone {push_seconds:.2f}s, A {cpu_a2:.2f} B {cpu_b2:.2f} CPU s")
            # Asked of B: its own copy is the peer source, its region the S3 one.
            plan = RestorePlan.model_validate(
                http.get(f"{b.url}/v1/runs/{RUN}/checkpoints/{step}/download").json()
            )
    # B's own copy (a restart on a node reading from the peer B); the plan
    # also lists A's T0 copy, left out here.
    peer_source = [s for s in plan.sources if s.region == "peer:peer-b"]
    region_source = [s for s in plan.sources if s.tier != "peer"]
    assert peer_source and region_source, plan
    from_peer: list[float] = []
    from_region: list[float] = []
    reps = 2 if ctx.quick else max(2, min(ctx.reps, 4))
    for rep in range(reps):
        order = [("peer", peer_source), ("region", region_source)]
        for label, sources in order if rep % 2 == 0 else order[::-1]:
            dest = ctx.work / f"peers-restore-{label}-{rep}"
            seconds = _restore(b.url, plan.model_copy(update={"sources": sources}), dest)
            (from_peer if label == "peer" else from_region).append(seconds)
            shutil.rmtree(dest, ignore_errors=True)
        log(f"peers rep {rep + 1}/{reps}: peer {from_peer[-1]:.2f}s, region {from_region[-1]:.2f}s")
    ctx.stop_agent(a)
    ctx.stop_agent(b)
    gb = size / GB
    return {
        "rows": [
            row(
                "restore from a peer agent",
                "throughput",
                "MB/s",
                [size / 1e6 / s for s in from_peer],
                ratio_label="peer / region time",
                ratio_values=[p / r for p, r in zip(from_peer, from_region, strict=True)],
                note=f"{size / 1e6:.0f} MB, every byte verified, loopback",
            ),
            row(
                "restore from the region",
                "throughput",
                "MB/s",
                [size / 1e6 / s for s in from_region],
                note="presigned GETs to SeaweedFS",
            ),
            row(
                "register → peer-safe",
                "time",
                "s",
                [to_peer_safe],
                note="catalog clock; region down meanwhile",
            ),
            row(
                "saving agent CPU per GB, register → peer-safe",
                "cpu",
                "s/GB",
                [cpu_a / gb],
                note="SHA-256 pass + push + failing upload attempts",
            ),
            row(
                "saving agent CPU per GB pushed",
                "cpu",
                "s/GB",
                [cpu_a2 / gb],
                note=f"push alone (hashes known), {push_seconds:.1f} s",
            ),
            row(
                "receiving agent CPU per GB",
                "cpu",
                "s/GB",
                [cpu_b2 / gb],
                note="receive, hash, fsync, commit",
            ),
        ],
        "notes": ["one machine: agent to agent is loopback; figures are indicative"],
        "details": {
            "bytes": size,
            "from_peer_s": from_peer,
            "from_region_s": from_region,
            "register_to_peer_safe_s": to_peer_safe,
            "cpu_saving_first_push_s": cpu_a,
            "cpu_receiving_first_push_s": cpu_b,
            "push_alone_s": push_seconds,
            "cpu_saving_push_alone_s": cpu_a2,
            "cpu_receiving_push_alone_s": cpu_b2,
        },
    }
