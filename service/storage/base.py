"""The object-store interface every region implements (S3 or a POSIX mount).

Multipart is part of the interface, not an S3 detail: the upload pipeline
streams parts in parallel the same way whatever the region's kind, and the
POSIX store maps a multipart upload onto positional writes into a temporary
file that is renamed into place on completion.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass


class StoreError(Exception):
    """A store call failed in a way worth retrying later (outage, 5xx, timeout)."""


class ObjectNotFound(StoreError):
    pass


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int


@dataclass
class MultipartUpload:
    key: str
    upload_id: str


@dataclass(frozen=True)
class PartRef:
    number: int
    etag: str


class ObjectStore(ABC):
    """Async access to one region's objects; keys are '/'-separated and relative."""

    region: str
    kind: str
    # What this store's MANIFEST.json files say about where the objects are
    # (storage/layout.py); None: the plain layout.
    key_layout: str | None = None

    @abstractmethod
    def uri(self, key: str) -> str:
        """A human- and tool-usable address (s3://bucket/key or a file path)."""

    @abstractmethod
    async def put_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None: ...

    @abstractmethod
    async def create_multipart(self, key: str) -> MultipartUpload: ...

    @abstractmethod
    async def upload_part(
        self,
        upload: MultipartUpload,
        number: int,
        offset: int,
        data: bytes | bytearray | memoryview,
    ) -> PartRef:
        """Part ``number`` (1-based) holds the bytes at ``offset`` of the object."""

    @abstractmethod
    async def complete_multipart(self, upload: MultipartUpload, parts: list[PartRef]) -> None: ...

    @abstractmethod
    async def abort_multipart(self, upload: MultipartUpload) -> None: ...

    @abstractmethod
    async def abort_incomplete(self, prefix: str) -> int:
        """Abort every multipart upload still open under ``prefix`` (``prefix``
        ends with '/'), and return how many: what an agent killed mid-upload
        left behind, which no one would otherwise ever complete or remove."""

    def may_leave_open(self, sizes: Iterable[int]) -> bool:
        """Whether writing objects of these sizes can have left something
        for ``abort_incomplete`` to clear had the writer been killed. Yes
        unless the store knows better."""
        return True

    @abstractmethod
    async def get_range(self, key: str, start: int, length: int) -> bytes: ...

    @abstractmethod
    def iter_range(
        self, key: str, start: int = 0, length: int | None = None, chunk_size: int = 1 << 20
    ) -> AsyncIterator[bytes]:
        """Stream an object (or a byte range of it) in bounded chunks."""

    @abstractmethod
    async def head(self, key: str) -> ObjectInfo | None: ...

    @abstractmethod
    async def delete(self, key: str) -> None: ...

    @abstractmethod
    def list(self, prefix: str) -> AsyncIterator[ObjectInfo]: ...

    @abstractmethod
    async def presign_get(self, key: str, expires_seconds: int = 3600) -> str | None:
        """A URL a client can GET (with Range) without credentials, or None when
        the objects are only reachable through the service."""

    async def copy_within(self, source: ObjectStore, source_key: str, key: str, size: int) -> bool:
        """Server-side copy from ``source`` when both live on one endpoint;
        False when this pair cannot (the caller then streams the bytes)."""
        return False

    def copies_server_side_from(self, source: ObjectStore) -> bool:
        """Whether ``copy_within(source, …)`` works for this pair (then a
        replica is cheaper copied inside the store than uploaded again)."""
        return False

    @abstractmethod
    async def copy_object(self, source_key: str, key: str, size: int) -> None:
        """Copy ``source_key`` (``size`` bytes) of this store to ``key`` without
        the bytes passing through the agent.

        The result is a plain, independent object: deleting the source later
        leaves it whole (the layout stays ``aws s3 cp``-able per checkpoint).
        Raises ObjectNotFound when the source is gone, StoreError otherwise.
        """

    async def ensure_ready(self) -> None:
        """Create the bucket/root if missing; called once at start-up."""

    async def aclose(self) -> None:
        """Release connections."""
