"""S3-compatible region (AWS, MinIO, SeaweedFS) through aioboto3."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable
from contextlib import AsyncExitStack
from typing import Any

import aioboto3
import botocore.auth
import botocore.session
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from ..config import RegionSettings
from . import layout
from .base import MultipartUpload, ObjectInfo, ObjectNotFound, ObjectStore, PartRef, StoreError
from .s3_endpoints import make_cacheable

UNSIGNED_PAYLOAD_SIGNER = "s3v4-tierckpt-unsigned-payload"
# The smallest part our multipart uploads send: `[upload] part_size_mb` may
# not go below it (S3's own floor for every part but the last), and an object
# no larger than one part is written with one PUT, by the upload and by
# replication alike (server-side copies go in parts only above 5 GiB).
MIN_PART_BYTES = 5 * 1024 * 1024


class _S3SigV4UnsignedPayload(botocore.auth.S3SigV4Auth):
    """SigV4 without hashing the body.

    Over plain HTTP botocore SHA-256-hashes every request body just to sign
    it: a second full pass over each part, on top of the hash tierckpt
    computes for the manifest. The headers stay signed; the body integrity is
    checked by tierckpt's own SHA-256 of each file (verify/scrub re-reads).
    """

    def _should_sha256_sign_payload(self, request: Any) -> bool:
        return False


botocore.auth.AUTH_TYPE_MAPS.setdefault(UNSIGNED_PAYLOAD_SIGNER, _S3SigV4UnsignedPayload)


class _PartBody:
    """An upload body sent straight from the caller's buffer.

    botocore wraps a ``bytes`` body in a BytesIO, which aiohttp copies whole
    on the event loop (``getbuffer``); a ``bytearray`` it slices (a copy) and,
    on Python < 3.12.9, joins with the request headers (another copy): each
    16 MiB part was copied two or three times on the one thread that drives
    every upload. This object passes botocore's checks (``read``, ``seek``,
    ``tell``, a length) and reaches aiohttp as an async iterable of 1 MiB
    memoryview slices of the buffer, which go to the socket without a copy
    of the part. Rewinding (``seek(0)``) makes botocore's retries resend it.
    """

    SLICE = 1 << 20

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(data).cast("B")
        self._position = 0

    def __len__(self) -> int:
        return self._view.nbytes

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._position, 2: len(self)}[whence]
        self._position = max(0, min(len(self), base + offset))
        return self._position

    def read(self, size: int | None = -1) -> bytes:
        # Only for a caller that insists on reading (botocore does not, with
        # unsigned payloads and no checksums); it copies.
        end = len(self) if size is None or size < 0 else min(len(self), self._position + size)
        chunk = bytes(self._view[self._position : end])
        self._position = end
        return chunk

    def __aiter__(self) -> AsyncIterator[memoryview]:
        return self._slices()

    async def _slices(self) -> AsyncIterator[memoryview]:
        view = self._view
        for start in range(self._position, len(view), self.SLICE):
            yield view[start : start + self.SLICE]


def _body(data: bytes | bytearray | memoryview) -> bytes | _PartBody:
    # A few KiB (manifests, small files) are cheaper sent as they are.
    if len(data) <= _PartBody.SLICE:
        return bytes(data)
    return _PartBody(data)


COPY_OBJECT_LIMIT = 5 * 1024**3
COPY_PART_SIZE = 1024**3
_NOT_FOUND_CODES = {"404", "NoSuchKey", "NotFound", "NoSuchUpload"}


def _client_config(
    settings: RegionSettings, pool_size: int, signature_version: str | None
) -> Config:
    return Config(
        signature_version=signature_version,
        s3={"addressing_style": "path"},
        # botocore >= 1.36 adds CRC32 trailers to every upload by default;
        # third-party stores may reject them, and they cost another pass.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        max_pool_connections=pool_size,
        connect_timeout=settings.connect_timeout_seconds,
        read_timeout=settings.read_timeout_seconds,
        retries={"max_attempts": settings.request_attempts, "mode": "standard"},
        region_name=settings.region_name,
    )


class S3Store(ObjectStore):
    kind = "s3"

    def __init__(self, settings: RegionSettings, pool_size: int = 32) -> None:
        assert settings.bucket
        self.region = settings.name
        self.bucket = settings.bucket
        self.prefix = settings.prefix
        self._settings = settings
        self._pool_size = pool_size
        self._stack = AsyncExitStack()
        self._client: Any = None
        self._credentials = {
            k: v
            for k, v in {
                "aws_access_key_id": settings.access_key_id,
                "aws_secret_access_key": settings.secret_access_key,
            }.items()
            if v
        }
        self._presigner: Any = None
        self.hashed = settings.hashed_prefix
        self.key_layout = layout.HASHED_LAYOUT if settings.hashed_prefix else None
        # Written on every new object (PUT, multipart, copy): encryption and class.
        self._write_args: dict[str, str] = {}
        if settings.sse:
            self._write_args["ServerSideEncryption"] = settings.sse
        if settings.sse_kms_key_id:
            self._write_args["SSEKMSKeyId"] = settings.sse_kms_key_id
        if settings.storage_class:
            self._write_args["StorageClass"] = settings.storage_class

    def full_key(self, key: str) -> str:
        if self.hashed:
            key = layout.hashed(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _listing(self, prefix: str) -> tuple[str, int]:
        """(what to list in the bucket, how much of each listed key is the
        region's prefix). In a hashed region only a rank's prefix (or deeper)
        names one partition; a shorter one lists the region whole, filtered."""
        strip = len(self.full_key(""))
        if self.hashed and layout.partition(prefix + "x") is None:
            return self.full_key(""), strip
        return self.full_key(prefix), strip

    def _logical(self, stored: str, strip: int) -> str:
        key = stored[strip:]
        return layout.unhashed(key) if self.hashed else key

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.full_key(key)}"

    async def _s3(self) -> Any:
        if self._client is None:
            insecure = (self._settings.endpoint_url or "https").startswith("http://")
            session = aioboto3.Session()
            self._client = await self._stack.enter_async_context(
                session.client(
                    "s3",
                    endpoint_url=self._settings.endpoint_url,
                    config=_client_config(
                        self._settings,
                        self._pool_size,
                        UNSIGNED_PAYLOAD_SIGNER if insecure else "s3v4",
                    ),
                    **self._credentials,
                )
            )
            make_cacheable(self._client)
        return self._client

    async def _call(self, operation: str, **kwargs: Any) -> Any:
        client = await self._s3()
        try:
            return await getattr(client, operation)(Bucket=self.bucket, **kwargs)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _NOT_FOUND_CODES:
                raise ObjectNotFound(f"{self.region}: {kwargs.get('Key', '')} not found") from exc
            raise StoreError(f"{self.region}: {operation} failed: {code or exc}") from exc
        except (BotoCoreError, OSError) as exc:
            raise StoreError(f"{self.region}: {operation} failed: {exc}") from exc

    async def ensure_ready(self) -> None:
        client = await self._s3()
        try:
            await client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code")) not in ("404", "NoSuchBucket"):
                raise StoreError(f"{self.region}: bucket {self.bucket}: {exc}") from exc
            await self._call("create_bucket")
        except (BotoCoreError, OSError) as exc:
            raise StoreError(f"{self.region}: unreachable: {exc}") from exc

    async def put_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None:
        await self._call("put_object", Key=self.full_key(key), Body=_body(data), **self._write_args)

    async def create_multipart(self, key: str) -> MultipartUpload:
        answer = await self._call(
            "create_multipart_upload", Key=self.full_key(key), **self._write_args
        )
        return MultipartUpload(key=key, upload_id=answer["UploadId"])

    async def upload_part(
        self,
        upload: MultipartUpload,
        number: int,
        offset: int,
        data: bytes | bytearray | memoryview,
    ) -> PartRef:
        answer = await self._call(
            "upload_part",
            Key=self.full_key(upload.key),
            UploadId=upload.upload_id,
            PartNumber=number,
            Body=_body(data),
        )
        return PartRef(number=number, etag=answer["ETag"])

    async def complete_multipart(self, upload: MultipartUpload, parts: list[PartRef]) -> None:
        await self._call(
            "complete_multipart_upload",
            Key=self.full_key(upload.key),
            UploadId=upload.upload_id,
            MultipartUpload={
                "Parts": [
                    {"PartNumber": p.number, "ETag": p.etag}
                    for p in sorted(parts, key=lambda p: p.number)
                ]
            },
        )

    async def abort_multipart(self, upload: MultipartUpload) -> None:
        try:
            await self._call(
                "abort_multipart_upload", Key=self.full_key(upload.key), UploadId=upload.upload_id
            )
        except StoreError:
            pass  # best effort; the bucket's lifecycle rule reaps leftovers

    def may_leave_open(self, sizes: Iterable[int]) -> bool:
        # A single PUT killed mid-way leaves nothing in S3; only an object
        # larger than the smallest part was ever sent in parts. Listing the
        # open uploads is a request and a paged XML answer per region, which
        # a checkpoint of small files need not pay.
        return any(size > MIN_PART_BYTES for size in sizes)

    async def abort_incomplete(self, prefix: str) -> int:
        client = await self._s3()
        paginator = client.get_paginator("list_multipart_uploads")
        aborted = 0
        listed, strip = self._listing(prefix)
        try:
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=listed):
                for upload in page.get("Uploads", []):
                    if not self._logical(upload["Key"], strip).startswith(prefix):
                        continue
                    with contextlib.suppress(ObjectNotFound):  # it ended meanwhile
                        await self._call(
                            "abort_multipart_upload", Key=upload["Key"], UploadId=upload["UploadId"]
                        )
                        aborted += 1
        except (ClientError, BotoCoreError, OSError) as exc:
            raise StoreError(f"{self.region}: listing uploads in {prefix} failed: {exc}") from exc
        return aborted

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        answer = await self._call(
            "get_object", Key=self.full_key(key), Range=f"bytes={start}-{start + length - 1}"
        )
        body = answer["Body"]
        try:
            data: bytes = await body.read()
        except (BotoCoreError, OSError) as exc:
            raise StoreError(f"{self.region}: reading {key} failed: {exc}") from exc
        finally:
            body.close()
        return data

    async def iter_range(
        self, key: str, start: int = 0, length: int | None = None, chunk_size: int = 1 << 20
    ) -> AsyncIterator[bytes]:
        kwargs: dict[str, Any] = {"Key": self.full_key(key)}
        if length is not None:
            if length <= 0:
                return
            kwargs["Range"] = f"bytes={start}-{start + length - 1}"
        elif start:
            kwargs["Range"] = f"bytes={start}-"
        answer = await self._call("get_object", **kwargs)
        body = answer["Body"]
        try:
            async for chunk in body.iter_chunks(chunk_size):
                yield chunk
        except (BotoCoreError, OSError) as exc:
            raise StoreError(f"{self.region}: reading {key} failed: {exc}") from exc
        finally:
            body.close()

    async def head(self, key: str) -> ObjectInfo | None:
        try:
            answer = await self._call("head_object", Key=self.full_key(key))
        except ObjectNotFound:
            return None
        return ObjectInfo(key=key, size=int(answer["ContentLength"]))

    async def delete(self, key: str) -> None:
        await self._call("delete_object", Key=self.full_key(key))

    async def list(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        client = await self._s3()
        paginator = client.get_paginator("list_objects_v2")
        listed, strip = self._listing(prefix)
        try:
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=listed):
                for item in page.get("Contents", []):
                    key = self._logical(item["Key"], strip)
                    if key.startswith(prefix):
                        yield ObjectInfo(key=key, size=int(item["Size"]))
        except (ClientError, BotoCoreError, OSError) as exc:
            raise StoreError(f"{self.region}: list {prefix} failed: {exc}") from exc

    def copies_server_side_from(self, source: ObjectStore) -> bool:
        return self._same_endpoint(source)

    def _same_endpoint(self, other: ObjectStore) -> bool:
        return (
            isinstance(other, S3Store)
            and other._settings.endpoint_url == self._settings.endpoint_url
            and other._credentials == self._credentials
        )

    async def copy_within(self, source: ObjectStore, source_key: str, key: str, size: int) -> bool:
        if not self._same_endpoint(source):
            return False
        assert isinstance(source, S3Store)
        await self._server_side_copy(source, source_key, key, size)
        return True

    async def copy_object(self, source_key: str, key: str, size: int) -> None:
        await self._server_side_copy(self, source_key, key, size)

    async def _server_side_copy(
        self, source: S3Store, source_key: str, key: str, size: int
    ) -> None:
        copy_source = {"Bucket": source.bucket, "Key": source.full_key(source_key)}
        if size <= COPY_OBJECT_LIMIT:
            await self._call(
                "copy_object", Key=self.full_key(key), CopySource=copy_source, **self._write_args
            )
            return
        # CopyObject stops at 5 GiB; larger objects are copied part by part,
        # still without the bytes leaving the store.
        upload = await self.create_multipart(key)
        try:
            parts = []
            for number, offset in enumerate(range(0, size, COPY_PART_SIZE), start=1):
                end = min(offset + COPY_PART_SIZE, size) - 1
                answer = await self._call(
                    "upload_part_copy",
                    Key=self.full_key(key),
                    UploadId=upload.upload_id,
                    PartNumber=number,
                    CopySource=copy_source,
                    CopySourceRange=f"bytes={offset}-{end}",
                )
                parts.append(PartRef(number=number, etag=answer["CopyPartResult"]["ETag"]))
            await self.complete_multipart(upload, parts)
        except BaseException:
            await self.abort_multipart(upload)
            raise

    async def presign_get(self, key: str, expires_seconds: int = 3600) -> str | None:
        if self._presigner is None:
            # Presigning is pure computation; a plain botocore client with the
            # standard signer does it without touching the network.
            self._presigner = botocore.session.get_session().create_client(
                "s3",
                endpoint_url=self._settings.endpoint_url,
                config=_client_config(self._settings, 1, "s3v4"),
                **self._credentials,
            )
            make_cacheable(self._presigner)
        url: str = self._presigner.generate_presigned_url(
            "get_object",
            Params={"Bucket": self.bucket, "Key": self.full_key(key)},
            ExpiresIn=expires_seconds,
        )
        return url

    async def aclose(self) -> None:
        await self._stack.aclose()
        self._client = None
