"""The checkpoint answers are built in one place (service.checkpoints.presenter):
each document has exactly its response model's fields in their order, and
validating it as the model and writing it back gives the same JSON, so the
`latest` fast path (which writes the document itself) and the routes that
answer with the models agree byte for byte on the shape."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

from tierckpt.service.checkpoints.presenter import (
    Listing,
    NewCheckpoint,
    NewShard,
    checkpoint_document,
    checkpoint_out,
    latest_document,
    to_json,
)
from tierckpt.service.checkpoints.repository import ReplicaRow
from tierckpt.service.checkpoints.schemas import CheckpointOut, LatestOut
from tierckpt.service.models import CheckpointState, ReplicaState, ShardState

CREATED = datetime(2024, 5, 1, 12, 0, 0, 123456)
DURABLE = CREATED + timedelta(seconds=3)


def _checkpoint(**overrides: Any) -> SimpleNamespace:
    """A checkpoint by the attribute names of an ORM row or a `latest` row."""
    values: dict[str, Any] = {
        "step": 200,
        "state": CheckpointState.DURABLE,
        "world_size": 2,
        "epoch": 3,
        "priority": "normal",
        "metrics": {"loss": 1, "tokens": 1e12},
        "meta": {"note": "é ünïcode"},
        "parent_run": "base",
        "parent_step": 100,
        "created_at": CREATED,
        "durable_at": DURABLE,
        "error": None,
        "total_bytes": 30,
        "file_count": 3,
        "write_seconds": 2,
        "pinned": 0,
        "quarantined_at": None,
        "quarantine_reason": None,
        "deleted_at": None,
        "deleted_reason": None,
    }
    values.update(overrides)
    return SimpleNamespace(**values)


def _replica(
    region: str,
    state: str,
    uri: str,
    verified_at: datetime | None = None,
    committed_at: datetime | None = None,
) -> ReplicaRow:
    return ReplicaRow(region, state, uri, verified_at, committed_at, error=None)


def _listing(**overrides: Any) -> Listing:
    values: dict[str, Any] = {
        "shards": [
            SimpleNamespace(rank=0, node="n0", path="/ssd/0", state="uploaded", error=None),
            SimpleNamespace(rank=1, node="n1", path="/ssd/1", state="uploaded", error=None),
        ],
        # Out of configuration order on purpose.
        "replicas": [
            _replica("west", ReplicaState.PENDING, "s3://w/r/200/"),
            _replica(
                "east",
                ReplicaState.COMMITTED,
                "/east/r/200/",
                verified_at=DURABLE,
                committed_at=DURABLE + timedelta(seconds=1.5),
            ),
        ],
        "children": [("r", 300), ("other", 5)],
        "files": [
            SimpleNamespace(rank=0, file_path="a.pt", file_size=10, file_sha256="ab" * 32),
            SimpleNamespace(rank=1, file_path="a.pt", file_size=20, file_sha256=None),
        ],
        "regions": ["east", "west"],
    }
    values.update(overrides)
    return Listing(**values)


def _round_trip(model: type[CheckpointOut], document: dict[str, Any]) -> None:
    assert list(document) == list(model.model_fields)
    assert model.model_validate(document).model_dump(mode="json") == document
    assert json.loads(model.model_validate(document).model_dump_json()) == json.loads(
        to_json(document)
    )


def test_checkpoint_document_is_a_checkpoint_out_field_for_field() -> None:
    document = checkpoint_document("r", _checkpoint(), _listing())
    _round_trip(CheckpointOut, document)
    assert document["created_at"] == "2024-05-01T12:00:00.123Z"
    assert document["metrics"] == {"loss": 1.0, "tokens": 1e12}
    assert document["write_seconds"] == 2.0 and document["pinned"] is False
    assert document["parent"] == {"run": "base", "step": 100}
    assert document["children"] == [{"run": "r", "step": 300}, {"run": "other", "step": 5}]
    assert [r["region"] for r in document["replicas"]] == ["east", "west"]
    assert document["replicas"][0]["lag_seconds"] == 1.5
    assert document["replicas"][0]["committed_at"] == "2024-05-01T12:00:04.623Z"
    assert document["replicas"][1]["lag_seconds"] > 0  # pending: waiting since durable
    assert document["files"] == [
        {"rank": 0, "path": "a.pt", "size": 10, "sha256": "ab" * 32},
        {"rank": 1, "path": "a.pt", "size": 20, "sha256": None},
    ]
    assert document["jobs"] is None


def test_a_list_entry_has_no_files_and_no_jobs() -> None:
    document = checkpoint_document(
        "r", _checkpoint(parent_run=None, parent_step=None), _listing(files=None, children=())
    )
    _round_trip(CheckpointOut, document)
    assert document["files"] is None and document["jobs"] is None
    assert document["parent"] is None and document["children"] == []


def test_the_detail_view_lists_the_jobs() -> None:
    job = SimpleNamespace(
        kind="replicate", state="queued", region="west", attempts=2, last_error="timeout"
    )
    document = checkpoint_document("r", _checkpoint(), _listing(jobs=[(job, None)]))
    _round_trip(CheckpointOut, document)
    assert document["jobs"] == [
        {
            "kind": "replicate",
            "state": "queued",
            "region": "west",
            "rank": None,
            "attempts": 2,
            "last_error": "timeout",
        }
    ]


def test_latest_document_is_a_latest_out_with_the_committed_locations() -> None:
    local = {"node": "n0", "path": "/ssd/0", "ranks": {"0": "/ssd/0"}}
    document = latest_document("r", _checkpoint(world_size=1), _listing(), local)
    _round_trip(LatestOut, document)
    assert document["locations"] == [{"region": "east", "uri": "/east/r/200/"}]
    assert document["local"] == local
    assert document["jobs"] is None
    # Everything else is the checkpoint's document (the pending lag grows between the two).
    checkpoint = checkpoint_document("r", _checkpoint(world_size=1), _listing())
    for key, value in checkpoint.items():
        if key != "replicas":
            assert document[key] == value, key
    assert [{**r, "lag_seconds": None} for r in document["replicas"]] == [
        {**r, "lag_seconds": None} for r in checkpoint["replicas"]
    ]


def test_a_registration_answer_from_its_values() -> None:
    checkpoint = NewCheckpoint(
        step=7,
        state=CheckpointState.REGISTERED,
        world_size=1,
        epoch=None,
        priority="urgent",
        metrics={"loss": 0.5},
        meta={},
        parent_run=None,
        parent_step=None,
        created_at=CREATED,
        total_bytes=5,
        file_count=1,
        write_seconds=None,
    )
    listing = Listing(
        shards=[NewShard(0, "n0", "/ssd/7", ShardState.REGISTERED)],
        replicas=[_replica("east", ReplicaState.PENDING, "/east/r/7/")],
        regions=["east"],
    )
    out = checkpoint_out("r", checkpoint, listing)
    assert json.loads(out.model_dump_json()) == {
        "run": "r",
        "step": 7,
        "state": "registered",
        "world_size": 1,
        "epoch": None,
        "priority": "urgent",
        "metrics": {"loss": 0.5},
        "metadata": {},
        "parent": None,
        "children": [],
        "created_at": "2024-05-01T12:00:00.123Z",
        "durable_at": None,
        "error": None,
        "total_bytes": 5,
        "file_count": 1,
        "write_seconds": None,
        "pinned": False,
        "quarantined_at": None,
        "quarantine_reason": None,
        "deleted_at": None,
        "deleted_reason": None,
        "shards": [
            {"rank": 0, "node": "n0", "path": "/ssd/7", "state": "registered", "error": None}
        ],
        "files": None,
        "replicas": [
            {
                "region": "east",
                "state": "pending",
                "uri": "/east/r/7/",
                "verified_at": None,
                "committed_at": None,
                "error": None,
                "lag_seconds": None,
            }
        ],
        "jobs": None,
        "copies": None,
        "peers": None,
        "peer_safe": None,
    }
