"""Per-chunk SHA-256s of a file: what lets a reader verify a byte range.

A whole-file SHA-256 can only be checked by reading the whole file; a reader
that needs a few MiB of a large file (a DCP rank loading its shard) checks
every fixed-size chunk it touches against the chunk's own hash instead.
Chunk ``i`` covers bytes ``[i * chunk_size, min((i + 1) * chunk_size, size))``;
an empty file has no chunks. Both hashes are computed in the upload's single
read pass (``FileHashes`` is fed the same buffers as the whole-file hash).
A file no larger than one chunk is its own only chunk: told the file's size,
``FileHashes`` takes the whole-file hash for it and reads the bytes once.

In the catalog the list is stored as one string, the hex digests concatenated
(64 characters each): ``encode`` / ``decode``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

MiB = 1024 * 1024
DEFAULT_CHUNK_SIZE = 8 * MiB
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# The chunk hashes of a buffer run in one of these threads while the caller's
# thread feeds the same buffer to the whole-file hash (hashlib releases the
# GIL on large buffers): two SHA-256 passes in the time of one, where a core
# is free. Created on first use.
_POOL: ThreadPoolExecutor | None = None
PARALLEL_MIN = 1024 * 1024  # smaller buffers: not worth a thread hop


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="tierckpt-chunk-hash")
    return _POOL


def chunk_count(size: int, chunk_size: int) -> int:
    return -(-size // chunk_size)


class FileHashes:
    """The whole-file SHA-256 and the chunks' SHA-256s, fed in file order."""

    def __init__(self, chunk_size: int, size: int | None = None) -> None:
        """``chunk_size`` 0: the whole-file hash only (``[upload]
        chunk_size_mb = 0`` saves the second pass's CPU). ``size``: the
        file's, when known; no larger than ``chunk_size``, the chunk pass is
        skipped (more bytes than a chunk fed then is an error)."""
        if chunk_size < 0:
            raise ValueError("chunk_size must be >= 0")
        self.chunk_size = chunk_size
        self.whole = hashlib.sha256()
        self._chunk = hashlib.sha256()
        self._filled = 0
        self.chunks: list[str] = []
        self._one_chunk = bool(chunk_size) and size is not None and size <= chunk_size
        self._fed = 0

    def update(self, data: memoryview | bytes) -> None:
        if not self.chunk_size:
            self.whole.update(data)
            return
        if self._one_chunk:
            self._fed += len(data)
            if self._fed > self.chunk_size:
                raise ValueError(
                    f"more than one chunk ({self.chunk_size} bytes) fed to the hashes of a "
                    "file said to be no larger"
                )
            self.whole.update(data)
            return
        if len(data) < PARALLEL_MIN:
            self.whole.update(data)
            self._update_chunks(data)
            return
        chunked = _pool().submit(self._update_chunks, data)
        try:
            self.whole.update(data)
        finally:
            chunked.result()

    def _update_chunks(self, data: memoryview | bytes) -> None:
        view = memoryview(data)
        position = 0
        while position < len(view):
            take = min(self.chunk_size - self._filled, len(view) - position)
            self._chunk.update(view[position : position + take])
            self._filled += take
            position += take
            if self._filled == self.chunk_size:
                self._close_chunk()

    def _close_chunk(self) -> None:
        self.chunks.append(self._chunk.hexdigest())
        self._chunk = hashlib.sha256()
        self._filled = 0

    def finish(self) -> tuple[str, tuple[str, ...] | None]:
        """(whole-file SHA-256, chunk SHA-256s or None when not hashed); call
        once, after the last update."""
        if not self.chunk_size:
            return self.whole.hexdigest(), None
        if self._one_chunk:
            whole = self.whole.hexdigest()
            return whole, (whole,) if self._fed else ()
        if self._filled:
            self._close_chunk()
        return self.whole.hexdigest(), tuple(self.chunks)


def encode(chunks: Sequence[str]) -> str:
    return "".join(chunks)


def decode(joined: str) -> tuple[str, ...]:
    if len(joined) % 64:
        raise ValueError("chunk hashes are not a multiple of 64 hex digits")
    return tuple(joined[i : i + 64] for i in range(0, len(joined), 64))


def valid(size: int, chunk_size: object, chunks: object) -> bool:
    """Whether ``chunks`` lists one hex SHA-256 per ``chunk_size`` chunk of ``size`` bytes."""
    return (
        type(chunk_size) is int
        and chunk_size >= 1
        and isinstance(chunks, (list, tuple))
        and len(chunks) == chunk_count(size, chunk_size)
        and all(isinstance(c, str) and _HEX64.match(c) for c in chunks)
    )
