"""Re-read a region's objects and compare each with its ``ObjectEntry``.

The one verification routine: verify jobs (and so the scrubber, which queues
them) and the catalog rebuild call it. Each caller words its own findings.

- Streaming, bounded memory: an object is read in ``CHUNK_SIZE`` chunks and
  hashed chunk by chunk in a worker thread (hashlib releases the GIL), never
  on the event loop; reading stops as soon as the object is longer than its
  entry says (an inflated object is corrupt, not worth reading in full).
- Bounded concurrency: ``width`` workers pull from the entries (no task per
  object: a checkpoint may hold 100 000 files), and each read holds one of
  the caller's ``slots``, shared across the caller's concurrent verifications.
- A missing object or a size/hash mismatch is a ``Mismatch``. Any other read
  error is an outage, never corruption: with ``collect_read_errors`` it is
  recorded as ``Unreadable`` and the others are still read; without, the
  first one cancels the remaining reads and is raised.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from ..concurrency import for_each_bounded
from ..storage.base import ObjectNotFound, ObjectStore
from ..storage.manifest import ObjectEntry

CHUNK_SIZE = 4 << 20


@dataclass(frozen=True)
class Mismatch:
    entry: ObjectEntry
    # Bytes read (None: the object is missing); past entry.size when larger,
    # as reading stopped there.
    size: int | None
    sha256: str | None  # of the bytes read, when the size matched

    @property
    def missing(self) -> bool:
        return self.size is None

    @property
    def larger(self) -> bool:
        return self.size is not None and self.size > self.entry.size


@dataclass(frozen=True)
class Unreadable:
    entry: ObjectEntry
    error: Exception


@dataclass
class Verification:
    bad: list[Mismatch] = field(default_factory=list)  # sorted by key
    unreadable: list[Unreadable] = field(default_factory=list)  # sorted by key

    @property
    def ok(self) -> bool:
        return not self.bad and not self.unreadable


async def verify_objects(
    store: ObjectStore,
    entries: Iterable[ObjectEntry],
    *,
    slots: asyncio.Semaphore,
    width: int,
    collect_read_errors: bool,
) -> Verification:
    """Compare every entry's object in ``store`` with the entry."""
    result = Verification()

    async def one(entry: ObjectEntry) -> None:
        async with slots:
            try:
                size, digest = await hash_object(store, entry.key, limit=entry.size)
            except ObjectNotFound:
                result.bad.append(Mismatch(entry, None, None))
                return
            except Exception as exc:
                if not collect_read_errors:
                    raise
                result.unreadable.append(Unreadable(entry, exc))
                return
        if size != entry.size:
            result.bad.append(Mismatch(entry, size, None))
        elif digest != entry.sha256:
            result.bad.append(Mismatch(entry, size, digest))

    await for_each_bounded(entries, width, one)
    result.bad.sort(key=lambda m: m.entry.key)
    result.unreadable.sort(key=lambda u: u.entry.key)
    return result


async def hash_object(store: ObjectStore, key: str, *, limit: int) -> tuple[int, str]:
    """(size, sha256) of an object, streamed; stops reading past ``limit`` bytes."""
    hasher = hashlib.sha256()
    size = 0
    async with reading(store, key) as stream:
        async for chunk in stream:
            size += len(chunk)
            if size > limit:
                break
            await asyncio.to_thread(hasher.update, chunk)
    return size, hasher.hexdigest()


@asynccontextmanager
async def reading(store: ObjectStore, key: str) -> AsyncIterator[AsyncIterator[bytes]]:
    """An object's bytes in ``CHUNK_SIZE`` chunks; the store's stream (its
    HTTP body or file) is released on leaving, also when reading stopped
    early (``iter_range`` is an async generator on every store)."""
    stream = store.iter_range(key, chunk_size=CHUNK_SIZE)
    try:
        yield stream
    finally:
        close: Callable[[], Awaitable[None]] | None = getattr(stream, "aclose", None)
        if close is not None:
            await close()
