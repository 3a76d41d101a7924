"""Staging a training state in the agent's memory tier.

The files are those :func:`.checkpoint_dir.write_state` writes, byte for
byte (the agent copies them to T0 as they are: no second encoding), but
written into a segment the agent reserved in its arena (a tmpfs):

* the safetensors files are laid out here, header first (8-byte
  little-endian length, then the JSON header padded with spaces to a
  multiple of 8) and each tensor's bytes written straight from the tensor's
  memory with ``pwrite`` (no intermediate ``bytes``), in safetensors' own
  order (dtype, widest first, then name), so ``safetensors.torch.load_file``
  reads them and they equal ``save_file``'s output
  (tests/unit/test_memory_stage.py holds the two together);
* ``state.json`` and ``objects.pt`` are small and written as usual.

Sizes are known before anything is written, so the reservation is exact.

The agent hands out every file at its size, a new sparse file. A file the
checkpointer prepared (mapped, its pages allocated, in the background after
the save before: segment_mappings.py) is written through that shared
mapping; any other with ``pwrite``: on a tmpfs out of room that fails with
ENOSPC (the trainer then writes to T0), where a store into a mapping would
kill the trainer with SIGBUS.
"""

from __future__ import annotations

import io
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint_dir import (
    MODEL_FILE,
    OBJECTS_FILE,
    SAFETENSORS_METADATA,
    STATE_FILE,
    TENSORS_FILE,
    EncodedState,
)
from .segment_mappings import Mappings

# safetensors' dtype names, in the order it writes tensors (widest first;
# within a dtype by name).
DTYPE_ORDER: tuple[tuple[str, str], ...] = (
    ("U64", "uint64"),
    ("I64", "int64"),
    ("F64", "float64"),
    ("C64", "complex64"),
    ("F32", "float32"),
    ("U32", "uint32"),
    ("I32", "int32"),
    ("BF16", "bfloat16"),
    ("F16", "float16"),
    ("U16", "uint16"),
    ("I16", "int16"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("I8", "int8"),
    ("U8", "uint8"),
    ("BOOL", "bool"),
)
DTYPES: dict[torch.dtype, tuple[int, str]] = {
    getattr(torch, attr): (rank, name)
    for rank, (name, attr) in enumerate(DTYPE_ORDER)
    if hasattr(torch, attr)
}
# One pwrite moves at most this much (Linux moves at most ~2 GiB per call).
MAX_WRITE = 1 << 30


@dataclass(frozen=True)
class SafetensorsLayout:
    header: bytes  # length prefix + padded JSON
    tensors: list[tuple[int, torch.Tensor]]  # (offset in the file, contiguous CPU tensor)
    size: int


def safetensors_layout(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> SafetensorsLayout:
    """Where every tensor goes in the file ``save_file`` would write."""
    entries = []
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors name")
        entries.append((DTYPES[tensor.dtype][0], name, tensor))
    entries.sort(key=lambda e: (e[0], e[1].encode()))
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    placed: list[tuple[int, torch.Tensor]] = []
    offset = 0
    for _rank, name, tensor in entries:
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": DTYPES[tensor.dtype][1],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        placed.append((offset, tensor))
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    return SafetensorsLayout(
        header=prefix,
        tensors=[(len(prefix) + at, t) for at, t in placed],
        size=len(prefix) + offset,
    )


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor over its own memory (a
    copy only for a GPU or non-contiguous tensor)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.contiguous().view(torch.uint8)


def _raw(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as a buffer over its own memory (no copy)."""
    return memoryview(_flat_bytes(tensor).numpy()).cast("B")  # type: ignore[arg-type]


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done : done + MAX_WRITE], offset + done)
        if n <= 0:
            raise OSError(f"short write at offset {offset + done}")
        done += n


@dataclass
class StagedFiles:
    """What goes into a segment: each file's size, and how to write it."""

    layouts: dict[str, SafetensorsLayout]
    small: dict[str, bytes]  # state.json
    objects: dict[str, object] | None

    @classmethod
    def of(cls, encoded: EncodedState) -> StagedFiles:
        layouts = {TENSORS_FILE: safetensors_layout(encoded.state_tensors, SAFETENSORS_METADATA)}
        if encoded.model_tensors is not None:
            layouts[MODEL_FILE] = safetensors_layout(encoded.model_tensors, SAFETENSORS_METADATA)
        return cls(
            layouts=layouts, small={STATE_FILE: encoded.skeleton.encode()}, objects=encoded.objects
        )

    def sizes(self) -> dict[str, int]:
        sizes = {name: layout.size for name, layout in self.layouts.items()}
        sizes.update({name: len(data) for name, data in self.small.items()})
        if self.objects is not None:
            # torch.save names the archive after the file ("objects/…"); into a
            # buffer it says "archive/…": as long, so the size is the same.
            buffer = io.BytesIO()
            torch.save(self.objects, buffer)
            sizes[OBJECTS_FILE] = len(buffer.getvalue())
        return sizes

    def write(self, directory: Path, mappings: Mappings | None = None) -> None:
        """Write every file into ``directory`` (the segment's: the agent
        created each file at its size), through ``mappings`` where it can."""
        used: set[tuple[int, int]] = set()
        for name, layout in self.layouts.items():
            fd = os.open(directory / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                target = mappings.target(fd, layout.size, used) if mappings else None
                if target is None:
                    _pwrite_all(fd, memoryview(layout.header), 0)
                    for offset, tensor in layout.tensors:
                        if tensor.numel():
                            _pwrite_all(fd, _raw(tensor), offset)
                else:
                    header = torch.frombuffer(bytearray(layout.header), dtype=torch.uint8)
                    target[: len(layout.header)].copy_(header)
                    for offset, tensor in layout.tensors:
                        if tensor.numel():
                            raw = _flat_bytes(tensor)
                            target[offset : offset + raw.numel()].copy_(raw)
                    del target
            finally:
                os.close(fd)
        if mappings is not None:
            mappings.saved(used)
        for name, data in self.small.items():
            (directory / name).write_bytes(data)
        if self.objects is not None:
            torch.save(self.objects, directory / OBJECTS_FILE)
