"""The names the service accepts for runs and regions, written once.

A name is 1-128 of [A-Za-z0-9._-] and neither "." nor "..": a run name
becomes a path segment of every object key built from it, a region name a
label and a URI part, and "." or ".." as a segment would leave its prefix
(a POSIX region would write outside its root). Run names never contain ","
or ":", which the catalog relies on to pack children into one column
(checkpoints/repository.py).

The checks are spelt per caller:

* `RUN_PATTERN` is a pattern for pydantic (`Field(pattern=...)`, the request
  bodies); "." and ".." are refused by `not_a_dot_segment` with their own
  message.
* `RUN_NAME` checks a run named in a URL path.
* `is_region_name` checks a configured region's name.

The compiled patterns end in ``\\Z``, not ``$``: with Python's ``re``, ``$``
also matches before a trailing newline, and "name\\n" in a URL would create
a run that no registration could name.
"""

from __future__ import annotations

import hashlib
import re

NAME_CHARS = r"[A-Za-z0-9._-]{1,128}"
DOT_SEGMENTS = (".", "..")
# How an invalid run name is explained to the caller.
RUN_NAME_RULE = "1-128 of A-Z a-z 0-9 . _ -, not '.' or '..'"

RUN_PATTERN = rf"^{NAME_CHARS}$"
NAME_PATTERN = re.compile(rf"^{NAME_CHARS}\Z")
RUN_NAME = re.compile(rf"^(?!\.{{1,2}}\Z){NAME_CHARS}\Z")


def not_a_dot_segment(run: str) -> str:
    """A pydantic field validator: refuses "." and ".." (they match the pattern)."""
    if run in DOT_SEGMENTS:
        raise ValueError("run must not be '.' or '..'")
    return run


def is_region_name(name: str) -> bool:
    return NAME_PATTERN.match(name) is not None and name not in DOT_SEGMENTS


def agent_directory_name(node: str, catalog_url: str) -> str:
    """One name per agent, for the directories only it writes (the memory
    arena, the registration inbox): its node and its catalog, so that two
    test agents on one machine, or one agent per catalog, never share one."""
    safe_node = re.sub(r"[^A-Za-z0-9._-]", "_", node)[:64]
    catalog = hashlib.sha256(catalog_url.encode()).hexdigest()[:10]
    return f"{safe_node}-{catalog}"
