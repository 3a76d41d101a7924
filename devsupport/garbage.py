"""What Python's cyclic collector finds: tests that a call leaves no cycle.

The collector runs in the caller's process, the trainer's: whatever a
client call leaves in a reference cycle brings the trainer's next
collection closer, and the oldest generation's walks its whole heap.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

# The client and its HTTP stack; anything else in a test process (pytest's
# own objects) is not the calls'.
CLIENT_MODULES = ("httpx", "httpcore", "h11", "tierckpt", "anyio", "asyncio", "pydantic")


@contextmanager
def cyclic_garbage() -> Iterator[Counter[str]]:
    """Counts, by type, of what the cyclic collector finds after the block."""
    found: Counter[str] = Counter()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield found
        gc.collect()
        found.update(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def of_the_client(found: Counter[str]) -> Counter[str]:
    """What the client and its HTTP stack left, of what the collector found."""
    return Counter({name: n for name, n in found.items() if name.startswith(CLIENT_MODULES)})
