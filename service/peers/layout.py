"""Where a peer copy lives on the receiving node: ``<first T0 root>/.peers/``.

``<root>/.peers/<run>/step-<step>/rank-<rank>/<file path>``, received into a
hidden sibling ``.rank-<rank>.partial`` and renamed into place whole at
commit, as a trainer's own save appears on T0: all or nothing. Every name in
it comes from the catalog (run names and file paths were validated at
registration); ``confined`` checks once more that a path stays inside.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import BadInput

PEERS_DIR = ".peers"


def peers_root(roots: list[Path]) -> Path:
    return Path(roots[0]) / PEERS_DIR


def copy_dir(roots: list[Path], run: str, step: int, rank: int) -> Path:
    return peers_root(roots) / run / f"step-{step}" / f"rank-{rank}"


def partial_dir(final: Path) -> Path:
    return final.with_name(f".{final.name}.partial")


def confined(base: Path, relative: str) -> Path:
    """``base / relative``, refused unless it stays under ``base``."""
    # The raw segments: PurePosixPath would quietly fold "a//b" and "./a".
    parts = relative.split("/")
    if any(p in ("", ".", "..") for p in parts) or "\x00" in relative:
        raise BadInput(f"invalid file path {relative[:200]!r}", code="invalid_path")
    return base.joinpath(*parts)
