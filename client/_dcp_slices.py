"""Read part of a tensor DCP stored with ``torch.save`` without reading all of it.

DCP's ``FileSystemWriter`` stores each tensor as a ``torch.save`` archive (an
uncompressed zip) inside a rank's file, and its own reader loads the whole
archive even when a rank needs a slice of it: after resharding, a rank would
read every stored shard its slice touches. Here only the archive's directory
(at its end), its ``data.pkl`` (at its start) and the bytes between the first
and the last element of the requested slice are read, and the slice is built
from them with the stored strides.

Anything else than what ``torch.save`` writes for one plain CPU tensor (an
unknown pickle global, a compressed or missing record, a negative stride)
gives None: the caller then loads the whole archive the usual way.
"""

from __future__ import annotations

import io
import pickle
import struct
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Read bytes [start, end) of the archive (relative to its first byte), verified.
ReadRange = Callable[[int, int], bytes]

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")
_STORAGES = (
    "DoubleStorage FloatStorage HalfStorage BFloat16Storage LongStorage IntStorage "
    "ShortStorage CharStorage ByteStorage BoolStorage ComplexFloatStorage ComplexDoubleStorage"
).split()


class _Unsupported(Exception):
    pass


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: Any
    numel: int


@dataclass(frozen=True)
class _TensorRef:
    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild(storage: Any, offset: int, size: Any, stride: Any, *rest: Any) -> _TensorRef:
    if not isinstance(storage, _StorageRef):
        raise _Unsupported("not a storage")
    return _TensorRef(storage, int(offset), tuple(size), tuple(stride))


def _storage_dtypes() -> dict[str, Any]:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage deprecation: only .dtype is read
        return {name: getattr(torch, name).dtype for name in _STORAGES if hasattr(torch, name)}


class _RefUnpickler(pickle.Unpickler):
    """Unpickles ``data.pkl`` into a :class:`_TensorRef`; refuses every
    global but the few ``torch.save`` uses for a tensor (no code runs)."""

    def __init__(self, data: bytes | io.BytesIO) -> None:
        super().__init__(data if isinstance(data, io.BytesIO) else io.BytesIO(data))
        self._dtypes = _storage_dtypes()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in self._dtypes:
            return self._dtypes[name]
        raise _Unsupported(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _Unsupported("persistent id")
        return _StorageRef(key=str(pid[2]), dtype=pid[1], numel=int(pid[4]))

    def load_ref(self) -> _TensorRef:
        ref = self.load()
        if not isinstance(ref, _TensorRef):
            raise _Unsupported("not one tensor")
        return ref


class _ArchiveFile(io.RawIOBase):
    """The archive as a seekable file whose reads are ranged reads."""

    def __init__(self, read: ReadRange, length: int) -> None:
        self._read, self._length, self._position = read, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        end = min(self._length, self._position + len(buffer))
        if end <= self._position:
            return 0
        data = self._read(self._position, end)
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)


def read_slice(
    read: ReadRange, length: int, offsets: Sequence[int], lengths: Sequence[int]
) -> Any | None:
    """The slice ``[offsets, offsets + lengths)`` of the tensor stored in the
    ``length``-byte archive, as a new tensor; None when the archive is not a
    layout this reads (the caller loads it whole)."""
    try:
        return _read_slice(read, length, list(offsets), list(lengths))
    except (
        _Unsupported,
        zipfile.BadZipFile,
        pickle.UnpicklingError,
        EOFError,
        KeyError,
        ValueError,
        struct.error,
    ):
        return None


HEAD_BYTES = 4096


def _from_head(read: ReadRange, length: int) -> tuple[_TensorRef, int, int] | None:
    """(tensor, data start, storage bytes) from the archive's first bytes:
    ``torch.save`` writes ``data.pkl`` first and the storages' records right
    after a few tiny ones, so the directory at the end (often another chunk)
    need not be read. None when the head does not look like that."""
    head = read(0, min(length, HEAD_BYTES))
    if len(head) < 30 or head[:4] != b"PK\x03\x04":
        return None
    fields = _LOCAL_HEADER.unpack(head[:30])
    name = head[30 : 30 + fields[10]].decode("utf-8", "replace")
    archive, _, record = name.partition("/")
    if record != "data.pkl" or fields[4] != zipfile.ZIP_STORED:
        return None
    start = 30 + fields[10] + fields[11]
    stream = io.BytesIO(head[start:])
    ref = _RefUnpickler(stream).load_ref()  # leaves the stream just after the pickle
    # The storage's record: the first local header after the pickle naming it.
    wanted = f"{archive}/data/{ref.storage.key}".encode()
    position = start + stream.tell()
    while (position := head.find(b"PK\x03\x04", position)) >= 0 and position + 30 <= len(head):
        fields = _LOCAL_HEADER.unpack(head[position : position + 30])
        if head[position + 30 : position + 30 + fields[10]] == wanted:
            if fields[4] != zipfile.ZIP_STORED:
                return None
            data_start = position + 30 + fields[10] + fields[11]
            element = _element_size(ref.storage.dtype)
            storage_bytes = ref.storage.numel * element
            if data_start + storage_bytes > length:
                return None
            return ref, data_start, storage_bytes
        position += 4
    return None


def _from_directory(read: ReadRange, length: int) -> tuple[_TensorRef, int, int]:
    """(tensor, data start, storage bytes) through the zip directory at the end."""
    archive = _ArchiveFile(read, length)
    with zipfile.ZipFile(archive) as zipped:
        entries = {info.filename.split("/", 1)[-1]: info for info in zipped.infolist()}
        ref = _RefUnpickler(zipped.read(entries["data.pkl"])).load_ref()
        record = entries[f"data/{ref.storage.key}"]
    if record.compress_type != zipfile.ZIP_STORED:
        raise _Unsupported("compressed record")
    header = _LOCAL_HEADER.unpack(read(record.header_offset, record.header_offset + 30))
    if header[0] != b"PK\x03\x04":
        raise _Unsupported("no local header")
    return ref, record.header_offset + 30 + header[10] + header[11], record.file_size


def _element_size(dtype: Any) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _read_slice(read: ReadRange, length: int, offsets: list[int], lengths: list[int]) -> Any:
    import torch

    located = _from_head(read, length) or _from_directory(read, length)
    ref, data_start, storage_bytes = located
    if len(ref.size) != len(lengths) or any(s < 0 for s in ref.stride):
        raise _Unsupported("another shape or a negative stride")
    element = _element_size(ref.storage.dtype)
    if any(n == 0 for n in lengths):
        return torch.empty(lengths, dtype=ref.storage.dtype)
    if any(o < 0 or o + n > s for o, n, s in zip(offsets, lengths, ref.size, strict=True)):
        raise _Unsupported("slice outside the stored tensor")
    first = ref.offset + sum(o * s for o, s in zip(offsets, ref.stride, strict=True))
    last = ref.offset + sum(
        (o + n - 1) * s for o, n, s in zip(offsets, lengths, ref.stride, strict=True)
    )
    if (last + 1) * element > storage_bytes:
        raise _Unsupported("slice outside the stored record")
    data = bytearray(read(data_start + first * element, data_start + (last + 1) * element))
    flat = torch.frombuffer(data, dtype=ref.storage.dtype)
    return flat.as_strided(lengths, ref.stride, 0).clone()
