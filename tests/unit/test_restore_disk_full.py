"""Restore onto a full disk: a clean error (exit 2 in the CLI), nothing
half-written next to the destination, before or during the download."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from tierckpt.client import (
    AsyncCheckpointClient,
    CheckpointClient,
    DestinationError,
    TransferOptions,
    _range_writes,
    cli,
)
from tierckpt.client import restore as restore_module

try:
    from test_client_fakeapi import BASE_URL, FakeApi
except ImportError:  # tests/unit collected as a package
    from .test_client_fakeapi import BASE_URL, FakeApi

RANGE = 1000
SMALL = TransferOptions(range_size=RANGE, concurrency=4, window=8, retries=1, retry_backoff=0.001)
FILES = {
    "model/weights.bin": os.urandom(20 * RANGE),
    "optim/state.bin": os.urandom(5 * RANGE),
    "config.json": b"{}",
}


@pytest.fixture
def fake() -> FakeApi:
    api = FakeApi(token="tok")
    api.add_checkpoint("llama", 100, FILES)
    return api


def client(fake: FakeApi) -> AsyncCheckpointClient:
    return AsyncCheckpointClient(
        BASE_URL, token="tok", transport=fake.async_transport(), transfer=SMALL
    )


def everything_under(path: Path) -> list[str]:
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*"))


async def test_enospc_while_writing_leaves_nothing(
    fake: FakeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_pwrite = os.pwrite
    budget = {"bytes": 7 * RANGE}  # the disk fills up part-way through

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if budget["bytes"] < len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        budget["bytes"] -= len(data)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(_range_writes.os, "pwrite", pwrite)
    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / "other-run").mkdir()  # the user's own files stay untouched
    async with client(fake) as api:
        with pytest.raises(DestinationError) as raised:
            await api.restore("llama", parent / "dest", step=100)
    assert raised.value.code == "no_space"
    assert "no space left on the device" in raised.value.message
    assert everything_under(parent) == ["other-run"]
    assert fake.object_requests("east"), "the download had started"


async def test_too_little_free_space_is_refused_before_downloading(
    fake: FakeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_statvfs = os.statvfs

    class Full:
        def __init__(self, real: Any) -> None:
            self.f_frsize = real.f_frsize
            self.f_bavail = 2  # two blocks free

    monkeypatch.setattr(restore_module.os, "statvfs", lambda path: Full(real_statvfs(path)))
    dest = tmp_path / "new" / "dest"
    async with client(fake) as api:
        with pytest.raises(DestinationError) as raised:
            await api.restore("llama", dest, step=100)
    assert raised.value.code == "no_space"
    assert "not enough space" in raised.value.message
    assert not fake.object_requests("east") and not fake.object_requests("west")
    assert everything_under(tmp_path) == []  # not even the parent directories


def test_cli_exit_code_for_a_full_disk(
    fake: FakeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    real_pwrite = os.pwrite

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if offset >= 3 * RANGE:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(_range_writes.os, "pwrite", pwrite)
    monkeypatch.setattr(
        cli,
        "_client",
        lambda args: CheckpointClient(
            BASE_URL, token="tok", transport=fake.transport(), transfer=SMALL
        ),
    )
    code = cli.main(["restore", "llama", str(tmp_path / "dest"), "--step", "100"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no space left" in err and "Traceback" not in err
    assert everything_under(tmp_path) == []
