"""Verified reads of byte ranges of a checkpoint's files, from the nearest copy.

A range is rounded out to the file's chunks (``chunk_size``, see the
service's ``storage/chunks.py``) and every chunk read is checked against its
SHA-256 from the catalog before a byte of it is used. Copies are tried in
order: this node's T0 copy (when the agent calls it intact), then the regions
of the restore plan; a chunk that fails its hash on one copy is read again
from the next. A file without chunk hashes (uploaded before they existed) is
verified whole instead: its T0 copy is hashed once, or it is downloaded
whole (verified) into a scratch directory, and ranges are then read from
that verified file. Memory holds the chunks of one range at a time.

``RangeFiles`` is used from synchronous code (DCP's reader): its reads run
on an event loop in a thread of their own.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
import threading
from collections import Counter, OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from ._direct_get import DirectRanges
from ._download import FileJob, SourceError, TransferOptions, _get_range_retrying, fetch_files
from ._range_writes import RangeBuffer
from .errors import RestoreError

T = TypeVar("T")
LOCAL = "local"
HASH_BLOCK = 8 * 1024 * 1024
# Verified chunks kept for the next read: the edges of each range read, which
# its neighbours share (DCP items packed back to back, an archive's directory
# read in several small reads). Bounds the cache to this many chunks.
CACHED_CHUNKS = 4


@dataclass(frozen=True)
class Remote:
    region: str
    url: str
    headers: dict[str, str]


@dataclass
class FileCopies:
    """One file of the checkpoint and where its copies are."""

    rank: int
    path: str
    size: int
    sha256: str
    chunk_size: int | None
    chunk_sha256: list[str] | None
    local: Path | None
    remotes: list[Remote] = field(default_factory=list)
    # Set once a whole-file-verified copy exists (files without chunk hashes).
    verified: Path | None = None

    @property
    def chunked(self) -> bool:
        return self.chunk_size is not None and self.chunk_sha256 is not None


def _sha(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def _pread(path: Path, offset: int, length: int) -> bytes:
    # O_NOFOLLOW: the T0 path comes from the agent; a symlink swapped in for
    # the file is refused rather than followed out of the rank's directory.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        out = bytearray()
        while len(out) < length:
            piece = os.pread(fd, length - len(out), offset + len(out))
            if not piece:
                raise OSError(f"{path} is shorter than expected")
            out += piece
        return bytes(out)
    finally:
        os.close(fd)


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        while block := os.read(fd, HASH_BLOCK):
            digest.update(block)
    finally:
        os.close(fd)
    return digest.hexdigest()


class RangeFiles:
    """Verified ranged reads of ``files`` (name -> copies). Counts the bytes
    it reads, per source (``bytes_read``, ``bytes_by_source``)."""

    def __init__(
        self,
        files: dict[str, FileCopies],
        *,
        base_url: str,
        timeout: float,
        scratch_root: Path,
        options: TransferOptions | None = None,
    ) -> None:
        self.files = files
        self.options = options or TransferOptions()
        self.bytes_by_source: Counter[str] = Counter()
        self._base_url, self._timeout = base_url, timeout
        self._scratch_root = scratch_root
        self._scratch: Path | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._http: httpx.AsyncClient | None = None
        self._direct: DirectRanges | None = None
        self._cache: OrderedDict[tuple[str, int], bytes] = OrderedDict()

    @property
    def bytes_read(self) -> int:
        return sum(self.bytes_by_source.values())

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def read(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` of file ``name``, verified."""
        return self._run(self._read(name, start, end))

    def close(self) -> None:
        async def shut() -> None:
            if self._direct is not None:
                self._direct.close()
            if self._http is not None:
                await self._http.aclose()

        try:
            self._run(shut())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)

    # -- on the loop -------------------------------------------------------------

    def _clients(self) -> tuple[httpx.AsyncClient, DirectRanges]:
        if self._http is None or self._direct is None:
            self._http = httpx.AsyncClient(base_url=self._base_url, timeout=self._timeout)
            self._direct = DirectRanges(connect_timeout=self._timeout, read_timeout=self._timeout)
        return self._http, self._direct

    async def _read(self, name: str, start: int, end: int) -> bytes:
        copies = self.files.get(name)
        if copies is None:
            raise RestoreError(f"{name} is not a file of this checkpoint", code="unknown_file")
        if not 0 <= start <= end <= copies.size:
            raise RestoreError(f"bytes {start}-{end} are outside {name}", code="bad_range")
        if start == end:
            return b""
        if not copies.chunked:
            path = await self._verified_whole(copies)
            return await asyncio.to_thread(_pread, path, start, end - start)
        size = copies.chunk_size
        assert size is not None
        first, last = start // size, (end - 1) // size
        pieces = []
        index = first
        while index <= last:
            cached = self._cache.get((name, index))
            if cached is not None:
                self._cache.move_to_end((name, index))
                pieces.append(cached)
                index += 1
                continue
            upto = index
            while upto < last and (name, upto + 1) not in self._cache:
                upto += 1
            data = await self._chunks(copies, index, upto)
            for edge in {index, upto}:
                self._remember(
                    (name, edge), data[(edge - index) * size : (edge - index + 1) * size]
                )
            pieces.append(data)
            index = upto + 1
        joined = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        base = first * size
        return joined[start - base : end - base]

    def _remember(self, key: tuple[str, int], chunk: bytes) -> None:
        self._cache[key] = chunk
        self._cache.move_to_end(key)
        while len(self._cache) > CACHED_CHUNKS:
            self._cache.popitem(last=False)

    async def _chunks(self, copies: FileCopies, first: int, last: int) -> bytes:
        """Chunks ``first`` to ``last`` (inclusive), each verified. Copies are
        tried in order; a chunk that does not verify on one is read again, on
        its own, from the next (not the whole range: one flipped bit in a
        large tensor costs one chunk more, not the tensor again). A long run
        is read as several ranges at once (``options.range_size``, at most
        ``options.concurrency`` in flight), as a restore reads a file."""
        assert copies.chunk_size is not None and copies.chunk_sha256 is not None
        size, hashes = copies.chunk_size, copies.chunk_sha256
        base, end = first * size, min((last + 1) * size, copies.size)
        out = bytearray(end - base)
        missing = list(range(first, last + 1))
        failures: list[str] = []
        per_read = max(1, self.options.range_size // size)
        limit = asyncio.Semaphore(self.options.concurrency)
        sources: list[Remote | None] = [None] if copies.local is not None else []
        for source in [*sources, *copies.remotes]:
            name = LOCAL if source is None else source.region

            async def read(
                piece: list[int], source: Remote | None = source, name: str = name
            ) -> list[int]:
                """Reads ``piece`` into ``out``; returns the chunks still missing."""
                start, stop = piece[0] * size, min((piece[-1] + 1) * size, copies.size)
                async with limit:
                    try:
                        if source is None:
                            assert copies.local is not None
                            data = await asyncio.to_thread(
                                _pread, copies.local, start, stop - start
                            )
                        else:
                            data = await self._get(copies, source, start, stop)
                    except (OSError, SourceError) as exc:
                        failures.append(f"{name}: {exc}")
                        return piece
                self.bytes_by_source[name] += len(data)
                expected = hashes[piece[0] : piece[-1] + 1]
                bad = await asyncio.to_thread(_bad_chunks, data, size, expected)
                out[start - base : stop - base] = data
                failures.extend(f"{name}: chunk {piece[i]} does not match its SHA-256" for i in bad)
                return [piece[i] for i in sorted(bad)]

            pieces = [
                run[i : i + per_read]
                for run in _runs(missing)
                for i in range(0, len(run), per_read)
            ]
            left = await asyncio.gather(*(read(piece) for piece in pieces))
            missing = sorted(index for still in left for index in still)
            if not missing:
                return bytes(out)
        raise RestoreError(
            f"no copy of rank {copies.rank} {copies.path} verifies for chunks {missing}: "
            + "; ".join(failures),
            code="all_sources_failed",
        )

    async def _get(self, copies: FileCopies, remote: Remote, start: int, end: int) -> bytes:
        http, direct = self._clients()
        job = FileJob(
            url=remote.url,
            target=Path(os.devnull),
            size=copies.size,
            sha256=copies.sha256,
            label=f"rank {copies.rank} {copies.path}",
            headers=remote.headers,
        )
        buffer: RangeBuffer = bytearray(end - start)
        await _get_range_retrying(http, job, start, end, self.options, buffer, direct)
        return bytes(buffer)

    async def _verified_whole(self, copies: FileCopies) -> Path:
        """A local file with the whole file's verified bytes (no chunk hashes
        to verify a range by): the T0 copy once it hashes right, else a
        verified download into the scratch directory."""
        if copies.verified is not None:
            return copies.verified
        if copies.local is not None:
            try:
                digest = await asyncio.to_thread(_hash_file, copies.local)
                self.bytes_by_source[LOCAL] += copies.size
                if digest == copies.sha256:
                    copies.verified = copies.local
                    return copies.local
            except OSError:
                pass
        if self._scratch is None:
            self._scratch_root.mkdir(parents=True, exist_ok=True)
            self._scratch = Path(
                tempfile.mkdtemp(prefix=".tierckpt-ranges-", dir=self._scratch_root)
            )
        target = self._scratch / f"rank-{copies.rank}" / copies.path.replace("/", "_")
        target.parent.mkdir(parents=True, exist_ok=True)
        http, direct = self._clients()
        failures = []
        for remote in copies.remotes:
            job = FileJob(
                url=remote.url,
                target=target,
                size=copies.size,
                sha256=copies.sha256,
                label=f"rank {copies.rank} {copies.path}",
                headers=remote.headers,
            )
            try:
                await fetch_files(
                    http,
                    [job],
                    options=self.options,
                    on_bytes=lambda n: None,
                    on_verified=lambda job: None,
                    direct=direct,
                )
            except SourceError as exc:
                failures.append(f"{remote.region}: {exc}")
                continue
            self.bytes_by_source[remote.region] += copies.size
            copies.verified = target
            return target
        raise RestoreError(
            f"no copy of rank {copies.rank} {copies.path} verifies: " + "; ".join(failures),
            code="all_sources_failed",
        )


def _runs(indices: list[int]) -> list[list[int]]:
    """Consecutive runs of sorted ``indices``: one read per run."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][-1] == index - 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


def _bad_chunks(data: bytes, chunk_size: int, expected: list[str]) -> set[int]:
    """Positions (within ``expected``) of the chunks of ``data`` whose SHA-256 differs."""
    view = memoryview(data)
    return {
        index
        for index, digest in enumerate(expected)
        if _sha(view[index * chunk_size : (index + 1) * chunk_size]) != digest
    }
