"""PreemptionGuard: signals trapped and given back, AWS and GCP notices polled
from a local HTTP server that answers like the metadata services."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tierckpt.client.preemption import PreemptionGuard, format_of


class Metadata:
    """What the fake metadata server answers; switched by the tests."""

    def __init__(self) -> None:
        self.pending = False
        self.imds_v2 = True
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.gcp_answer_override: str | None = None


@pytest.fixture
def metadata() -> Iterator[tuple[Metadata, str]]:
    state = Metadata()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, status: int, body: str, content_type: str = "text/plain") -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self) -> None:
            state.requests.append(("PUT", self.path, dict(self.headers)))
            if self.path == "/latest/api/token" and state.imds_v2:
                assert self.headers["X-aws-ec2-metadata-token-ttl-seconds"]
                self._send(200, "secret-token")
            else:
                self._send(404, "not found")

        def do_GET(self) -> None:
            state.requests.append(("GET", self.path, dict(self.headers)))
            if self.path == "/latest/meta-data/spot/instance-action":
                if state.imds_v2 and self.headers.get("X-aws-ec2-metadata-token") != "secret-token":
                    self._send(401, "")
                elif state.pending:
                    body = {"action": "terminate", "time": "2026-11-22T11:02:00Z"}
                    self._send(200, json.dumps(body), "application/json")
                else:
                    self._send(404, "<html>Not Found</html>", "text/html")
            elif self.path == "/computeMetadata/v1/instance/preempted":
                if self.headers.get("Metadata-Flavor") != "Google":
                    self._send(403, "Missing Metadata-Flavor:Google header.")
                elif state.gcp_answer_override is not None:
                    self._send(200, state.gcp_answer_override)
                else:
                    self._send(200, "TRUE" if state.pending else "FALSE")
            else:
                self._send(404, "")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _wait_until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# -- signals ------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_sets_the_flag_and_previous_handler_comes_back(sig: signal.Signals) -> None:
    seen: list[int] = []

    def previous(signum: int, frame: Any) -> None:
        seen.append(signum)

    original = signal.signal(sig, previous)
    try:
        with PreemptionGuard() as guard:
            assert not guard.preempted and guard.notice is None
            os.kill(os.getpid(), sig)
            assert guard.wait(5)
            assert guard.preempted
            assert guard.notice is not None
            assert (guard.notice.source, guard.notice.detail) == ("signal", sig.name)
            os.kill(os.getpid(), sig)  # a second one: still only the flag
        assert seen == []  # the guard had the signal, not the previous handler
        assert signal.getsignal(sig) is previous
        os.kill(os.getpid(), sig)
        _wait_until(lambda: seen == [sig])
        assert guard.preempted  # stays set after the guard is closed
    finally:
        signal.signal(sig, original)


def test_signal_handlers_restored_after_an_exception() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="boom"), PreemptionGuard():
        assert signal.getsignal(signal.SIGTERM) is not before
        raise RuntimeError("boom")
    assert signal.getsignal(signal.SIGTERM) is before


def test_only_the_requested_signals_are_trapped() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionGuard(signals=[signal.SIGUSR2]):
        assert signal.getsignal(signal.SIGUSR1) is before
        assert signal.getsignal(signal.SIGUSR2) is not before


def test_signals_need_the_main_thread_polling_does_not(metadata: tuple[Metadata, str]) -> None:
    state, base = metadata
    outcome: dict[str, Any] = {}

    def in_thread() -> None:
        try:
            PreemptionGuard().__enter__()
        except ValueError as exc:
            outcome["error"] = str(exc)
        with PreemptionGuard(
            signals=(),
            notice_url=f"{base}/computeMetadata/v1/instance/preempted",
            poll_interval=0.02,
        ) as guard:
            state.pending = True
            outcome["preempted"] = guard.wait(5)

    worker = threading.Thread(target=in_thread)
    worker.start()
    worker.join(10)
    assert "main thread" in outcome["error"] and "signals=()" in outcome["error"]
    assert outcome["preempted"] is True


def test_manual_trigger_and_reentry() -> None:
    guard = PreemptionGuard(signals=())
    with guard:
        guard.trigger("drain requested by the scheduler")
        guard.trigger("ignored: the first notice is kept")
        assert guard.preempted
        assert guard.notice is not None and guard.notice.detail.startswith("drain")
        with pytest.raises(RuntimeError, match="already active"):
            guard.__enter__()


# -- notices ------------------------------------------------------------------------


def test_aws_spot_notice_with_imdsv2_token(metadata: tuple[Metadata, str]) -> None:
    state, base = metadata
    url = f"{base}/latest/meta-data/spot/instance-action"
    with PreemptionGuard(signals=(), notice_url=url, poll_interval=0.02) as guard:
        assert guard.format == "aws"
        _wait_until(lambda: sum(1 for r in state.requests if r[0] == "GET") >= 3)
        assert not guard.preempted  # 404s: no notice yet
        state.pending = True
        assert guard.wait(5)
    assert guard.notice is not None
    assert guard.notice.source == "aws"
    assert guard.notice.detail == "terminate at 2026-11-22T11:02:00Z"
    assert guard.notice.deadline is not None and guard.notice.deadline.minute == 2
    puts = [r for r in state.requests if r[0] == "PUT"]
    assert len(puts) == 1  # the token is reused between polls
    assert all(r[2].get("X-aws-ec2-metadata-token") for r in state.requests if r[0] == "GET")


def test_aws_imdsv1_without_token(metadata: tuple[Metadata, str]) -> None:
    state, base = metadata
    state.imds_v2 = False
    state.pending = True
    url = f"{base}/latest/meta-data/spot/instance-action"
    with PreemptionGuard(signals=(), notice_url=url, poll_interval=0.02) as guard:
        assert guard.wait(5)
    assert guard.notice is not None and guard.notice.source == "aws"


def test_gcp_preempted_notice(metadata: tuple[Metadata, str]) -> None:
    state, base = metadata
    url = f"{base}/computeMetadata/v1/instance/preempted"
    assert format_of(url) == "gcp"
    with PreemptionGuard(signals=(), notice_url=url, poll_interval=0.02) as guard:
        _wait_until(lambda: len(state.requests) >= 3)
        assert not guard.preempted
        state.pending = True
        assert guard.wait(5)
    assert guard.notice is not None and guard.notice.source == "gcp"
    assert all(r[2].get("Metadata-Flavor") == "Google" for r in state.requests)


def test_unreachable_or_strange_notice_server_never_preempts(
    metadata: tuple[Metadata, str], caplog: pytest.LogCaptureFixture
) -> None:
    state, base = metadata
    state.gcp_answer_override = "MAYBE"
    with PreemptionGuard(
        signals=(),
        notice_url=f"{base}/computeMetadata/v1/instance/preempted",
        poll_interval=0.02,
    ) as guard:
        _wait_until(lambda: len(state.requests) >= 3)
        assert not guard.preempted
    # A closed port: connection refused on every poll, reported once as a warning.
    with PreemptionGuard(
        signals=(),
        notice_url=f"http://127.0.0.1:{closed_port()}/latest/meta-data/spot/instance-action",
        poll_interval=0.02,
        timeout=0.5,
    ) as guard:
        time.sleep(0.2)
        assert not guard.preempted
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2  # one per guard, not one per poll


def test_exit_stops_the_poller_promptly(metadata: tuple[Metadata, str]) -> None:
    _, base = metadata
    guard = PreemptionGuard(
        signals=(), notice_url=f"{base}/latest/meta-data/spot/instance-action", poll_interval=60
    )
    with guard:
        thread = guard._thread
        assert thread is not None and thread.is_alive()
    began = time.monotonic()
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - began < 2


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        PreemptionGuard(poll_interval=0)
    with pytest.raises(ValueError):
        PreemptionGuard(signals=[99999])
