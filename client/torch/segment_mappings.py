"""The trainer's shared mapping of the segment reserved for its next save.

The agent gives every reservation new, sparse files (it never hands one
segment's files to another: service/memory/arena.py). Writing into a new
file's holes (allocating and zeroing its pages) costs the trainer several
times the copy itself, so when a registration hands back the segment
reserved for the next save, its files are mapped in a background thread at
niceness 19 and their pages allocated (:meth:`Mappings.prepare`). The next
save then copies into pages that exist: the cost of a bare memcpy. A save
that comes while the preparation still runs waits for it (it would do the
same work itself); a file not prepared is written with ``pwrite``.

The pages are allocated with ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14),
one 16 MiB chunk per call, not with ``MAP_POPULATE``: that holds the
process's memory-map lock for the whole file, and any ``mmap`` or ``munmap``
of the training loop meanwhile (a large tensor allocated or freed) waited
for it, up to 2 s for a new 2 GB file. A chunk holds it for milliseconds.
Where the call is missing (older kernels) or fails (a full tmpfs), the
mapping is given up and the save writes the file with ``pwrite``, which
fails with ENOSPC on a full tmpfs (where a store into a mapping would raise
SIGBUS), and the trainer stages on T0 instead.

Once its save is done a segment's files are never written again, so its
mappings are dropped then, unmapped in a background thread (a large
mapping takes tens of milliseconds to tear down): a trainer never keeps a
mapping of a file the agent may free.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

Key = tuple[int, int]  # (st_dev, st_ino)
# The preparation's niceness: it runs while the trainer trains and the agent
# uploads; neither should wait for it.
PREPARE_NICE = 19
MADV_POPULATE_WRITE = 23  # <linux/mman.h>, all architectures
POPULATE_CHUNK = 16 << 20


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise through ctypes, which releases the GIL during the call."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise  # type: ignore[no-any-return]


_MADVISE = _libc_madvise()


def populate(mapping: mmap.mmap) -> bool:
    """Fill ``mapping``'s page tables for writing, allocating any missing
    pages, a chunk per call; False when it could not (no such call here,
    or no room for a page)."""
    if _MADVISE is None:
        return False
    exported = ctypes.c_char.from_buffer(mapping)
    base = ctypes.addressof(exported)
    del exported  # the address stays valid as long as the mapping
    for offset in range(0, len(mapping), POPULATE_CHUNK):
        length = min(POPULATE_CHUNK, len(mapping) - offset)
        if _MADVISE(base + offset, length, MADV_POPULATE_WRITE) != 0:
            return False
    return True


class Mappings:
    """The mappings of the segment prepared for the next save, by inode.

    Not thread-safe (one checkpointer's saves are sequential); the
    preparation's thread only maps, and its mappings join ``_maps`` on the
    caller's thread (:meth:`_settle`)."""

    def __init__(self) -> None:
        # (dev, inode) -> (its own descriptor, the mapping, a view of it)
        self._maps: dict[Key, tuple[int, mmap.mmap, torch.Tensor]] = {}
        self._preparing: threading.Thread | None = None
        self._prepared: list[tuple[Key, int, mmap.mmap]] = []
        self._unmapping: threading.Thread | None = None

    def target(self, fd: int, size: int, used: set[Key]) -> torch.Tensor | None:
        """A uint8 tensor over the first ``size`` bytes of open file ``fd``
        when it was prepared, or None (write it with pwrite)."""
        self._settle()
        info = os.fstat(fd)
        key = (info.st_dev, info.st_ino)
        found = self._maps.get(key)
        if size == 0 or found is None or info.st_size < size or len(found[1]) < size:
            return None
        used.add(key)
        return found[2][:size]

    def saved(self, used: set[Key]) -> None:
        """One save done: its files are never written again, so every
        mapping goes (``used`` is the save's; any other is stale)."""
        del used
        self._settle()
        self._drop_all()

    def prepare(self, directory: Path, sizes: Mapping[str, int]) -> None:
        """Map the files of ``directory`` (the segment reserved for the next
        save; ``sizes``: the files written in place and the sizes that save
        will write) and allocate their pages, in a background thread."""
        self._settle()
        todo: list[tuple[Key, int, int]] = []
        for name, size in sizes.items():
            try:
                fd = os.open(directory / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:  # gone already (reclaimed): the save finds out
                continue
            info = os.fstat(fd)
            key = (info.st_dev, info.st_ino)
            if size == 0 or info.st_size < size or key in self._maps:
                os.close(fd)
                continue
            todo.append((key, fd, info.st_size))
        if todo:
            thread = threading.Thread(
                target=self._map_all, args=(todo,), name="tierckpt-prepare-segment", daemon=True
            )
            self._preparing = thread
            thread.start()

    def close(self) -> None:
        """Unmap everything before returning: a thread still unmapping while
        the interpreter exits would free tensors under its finalization."""
        self._settle()
        self._drop_all()
        self._join_unmapping()

    def _join_unmapping(self) -> None:
        thread, self._unmapping = self._unmapping, None
        if thread is not None:
            thread.join()

    def _map_all(self, todo: list[tuple[Key, int, int]]) -> None:
        _lower_priority()
        for key, fd, length in todo:
            try:
                mapping = mmap.mmap(fd, length, flags=mmap.MAP_SHARED)
            except (OSError, ValueError):  # the save writes it itself
                os.close(fd)
                continue
            if populate(mapping):
                self._prepared.append((key, fd, mapping))
            else:  # as if not prepared: the save writes it (holes and all) with pwrite
                mapping.close()
                os.close(fd)

    def _settle(self) -> None:
        """Wait for a preparation still running; its mappings join the kept ones."""
        thread, self._preparing = self._preparing, None
        if thread is None:
            return
        thread.join()
        prepared, self._prepared = self._prepared, []
        for key, fd, mapping in prepared:
            self._maps[key] = (fd, mapping, torch.frombuffer(mapping, dtype=torch.uint8))

    def _drop_all(self) -> None:
        if not self._maps:
            return
        dropped = list(self._maps.values())
        self._maps.clear()
        self._join_unmapping()  # one at a time (the last one is long done)
        self._unmapping = threading.Thread(
            target=_unmap, args=(dropped,), name="tierckpt-unmap-segment", daemon=True
        )
        self._unmapping.start()


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREPARE_NICE)
    except OSError:  # not permitted here: it runs at the trainer's
        pass


def _unmap(dropped: list[tuple[int, mmap.mmap, torch.Tensor]]) -> None:
    _lower_priority()
    while dropped:
        fd, mapping, view = dropped.pop()
        del view
        os.close(fd)
        try:
            mapping.close()
        except BufferError:  # a view is still referenced: the collector unmaps it
            pass
