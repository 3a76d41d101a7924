"""API fuzzing: schemathesis against the service's own OpenAPI schema.

The in-process app (SQLite catalog, POSIX region, worker running) is driven
through ASGI with generated requests, valid and invalid: no answer may be a
5xx, and every answer must match the schema (status code documented, body
and content type as declared). One run (and the runs it knows about) exists
beforehand, so lookups also reach real rows, not only 404s.

Bounded for CI: TIERCKPT_FUZZ_EXAMPLES (default 12) per operation and
phase, a fixed seed (TIERCKPT_FUZZ_SEED to explore others).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from devsupport.agent import make_settings, posix_region, write_checkpoint
from tierckpt.service.app import create_app
from tierckpt.service.migrate import upgrade

EXAMPLES = int(os.environ.get("TIERCKPT_FUZZ_EXAMPLES", "12"))
SEED = int(os.environ.get("TIERCKPT_FUZZ_SEED", "20261122"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    negative_data_rejection,
]


# schemathesis' lazy `from_fixture` does not work with pytest 9 (it sets
# `node._nodeid`), so the schema is built at import: from the app's own
# OpenAPI document, which needs no catalog. The catalog is migrated, and the
# app's lifespan (worker included) started, by the fixture below, before the
# first request.
WORK = Path(tempfile.mkdtemp(prefix="tierckpt-fuzz-"))
CATALOG = f"sqlite+aiosqlite:///{WORK / 'catalog.db'}"
APP = create_app(
    make_settings(
        CATALOG,
        WORK / "ssd",
        [posix_region("local", WORK / "region")],
        # Fuzzing sends requests as fast as it can; throttling is tested elsewhere.
        server={"rate_limit_per_second": 0},
    )
)
schema = schemathesis.openapi.from_dict(
    APP.openapi(),
    config=schemathesis.Config.from_dict(
        {
            "seed": SEED,
            "generation": {"max-examples": EXAMPLES, "mode": "all", "database": "none"},
            "phases": {"coverage": {"enabled": False}, "stateful": {"enabled": False}},
        }
    ),
)
schema.app = APP  # requests go through ASGI, in process


@pytest.fixture(scope="module", autouse=True)
def running_app() -> Iterator[Any]:
    # Set up again, with WORK made anew, when the module's tests reach a
    # worker in two parts (pytest-xdist's `--dist worksteal` does that).
    (WORK / "ssd").mkdir(parents=True, exist_ok=True)
    upgrade(CATALOG)
    # One run with a checkpoint, registered through the same app.
    ckpt = write_checkpoint(WORK / "ssd" / "seed", {"w.bin": b"weights", "m.json": b"{}"})
    with asgi.get_client(APP) as client:
        answer = client.post("/v1/checkpoints", json={"run": "r", "step": 1, "path": str(ckpt)})
        assert answer.status_code == 202, answer.text
    try:
        yield APP
    finally:
        # The lifespan runs in schemathesis' event loop thread until stopped:
        # stop it (and the worker) now, not at interpreter exit.
        asgi.shutdown_lifespans()
        shutil.rmtree(WORK, ignore_errors=True)


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), max_examples=EXAMPLES)
def test_api_fuzz(case: schemathesis.Case) -> None:
    case.call_and_validate(checks=CHECKS)


def test_schema_documents_the_error_shape(running_app: Any) -> None:
    with asgi.get_client(running_app) as client:
        document = client.get("/openapi.json").json()
    error = document["components"]["schemas"]["Error"]
    assert error["required"] == ["error"]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            for status in ("4XX", "422", "503"):
                content = responses[status]["content"]["application/json"]["schema"]
                assert content == {"$ref": "#/components/schemas/Error"}, (method, path, status)
    assert "HTTPValidationError" not in document["components"]["schemas"]
