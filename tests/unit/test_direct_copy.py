"""The memory tier's T0 copy around the page cache (service/memory/direct_copy.py):
the same bytes at every size around the block grid, direct where the
filesystem allows it, through the page cache where not."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierckpt.service.memory import direct_copy

SIZES = [0, 1, 4095, 4096, 4097, direct_copy.CHUNK, 2 * direct_copy.CHUNK + 12_345]


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    """Where segments live: /dev/shm (tmpfs) when there is one."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path / "segments"
        return
    directory = shm / f"tierckpt-test-{os.getpid()}-{tmp_path.name}"
    directory.mkdir()
    try:
        yield directory
    finally:
        for path in directory.iterdir():
            path.unlink()
        directory.rmdir()


def _copy(source: Path, destination: Path) -> bool:
    """Copy as persist.copy_file does; whether the write was direct."""
    src = os.open(source, os.O_RDONLY)
    try:
        dst = direct_copy.create(destination)
        try:
            direct = direct_copy.is_direct(dst)
            direct_copy.copy(src, dst, source.stat().st_size)
            os.fsync(dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    return direct


@pytest.mark.parametrize("size", SIZES)
def test_the_copy_holds_the_same_bytes(size: int, shm_dir: Path, tmp_path: Path) -> None:
    shm_dir.mkdir(exist_ok=True)
    source = shm_dir / f"segment-{size}.bin"
    data = os.urandom(size)
    source.write_bytes(data)
    (tmp_path / "t0").mkdir()
    target = tmp_path / "t0" / "model.safetensors"
    _copy(source, target)
    assert target.read_bytes() == data
    # Onto the tmpfs too (direct or not, as that kernel's tmpfs allows).
    again = shm_dir / f"copy-{size}.bin"
    _copy(source, again)
    assert again.read_bytes() == data


def test_the_copy_to_t0_is_direct_where_the_filesystem_allows_it(
    shm_dir: Path, tmp_path: Path
) -> None:
    shm_dir.mkdir(exist_ok=True)
    source = shm_dir / "segment.bin"
    source.write_bytes(os.urandom(3 * 4096 + 7))
    probe = tmp_path / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | direct_copy._DIRECT, 0o644))
    except OSError:
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    assert _copy(source, tmp_path / "direct.bin")
    assert (tmp_path / "direct.bin").read_bytes() == source.read_bytes()


def test_an_existing_file_is_never_overwritten(tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.write_bytes(b"the user's")
    with pytest.raises(FileExistsError):
        direct_copy.create(target)
    assert target.read_bytes() == b"the user's"
