"""Stream one file from local SSD to a region, hashing it in the same pass.

Each part is read (``pread``) and fed to SHA-256 in a worker thread (hashlib
releases the GIL on large buffers), strictly in order so one hash covers the
file; the part is then sent while the next one is read. A semaphore shared by
all files bounds the parts held in memory (``parts_in_flight × part_size``)
whatever the checkpoint's size.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from ..storage.base import ObjectStore, PartRef
from .source import SourceChanged, SourceFile, check_unchanged, open_checked, read_exact


@dataclass(frozen=True)
class UploadLimits:
    part_size: int
    parts: asyncio.Semaphore


@dataclass(frozen=True)
class UploadedFile:
    relative: str
    size: int
    sha256: str


def _read_and_hash(
    fd: int, offset: int, length: int, source: SourceFile, hasher: hashlib._Hash
) -> bytes:
    data = read_exact(fd, offset, length, source)
    hasher.update(data)
    return data


async def upload_file(
    store: ObjectStore, source: SourceFile, roots: list[Path], limits: UploadLimits
) -> UploadedFile:
    fd = await asyncio.to_thread(open_checked, source, roots)
    try:
        hasher = hashlib.sha256()
        if source.size <= limits.part_size:
            async with limits.parts:
                data = await asyncio.to_thread(_read_and_hash, fd, 0, source.size, source, hasher)
                await store.put_bytes(source.key, data)
                del data
        else:
            await _multipart(store, source, fd, hasher, limits)
        # The bytes sent must be the bytes registered: checked again after
        # the last read, on the same open file.
        await asyncio.to_thread(check_unchanged, fd, source)
    finally:
        os.close(fd)
    digest = hasher.hexdigest()
    if source.expected_sha256 and digest != source.expected_sha256:
        raise SourceChanged(
            f"{source.relative}: SHA-256 {digest} does not match the {source.expected_sha256} "
            "given at registration"
        )
    return UploadedFile(relative=source.relative, size=source.size, sha256=digest)


async def _multipart(
    store: ObjectStore,
    source: SourceFile,
    fd: int,
    hasher: hashlib._Hash,
    limits: UploadLimits,
) -> None:
    upload = await store.create_multipart(source.key)
    sends: list[asyncio.Task[PartRef]] = []

    async def send(number: int, offset: int, data: bytes) -> PartRef:
        try:
            return await store.upload_part(upload, number, offset, data)
        finally:
            limits.parts.release()

    try:
        for number, offset in enumerate(range(0, source.size, limits.part_size), start=1):
            await limits.parts.acquire()
            try:
                length = min(limits.part_size, source.size - offset)
                data = await asyncio.to_thread(_read_and_hash, fd, offset, length, source, hasher)
            except BaseException:
                limits.parts.release()
                raise
            sends.append(asyncio.create_task(send(number, offset, data)))
            del data
            # Stop reading as soon as one part has failed.
            failed = next((t for t in sends if t.done() and t.exception()), None)
            if failed is not None:
                failed.result()
        parts = await asyncio.gather(*sends)
        await store.complete_multipart(upload, list(parts))
    except BaseException:
        for task in sends:
            task.cancel()
        await asyncio.gather(*sends, return_exceptions=True)
        await store.abort_multipart(upload)
        raise
