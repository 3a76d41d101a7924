"""The benchmark's floor for one HTTP call (benchmarks/empty_server.py): a
real uvicorn process that answers every request empty, and is gone, with
its session, when the context ends."""

from __future__ import annotations

import os

import httpx
import pytest

from benchmarks.empty_server import empty_server


def test_answers_every_call_empty_and_stops_with_its_context() -> None:
    with empty_server() as url:
        with httpx.Client(base_url=url, trust_env=False) as http:
            posted = http.post("/v1/checkpoints", json={"run": "r", "step": 1})
            fetched = http.get("/anything/at/all")
        assert (posted.status_code, posted.json()) == (200, {})
        assert (fetched.status_code, fetched.json()) == (200, {})
        port = httpx.URL(url).port
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/", timeout=2, trust_env=False)


def test_a_large_body_is_read_to_its_end() -> None:
    body = os.urandom(1 << 20)  # more than one receive() of the server
    with empty_server() as url, httpx.Client(base_url=url, trust_env=False) as http:
        for _ in range(3):  # the connection stays usable: nothing left unread
            answer = http.post("/upload", content=body)
            assert answer.json() == {}
