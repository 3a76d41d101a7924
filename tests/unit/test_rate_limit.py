"""The token bucket and how the rate limiter names a caller."""

from __future__ import annotations

import hashlib

import pytest

from tierckpt.service.config import TokenSettings
from tierckpt.service.limits import RateLimit, TokenBuckets


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bucket_allows_a_burst_then_the_rate() -> None:
    clock = Clock()
    buckets = TokenBuckets(rate=2.0, burst=3, clock=clock)
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a") == pytest.approx(0.5)  # one token comes every 0.5 s
    assert buckets.take("b") == 0.0  # another caller has its own bucket
    clock.now += 0.5
    assert buckets.take("a") == 0.0
    assert buckets.take("a") > 0
    clock.now += 60  # refills up to the burst, not beyond
    assert [buckets.take("a") for _ in range(4)][-1] > 0


def test_bucket_keys_are_bounded() -> None:
    buckets = TokenBuckets(rate=1.0, burst=1, max_keys=3, clock=Clock())
    for key in "abcdef":
        buckets.take(key)
    assert len(buckets._buckets) == 3


def scope(authorization: str | None, client: str = "127.0.0.1") -> dict[str, object]:
    headers = [(b"authorization", authorization.encode())] if authorization else []
    return {"type": "http", "path": "/v1/runs", "headers": headers, "client": (client, 5000)}


async def _app(scope: object, receive: object, send: object) -> None:  # pragma: no cover
    raise AssertionError("not called")


def test_caller_is_the_configured_token_else_the_address() -> None:
    token = TokenSettings(name="t", sha256=hashlib.sha256(b"secret").hexdigest(), role="admin")
    limiter = RateLimit(_app, rate=1, burst=1, tokens=[token])
    assert limiter.caller(scope("Bearer secret")) == f"token:{token.sha256}"
    assert limiter.caller(scope("bearer secret", "10.0.0.9")) == f"token:{token.sha256}"
    # Unknown tokens do not get a bucket each (that would be unbounded).
    assert limiter.caller(scope("Bearer guess-1", "10.0.0.9")) == "addr:10.0.0.9"
    assert limiter.caller(scope("Bearer guess-2", "10.0.0.9")) == "addr:10.0.0.9"
    assert limiter.caller(scope(None, "10.0.0.8")) == "addr:10.0.0.8"
    # No tokens configured (loopback admin): per client address.
    open_limiter = RateLimit(_app, rate=1, burst=1, tokens=[])
    assert open_limiter.caller(scope("Bearer secret", "127.0.0.2")) == "addr:127.0.0.2"
