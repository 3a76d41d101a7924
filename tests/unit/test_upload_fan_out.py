"""One read of a file feeds several regions (``pipeline.upload_file_to``)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tierckpt.service.config import RegionSettings
from tierckpt.service.observability import metrics
from tierckpt.service.storage.base import MultipartUpload, StoreError
from tierckpt.service.storage.posix import PosixStore
from tierckpt.service.uploads.pipeline import (
    Destination,
    UploadedFile,
    UploadLimits,
    upload_file_to,
)
from tierckpt.service.uploads.source import SourceFile

MiB = 1024 * 1024


class PartsFail(PosixStore):
    """A region that takes the first part of a file, then fails."""

    async def upload_part(
        self,
        upload: MultipartUpload,
        number: int,
        offset: int,
        data: bytes | bytearray | memoryview,
    ):  # type: ignore[no-untyped-def]
        if number > 1:
            raise StoreError(f"{self.region}: upload_part failed: SlowDown")
        return await super().upload_part(upload, number, offset, data)


def store(tmp_path: Path, name: str, kind: type[PosixStore] = PosixStore) -> PosixStore:
    return kind(RegionSettings(name=name, kind="posix", root=tmp_path / name))


def source_of(path: Path, data: bytes) -> SourceFile:
    path.write_bytes(data)
    info = path.stat()
    return SourceFile(
        path=path,
        relative=path.name,
        key=f"k/{path.name}",
        size=info.st_size,
        mtime_ns=info.st_mtime_ns,
    )


def read_bytes() -> float:
    return metrics.UPLOAD_READ_BYTES._value.get()


@pytest.mark.parametrize("size", [3 * MiB, 12 * MiB + 5], ids=["one-put", "multipart"])
async def test_every_region_gets_the_bytes_of_one_read(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    source = source_of(tmp_path / "w.bin", data)
    east, west = store(tmp_path, "east"), store(tmp_path, "west")
    limits = UploadLimits.of(5 * MiB, 2, chunk_size=4 * MiB)
    before = read_bytes()
    outcomes = await upload_file_to(
        [Destination(east), Destination(west)], source, [tmp_path], limits
    )
    assert read_bytes() - before == size
    assert outcomes[0] == outcomes[1]
    assert isinstance(outcomes[0], UploadedFile)
    assert outcomes[0].sha256 == hashlib.sha256(data).hexdigest()
    for region in ("east", "west"):
        assert (tmp_path / region / "k" / "w.bin").read_bytes() == data


async def test_a_failing_secondary_region_does_not_fail_the_primary(tmp_path: Path) -> None:
    data = os.urandom(12 * MiB)
    source = source_of(tmp_path / "w.bin", data)
    east, west = store(tmp_path, "east"), store(tmp_path, "west", PartsFail)
    limits = UploadLimits.of(5 * MiB, 2, chunk_size=0)
    uploaded, failed = await upload_file_to(
        [Destination(east), Destination(west)], source, [tmp_path], limits
    )
    assert (
        isinstance(uploaded, UploadedFile) and uploaded.sha256 == hashlib.sha256(data).hexdigest()
    )
    assert (tmp_path / "east" / "k" / "w.bin").read_bytes() == data
    assert isinstance(failed, StoreError) and "SlowDown" in str(failed)
    assert not (tmp_path / "west" / "k" / "w.bin").exists()
    # Every part buffer came back: the next file can use the whole pool.
    assert limits.parts._free.qsize() == limits.parts._created


async def test_a_failing_primary_region_fails_the_upload(tmp_path: Path) -> None:
    source = source_of(tmp_path / "w.bin", os.urandom(12 * MiB))
    east, west = store(tmp_path, "east", PartsFail), store(tmp_path, "west")
    limits = UploadLimits.of(5 * MiB, 2, chunk_size=0)
    with pytest.raises(StoreError, match="SlowDown"):
        await upload_file_to([Destination(east), Destination(west)], source, [tmp_path], limits)
    assert not (tmp_path / "east" / "k" / "w.bin").exists()
    assert limits.parts._free.qsize() == limits.parts._created
