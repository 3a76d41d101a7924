"""What a checkpoint's peer copies add up to: each peer's state, peer-safe.

Copies are recorded per shard (a checkpoint's ranks come from several nodes
and go to several peers). Per checkpoint and peer node, ``peer:<node>`` is:

* ``committed`` when that node holds, verified, every shard it was sent;
* ``corrupt`` when one of them failed a re-read (a new copy is being made);
* ``pending`` while a push is under way (or was interrupted);
* ``deleted`` once the peer retention evicted all of them.

A checkpoint is *peer-safe* once every one of its ``world_size`` shards has
at least ``[peers] copies`` committed copies, each on a node other than the
shard's own: it then survives the loss of any one failure domain before it
is durable (a whole-cluster loss still falls back to the regions).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Container, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from ..models import ENDED_STATES, PeerCopyState

# A checkpoint in one of these states keeps no peer copy: none is received,
# and the peer pass evicts any a node holds.
GONE = ENDED_STATES


class CopyValues(Protocol):
    shard_id: int
    node: str
    state: str
    committed_at: datetime | None
    verified_at: datetime | None


@dataclass(frozen=True)
class PeerSummary:
    node: str
    state: str
    shards: int  # shards sent to the node
    committed: int  # of those, committed
    committed_at: datetime | None
    verified_at: datetime | None


def by_node(copies: Iterable[CopyValues]) -> list[PeerSummary]:
    grouped: dict[str, list[CopyValues]] = defaultdict(list)
    for copy in copies:
        grouped[copy.node].append(copy)
    summaries = []
    for node in sorted(grouped):
        rows = grouped[node]
        states = {r.state for r in rows}
        if PeerCopyState.CORRUPT in states:
            state = PeerCopyState.CORRUPT
        elif PeerCopyState.PENDING in states:
            state = PeerCopyState.PENDING
        elif states == {PeerCopyState.DELETED}:
            state = PeerCopyState.DELETED
        elif PeerCopyState.COMMITTED in states:
            state = PeerCopyState.COMMITTED
        else:
            state = PeerCopyState.DELETED
        committed = [r for r in rows if r.state == PeerCopyState.COMMITTED]
        summaries.append(
            PeerSummary(
                node=node,
                state=state,
                shards=len(rows),
                committed=len(committed),
                committed_at=max(
                    (r.committed_at for r in committed if r.committed_at), default=None
                ),
                verified_at=min((r.verified_at for r in committed if r.verified_at), default=None),
            )
        )
    return summaries


def peer_safe(
    world_size: int,
    shard_nodes: dict[int, str],
    copies: Iterable[CopyValues],
    needed: int,
    live: Container[str] | None = None,
) -> bool:
    """``shard_nodes``: shard id -> the node it was registered on; ``live``:
    count only copies on these nodes (None: every copy the catalog records)."""
    if needed <= 0 or len(shard_nodes) < world_size:
        return False
    held: dict[int, set[str]] = defaultdict(set)
    for copy in copies:
        origin = shard_nodes.get(copy.shard_id)
        if live is not None and copy.node not in live:
            continue
        if copy.state == PeerCopyState.COMMITTED and origin is not None and copy.node != origin:
            held[copy.shard_id].add(copy.node)
    return all(len(held[shard_id]) >= needed for shard_id in shard_nodes)


def spread_key(shard_id: int, node: str) -> str:
    """Peers in an order of their own per shard: copies spread evenly."""
    return hashlib.sha256(f"{shard_id}:{node}".encode()).hexdigest()
