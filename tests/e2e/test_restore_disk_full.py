"""End to end: `tierckpt restore` onto a real, small, full filesystem (tmpfs).

Two ways a disk is too small: not enough bytes (refused before any download)
and no inodes left part-way through (a real ENOSPC while files are being
created). Both: exit 2 with the reason, nothing left in the destination's
parent. Needs permission to mount a tmpfs (root); skipped otherwise.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devsupport.agent import write_checkpoint
from devsupport.processes import ServeProcess, agent_config, cli

pytestmark = pytest.mark.e2e


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[ServeProcess, Path]]:
    config = agent_config(tmp_path, worker={"poll_interval": 0.1})
    with config.serve().start() as running:
        yield running, config.ssd


def register(agent: ServeProcess, run: str, step: int, path: Path) -> None:
    done = cli(
        "--json", "register", run, str(step), str(path), "--wait", "--timeout", "120",
        server=agent.url,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["state"] == "durable"


def test_restore_onto_a_full_disk_is_a_clean_error(
    agent: tuple[ServeProcess, Path], tmpfs: Callable[[str, str], Path], tmp_path: Path
) -> None:
    server, ssd = agent
    big = write_checkpoint(ssd / "big", {"weights.bin": 3 << 20, "meta.json": b"{}"})
    many = write_checkpoint(ssd / "many", {f"shard-{i:02d}.bin": 4096 for i in range(12)})
    register(server, "big", 1, big)
    register(server, "many", 1, many)

    # 2 MiB of space for a 3 MiB checkpoint: refused before downloading.
    small = tmpfs("small", "size=2m")
    (small / "keep.txt").write_text("the user's own file")
    refused = cli("restore", "big", str(small / "dest"), server=server.url)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "not enough space to restore big:1" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert sorted(p.name for p in small.iterdir()) == ["keep.txt"]

    # Plenty of bytes, 8 inodes: the disk fills up while files are created.
    few_inodes = tmpfs("inodes", "size=16m,nr_inodes=8")
    failed = cli("restore", "many", str(few_inodes / "dest"), server=server.url)
    assert failed.returncode == 2, failed.stdout + failed.stderr
    assert "no space left on the device" in failed.stderr.lower()
    assert list(few_inodes.iterdir()) == []

    # The same restore elsewhere works, bit for bit: nothing was wrong but the disk.
    good = tmp_path / "restored"
    ok = cli("restore", "many", str(good), server=server.url)
    assert ok.returncode == 0, ok.stderr
    for source in many.iterdir():
        restored = good / source.name
        assert (
            hashlib.sha256(restored.read_bytes()).digest()
            == hashlib.sha256(source.read_bytes()).digest()
        )
