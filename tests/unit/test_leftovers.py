"""abort_left_uploads: best effort, so a store that cannot list uploads never
blocks the upload or the deletion asking for the clean-up."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tierckpt.service.storage.base import StoreError
from tierckpt.service.storage.leftovers import abort_left_uploads


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
