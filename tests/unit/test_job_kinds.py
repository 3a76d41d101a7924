"""The job registry: every kind's payload (and the form it is stored in),
its retry policy."""

from __future__ import annotations

import json

import pytest

from tierckpt.service.config import WorkerSettings
from tierckpt.service.jobs.kinds import (
    KINDS,
    REPLICATE_MAX_ATTEMPTS,
    DeletePayload,
    NoPayload,
    UploadMode,
    UploadPayload,
    payload_of,
)
from tierckpt.service.models import JobKind


def stored(payload: dict[str, object]) -> dict[str, object]:
    """What a JSON column gives back."""
    loaded: dict[str, object] = json.loads(json.dumps(payload))
    return loaded


def test_every_kind_is_registered_and_nothing_else() -> None:
    assert set(KINDS) == {k.value for k in JobKind}
    assert set(KINDS) == {
        "upload",
        "commit",
        "replicate",
        "verify",
        "delete",
        "retain",
        "peer_push",
        "prefetch",
    }
    assert all(KINDS[name].name == name for name in KINDS)


@pytest.mark.parametrize(
    ("kind", "payload"),
    [
        ("upload", UploadPayload(UploadMode.PRIMARY)),
        ("upload", UploadPayload(UploadMode.FAN_OUT)),
        ("upload", UploadPayload(UploadMode.REPAIR)),
        ("commit", NoPayload()),
        ("replicate", NoPayload()),
        ("verify", NoPayload()),
        ("retain", NoPayload()),
        ("peer_push", NoPayload()),
        ("prefetch", NoPayload()),
        ("delete", DeletePayload("retention: keep_last", force=False)),
        ("delete", DeletePayload("deleted by alice", force=True)),
    ],
)
def test_payloads_round_trip_through_the_catalog(kind: str, payload: object) -> None:
    assert isinstance(payload, KINDS[kind].payload)
    assert payload_of(kind, stored(payload.to_json())) == payload  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("row", "mode"),
    [
        # The forms agents have always written: a flag per mode, none for primary.
        ({}, UploadMode.PRIMARY),
        (None, UploadMode.PRIMARY),
        ({"fan_out": True}, UploadMode.FAN_OUT),
        ({"repair": True}, UploadMode.REPAIR),
        ({"fan_out": False}, UploadMode.PRIMARY),
    ],
)
def test_upload_payloads_stored_by_earlier_agents_still_read(
    row: dict[str, object] | None, mode: UploadMode
) -> None:
    assert UploadPayload.from_json(row).mode == mode


def test_upload_payloads_are_stored_in_the_form_earlier_agents_read() -> None:
    # An agent of the previous version sharing the catalog reads these flags.
    assert UploadPayload(UploadMode.PRIMARY).to_json() == {}
    assert UploadPayload(UploadMode.FAN_OUT).to_json() == {"fan_out": True}
    assert UploadPayload(UploadMode.REPAIR).to_json() == {"repair": True}


def test_delete_payloads_stored_by_earlier_agents_still_read() -> None:
    assert DeletePayload.from_json({"reason": "retention: keep_last", "force": False}) == (
        DeletePayload("retention: keep_last", force=False)
    )
    assert DeletePayload.from_json({"reason": "deleted by bob", "force": True}).force
    assert DeletePayload.from_json({}) == DeletePayload("deleted", force=False)
    assert DeletePayload.from_json(None).reason == "deleted"
    assert DeletePayload("x", force=True).to_json() == {"reason": "x", "force": True}


def test_retry_policies() -> None:
    worker = WorkerSettings(max_attempts=7)
    # Work that can really fail follows the agent's setting…
    assert KINDS["upload"].retry.attempts(worker) == 7
    assert KINDS["commit"].retry.attempts(worker) == 7
    # …work that only an outage delays is retried (practically) for ever.
    assert KINDS["replicate"].retry.attempts(worker) == REPLICATE_MAX_ATTEMPTS == 1_000_000
    assert KINDS["delete"].retry.attempts() == 1_000_000
    assert KINDS["verify"].retry.attempts() == 1000
    with pytest.raises(ValueError, match="max_attempts"):
        KINDS["upload"].retry.attempts()
