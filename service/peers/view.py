"""A checkpoint's peer copies as its detail view shows them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..models import Checkpoint, PeerCopy, PeerCopyState, Shard
from .state import by_node, peer_safe


@dataclass
class PeerView:
    peers: list[dict[str, Any]] = field(default_factory=list)
    peer_safe: bool = False
    # CopyOut entries, one per committed shard copy.
    copies: list[dict[str, Any]] = field(default_factory=list)


def peer_view(
    checkpoint: Checkpoint | Any,
    shard_rows: Iterable[Shard | Any],
    copies: Sequence[PeerCopy | Any],
    needed: int,
) -> PeerView:
    """From the checkpoint, shard and peer copy rows the detail view has read
    (in one snapshot): ORM objects, or rows by their attribute names
    (checkpoints/detail_in_one.py)."""
    world_size = checkpoint.world_size
    shards = {s.id: (s.node, s.rank) for s in shard_rows}
    view = PeerView(
        peers=[
            {
                "name": f"peer:{s.node}",
                "node": s.node,
                "state": s.state,
                "shards": s.shards,
                "committed": s.committed,
                "committed_at": s.committed_at,
                "verified_at": s.verified_at,
            }
            for s in by_node(copies)
        ],
        peer_safe=peer_safe(
            world_size, {sid: node for sid, (node, _rank) in shards.items()}, copies, needed
        ),
    )
    view.copies = [
        {
            "tier": "peer",
            "node": c.node,
            "rank": shards[c.shard_id][1] if c.shard_id in shards else None,
            "path": c.path,
            "region": None,
            "uri": None,
        }
        for c in copies
        if c.state == PeerCopyState.COMMITTED
    ]
    return view
