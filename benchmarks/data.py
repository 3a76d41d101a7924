"""The checkpoint files every variant uploads: written once, shared by hard links."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

from tierckpt.client._files import fsync_file

MiB = 1024 * 1024
KiB = 1024


@dataclass(frozen=True)
class Dataset:
    root: Path  # the directory holding the files
    files: list[tuple[str, int]]  # (relative path, size), in path order

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)

    @property
    def large(self) -> list[tuple[str, int]]:
        return [f for f in self.files if f[1] >= 8 * MiB]

    def describe(self) -> dict[str, object]:
        large = self.large
        return {
            "total_bytes": self.total_bytes,
            "file_count": len(self.files),
            "large_files": [size for _, size in large],
            "small_files": len(self.files) - len(large),
            "small_bytes": self.total_bytes - sum(size for _, size in large),
        }


def layout(quick: bool, seed: int = 20261122) -> list[tuple[str, int]]:
    """A few large files (weights, optimizer state) plus ~100 small ones
    (configs, tokenizer, per-layer metadata), sizes log-uniform 4 KiB-1 MiB."""
    if quick:
        large = [("model/weights-00001.bin", 96 * MiB), ("model/weights-00002.bin", 64 * MiB)]
        large.append(("optim/state.bin", 80 * MiB))
    else:
        large = [(f"model/weights-{i:05d}.bin", 256 * MiB) for i in range(1, 3)]
        large += [("optim/state-00001.bin", 320 * MiB), ("optim/state-00002.bin", 128 * MiB)]
    rng = random.Random(seed)
    small = [(f"meta/layer-{i:03d}.json", int(4 * KiB * (256 ** rng.random()))) for i in range(100)]
    return sorted(large + small)


def write_random(path: Path, size: int, chunk: int = 8 * MiB) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        remaining = size
        while remaining:
            data = os.urandom(min(remaining, chunk))
            handle.write(data)
            remaining -= len(data)


def make_dataset(root: Path, quick: bool) -> Dataset:
    files = layout(quick)
    for relative, size in files:
        write_random(root / relative, size)
    for relative, _ in files:
        # On disk before any scenario: the writeback of a gigabyte written
        # just now would otherwise land in the first scenarios' timings (the
        # catalog's fsyncs queue behind it), a start-up transient of the
        # benchmark, not anything the agent did.
        fsync_file(root / relative)
    return Dataset(root=root, files=files)


def link_copy(dataset: Dataset, target: Path) -> Dataset:
    """The same files under another directory, as hard links: the same bytes
    (and page cache), yet every registered step owns its own directory, so
    nothing the agent might do with one step's files touches another's."""
    for relative, _ in dataset.files:
        destination = target / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        os.link(dataset.root / relative, destination)
    return Dataset(root=target, files=dataset.files)


def sparse_file(path: Path, size: int) -> Path:
    """A file of `size` bytes that occupies (almost) no disk: like `truncate -s`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb"):
        pass
    os.truncate(path, size)
    return path
