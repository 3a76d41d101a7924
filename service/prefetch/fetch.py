"""One object of a region streamed into a file of a prefetched copy, verified.

The bytes arrive in bounded pieces (``ObjectStore.iter_range``), each written
and hashed in a thread (whole-file and per-chunk SHA-256, one pass,
``storage/chunks.py``), into a hidden temporary file next to the target. Only
when the size, the whole-file hash and every chunk hash match the catalog is
the file fsynced and renamed into place; anything else removes it. So a file
at its final path is always a verified one, and a killed prefetch leaves at
most a temporary file (removed with the copy, see ``copies.remove``).
"""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path
from typing import BinaryIO

from ..storage.base import ObjectStore
from ..storage.chunks import FileHashes
from ..storage.manifest import ObjectEntry

PIECE_BYTES = 1 << 20  # what one read from the store holds, at most
TMP_INFIX = ".tierckpt-tmp-"


class BadCopy(Exception):
    """The bytes a region served do not hash to the catalog's: try another."""


def hash_local(path: Path, size: int, sha256: str) -> bool:
    """Whether the file at ``path`` has ``size`` bytes hashing to ``sha256``
    (a file a killed prefetch already put in place is kept, not fetched again).
    Blocking: call it in a thread."""
    hashes = FileHashes(0)
    seen = 0
    try:
        with open(path, "rb") as handle:
            while piece := handle.read(8 * PIECE_BYTES):
                hashes.update(piece)
                seen += len(piece)
    except OSError:
        return False
    return seen == size and hashes.finish()[0] == sha256


def _write(handle: BinaryIO, hashes: FileHashes, piece: bytes) -> None:
    hashes.update(piece)
    handle.write(piece)


def _finish(handle: BinaryIO, tmp: Path, target: Path) -> None:
    handle.flush()
    os.fsync(handle.fileno())
    handle.close()
    os.rename(tmp, target)


async def fetch_object(store: ObjectStore, obj: ObjectEntry, target: Path) -> int:
    """Stream ``obj`` from ``store`` into ``target`` (its parent exists),
    verified; returns the bytes read. BadCopy when they do not hash right,
    StoreError when the region fails (the caller tries the next region)."""
    tmp = target.parent / f".{target.name}{TMP_INFIX}{secrets.token_hex(4)}"
    hashes = FileHashes(obj.chunk_size or 0, obj.size)
    handle = await asyncio.to_thread(open, tmp, "wb")
    seen = 0
    try:
        async for piece in store.iter_range(obj.key, 0, obj.size, chunk_size=PIECE_BYTES):
            seen += len(piece)
            if seen > obj.size:
                raise BadCopy(f"{obj.key}: {store.region} serves more than {obj.size} bytes")
            await asyncio.to_thread(_write, handle, hashes, piece)
        whole, chunk_hashes = hashes.finish()
        if seen != obj.size or whole != obj.sha256:
            raise BadCopy(
                f"{obj.key}: {store.region} served {seen} bytes hashing to {whole[:12]}…, "
                f"the catalog has {obj.size} bytes and {obj.sha256[:12]}…"
            )
        if obj.chunk_sha256 is not None and chunk_hashes != obj.chunk_sha256:
            raise BadCopy(f"{obj.key}: {store.region} serves chunks that differ from the catalog's")
        await asyncio.to_thread(_finish, handle, tmp, target)
    except BaseException:
        handle.close()
        tmp.unlink(missing_ok=True)
        raise
    return seen
