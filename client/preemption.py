"""Know in time that the machine is being taken away, and save then.

:class:`PreemptionGuard` is a context manager for a training loop. While it
is active it

- traps SIGTERM and SIGUSR1 (what Kubernetes, Slurm ``--signal`` and most
  schedulers send before killing a job) instead of dying on them, and puts
  the previous handlers back on exit;
- optionally polls a cloud spot/preemption notice in a background thread:
  AWS (``/latest/meta-data/spot/instance-action``: 200 with a JSON body once
  a notice is pending, 404 before; IMDSv2 token when the server offers one)
  or GCP (``/computeMetadata/v1/instance/preempted``: ``TRUE``/``FALSE``,
  with the ``Metadata-Flavor: Google`` header). The URL is configurable, so
  tests and unusual setups point it at their own server.

Nothing is saved from a signal handler or the polling thread: they only
record the notice. The loop checks :attr:`PreemptionGuard.preempted` after
each step and saves with ``priority="urgent"``, which the agent uploads
before the normal work already queued::

    with PreemptionGuard(notice_url=AWS_SPOT_URL) as guard:
        for step in ...:
            train_step()
            if guard.preempted:
                checkpointer.save(step, priority="urgent", wait_durable=60)
                break

Needs no PyTorch; only httpx (already a client dependency) for polling.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from types import FrameType
from typing import Any, Literal, Self
from urllib.parse import urlsplit

import httpx

from ._closing import ClosesOnExit

log = logging.getLogger("tierckpt.client.preemption")

AWS_SPOT_URL = "http://169.254.169.254/latest/meta-data/spot/instance-action"
GCP_PREEMPTED_URL = "http://metadata.google.internal/computeMetadata/v1/instance/preempted"
DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)

NoticeFormat = Literal["auto", "aws", "gcp"]
_SignalHandler = Callable[[int, FrameType | None], Any] | int | None


@dataclass(frozen=True)
class Notice:
    """Why the guard says "save now"."""

    source: str  # "signal", "aws", "gcp" or "manual"
    detail: str  # "SIGTERM", "terminate at 2026-11-22T11:02:00Z", …
    received_at: float  # time.monotonic() when it was seen
    deadline: datetime | None = None  # when the cloud will take the machine, if it said


def format_of(url: str) -> Literal["aws", "gcp"]:
    """The metadata dialect of ``url``: GCP's lives under ``/computeMetadata/``."""
    return "gcp" if "/computeMetadata/" in urlsplit(url).path else "aws"


def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    with contextlib.suppress(ValueError):
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    return None


class _Poller:
    """One HTTP probe of a notice URL; keeps the IMDSv2 token between probes."""

    TOKEN_TTL = 21600

    def __init__(self, url: str, dialect: Literal["aws", "gcp"], timeout: float) -> None:
        self.url = url
        self.dialect = dialect
        # trust_env=False: an HTTP(S)_PROXY must never see link-local metadata calls.
        self.http = httpx.Client(timeout=timeout, trust_env=False, follow_redirects=False)
        self._token: str | None = None
        self._token_expires = 0.0
        self._imds_v1 = False  # the server offered no token: plain GETs

    def close(self) -> None:
        self.http.close()

    def _aws_token(self) -> str | None:
        if self._imds_v1:
            return None
        if self._token is not None and time.monotonic() < self._token_expires:
            return self._token
        parts = urlsplit(self.url)
        try:
            answer = self.http.put(
                f"{parts.scheme}://{parts.netloc}/latest/api/token",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.TOKEN_TTL)},
            )
        except httpx.HTTPError:
            return None  # the GET below reports the outage
        if answer.status_code != 200 or not answer.text.strip():
            self._imds_v1 = True
            return None
        self._token = answer.text.strip()
        self._token_expires = time.monotonic() + self.TOKEN_TTL / 2
        return self._token

    def probe(self) -> Notice | None:
        """A notice if one is pending; None if not; raises httpx.HTTPError or
        ValueError when the server cannot be asked or answers nonsense."""
        if self.dialect == "gcp":
            answer = self.http.get(self.url, headers={"Metadata-Flavor": "Google"})
            answer.raise_for_status()
            value = answer.text.strip().upper()
            if value == "TRUE":
                return Notice("gcp", "instance preempted", time.monotonic())
            if value == "FALSE":
                return None
            raise ValueError(f"unexpected answer {answer.text[:60]!r}")
        token = self._aws_token()
        headers = {"X-aws-ec2-metadata-token": token} if token else {}
        answer = self.http.get(self.url, headers=headers)
        if answer.status_code == 401 and token:
            self._token = None  # expired or revoked: a new one next time
        if answer.status_code == 404:
            return None
        answer.raise_for_status()
        try:
            body = json.loads(answer.text)
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        action = str(body.get("action") or "terminate")
        when = body.get("time")
        detail = f"{action} at {when}" if when else action
        return Notice("aws", detail, time.monotonic(), _parse_time(when))


class PreemptionGuard(ClosesOnExit):
    """Trap preemption signals and poll a spot-termination notice; see the module doc.

    ``signals``: trapped while active (default SIGTERM and SIGUSR1; ``()`` to
    only poll, e.g. outside the main thread). ``notice_url``: poll it every
    ``poll_interval`` seconds (``AWS_SPOT_URL``, ``GCP_PREEMPTED_URL`` or
    your own); ``notice_format`` picks the dialect ("auto": from the path).
    """

    def __init__(
        self,
        signals: Iterable[signal.Signals | int] = DEFAULT_SIGNALS,
        *,
        notice_url: str | None = None,
        notice_format: NoticeFormat = "auto",
        poll_interval: float = 5.0,
        timeout: float = 2.0,
    ) -> None:
        if poll_interval <= 0 or timeout <= 0:
            raise ValueError("poll_interval and timeout must be > 0")
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.notice_url = notice_url
        self.format: Literal["aws", "gcp"] | None = None
        if notice_url is not None:
            self.format = format_of(notice_url) if notice_format == "auto" else notice_format
        self.poll_interval = poll_interval
        self.timeout = timeout
        self._event = threading.Event()
        self._stop = threading.Event()
        self._notice: Notice | None = None
        self._lock = threading.Lock()
        self._previous: dict[signal.Signals, _SignalHandler] = {}
        self._thread: threading.Thread | None = None
        self._active = False

    # -- state -------------------------------------------------------------------

    @property
    def preempted(self) -> bool:
        """True once a notice arrived (and for the rest of the guard's life)."""
        return self._event.is_set()

    @property
    def notice(self) -> Notice | None:
        return self._notice

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a notice arrives (True) or ``timeout`` passes (False)."""
        return self._event.wait(timeout)

    def trigger(self, detail: str = "requested", source: str = "manual") -> None:
        """Record a notice from elsewhere (an orchestrator hook, a test)."""
        self._record(Notice(source, detail, time.monotonic()))

    def _record(self, notice: Notice) -> None:
        with self._lock:
            if self._notice is None:
                self._notice = notice
        self._event.set()

    # -- signals -----------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # Only record: the loop decides when to save. No logging here (not
        # reentrant-safe while the main thread may hold the logging lock).
        name = signal.Signals(signum).name
        if self._notice is None:
            self._notice = Notice("signal", name, time.monotonic())
        self._event.set()

    def _install_signals(self) -> None:
        if not self.signals:
            return
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "PreemptionGuard traps signals, which Python only allows in the main thread; "
                "enter it there, or pass signals=() to only poll a notice URL"
            )
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def _restore_signals(self) -> None:
        for sig, previous in self._previous.items():
            # None: the handler was not installed from Python; the default is
            # the closest thing to put back.
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    # -- polling -----------------------------------------------------------------

    def _poll_loop(self, poller: _Poller) -> None:
        failures = 0
        try:
            while not self._stop.is_set():
                try:
                    notice = poller.probe()
                except (httpx.HTTPError, ValueError) as exc:
                    failures += 1
                    # Once loudly, then quietly: a missing metadata server
                    # must not flood the training log.
                    level = logging.WARNING if failures == 1 else logging.DEBUG
                    log.log(level, "preemption notice %s not readable: %s", poller.url, exc)
                else:
                    failures = 0
                    if notice is not None:
                        log.warning("preemption notice (%s): %s", notice.source, notice.detail)
                        self._record(notice)
                        return
                self._stop.wait(self.poll_interval)
        except Exception:  # a bug here must not kill the process silently
            log.exception("preemption notice polling stopped")
        finally:
            poller.close()

    # -- context manager -----------------------------------------------------------

    def __enter__(self) -> Self:
        if self._active:
            raise RuntimeError("PreemptionGuard is already active")
        self._install_signals()
        self._active = True
        if self.notice_url is not None and self.format is not None:
            self._stop.clear()
            poller = _Poller(self.notice_url, self.format, self.timeout)
            self._thread = threading.Thread(
                target=self._poll_loop, args=(poller,), name="tierckpt-preemption", daemon=True
            )
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop polling and put the previous signal handlers back."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout + 1.0)
            self._thread = None
        if self._active:
            self._restore_signals()
            self._active = False
