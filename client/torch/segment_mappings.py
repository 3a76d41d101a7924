"""The trainer's shared mappings of memory-tier segment files, kept across saves.

A copy into a mapping whose pages are populated costs what a bare memcpy
does; mapping a 2 GB file anew (building its page tables) costs as much
again, and writing into a file's holes (allocating and zeroing its pages)
several times that. The agent recycles a freed segment's files
(service/memory/spares.py), so the same inodes come back save after save:
a mapping kept by inode turns every later copy into the bare memcpy.

Two ways a mapping comes to exist:

* **At a save** (:meth:`Mappings.target`), for a fully allocated file not
  mapped yet. The save pays the mapping.
* **Ahead of the save** (:meth:`Mappings.prepare`): when a registration
  hands back the segment reserved for the next save, its files are mapped
  in a background thread at niceness 19 and their page tables filled
  (which also allocates the pages of a new, sparse file). Without it a
  run's saves 1–3 wrote into new pages and saves 4–6 mapped the recycled
  ones, each at 2–10× the copy; with it, from the second save on, the save
  finds its files mapped. The next save waits for a preparation still
  running (it would do the same work itself).

  The page tables are filled with ``madvise(MADV_POPULATE_WRITE)`` (Linux
  5.14), one 16 MiB chunk per call, not with ``MAP_POPULATE``: that holds
  the process's memory-map lock for the whole file, and any ``mmap`` or
  ``munmap`` of the training loop meanwhile (a large tensor allocated or
  freed) waited for it, up to 2 s for a new 2 GB file. A chunk holds it for
  milliseconds. Where the call is missing (older kernels) or fails (a full
  tmpfs), the mapping is given up and the save maps the file itself.

A mapping is only written within the file's current size, and only when the
file has no holes (checked at each save: ``target``). A preparation on a
full tmpfs leaves holes (the call fails where a store would raise SIGBUS);
the save then finds them and writes with ``pwrite``, which fails with
ENOSPC, and the trainer stages on T0 instead.

A kept mapping pins its file's pages: if the agent deletes the file (to
make room) the pages stay allocated until the trainer's next saves drop the
mapping, at most ``KEEP`` segments' worth per trainer, plus the one prepared.
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
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
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
    """Shared mappings of the segment files a trainer wrote in its last
    ``KEEP`` saves, by inode. Three: with the next save's segment reserved
    as the last one is staged, three sets of files take turns (the newest
    kept on T0's behalf, the one staged, the one reserved ahead), each
    coming back every third save.

    Not thread-safe (one checkpointer's saves are sequential); the
    preparation's thread only maps, and its mappings join ``_maps`` on the
    caller's thread (:meth:`_settle`)."""

    KEEP = 3

    def __init__(self) -> None:
        # (dev, inode) -> (its own descriptor, the mapping, a view of it)
        self._maps: dict[Key, tuple[int, mmap.mmap, torch.Tensor]] = {}
        self._recent: list[set[Key]] = []
        self._preparing: threading.Thread | None = None
        self._prepared: list[tuple[Key, int, mmap.mmap]] = []

    def target(self, fd: int, size: int, used: set[Key]) -> torch.Tensor | None:
        """A uint8 tensor over the first ``size`` bytes of open file ``fd``,
        or None when the file has holes (write it with pwrite)."""
        self._settle()
        info = os.fstat(fd)
        if size == 0 or info.st_size < size or info.st_blocks * 512 < size:
            return None
        key = (info.st_dev, info.st_ino)
        if not self._holds(key, size):
            self._drop(key)
            mapping = mmap.mmap(fd, info.st_size, flags=mmap.MAP_SHARED | _POPULATE)
            self._keep(key, os.dup(fd), mapping)
        used.add(key)
        return self._maps[key][2][:size]

    def saved(self, used: set[Key]) -> None:
        """One save done: keep the mappings of the last ``KEEP`` saves."""
        self._settle()
        self._recent = [*self._recent, used][-self.KEEP :]
        alive = set().union(*self._recent)
        for key in [k for k in self._maps if k not in alive]:
            self._drop(key)

    def prepare(self, directory: Path, sizes: Mapping[str, int]) -> None:
        """Map the files of ``directory`` (the segment reserved for the next
        save; ``sizes``: the files written in place and the sizes that save
        will write) that no kept mapping covers, in a background thread."""
        self._settle()
        todo: list[tuple[Key, int, int]] = []
        for name, size in sizes.items():
            try:
                fd = os.open(directory / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:  # gone already (reclaimed): the save finds out
                continue
            info = os.fstat(fd)
            key = (info.st_dev, info.st_ino)
            if size == 0 or info.st_size < size or self._holds(key, size):
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
        self._settle()
        for key in list(self._maps):
            self._drop(key)
        self._recent = []

    def _map_all(self, todo: list[tuple[Key, int, int]]) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREPARE_NICE)
        except OSError:  # not permitted here: it runs at the trainer's
            pass
        for key, fd, length in todo:
            try:
                mapping = mmap.mmap(fd, length, flags=mmap.MAP_SHARED)
            except (OSError, ValueError):  # the save maps it, or writes it, itself
                os.close(fd)
                continue
            if populate(mapping):
                self._prepared.append((key, fd, mapping))
            else:  # as if not prepared: the save maps it (or writes the holes) itself
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
            self._drop(key)
            self._keep(key, fd, mapping)

    def _holds(self, key: Key, size: int) -> bool:
        """A kept mapping of ``key`` at least ``size`` long, whose file is
        still linked. The kept descriptor holds the inode, so its number is
        not given to another file while it is kept."""
        found = self._maps.get(key)
        return found is not None and len(found[1]) >= size and os.fstat(found[0]).st_nlink > 0

    def _keep(self, key: Key, fd: int, mapping: mmap.mmap) -> None:
        self._maps[key] = (fd, mapping, torch.frombuffer(mapping, dtype=torch.uint8))

    def _drop(self, key: Key) -> None:
        found = self._maps.pop(key, None)
        if found is None:
            return
        kept, mapping, view = found
        del view, found
        os.close(kept)
        try:
            mapping.close()
        except BufferError:  # a view is still referenced: the collector unmaps it
            pass
