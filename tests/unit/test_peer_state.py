"""The peer tier's pure rules: a peer node's state, peer-safe, path confinement."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from tierckpt.service.errors import BadInput
from tierckpt.service.peers import layout
from tierckpt.service.peers.state import by_node, peer_safe
from tierckpt.service.peers.upkeep import Held, to_evict

T1 = datetime(2026, 11, 24, 8, 0)
T2 = datetime(2026, 11, 24, 9, 0)


@dataclass
class Copy:
    shard_id: int
    node: str
    state: str
    committed_at: datetime | None = None
    verified_at: datetime | None = None


def test_a_peer_is_committed_only_when_every_shard_it_was_sent_is() -> None:
    copies = [
        Copy(1, "b", "committed", T1, T1),
        Copy(2, "b", "committed", T2, T2),
        Copy(1, "c", "committed", T1, T1),
        Copy(2, "c", "pending"),
        Copy(1, "d", "committed", T1, T1),
        Copy(2, "d", "corrupt"),
        Copy(1, "e", "deleted"),
    ]
    summary = {s.node: s for s in by_node(copies)}
    assert summary["b"].state == "committed"
    assert (summary["b"].shards, summary["b"].committed) == (2, 2)
    assert summary["b"].committed_at == T2 and summary["b"].verified_at == T1
    assert summary["c"].state == "pending"
    assert summary["d"].state == "corrupt"
    assert summary["e"].state == "deleted"


def test_peer_safe_needs_every_shard_copied_k_times_off_its_node() -> None:
    shards = {1: "a", 2: "b"}
    both = [Copy(1, "b", "committed"), Copy(2, "a", "committed")]
    assert peer_safe(2, shards, both, 1)
    assert not peer_safe(2, shards, both, 2)
    # A rank not registered yet: not safe whatever the copies.
    assert not peer_safe(3, shards, both, 1)
    # A copy on the shard's own node does not count; nor does a pending one.
    assert not peer_safe(2, shards, [Copy(1, "a", "committed"), Copy(2, "a", "committed")], 1)
    assert not peer_safe(2, shards, [Copy(1, "b", "pending"), Copy(2, "a", "committed")], 1)
    # Peers off: never peer-safe.
    assert not peer_safe(2, shards, both, 0)


@pytest.mark.parametrize("bad", ["../x", "a/../../x", "/etc/passwd", "a//b", "./a", "", "a\x00b"])
def test_a_pushed_path_must_stay_in_the_copy(tmp_path: Path, bad: str) -> None:
    with pytest.raises(BadInput):
        layout.confined(tmp_path, bad)


def test_copies_live_under_the_first_t0_root(tmp_path: Path) -> None:
    final = layout.copy_dir([tmp_path / "ssd", tmp_path / "other"], "run", 7, 1)
    assert final == tmp_path / "ssd" / ".peers" / "run" / "step-7" / "rank-1"
    assert layout.partial_dir(final).name == ".rank-1.partial"
    assert layout.confined(final, "sub/w.bin") == final / "sub" / "w.bin"


def test_peer_retention_keeps_the_newest_and_every_copy_not_yet_durable() -> None:
    held = [
        Held(1, "/p/1", "r", 1, "durable"),
        Held(2, "/p/2", "r", 2, "uploading"),  # older, not durable: kept
        Held(3, "/p/3", "r", 3, "replicated"),
        Held(4, "/p/4", "r", 4, "durable"),
        Held(5, "/p/5", "r", 5, "deleted"),  # gone: evicted even if newest
        Held(6, "/p/6", "other", 1, "durable"),  # its run's newest
        Held(7, "/p/7", "r", 0, "durable", is_shard_t0=True),  # T0 retention's
    ]
    assert [c.id for c in to_evict(held, keep_last=2)] == [1, 5]
    assert [c.id for c in to_evict(held, keep_last=1)] == [1, 3, 5]


def test_peer_safe_on_live_agents_only_counts_their_copies() -> None:
    shards = {1: "a"}
    copies = [Copy(1, "b", "committed"), Copy(1, "c", "committed")]
    assert peer_safe(1, shards, copies, 2)
    assert not peer_safe(1, shards, copies, 2, live={"a", "b"})
    assert peer_safe(1, shards, copies, 1, live={"c"})


def test_a_link_leading_out_of_a_copy_is_not_served(tmp_path: Path) -> None:
    from tierckpt.service.peers.routes import _served_size

    base = tmp_path / "copy"
    base.mkdir()
    (base / "w.bin").write_bytes(b"12345")
    secret = tmp_path / "secret"
    secret.write_bytes(b"not yours")
    (base / "link.bin").symlink_to(secret)
    assert _served_size(base, base / "w.bin") == 5
    assert _served_size(base, base / "link.bin") is None
    assert _served_size(base, base / "missing.bin") is None
