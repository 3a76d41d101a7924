"""Registration scans small checkpoints on the event loop and large ones in a
thread (service.checkpoints.service.scan_checkpoint): the inline attempt gives
up as soon as the directory has more entries than allowed, and the answer is
the same either way."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tierckpt.service.checkpoints import service as service_module
from tierckpt.service.checkpoints.scan import ScanTooLarge, scan
from tierckpt.service.checkpoints.service import INLINE_SCAN_ENTRIES, scan_checkpoint


def make(directory: Path, count: int) -> Path:
    for i in range(count):
        sub = directory / f"d{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i}.bin").write_bytes(b"x" * i)
    return directory


def test_max_entries_stops_a_large_scan(tmp_path: Path) -> None:
    big = make(tmp_path / "big", 50)
    with pytest.raises(ScanTooLarge):
        scan(str(big), [tmp_path], max_files=1000, max_path_length=1024, max_entries=20)
    full = scan(str(big), [tmp_path], max_files=1000, max_path_length=1024)
    assert len(full.files) == 50
    small = scan(str(big), [tmp_path], max_files=1000, max_path_length=1024, max_entries=100)
    assert small == full


def _resources(root: Path) -> Any:
    local = SimpleNamespace(roots=[root], max_files_per_checkpoint=100_000, max_path_length=1024)
    return SimpleNamespace(settings=SimpleNamespace(local=local))


@pytest.mark.parametrize("count", [1, INLINE_SCAN_ENTRIES * 2])
def test_scan_checkpoint_uses_a_thread_only_when_large(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    directory = make(tmp_path / "c", count)
    threads: list[str] = []
    real_scan = service_module.scan

    def spying_scan(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real_scan(*args, **kwargs)

    monkeypatch.setattr(service_module, "scan", spying_scan)
    shard = asyncio.run(scan_checkpoint(_resources(tmp_path), str(directory)))
    assert len(shard.files) == count
    main = threading.main_thread().name
    if count == 1:
        assert threads == [main]
    else:
        assert threads[0] == main and len(threads) == 2 and threads[1] != main
