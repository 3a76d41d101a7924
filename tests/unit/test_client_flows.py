"""The client flows without a network: each is a generator of I/O requests
that the sync and the async driver carry out the same way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tierckpt.client import ServerError
from tierckpt.client._core import ClientCore
from tierckpt.client._effects import Effect, Http, Sleep, drive, drive_async

BASE_URL = "http://agent.test"


def core(retries: int = 3) -> ClientCore:
    return ClientCore(BASE_URL, None, 30.0, retries, None, None)


def scripted(answers: list[Any], seen: list[Effect]) -> Callable[[Effect], Any]:
    """Answers each Http request with the next of ``answers`` (raising it
    when it is an exception); records every request."""

    def perform(request: Effect) -> Any:
        seen.append(request)
        if not isinstance(request, Http):
            return None
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return perform


def busy_then_empty() -> list[Any]:
    return [
        httpx.Response(503, headers={"Retry-After": "0"}),
        httpx.ConnectError("refused"),
        httpx.Response(200, json={"runs": [], "total": 0}),
    ]


def test_send_retries_busy_answers_and_refused_connections_with_backoff() -> None:
    seen: list[Effect] = []
    assert drive(core()._runs(), scripted(busy_then_empty(), seen)) == []
    kinds = [type(request) for request in seen]
    assert kinds == [Http, Sleep, Http, Sleep, Http]
    first, second = (request.seconds for request in seen if isinstance(request, Sleep))
    assert second > first > 0


async def test_the_async_driver_makes_the_same_requests() -> None:
    synced: list[Effect] = []
    drive(core()._runs(), scripted(busy_then_empty(), synced))
    awaited: list[Effect] = []
    perform = scripted(busy_then_empty(), awaited)

    async def perform_async(request: Effect) -> Any:
        return perform(request)

    assert await drive_async(core()._runs(), perform_async) == []
    assert [shown(request) for request in awaited] == [shown(request) for request in synced]


def shown(request: Effect) -> tuple[Any, ...]:
    if isinstance(request, Http):
        return ("http", request.call.method, request.call.path, request.call.params)
    return (request,)


def test_a_refused_connection_past_the_budget_is_a_server_error() -> None:
    seen: list[Effect] = []
    answers: list[Any] = [httpx.ConnectError("refused")] * 2
    with pytest.raises(ServerError) as raised:
        drive(core(retries=1)._runs(), scripted(answers, seen))
    assert raised.value.code == "unreachable"
    assert [type(request) for request in seen] == [Http, Sleep, Http]
