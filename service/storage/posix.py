"""POSIX region: a mounted directory (NFS, EFS, Lustre, or a local disk).

Every object is written to a hidden temporary file, fsynced, then renamed
into place, so a reader (or a crash) never sees half an object; the manifest
thereby lands atomically as the commit marker.
"""

from __future__ import annotations

import asyncio
import errno
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import aiofiles
import aiofiles.os

from ...client._files import fsync_dir
from ..config import RegionSettings
from .base import MultipartUpload, ObjectInfo, ObjectNotFound, ObjectStore, PartRef, StoreError

_TMP_MARK = ".tierckpt-tmp-"


class PosixStore(ObjectStore):
    kind = "posix"

    def __init__(self, settings: RegionSettings) -> None:
        assert settings.root is not None
        self.region = settings.name
        self.root = settings.root.resolve()
        self.base = self.root / settings.prefix if settings.prefix else self.root

    def _path(self, key: str) -> Path:
        # Keys come from validated names, but confinement is checked here too:
        # a store must never write outside its root whatever it is handed.
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") for p in parts):
            raise StoreError(f"{self.region}: invalid object key {key!r}")
        return self.base.joinpath(*parts)

    def _tmp_for(self, path: Path) -> Path:
        return path.with_name(f"{_TMP_MARK}{path.name}.{secrets.token_hex(6)}")

    def uri(self, key: str) -> str:
        trailing = "/" if key.endswith("/") else ""
        return f"{self._path(key.rstrip('/'))}{trailing}"

    async def ensure_ready(self) -> None:
        await asyncio.to_thread(self.base.mkdir, parents=True, exist_ok=True)

    @staticmethod
    def _write_atomic(path: Path, data: bytes | bytearray | memoryview) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{_TMP_MARK}{path.name}.{secrets.token_hex(6)}")
        try:
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
            fsync_dir(path.parent)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    async def put_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None:
        try:
            await asyncio.to_thread(self._write_atomic, self._path(key), data)
        except OSError as exc:
            raise StoreError(f"{self.region}: writing {key} failed: {exc}") from exc

    async def create_multipart(self, key: str) -> MultipartUpload:
        path = self._path(key)
        tmp = self._tmp_for(path)

        def _create() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.touch()

        try:
            await asyncio.to_thread(_create)
        except OSError as exc:
            raise StoreError(f"{self.region}: creating {key} failed: {exc}") from exc
        # The upload id is the temp file's name: parts are written at their
        # offsets, which the caller passes through the part number and size.
        return MultipartUpload(key=key, upload_id=tmp.name)

    async def upload_part(
        self,
        upload: MultipartUpload,
        number: int,
        offset: int,
        data: bytes | bytearray | memoryview,
    ) -> PartRef:
        tmp = self._path(upload.key).with_name(upload.upload_id)

        def _write() -> None:
            fd = os.open(tmp, os.O_WRONLY)
            try:
                view = memoryview(data)
                written = 0
                while written < len(view):
                    written += os.pwrite(fd, view[written:], offset + written)
            finally:
                os.close(fd)

        try:
            await asyncio.to_thread(_write)
        except OSError as exc:
            raise StoreError(f"{self.region}: writing {upload.key} failed: {exc}") from exc
        return PartRef(number=number, etag=str(offset))

    async def complete_multipart(self, upload: MultipartUpload, parts: list[PartRef]) -> None:
        path = self._path(upload.key)
        tmp = path.with_name(upload.upload_id)

        def _finish() -> None:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            fsync_dir(path.parent)

        try:
            await asyncio.to_thread(_finish)
        except OSError as exc:
            raise StoreError(f"{self.region}: completing {upload.key} failed: {exc}") from exc

    async def abort_multipart(self, upload: MultipartUpload) -> None:
        tmp = self._path(upload.key).with_name(upload.upload_id)
        await asyncio.to_thread(tmp.unlink, missing_ok=True)

    async def abort_incomplete(self, prefix: str) -> int:
        # An open upload here is a temporary file next to its object's path.
        top = self._path(prefix.rstrip("/"))

        def _remove() -> int:
            removed = 0
            for dirpath, _dirs, files in os.walk(top):
                for name in files:
                    if name.startswith(_TMP_MARK):
                        (Path(dirpath) / name).unlink(missing_ok=True)
                        removed += 1
            return removed

        try:
            return await asyncio.to_thread(_remove)
        except OSError as exc:
            raise StoreError(f"{self.region}: clearing {prefix} failed: {exc}") from exc

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        path = self._path(key)
        try:
            async with aiofiles.open(path, "rb") as handle:
                await handle.seek(start)
                return await handle.read(length)
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"{self.region}: {key} not found") from exc
        except OSError as exc:
            raise StoreError(f"{self.region}: reading {key} failed: {exc}") from exc

    async def iter_range(
        self, key: str, start: int = 0, length: int | None = None, chunk_size: int = 1 << 20
    ) -> AsyncIterator[bytes]:
        path = self._path(key)
        try:
            async with aiofiles.open(path, "rb") as handle:
                await handle.seek(start)
                remaining = length
                while remaining is None or remaining > 0:
                    want = chunk_size if remaining is None else min(chunk_size, remaining)
                    chunk = await handle.read(want)
                    if not chunk:
                        break
                    if remaining is not None:
                        remaining -= len(chunk)
                    yield chunk
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"{self.region}: {key} not found") from exc
        except OSError as exc:
            raise StoreError(f"{self.region}: reading {key} failed: {exc}") from exc

    async def head(self, key: str) -> ObjectInfo | None:
        try:
            stat = await aiofiles.os.stat(self._path(key))
        except FileNotFoundError:
            return None
        return ObjectInfo(key=key, size=stat.st_size)

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(self._path(key).unlink, missing_ok=True)

    async def list(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        def _walk() -> list[ObjectInfo]:
            found: list[ObjectInfo] = []
            for dirpath, _dirs, files in os.walk(self.base):
                for name in files:
                    if name.startswith(_TMP_MARK):
                        continue
                    full = Path(dirpath) / name
                    key = full.relative_to(self.base).as_posix()
                    if key.startswith(prefix):
                        found.append(ObjectInfo(key=key, size=full.stat().st_size))
            return sorted(found, key=lambda o: o.key)

        for info in await asyncio.to_thread(_walk):
            yield info

    async def copy_object(self, source_key: str, key: str, size: int) -> None:
        source, path = self._path(source_key), self._path(key)
        try:
            await asyncio.to_thread(_copy_atomic, source, path, size)
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"{self.region}: {source_key} not found") from exc
        except OSError as exc:
            raise StoreError(f"{self.region}: copying {source_key} to {key} failed: {exc}") from exc

    async def presign_get(self, key: str, expires_seconds: int = 3600) -> str | None:
        return None

    def local_path(self, key: str) -> Path:
        return self._path(key)


_COPY_CHUNK = 64 * 1024 * 1024
# copy_file_range is refused between file systems on older kernels, and by
# some file systems (and seccomp profiles) altogether; sendfile then does the
# same in-kernel copy.
_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM}


def _copy_atomic(source: Path, path: Path, size: int) -> None:
    """Copy ``size`` bytes of ``source`` into a new file at ``path``: temporary
    file, fsync, rename, like every other write of this store.

    The bytes are moved by the kernel (copy_file_range, which may share
    extents copy-on-write on XFS/btrfs, else sendfile), never through a
    Python buffer. A real copy, not a hard link: the new object must outlive
    the source's deletion *and* never change if the source were rewritten.
    """
    src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if os.fstat(src).st_size != size:
            raise OSError(errno.EIO, f"{source} holds {os.fstat(src).st_size} bytes, not {size}")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{_TMP_MARK}{path.name}.{secrets.token_hex(6)}")
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                kernel_copy(src, dst, size)
                os.fsync(dst)
            finally:
                os.close(dst)
            os.replace(tmp, path)
            fsync_dir(path.parent)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    finally:
        os.close(src)


def kernel_copy(src: int, dst: int, size: int) -> None:
    copied = 0
    use_range = hasattr(os, "copy_file_range")
    while copied < size:
        want = min(_COPY_CHUNK, size - copied)
        if use_range:
            try:
                n = os.copy_file_range(src, dst, want, copied, copied)
            except OSError as exc:
                if exc.errno not in _NO_COPY_FILE_RANGE or copied:
                    raise
                use_range = False
                continue
        else:
            os.lseek(dst, copied, os.SEEK_SET)
            n = os.sendfile(dst, src, copied, want)
        if n == 0:
            raise OSError(errno.EIO, f"source ended after {copied} of {size} bytes")
        copied += n
