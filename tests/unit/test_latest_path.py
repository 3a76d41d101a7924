"""The `latest` fast path (latest_path.py) answers a good request itself, and
the read's own refusals and outages as the route would; everything else goes,
untouched, to the FastAPI route that words those errors. The catalog read is
replaced by a fake here; the integration tests (test_latest_catalog,
test_auth_api, test_catalog_outage) run the real one."""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from tierckpt.service.checkpoints import latest_path
from tierckpt.service.checkpoints.latest_path import LatestFastPath, _query
from tierckpt.service.config import TokenSettings
from tierckpt.service.errors import BadInput, NotFound

TOKENS = [
    TokenSettings(name="readers", sha256=hashlib.sha256(b"r-secret").hexdigest(), runs="llama-*")
]
ANSWER = b'{"run":"llama-7b","step":7}'


class Inner:
    """The rest of the app: records that the request was passed on."""

    def __init__(self) -> None:
        self.called = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.called += 1
        await send({"type": "http.response.start", "status": 599, "headers": []})
        await send({"type": "http.response.body", "body": b"route"})


def _scope(
    path: str = "/v1/runs/llama-7b/latest",
    query: bytes = b"",
    token: bytes | None = b"r-secret",
    method: str = "GET",
    tokens: list[TokenSettings] | None = None,
) -> dict[str, Any]:
    resources = SimpleNamespace(
        settings=SimpleNamespace(tokens=TOKENS if tokens is None else tokens)
    )
    headers = [(b"host", b"agent")]
    if token is not None:
        headers.append((b"authorization", b"Bearer " + token))
    return {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": query,
        "headers": headers,
        "app": SimpleNamespace(state=SimpleNamespace(resources=resources)),
    }


async def _call(scope: dict[str, Any]) -> tuple[Inner, list[dict[str, Any]]]:
    inner = Inner()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await LatestFastPath(inner)(scope, receive, send)
    return inner, sent


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None, str | None]]:
    calls: list[tuple[str, str | None, str | None]] = []

    async def fake(resources: Any, run: str, region: str | None, node: str | None) -> bytes:
        calls.append((run, region, node))
        return ANSWER

    monkeypatch.setattr(latest_path, "latest_json", fake)
    return calls


async def test_a_good_request_is_answered_below_the_routing(asked: list[Any]) -> None:
    scope = _scope(query=b"region=east&node=n-1")
    inner, sent = await _call(scope)
    assert inner.called == 0
    assert asked == [("llama-7b", "east", "n-1")]
    start, body = sent
    assert start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"content-length"] == str(len(ANSWER)).encode()
    assert body["body"] == ANSWER
    # The request metrics label it as the route would.
    assert scope["route"].path == "/v1/runs/{run}/latest"


@pytest.mark.parametrize(
    "scope",
    [
        _scope(token=None),  # no token: the route answers 401
        _scope(token=b"wrong"),  # 401
        _scope(path="/v1/runs/gpt-2/latest"),  # outside the token's runs: 403
        _scope(path="/v1/runs/bad name/latest"),  # invalid run name: 422
        _scope(path="/v1/runs/../latest"),
        _scope(query=b"region=east&region=west"),  # ambiguous
        _scope(query=b"colour=red"),  # not ours: the route decides
        _scope(query=b"region"),  # malformed
        _scope(query=b"node=" + b"n" * 600),  # longer than any client sends
        _scope(method="POST"),
        _scope(path="/v1/runs/llama-7b/checkpoints"),
    ],
)
async def test_anything_else_is_passed_on_untouched(
    scope: dict[str, Any], asked: list[Any]
) -> None:
    inner, sent = await _call(scope)
    assert inner.called == 1
    assert sent[0]["status"] == 599
    if scope["path"].endswith("/latest") and scope["method"] == "GET":
        assert "route" not in scope


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (NotFound("run 'llama-7b' has no valid checkpoint yet", code="no_valid_checkpoint"), 404),
        (BadInput("unknown region 'mars'", code="unknown_region"), 400),
    ],
)
async def test_refusals_of_the_read_are_answered_once_as_the_route_words_them(
    error: Exception, status: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A young run's `latest` is a 404 until its first checkpoint is durable:
    the route would read the catalog again only to refuse the same way."""
    calls = 0

    async def refusing(*_args: Any) -> bytes:
        nonlocal calls
        calls += 1
        raise error

    monkeypatch.setattr(latest_path, "latest_json", refusing)
    scope = _scope()
    inner, sent = await _call(scope)
    assert inner.called == 0 and calls == 1
    assert sent[0]["status"] == status
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert body == {"error": {"code": error.code, "message": error.message}}  # type: ignore[attr-defined]
    assert scope["route"].path == "/v1/runs/{run}/latest"


async def test_an_unexpected_error_of_the_read_is_left_to_the_route(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def failing(*_args: Any) -> bytes:
        raise RuntimeError("a bug: the route logs it and answers 500")

    monkeypatch.setattr(latest_path, "latest_json", failing)
    inner, _sent = await _call(_scope())
    assert inner.called == 1


async def test_a_catalog_outage_is_answered_once_not_asked_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = 0

    async def outage(*_args: Any) -> bytes:
        nonlocal calls
        calls += 1
        raise OperationalError("SELECT", {}, ConnectionRefusedError("refused"))

    monkeypatch.setattr(latest_path, "latest_json", outage)
    inner, sent = await _call(_scope())
    assert inner.called == 0 and calls == 1
    assert sent[0]["status"] == 503
    assert dict(sent[0]["headers"])[b"retry-after"] == b"2"
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert body["error"]["code"] == "catalog_unavailable"


async def test_no_tokens_configured_means_the_loopback_admin(asked: list[Any]) -> None:
    inner, sent = await _call(_scope(token=None, tokens=[]))
    assert inner.called == 0 and sent[0]["status"] == 200


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"", {}),
        (b"region=east", {"region": "east"}),
        (b"region=east&node=a%2Fb", {"region": "east", "node": "a/b"}),
        (b"node=", {"node": ""}),
        (b"region=a&region=b", None),
        (b"other=1", None),
        (b"&&", None),
    ],
)
def test_query(raw: bytes, expected: dict[str, str] | None) -> None:
    assert _query(raw) == expected
