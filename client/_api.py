"""Request building and response parsing shared by the sync and async clients.

Each endpoint is described once as a :class:`Call` (method, path, query, body
and a parser); the two clients only differ in how they send it. The wait
policy lives here for the same reason.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
from pydantic import ValidationError

from .errors import CheckpointFailedError, ServerError, error_from_response
from .models import (
    FAILED_STATES,
    STATE_ORDER,
    Advice,
    Checkpoint,
    CheckpointRef,
    Lineage,
    MemoryInfo,
    MemorySegment,
    Prefetch,
    PrefetchJob,
    RestorePlan,
    RunSummary,
)

T = TypeVar("T")

DEFAULT_URL = "http://127.0.0.1:8470"
USER_AGENT = "tierckpt-client/0.1"

ParentLike = CheckpointRef | tuple[str, int] | Mapping[str, Any] | int | None
FilesLike = Mapping[str, str] | Iterable[Mapping[str, Any]] | None


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    method: str
    path: str
    parse: Callable[[Any], T]
    params: dict[str, Any] | None = None
    body: Any = None
    # `latest` answers "none" with a 404; that is a result, not an error.
    none_on_404: bool = False


def _seg(value: str | int) -> str:
    return quote(str(value), safe="")


def _query(**params: Any) -> dict[str, Any]:
    return {k: v for k, v in params.items() if v is not None}


def _checkpoint(data: Any) -> Checkpoint:
    return Checkpoint.model_validate(data)


class _AutoParent:
    """Default of ``register(parent=…)``: the checkpoint this client restored
    last, if any (a resumed run descends from what it resumed from)."""

    def __repr__(self) -> str:
        return "AUTO_PARENT"


AUTO_PARENT = _AutoParent()


def lineage(run: str, step: int) -> Call[Lineage]:
    return Call(
        "GET",
        f"/v1/runs/{_seg(run)}/checkpoints/{_seg(step)}/lineage",
        Lineage.model_validate,
    )


def advice(
    run: str,
    mtbf_hours: float,
    *,
    cost_seconds: float | None = None,
    restart_seconds: float | None = None,
    window: int | None = None,
) -> Call[Advice]:
    params = _query(
        mtbf_hours=mtbf_hours,
        cost_seconds=cost_seconds,
        restart_seconds=restart_seconds,
        window=window,
    )
    return Call("GET", f"/v1/runs/{_seg(run)}/advice", Advice.model_validate, params=params)


def _parent(parent: ParentLike, run: str) -> dict[str, Any] | None:
    if parent is None:
        return None
    if isinstance(parent, CheckpointRef):
        return parent.model_dump()
    if isinstance(parent, int):
        # Bare step: the common case of a parent in the same run.
        return {"run": run, "step": parent}
    if isinstance(parent, tuple):
        parent_run, parent_step = parent
        return {"run": parent_run, "step": int(parent_step)}
    return {"run": parent["run"], "step": int(parent["step"])}


def _files(files: FilesLike) -> list[dict[str, Any]] | None:
    if files is None:
        return None
    if isinstance(files, Mapping):
        return [{"path": path, "sha256": sha} for path, sha in files.items()]
    return [dict(entry) for entry in files]


def register(
    run: str,
    step: int,
    path: str | os.PathLike[str],
    *,
    rank: int = 0,
    world_size: int = 1,
    metrics: Mapping[str, float] | None = None,
    parent: ParentLike = None,
    priority: str = "normal",
    epoch: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    files: FilesLike = None,
    write_seconds: float | None = None,
) -> Call[Checkpoint]:
    # The agent runs in another cwd, so a relative path would mean nothing to
    # it; symlinks are left for the service to resolve against local_roots.
    body: dict[str, Any] = {
        "run": run,
        "step": step,
        "path": os.path.abspath(os.fspath(path)),
        "rank": rank,
        "world_size": world_size,
        "priority": priority,
    }
    optional = {
        "epoch": epoch,
        "metrics": dict(metrics) if metrics is not None else None,
        "metadata": dict(metadata) if metadata is not None else None,
        "parent": _parent(parent, run),
        "files": _files(files),
        "write_seconds": write_seconds,
    }
    body.update(_query(**optional))
    return Call("POST", "/v1/checkpoints", _checkpoint, body=body)


def get(run: str, step: int) -> Call[Checkpoint]:
    return Call("GET", f"/v1/runs/{_seg(run)}/checkpoints/{_seg(step)}", _checkpoint)


def verify(run: str, step: int) -> Call[Checkpoint]:
    return Call("POST", f"/v1/runs/{_seg(run)}/checkpoints/{_seg(step)}/verify", _checkpoint)


def list_checkpoints(
    run: str,
    *,
    state: str | None = None,
    min_step: int | None = None,
    max_step: int | None = None,
    limit: int | None = None,
    offset: int | None = None,
) -> Call[list[Checkpoint]]:
    def parse(data: Any) -> list[Checkpoint]:
        return [Checkpoint.model_validate(item) for item in data["checkpoints"]]

    params = _query(state=state, min_step=min_step, max_step=max_step, limit=limit, offset=offset)
    return Call("GET", f"/v1/runs/{_seg(run)}/checkpoints", parse, params=params)


def runs(*, limit: int | None = None, offset: int | None = None) -> Call[list[RunSummary]]:
    def parse(data: Any) -> list[RunSummary]:
        return [RunSummary.model_validate(item) for item in data["runs"]]

    return Call("GET", "/v1/runs", parse, params=_query(limit=limit, offset=offset))


def latest(
    run: str,
    *,
    region: str | None = None,
    node: str | None = None,
    scope: str | None = None,
    peer_safe: bool = False,
) -> Call[Checkpoint | None]:
    return Call(
        "GET",
        f"/v1/runs/{_seg(run)}/latest",
        _checkpoint,
        params=_query(
            region=region, node=node, scope=scope, peer_safe="true" if peer_safe else None
        ),
        none_on_404=True,
    )


def prefetch(run: str, nodes: Sequence[str], *, step: int | None = None) -> Call[Prefetch]:
    body: dict[str, Any] = {"nodes": list(nodes)}
    if step is not None:
        body["step"] = step
    return Call("POST", f"/v1/runs/{_seg(run)}/prefetch", Prefetch.model_validate, body=body)


def prefetch_jobs(
    run: str, *, step: int | None = None, limit: int | None = None
) -> Call[list[PrefetchJob]]:
    def parse(data: Any) -> list[PrefetchJob]:
        return [PrefetchJob.model_validate(item) for item in data["jobs"]]

    params = _query(step=step, limit=limit)
    return Call("GET", f"/v1/runs/{_seg(run)}/prefetch", parse, params=params)


def memory_info() -> Call[MemoryInfo]:
    return Call("GET", "/v1/memory", MemoryInfo.model_validate)


def reserve_segment(
    run: str, step: int, files: Mapping[str, int], *, rank: int = 0, world_size: int = 1
) -> Call[MemorySegment]:
    body = {
        "run": run,
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "files": [{"path": path, "size": size} for path, size in files.items()],
    }
    return Call("POST", "/v1/memory/segments", MemorySegment.model_validate, body=body)


def register_segment(
    segment_id: str, registration: Call[Checkpoint], *, reserve_next: bool = False
) -> Call[Checkpoint]:
    """``registration`` (built by :func:`register`) sent for a memory segment."""
    body = registration.body
    if reserve_next:
        body = {**(body or {}), "reserve_next": True}
    return Call(
        "POST",
        f"/v1/memory/segments/{_seg(segment_id)}/register",
        _checkpoint,
        body=body,
    )


def release_segment(segment_id: str) -> Call[None]:
    return Call("DELETE", f"/v1/memory/segments/{_seg(segment_id)}", lambda _data: None)


def restore_plan(
    run: str,
    step: int,
    *,
    region: str | None = None,
    rank: int | None = None,
    chunks: bool = False,
) -> Call[RestorePlan]:
    return Call(
        "GET",
        f"/v1/runs/{_seg(run)}/checkpoints/{_seg(step)}/download",
        RestorePlan.model_validate,
        params=_query(region=region, rank=rank, chunks="true" if chunks else None),
    )


def request_args(call: Call[Any], token: str | None) -> dict[str, Any]:
    """Keyword arguments for ``httpx.Client.request`` / ``httpx.AsyncClient.request``."""
    return {
        "method": call.method,
        "url": call.path,
        "params": call.params,
        "json": call.body,
        "headers": auth_headers(token),
    }


def auth_headers(token: str | None) -> dict[str, str]:
    # Per request rather than on the httpx client: the same connection pool
    # also fetches presigned object-store URLs, which must not see the token.
    return {"Authorization": f"Bearer {token}"} if token else {}


def parse_response(call: Call[T], response: httpx.Response) -> T:
    if call.none_on_404 and response.status_code == 404:
        return None  # type: ignore[return-value]
    if not response.is_success:
        raise error_from_response(response)
    try:
        return call.parse(response.json())
    except (ValueError, KeyError, TypeError, ValidationError) as exc:
        # ValidationError is a ValueError; named for the reader.
        raise ServerError(
            f"unexpected answer from {call.method} {call.path}: {exc}",
            code="bad_response",
            status=response.status_code,
        ) from exc


def check_wait_target(state: str) -> int:
    if state not in STATE_ORDER:
        raise ValueError(f"state must be one of {', '.join(STATE_ORDER)}; got {state!r}")
    return STATE_ORDER.index(state)


def wait_reached(checkpoint: Checkpoint, target: int) -> bool:
    """True once the checkpoint is at or past ``target``; raises when it can
    never get there."""
    if checkpoint.state in FAILED_STATES:
        reason = f": {checkpoint.error}" if checkpoint.error else ""
        raise CheckpointFailedError(
            f"checkpoint {checkpoint.run}:{checkpoint.step} is {checkpoint.state}{reason}",
            checkpoint,
        )
    if checkpoint.state not in STATE_ORDER:
        return False
    return STATE_ORDER.index(checkpoint.state) >= target


def next_poll_delay(deadline: float | None, poll_interval: float) -> float | None:
    """Seconds to sleep before the next poll; None once the deadline passed."""
    if deadline is None:
        return poll_interval
    remaining = deadline - time.monotonic()
    return None if remaining <= 0 else min(poll_interval, remaining)


def wait_deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def wait_timeout_error(
    run: str, step: int, state: str, last: Checkpoint, timeout: float | None
) -> TimeoutError:
    return TimeoutError(
        f"checkpoint {run}:{step} still {last.state} after {timeout or 0:g}s (waiting for {state})"
    )


# Answers worth asking again: the service is busy (429) or its catalog is
# briefly unreachable (503). Every call here is safe to repeat: register is
# idempotent (same content -> 200), the rest read or set absolute state.
RETRY_STATUSES = (429, 503)
RETRY_ATTEMPTS = 5


def retry_after(
    response: httpx.Response | None, attempt: int, attempts: int = RETRY_ATTEMPTS
) -> float | None:
    """Seconds to wait before attempt ``attempt + 1``, or None to stop.

    ``response`` None means no answer at all (connection refused while the
    agent restarts, say)."""
    if attempt >= attempts:
        return None
    if response is not None and response.status_code not in RETRY_STATUSES:
        return None
    backoff = min(8.0, 0.25 * 2**attempt)
    if response is not None:
        header = response.headers.get("Retry-After", "")
        try:
            return min(30.0, max(backoff, float(header)))
        except ValueError:
            pass
    return backoff
