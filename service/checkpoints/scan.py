"""List a checkpoint directory at registration, without reading any content.

Only names, sizes and mtimes are taken (one ``lstat`` per entry), so register
answers in milliseconds whatever the checkpoint's size. The walk is confined:
the path must resolve under a configured local root, symlinks may not leave
that root, and FIFOs, sockets and devices are refused by name (opening a FIFO
would hang the agent).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput

_FORBIDDEN_CHARS = {chr(c) for c in range(32)} | {"\x7f", "\\"}


class ScanTooLarge(Exception):
    """More entries than the caller allowed for a scan on the event loop."""


@dataclass(frozen=True)
class ScannedFile:
    path: str  # relative, '/'-separated
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class ScannedShard:
    directory: Path
    files: list[ScannedFile]
    is_directory: bool = True

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def root_of(resolved: Path, roots: list[Path]) -> Path | None:
    """The local root (resolved) that ``resolved`` lies in, or None: the
    path confinement every checkpoint directory and segment target obeys."""
    for root in roots:
        real_root = Path(os.path.realpath(root))
        if resolved == real_root or resolved.is_relative_to(real_root):
            return real_root
    return None


def check_name(relative: str, max_path_length: int) -> None:
    """BadInput for a file name the catalog and the regions cannot hold."""
    if len(relative.encode()) > max_path_length:
        raise BadInput(
            f"file path {relative[:80]!r}… is longer than {max_path_length} bytes",
            code="path_too_long",
        )
    if any(ch in _FORBIDDEN_CHARS for ch in relative):
        raise BadInput(
            f"file name {relative!r} contains a control character or backslash; rename it",
            code="invalid_file_name",
        )
    try:
        relative.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadInput(
            f"file name {relative.encode('utf-8', 'surrogateescape')!r} is not valid UTF-8",
            code="invalid_file_name",
        ) from exc


def scan(
    path: str,
    roots: list[Path],
    *,
    max_files: int,
    max_path_length: int,
    max_entries: int | None = None,
) -> ScannedShard:
    """List ``path`` (a file or a directory tree) under ``roots``.

    With ``max_entries``, a directory with more entries than that raises
    ``ScanTooLarge`` as soon as it is seen to: the caller scans small
    checkpoints inline and hands large ones to a thread.
    """
    if "\x00" in path or len(path.encode("utf-8", "surrogateescape")) > max_path_length:
        raise BadInput("path is too long or contains a NUL byte", code="invalid_path")
    candidate = Path(path)
    if not candidate.is_absolute():
        raise BadInput(f"path {path!r} must be absolute", code="path_not_absolute")
    resolved = Path(os.path.realpath(candidate))
    root = root_of(resolved, roots)
    if root is None:
        allowed = ", ".join(str(r) for r in roots)
        raise BadInput(
            f"path {path} resolves to {resolved}, outside the local roots this agent may read "
            f"({allowed})",
            code="path_outside_roots",
        )
    try:
        info = os.stat(resolved)
    except FileNotFoundError as exc:
        raise BadInput(f"path {path} does not exist on this node", code="path_not_found") from exc
    except OSError as exc:
        raise BadInput(
            f"path {path} cannot be read: {exc.strerror}", code="path_unreadable"
        ) from exc

    if stat.S_ISREG(info.st_mode):
        check_name(resolved.name, max_path_length)
        return ScannedShard(
            directory=resolved.parent,
            files=[ScannedFile(resolved.name, info.st_size, info.st_mtime_ns)],
            is_directory=False,
        )
    if not stat.S_ISDIR(info.st_mode):
        raise BadInput(f"path {path} is not a regular file or directory", code="special_file")

    files: list[ScannedFile] = []
    stack = [resolved]
    seen = 0
    while stack:
        directory = stack.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError as exc:
            raise BadInput(
                f"cannot list {directory}: {exc.strerror}", code="path_unreadable"
            ) from exc
        seen += len(entries)
        if max_entries is not None and seen > max_entries:
            raise ScanTooLarge(path)
        for entry in entries:
            full = Path(entry.path)
            relative = full.relative_to(resolved).as_posix()
            check_name(relative, max_path_length)
            entry_info = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(entry_info.st_mode):
                target = Path(os.path.realpath(full))
                if root_of(target, [root]) is None:
                    raise BadInput(
                        f"{relative} is a symlink to {target}, outside the local root {root}",
                        code="symlink_outside_roots",
                    )
                try:
                    entry_info = os.stat(target)
                except FileNotFoundError as exc:
                    raise BadInput(
                        f"{relative} is a dangling symlink", code="dangling_symlink"
                    ) from exc
                if stat.S_ISDIR(entry_info.st_mode):
                    raise BadInput(
                        f"{relative} is a symlink to a directory; link the files instead",
                        code="symlinked_directory",
                    )
            if stat.S_ISDIR(entry_info.st_mode):
                stack.append(full)
            elif stat.S_ISREG(entry_info.st_mode):
                files.append(ScannedFile(relative, entry_info.st_size, entry_info.st_mtime_ns))
                if len(files) > max_files:
                    raise BadInput(
                        f"more than {max_files} files in {path}; pack small files or raise "
                        "[local].max_files_per_checkpoint",
                        code="too_many_files",
                    )
            else:
                raise BadInput(
                    f"{relative} is not a regular file (FIFO, socket or device); remove it from "
                    "the checkpoint directory",
                    code="special_file",
                )
    if not files:
        raise BadInput(f"{path} contains no files", code="empty_checkpoint")
    files.sort(key=lambda f: f.path)
    return ScannedShard(directory=resolved, files=files)
