"""`restore_from_local`: a restore copied from this node's intact T0 copies
(`latest(node=…).local`, the node's own or prefetched ones), every file
hashed on the way, all or nothing; None (nothing left behind) whenever a
region must serve it instead."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tierckpt.client.models import Checkpoint
from tierckpt.client.restore import restore_from_local


def checkpoint(tmp_path: Path, ranks: dict[int, dict[str, bytes]], offered: set[int]) -> Checkpoint:
    files = []
    local = {}
    for rank, content in ranks.items():
        directory = tmp_path / "t0" / f"rank-{rank:05d}"
        for path, data in content.items():
            (directory / path).parent.mkdir(parents=True, exist_ok=True)
            (directory / path).write_bytes(data)
            files.append(
                {
                    "rank": rank,
                    "path": path,
                    "size": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                }
            )
        if rank in offered:
            local[rank] = str(directory)
    return Checkpoint.model_validate(
        {
            "run": "r",
            "step": 3,
            "state": "durable",
            "world_size": len(ranks),
            "files": files,
            "local": {"node": "n", "path": local.get(0), "ranks": local},
        }
    )


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name != "t0")


def test_every_rank_is_copied_and_verified(tmp_path: Path) -> None:
    ckpt = checkpoint(tmp_path, {0: {"a.bin": b"aa", "m/x": b"x"}, 1: {"b.bin": b"bbb"}}, {0, 1})
    seen: list[tuple[int, int]] = []
    dest = restore_from_local(ckpt, tmp_path / "dest", progress=lambda d, t: seen.append((d, t)))
    assert dest == tmp_path / "dest"
    assert (dest / "a.bin").read_bytes() == b"aa" and (dest / "b.bin").read_bytes() == b"bbb"
    assert (dest / "m" / "x").read_bytes() == b"x"
    assert seen[-1] == (6, 6)
    one = restore_from_local(ckpt, tmp_path / "one", rank=1)
    assert one is not None and sorted(p.name for p in one.iterdir()) == ["b.bin"]


def test_a_rank_not_offered_or_a_wrong_file_means_download(tmp_path: Path) -> None:
    ckpt = checkpoint(tmp_path, {0: {"a.bin": b"aa"}, 1: {"b.bin": b"bbb"}}, {0})
    assert restore_from_local(ckpt, tmp_path / "dest") is None
    assert restore_from_local(ckpt, tmp_path / "zero", rank=0) is not None
    # Changed behind the agent's back: same size, other bytes.
    (tmp_path / "t0" / "rank-00000" / "a.bin").write_bytes(b"zz")
    assert restore_from_local(ckpt, tmp_path / "dest", rank=0) is None
    # Grown, or gone.
    (tmp_path / "t0" / "rank-00000" / "a.bin").write_bytes(b"aaa")
    assert restore_from_local(ckpt, tmp_path / "dest", rank=0) is None
    (tmp_path / "t0" / "rank-00000" / "a.bin").unlink()
    assert restore_from_local(ckpt, tmp_path / "dest", rank=0) is None
    assert leftovers(tmp_path) == ["zero"]  # no staging directory, no dest
