"""An answer read whole lets go of its stream: a call leaves no garbage cycle.

httpx (0.28) wraps every response's stream in one that points back at the
response (to set ``elapsed`` when it closes): a reference cycle per request,
and about 45 objects of httpx and httpcore hang off it (the request, its
headers and URL, the pool's request with its event, condition and lock).
Reference counting cannot free a cycle; only Python's cyclic collector can,
and it runs in the caller's process, which is the trainer's. Each call thus
moved the trainer about 1/15 of the way to a young-generation collection,
every tenth of those is an older one, and the oldest walks the trainer's
whole heap (tens of milliseconds with a framework loaded): a pause that
lands inside whichever call, or training step, happens to trigger it
(the benchmark's slowest register calls were mostly these).

Every API call reads its answer whole, so once ``request`` returns the body
is in memory and the stream closed (``elapsed`` set): replacing the stream
with an empty one breaks the cycle, and the call's objects are freed by
reference counting as soon as its answer has been parsed.
"""

from __future__ import annotations

import httpx

# Stateless: one empty stream serves every answer, sync and async.
_EMPTY = httpx.ByteStream(b"")


def detached(response: httpx.Response) -> httpx.Response:
    """``response``, no longer referenced by its own (closed) stream."""
    if response.is_closed:
        response.stream = _EMPTY
    return response
