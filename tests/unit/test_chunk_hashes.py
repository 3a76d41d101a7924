"""Per-chunk SHA-256s (storage/chunks.py): computed beside the whole-file hash
in one pass, kept in the manifest only when known (old manifests unchanged)."""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime

import pytest

from tierckpt.service.storage import chunks
from tierckpt.service.storage.manifest import (
    InvalidManifest,
    ObjectEntry,
    build_manifest,
    parse_manifest,
)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 4567])
def test_file_hashes_whatever_the_pieces_fed(size: int) -> None:
    data = os.urandom(size)
    # Pieces that straddle chunk boundaries in every way (as upload parts do).
    hashes = chunks.FileHashes(1000)
    position = 0
    for piece in (1, 998, 3, 1500, 7):
        hashes.update(memoryview(data)[position : position + piece])
        position += piece
    hashes.update(data[position:])
    whole, parts = hashes.finish()
    assert whole == sha(data)
    assert parts == tuple(sha(data[i : i + 1000]) for i in range(0, size, 1000))
    assert len(parts) == chunks.chunk_count(size, 1000)
    assert chunks.decode(chunks.encode(parts)) == parts


def _manifest(files: list[ObjectEntry]) -> bytes:
    return build_manifest(
        run="llm",
        step=7,
        world_size=1,
        epoch=None,
        parent=None,
        metrics={},
        metadata={},
        created_at=datetime(2026, 1, 2, 3, 4, 5),
        files=files,
    )


def test_manifest_carries_chunks_when_known_and_round_trips() -> None:
    data = os.urandom(2500)
    hashes = chunks.FileHashes(1000)
    hashes.update(data)
    whole, parts = hashes.finish()
    with_chunks = ObjectEntry.of("llm", 7, 0, "a.bin", 2500, whole, 1000, parts)
    plain = ObjectEntry.of("llm", 7, 0, "b.bin", 3, sha(b"abc"))
    document = json.loads(_manifest([with_chunks, plain]))
    assert document["files"][0]["chunk_size"] == 1000
    assert document["files"][0]["chunk_sha256"] == list(parts)
    # A file without chunk hashes is written as before: no new keys.
    assert set(document["files"][1]) == {"rank", "path", "size", "sha256"}
    parsed = parse_manifest(_manifest([with_chunks, plain]), "llm", 7)
    assert parsed.files[0].chunk_size == 1000 and parsed.files[0].chunk_sha256 == parts
    assert parsed.files[1].chunk_sha256 is None
    # Chunks are not part of an entry's identity (copies compare equal).
    assert with_chunks == ObjectEntry.of("llm", 7, 0, "a.bin", 2500, whole)


@pytest.mark.parametrize(
    "chunk_size, chunk_sha256",
    [(1000, ["a" * 64]), (0, []), ("8", ["a" * 64] * 3), (1000, ["A" * 64] * 3)],
)
def test_manifest_refuses_chunk_lists_that_do_not_fit(
    chunk_size: object, chunk_sha256: object
) -> None:
    document = json.loads(_manifest([ObjectEntry.of("llm", 7, 0, "a.bin", 2500, "e" * 64)]))
    document["files"][0].update(chunk_size=chunk_size, chunk_sha256=chunk_sha256)
    with pytest.raises(InvalidManifest, match="chunk_sha256"):
        parse_manifest(json.dumps(document).encode(), "llm", 7)


def test_file_hashes_of_large_buffers_hash_chunks_beside_the_whole() -> None:
    """Buffers of PARALLEL_MIN and more: chunks hashed in another thread."""
    data = os.urandom(3 * chunks.MiB + 5)
    hashes = chunks.FileHashes(chunks.MiB)
    step = chunks.MiB + chunks.MiB // 2
    for position in range(0, len(data), step):
        hashes.update(memoryview(data)[position : position + step])
    whole, parts = hashes.finish()
    assert whole == sha(data)
    assert parts == tuple(sha(data[i : i + chunks.MiB]) for i in range(0, len(data), chunks.MiB))


def test_chunk_size_zero_hashes_the_whole_file_only() -> None:
    hashes = chunks.FileHashes(0)
    hashes.update(os.urandom(2 * chunks.MiB))
    hashes.update(b"tail")
    whole, parts = hashes.finish()
    assert len(whole) == 64 and parts is None


@pytest.mark.parametrize("size", [0, 1, 999, 1000])
def test_a_file_of_one_chunk_is_hashed_once(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Told the size, a file no larger than a chunk gets its whole-file hash as
    its only chunk's, the same answer as the second pass gave, without it."""
    data = os.urandom(size)
    expected = chunks.FileHashes(1000)
    expected.update(data)
    wanted = expected.finish()

    def no_second_pass(self: chunks.FileHashes, data: object) -> None:
        raise AssertionError("the chunk pass ran")

    monkeypatch.setattr(chunks.FileHashes, "_update_chunks", no_second_pass)
    hashes = chunks.FileHashes(1000, size)
    for position in range(0, size, 300):
        hashes.update(memoryview(data)[position : position + 300])
    assert hashes.finish() == wanted
    assert wanted[1] == ((sha(data),) if size else ())


def test_more_than_a_chunk_fed_after_a_size_of_one_is_refused() -> None:
    """A wrong answer (one chunk's hash for two chunks' bytes) is never given."""
    hashes = chunks.FileHashes(1000, 1000)
    hashes.update(os.urandom(1000))
    with pytest.raises(ValueError, match="more than one chunk"):
        hashes.update(b"x")


def test_a_size_larger_than_a_chunk_hashes_every_chunk() -> None:
    data = os.urandom(2500)
    hashes = chunks.FileHashes(1000, len(data))
    hashes.update(data)
    assert hashes.finish() == (
        sha(data),
        tuple(sha(data[i : i + 1000]) for i in range(0, 2500, 1000)),
    )
