"""client/_dcp_slices.py: part of a torch.save'd tensor from a few ranged reads."""

from __future__ import annotations

import io
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tierckpt.client import _dcp_slices  # noqa: E402


def archive(tensor: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


TENSORS = {
    "view of a larger storage": lambda: torch.arange(120.0).reshape(10, 12)[2:],
    "bfloat16": lambda: torch.randn(64, 33).to(torch.bfloat16),
    "int64 vector": lambda: torch.arange(50, dtype=torch.int64),
    "transposed": lambda: torch.randn(300, 200).t(),
}


@pytest.mark.parametrize("name", TENSORS)
def test_slices_equal_torch_load_and_read_little(name: str) -> None:
    tensor = TENSORS[name]()
    data = archive(tensor)
    reads: list[tuple[int, int]] = []

    def read(start: int, end: int) -> bytes:
        reads.append((start, end))
        return data[start:end]

    # Found from the head; the directory at the end gives the same answer.
    assert _dcp_slices._from_head(read, len(data)) == _dcp_slices._from_directory(read, len(data))
    dims = tensor.dim()
    for offsets, lengths in (
        ([1] + [0] * (dims - 1), [3, *tensor.shape[1:]]),
        ([2] * dims, [3] * dims),
        ([0] * dims, list(tensor.shape)),
        ([0] * dims, [0] * dims),
    ):
        reads.clear()
        got = _dcp_slices.read_slice(read, len(data), offsets, lengths)
        expected = tensor[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))]
        assert got is not None and torch.equal(got, expected)
        # The head (at most 4 KiB) and the bytes spanning the slice, no more.
        assert reads[0] == (0, min(len(data), _dcp_slices.HEAD_BYTES))
        element = tensor.element_size()
        spanned = sum(e - s for s, e in reads[1:])
        assert spanned <= max(1, expected.numel()) * element * max(tensor.stride()), reads


def test_anything_else_is_left_to_torch_load() -> None:
    def read_from(data: bytes) -> Any:
        return lambda start, end: data[start:end]

    assert _dcp_slices.read_slice(read_from(b"x" * 100), 100, [0], [1]) is None
    # A pickle with another global than a tensor's: refused, nothing runs.
    data = archive({"not": "a tensor"})
    assert _dcp_slices.read_slice(read_from(data), len(data), [0], [1]) is None
    data = archive(torch.arange(4.0))
    assert _dcp_slices.read_slice(read_from(data), len(data), [3], [2]) is None  # out of range
