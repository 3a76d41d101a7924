"""Small files written whole or not at all: a scratch sibling, renamed into
place. A kill -9 at any moment leaves the old file or the new one, never a
part (what was written is in the page cache); surviving a power loss would
take an fsync on top, which these callers (the memory arena's segment
states) do not pay for on their hot path.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any


def write_atomically(path: Path, text: str) -> None:
    scratch = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    try:
        with open(scratch, "w") as fh:
            fh.write(text)
        os.rename(scratch, path)
    except OSError:
        scratch.unlink(missing_ok=True)
        raise


def write_json_atomically(path: Path, value: Any) -> None:
    write_atomically(path, json.dumps(value, sort_keys=True))


def read_json(path: Path) -> Any:
    """The JSON in ``path``, or None when there is no such file."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
