"""abort_left_uploads: best effort, so a store that cannot list uploads never
blocks the upload or the deletion asking for the clean-up; and which
stores' objects can have left anything to clear."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from pydantic import ValidationError

from tierckpt.service.config import UploadSettings
from tierckpt.service.storage.base import StoreError
from tierckpt.service.storage.leftovers import abort_left_uploads
from tierckpt.service.storage.posix import PosixStore
from tierckpt.service.storage.s3 import MIN_PART_BYTES, S3Store


class _Store:
    region = "east"

    def __init__(self, outcome: int | Exception) -> None:
        self.outcome = outcome
        self.asked: list[str] = []

    async def abort_incomplete(self, prefix: str) -> int:
        self.asked.append(prefix)
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


async def test_refused_listing_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    store: Any = _Store(StoreError("east: list_multipart_uploads failed: AccessDenied"))
    with caplog.at_level(logging.WARNING, logger="tierckpt.storage"):
        await abort_left_uploads(store, "run/step-000000000001/rank-00000/")
    assert store.asked == ["run/step-000000000001/rank-00000/"]
    assert "AccessDenied" in caplog.text


async def test_what_was_aborted_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    store: Any = _Store(2)
    with caplog.at_level(logging.INFO, logger="tierckpt.storage"):
        await abort_left_uploads(store, "run/step-000000000001/")
    assert "aborted 2 open upload(s)" in caplog.text


async def test_anything_else_is_not_swallowed() -> None:
    store: Any = _Store(RuntimeError("a bug"))
    with pytest.raises(RuntimeError):
        await abort_left_uploads(store, "run/")


def test_s3_lists_open_uploads_only_where_a_part_could_have_been_sent() -> None:
    """An object no larger than the smallest part a configuration can have
    (`[upload] part_size_mb` >= 5) was sent with one PUT, which leaves
    nothing open in S3: no listing for it. A POSIX store's single write leaves
    a temporary file when killed, so it is always cleared."""
    with pytest.raises(ValidationError):
        UploadSettings(part_size_mb=4)
    smallest = UploadSettings(part_size_mb=5).part_size_mb * 1024 * 1024
    assert smallest == MIN_PART_BYTES
    s3: Any = S3Store.__new__(S3Store)
    assert not s3.may_leave_open([])
    assert not s3.may_leave_open([0, 4096, MIN_PART_BYTES])
    assert s3.may_leave_open([4096, MIN_PART_BYTES + 1])
    posix: Any = PosixStore.__new__(PosixStore)
    assert posix.may_leave_open([4096])
