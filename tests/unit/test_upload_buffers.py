"""The upload pipeline's part buffers and the zero-copy request body."""

from __future__ import annotations

import asyncio
import os

import pytest

from tierckpt.service.storage.s3 import _body, _PartBody
from tierckpt.service.uploads.pipeline import PartBuffers


async def test_part_buffers_are_bounded_and_reused() -> None:
    pool = PartBuffers(2, 1024)
    first, second = await pool.acquire(), await pool.acquire()
    assert len(first) == len(second) == 1024 and first is not second
    waiting = asyncio.ensure_future(pool.acquire())
    await asyncio.sleep(0.01)
    assert not waiting.done(), "a third buffer was handed out past the bound"
    pool.release(first)
    assert await asyncio.wait_for(waiting, 1) is first  # the same memory, not a new one


async def test_part_body_streams_the_buffer_and_rewinds_for_retries() -> None:
    data = bytearray(os.urandom(3 * _PartBody.SLICE + 123))
    body = _PartBody(data)
    assert len(body) == len(data) and body.tell() == 0
    slices = [bytes(chunk) async for chunk in body]
    assert b"".join(slices) == data
    assert max(len(s) for s in slices) == _PartBody.SLICE
    # What botocore does before a retry: rewind, then the whole body again.
    assert body.seek(0) == 0
    assert b"".join([bytes(c) async for c in body]) == data
    body.seek(10)
    assert body.read(5) == data[10:15] and body.tell() == 15
    assert body.seek(-3, 2) == len(data) - 3 and body.read() == data[-3:]


async def test_the_slices_share_the_callers_buffer() -> None:
    data = bytearray(2 * _PartBody.SLICE)
    first = await anext(aiter(_PartBody(data)))
    data[0] = 7
    assert first[0] == 7  # a view, not a copy


@pytest.mark.parametrize("size", [0, 1, _PartBody.SLICE])
def test_small_bodies_are_sent_as_bytes(size: int) -> None:
    assert _body(bytearray(size)) == bytes(size)
