"""The sync and async API clients: request shapes, error mapping, wait()."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import httpx
import pytest

from tierckpt.client import (
    AsyncCheckpointClient,
    AuthError,
    BadRequestError,
    Checkpoint,
    CheckpointClient,
    CheckpointFailedError,
    CheckpointRef,
    ConflictError,
    NotFoundError,
    ServerError,
    TierckptError,
)

try:
    from test_client_fakeapi import BASE_URL, FakeApi, error
except ImportError:  # tests/unit collected as a package
    from .test_client_fakeapi import BASE_URL, FakeApi, error


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answering(response: httpx.Response) -> httpx.MockTransport:
    return httpx.MockTransport(lambda request: response)


@pytest.fixture
def fake() -> FakeApi:
    return FakeApi()


@pytest.fixture
def client(fake: FakeApi):
    with CheckpointClient(BASE_URL, transport=fake.transport()) as client:
        yield client


# -- error mapping ------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, BadRequestError),
        (401, AuthError),
        (403, AuthError),
        (404, NotFoundError),
        (409, ConflictError),
        (422, BadRequestError),
        (500, ServerError),
        (503, ServerError),
    ],
)
def test_error_answers_map_to_exception_classes(status, cls):
    transport = answering(error(status, "some_code", "what to do"))
    with CheckpointClient(BASE_URL, transport=transport, retries=0) as client:
        with pytest.raises(cls) as caught:
            client.get("run", 1)
    assert type(caught.value) is cls
    assert (caught.value.code, caught.value.message, caught.value.status) == (
        "some_code",
        "what to do",
        status,
    )


def test_conflict_and_auth_are_bad_requests():
    assert issubclass(ConflictError, BadRequestError)
    assert issubclass(AuthError, BadRequestError)
    assert not issubclass(NotFoundError, BadRequestError)


def test_fastapi_detail_bodies_still_give_a_message():
    body = {"detail": [{"loc": ["body", "step"], "msg": "must be >= 0"}]}
    with CheckpointClient(BASE_URL, transport=answering(httpx.Response(422, json=body))) as c:
        with pytest.raises(BadRequestError, match=r"body\.step: must be >= 0"):
            c.get("run", 1)


def test_non_json_gateway_error_is_a_server_error():
    transport = answering(httpx.Response(502, text="<html>Bad Gateway</html>"))
    with CheckpointClient(BASE_URL, transport=transport) as client:
        with pytest.raises(ServerError, match="HTTP 502") as caught:
            client.get("run", 1)
    assert caught.value.status == 502


def test_garbled_success_answer_is_a_server_error():
    with CheckpointClient(BASE_URL, transport=answering(httpx.Response(200, text="ok"))) as c:
        with pytest.raises(ServerError) as caught:
            c.get("run", 1)
    assert caught.value.code == "bad_response"


def test_nothing_listening_is_a_server_error():
    with CheckpointClient(f"http://127.0.0.1:{closed_port()}", timeout=2, retries=0) as client:
        with pytest.raises(ServerError) as caught:
            client.runs()
    assert caught.value.code == "unreachable"


async def test_timeout_is_a_server_error():
    def hang(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("read timed out", request=request)

    async with AsyncCheckpointClient(BASE_URL, transport=httpx.MockTransport(hang)) as client:
        with pytest.raises(ServerError) as caught:
            await client.get("run", 1)
    assert caught.value.code == "timeout"
    assert isinstance(caught.value, TierckptError)


# -- requests and parsing -----------------------------------------------------


def test_register_sends_absolute_path_and_parses_checkpoint(fake, client, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    checkpoint = client.register(
        "llama",
        1200,
        "step-1200",
        metrics={"val_loss": 1.5},
        parent=1100,
        priority="urgent",
        files={"model.bin": "ab" * 32},
    )
    body = json.loads(fake.requests[-1].content)
    assert body["path"] == os.path.join(str(tmp_path), "step-1200")
    assert body["parent"] == {"run": "llama", "step": 1100}
    assert body["files"] == [{"path": "model.bin", "sha256": "ab" * 32}]
    assert body["priority"] == "urgent"
    assert "epoch" not in body  # unset optionals are not sent as null
    assert isinstance(checkpoint, Checkpoint)
    assert (checkpoint.run, checkpoint.step, checkpoint.state) == ("llama", 1200, "registered")
    assert checkpoint.parent == CheckpointRef(run="llama", step=1100)
    assert checkpoint.metrics == {"val_loss": 1.5}


def test_register_twice_with_other_content_conflicts(client):
    client.register("llama", 1, "/ssd/a")
    assert client.register("llama", 1, "/ssd/a").step == 1
    with pytest.raises(ConflictError) as caught:
        client.register("llama", 1, "/ssd/b")
    assert caught.value.code == "checkpoint_conflict"


def test_register_parent_forms(fake, client):
    client.register("b", 2, "/ssd/x", parent=("a", 7))
    assert json.loads(fake.requests[-1].content)["parent"] == {"run": "a", "step": 7}
    client.register("b", 3, "/ssd/y", parent=CheckpointRef(run="c", step=8))
    assert json.loads(fake.requests[-1].content)["parent"] == {"run": "c", "step": 8}


def test_get_ignores_unknown_fields(fake, client):
    fake.add_checkpoint("llama", 5, {"a.bin": b"abc"})
    checkpoint = client.get("llama", 5)
    assert checkpoint.files[0].size == 3
    assert checkpoint.replicas[0].state == "committed"
    assert not hasattr(checkpoint, "future_field")


def test_latest_returns_none_on_404_and_locations_otherwise(fake, client):
    assert client.latest("llama") is None
    fake.add_checkpoint("llama", 5, {"a.bin": b"abc"})
    fake.add_checkpoint("llama", 9, {"a.bin": b"abc"}, state="uploading")
    latest = client.latest("llama", node="node-a")
    assert latest is not None
    assert latest.step == 5
    assert [loc.region for loc in latest.locations] == ["east", "west"]
    assert latest.local is not None and latest.local.path == "/ssd/local/copy"
    assert fake.requests[-1].url.params["node"] == "node-a"


def test_list_and_runs(fake, client):
    for step in (1, 2, 3):
        fake.add_checkpoint("llama", step, {"a.bin": b"x"})
    fake.add_checkpoint("gpt", 7, {"a.bin": b"x"})
    listed = client.list_checkpoints("llama", limit=2, state="durable")
    assert [c.step for c in listed] == [3, 2]
    assert fake.requests[-1].url.params["state"] == "durable"
    assert "min_step" not in fake.requests[-1].url.params
    runs = client.runs()
    assert {(r.run, r.latest_step) for r in runs} == {("llama", 3), ("gpt", 7)}


def test_bearer_token_is_sent():
    fake = FakeApi(token="s3cret")
    fake.add_checkpoint("llama", 1, {"a.bin": b"x"})
    with CheckpointClient(BASE_URL, transport=fake.transport()) as anonymous:
        with pytest.raises(AuthError):
            anonymous.get("llama", 1)
    with CheckpointClient(BASE_URL, token="s3cret", transport=fake.transport()) as client:
        assert client.get("llama", 1).step == 1
    assert fake.requests[-1].headers["authorization"] == "Bearer s3cret"


async def test_async_client_has_the_same_calls(fake):
    fake.add_checkpoint("llama", 4, {"a.bin": b"x"})
    async with AsyncCheckpointClient(BASE_URL, transport=fake.transport()) as client:
        registered = await client.register("llama", 5, "/ssd/llama/5", world_size=2)
        assert registered.world_size == 2
        assert (await client.get("llama", 4)).state == "durable"
        assert [c.step for c in await client.list_checkpoints("llama")] == [5, 4]
        assert (await client.latest("llama")).step == 4
        assert [r.run for r in await client.runs()] == ["llama"]
        with pytest.raises(NotFoundError):
            await client.get("llama", 99)


# -- wait ---------------------------------------------------------------------


def test_wait_returns_at_the_first_state_at_least_the_target(fake, client):
    fake.add_checkpoint("llama", 1, {"a.bin": b"x"})
    fake.state_script[("llama", 1)] = ["registered", "uploading", "durable"]
    reached = client.wait("llama", 1, state="uploading", poll_interval=0.001)
    assert reached.state == "uploading"
    reached = client.wait("llama", 1, poll_interval=0.001)
    assert reached.state == "durable"


async def test_wait_accepts_a_later_state_than_asked(fake):
    fake.add_checkpoint("llama", 1, {"a.bin": b"x"})
    fake.state_script[("llama", 1)] = ["registered", "replicated"]
    async with AsyncCheckpointClient(BASE_URL, transport=fake.transport()) as client:
        reached = await client.wait("llama", 1, state="durable", poll_interval=0.001)
    assert reached.state == "replicated"
    assert len([r for r in fake.requests if r.url.path.endswith("/checkpoints/1")]) == 2


@pytest.mark.parametrize("final", ["failed", "corrupt", "deleted"])
def test_wait_raises_when_the_checkpoint_fails(fake, client, final):
    fake.add_checkpoint("llama", 1, {"a.bin": b"x"})
    fake.state_script[("llama", 1)] = ["uploading", final]
    with pytest.raises(CheckpointFailedError) as caught:
        client.wait("llama", 1, state="replicated", poll_interval=0.001)
    assert caught.value.checkpoint.state == final
    if final == "failed":
        assert "changed during upload" in caught.value.message


async def test_wait_times_out(fake):
    fake.add_checkpoint("llama", 1, {"a.bin": b"x"}, state="uploading")
    async with AsyncCheckpointClient(BASE_URL, transport=fake.transport()) as client:
        with pytest.raises(TimeoutError, match="still uploading"):
            await client.wait("llama", 1, timeout=0.05, poll_interval=0.01)
    polls = [r for r in fake.requests if r.url.path.endswith("/checkpoints/1")]
    assert 2 <= len(polls) <= 20


def test_wait_rejects_unknown_target_and_missing_checkpoint(client):
    with pytest.raises(ValueError, match="state must be one of"):
        client.wait("llama", 1, state="committed")
    with pytest.raises(NotFoundError):
        client.wait("llama", 1)


# -- packaging ----------------------------------------------------------------


def test_importing_the_client_does_not_import_the_service_stack():
    code = (
        "import sys, tierckpt.client, tierckpt.client.cli; "
        "heavy = [m for m in ('fastapi', 'sqlalchemy', 'aioboto3', 'torch', 'tierckpt.service') "
        "if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("status", [429, 503])
def test_busy_answers_are_retried_with_backoff(status, monkeypatch):
    import time as time_module

    waits: list[float] = []
    monkeypatch.setattr(time_module, "sleep", waits.append)
    answers = iter([error(status, "busy", "later"), error(status, "busy", "later")])

    def handler(request: httpx.Request) -> httpx.Response:
        nxt = next(answers, None)
        if nxt is not None:
            return nxt
        return httpx.Response(200, json={"runs": [], "total": 0})

    with CheckpointClient(BASE_URL, transport=httpx.MockTransport(handler), retries=3) as client:
        assert client.runs() == []
    assert len(waits) == 2 and waits[1] > waits[0] > 0


def test_retries_stop_after_the_budget(monkeypatch):
    import time as time_module

    waits: list[float] = []
    monkeypatch.setattr(time_module, "sleep", waits.append)
    transport = answering(error(503, "catalog_unavailable", "retry shortly"))
    with CheckpointClient(BASE_URL, transport=transport, retries=2) as client:
        with pytest.raises(ServerError):
            client.runs()
    assert len(waits) == 2


def test_a_release_without_retry_is_one_attempt(monkeypatch):
    """What a checkpointer gives back as training ends is asked once: an
    agent gone or busy then reclaims it by its lease, and the trainer does
    not wait through the retries' backoff to exit."""
    import time as time_module

    waits: list[float] = []
    monkeypatch.setattr(time_module, "sleep", waits.append)
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(f"{request.method} {request.url.path}")
        return error(503, "draining", "the agent is draining")

    with CheckpointClient(BASE_URL, transport=httpx.MockTransport(handler), retries=3) as client:
        with pytest.raises(ServerError):
            client.release_segment("seg-1", retry=False)
        assert asked == ["DELETE /v1/memory/segments/seg-1"] and waits == []
        with pytest.raises(ServerError):
            client.release_segment("seg-1")
        assert len(asked) == 1 + 4 and len(waits) == 3
