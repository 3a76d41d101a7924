"""In-process fake of the tierckpt HTTP API (docs/API.md) for client and CLI tests.

It keeps checkpoints in memory, answers the catalog endpoints, builds restore
plans, and serves object bytes with ``Range`` support for two regions: "east"
through the service's own object endpoint (relative URLs, bearer token) and
"west" through presigned absolute URLs on another host (which refuse an
``Authorization`` header, as S3 does). Knobs let tests corrupt or break a
region, script successive states, delay answers, and force error answers.
The tests at the bottom check the fake itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, unquote

import httpx

API_HOST = "api.test"
BASE_URL = f"http://{API_HOST}"
S3_HOST = "s3.west.test"
RUN_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
STAMP = "2026-11-22T11:00:00Z"


def error(status: int, code: str, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": message}})


def object_key(run: str, step: int, rank: int, path: str) -> str:
    return f"{run}/step-{step:012d}/rank-{rank:05d}/{path}"


class FakeApi:
    def __init__(self, token: str | None = None, regions: tuple[str, ...] = ("east", "west")):
        self.token = token
        self.regions = list(regions)
        self.checkpoints: dict[tuple[str, int], dict[str, Any]] = {}
        self.registered: dict[tuple[str, int, int], dict[str, Any]] = {}
        # (run, step) -> states answered by successive GETs; the last one sticks.
        self.state_script: dict[tuple[str, int], list[str]] = {}
        # region -> object key -> bytes
        self.objects: dict[str, dict[str, bytes]] = {region: {} for region in self.regions}
        self.corrupt: set[tuple[str, str]] = set()  # (region, key) served with a flipped byte
        self.broken: dict[str, int] = {}  # region -> HTTP status for every object GET
        self.flaky: dict[str, int] = {}  # region -> number of object GETs answered 503 first
        self.ignore_range: set[str] = set()  # regions answering 200 with the whole object
        self.forced: dict[tuple[str, str], httpx.Response] = {}  # (method, path) -> answer
        self.plan_override: dict[str, Any] | None = None
        self.delay: Callable[[httpx.Request], float] | None = None
        self.requests: list[httpx.Request] = []
        self.in_flight = 0
        self.max_in_flight = 0

    # -- set-up helpers -------------------------------------------------------

    def add_checkpoint(
        self,
        run: str,
        step: int,
        files: dict[tuple[int, str], bytes] | dict[str, bytes],
        *,
        state: str = "durable",
        world_size: int | None = None,
        regions: tuple[str, ...] | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        entries = []
        for where, data in files.items():
            rank, path = where if isinstance(where, tuple) else (0, where)
            entries.append(
                {
                    "rank": rank,
                    "path": path,
                    "size": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                }
            )
            for region in regions or self.regions:
                self.objects[region][object_key(run, step, rank, path)] = data
        ranks = {entry["rank"] for entry in entries} or {0}
        record = {
            "run": run,
            "step": step,
            "state": state,
            "world_size": world_size or max(ranks) + 1,
            "epoch": None,
            "priority": "normal",
            "metrics": {},
            "metadata": {},
            "parent": None,
            "children": [],
            "created_at": STAMP,
            "durable_at": STAMP if state in ("durable", "replicated") else None,
            "error": None,
            "total_bytes": sum(entry["size"] for entry in entries),
            "file_count": len(entries),
            "write_seconds": None,
            "shards": [
                {
                    "rank": r,
                    "node": "node-a",
                    "path": f"/ssd/{run}/step-{step}",
                    "state": "uploaded",
                }
                for r in sorted(ranks)
            ],
            "files": entries,
            "replicas": [
                {
                    "region": region,
                    "state": "committed",
                    "uri": f"s3://b/{run}/",
                    "verified_at": None,
                }
                for region in regions or self.regions
            ],
            "future_field": {"added": "by a newer service"},
        }
        record.update(extra)
        self.checkpoints[(run, step)] = record
        return record

    def key_of(self, run: str, step: int, path: str, rank: int = 0) -> str:
        return object_key(run, step, rank, path)

    def transport(self) -> httpx.MockTransport:
        """Serves sync and async clients; answers immediately."""
        return httpx.MockTransport(self.handle)

    def async_transport(self) -> httpx.MockTransport:
        """Async only; answers after ``delay`` and tracks concurrent requests."""

        async def handle(request: httpx.Request) -> httpx.Response:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(self.delay(request) if self.delay else 0.001)
                return self.handle(request)
            finally:
                self.in_flight -= 1

        return httpx.MockTransport(handle)

    def object_requests(self, region: str) -> list[httpx.Request]:
        if region == "west":
            return [r for r in self.requests if r.url.host == S3_HOST]
        prefix = f"/v1/regions/{region}/objects/"
        return [r for r in self.requests if r.url.path.startswith(prefix)]

    # -- request handling -----------------------------------------------------

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.host == S3_HOST:
            if "authorization" in request.headers:
                return httpx.Response(400, text="<Error>only one auth mechanism allowed</Error>")
            if request.url.params.get("X-Amz-Signature") != "sig":
                return httpx.Response(403, text="<Error>SignatureDoesNotMatch</Error>")
            key = unquote(request.url.raw_path.decode().split("?")[0].removeprefix("/bucket/"))
            return self._object(request, "west", key)
        path = unquote(request.url.raw_path.decode().split("?")[0])
        forced = self.forced.get((request.method, path))
        if forced is not None:
            return forced
        if self.token and request.headers.get("authorization") != f"Bearer {self.token}":
            return error(401, "unauthorized", "a valid bearer token is required")
        return self._route(request, path)

    def _route(self, request: httpx.Request, path: str) -> httpx.Response:
        parts = path.strip("/").split("/")
        method = request.method
        if method == "POST" and parts == ["v1", "checkpoints"]:
            return self._register(request)
        if method != "GET" or parts[:1] != ["v1"]:
            return error(405, "method_not_allowed", f"{method} {path}")
        match parts[1:]:
            case ["runs"]:
                return self._runs()
            case ["runs", run, "checkpoints"]:
                return self._list(run, request)
            case ["runs", run, "latest"]:
                return self._latest(run, request)
            case ["runs", run, "checkpoints", step]:
                return self._get(run, int(step))
            case ["runs", run, "checkpoints", step, "download"]:
                return self._plan(run, int(step), request)
            case ["regions", region, "objects", *key]:
                return self._object(request, region, "/".join(key))
        return httpx.Response(404, json={"detail": "Not Found"})

    def _register(self, request: httpx.Request) -> httpx.Response:
        import json

        body = json.loads(request.content)
        if not RUN_RE.fullmatch(str(body.get("run", ""))):
            return error(422, "invalid_run", f"run must match {RUN_RE.pattern}")
        if not str(body.get("path", "")).startswith("/"):
            return error(422, "path_not_absolute", "path must be absolute")
        key = (body["run"], body["step"], body.get("rank", 0))
        previous = self.registered.get(key)
        if previous is not None:
            if previous["path"] != body["path"]:
                return error(
                    409, "checkpoint_conflict", "step already registered with other content"
                )
            return httpx.Response(200, json=self.checkpoints[(body["run"], body["step"])])
        self.registered[key] = body
        record = self.add_checkpoint(body["run"], body["step"], {}, state="registered")
        record.update(
            world_size=body.get("world_size", 1),
            metrics=body.get("metrics") or {},
            parent=body.get("parent"),
            priority=body.get("priority", "normal"),
            replicas=[],
        )
        return httpx.Response(202, json=record)

    def _get(self, run: str, step: int) -> httpx.Response:
        record = self.checkpoints.get((run, step))
        if record is None:
            return error(404, "checkpoint_not_found", f"no checkpoint {run}:{step}")
        script = self.state_script.get((run, step))
        if script:
            record["state"] = script.pop(0) if len(script) > 1 else script[0]
            if record["state"] == "failed":
                record["error"] = "file model.bin changed during upload"
        return httpx.Response(200, json=record)

    def _list(self, run: str, request: httpx.Request) -> httpx.Response:
        rows = [
            {k: v for k, v in record.items() if k != "files"}
            for (r, _), record in sorted(self.checkpoints.items(), key=lambda kv: -kv[0][1])
            if r == run
        ]
        limit = int(request.url.params.get("limit", 50))
        return httpx.Response(200, json={"checkpoints": rows[:limit], "total": len(rows)})

    def _runs(self) -> httpx.Response:
        names = sorted({run for run, _ in self.checkpoints})
        runs = [
            {
                "run": name,
                "checkpoints": sum(1 for r, _ in self.checkpoints if r == name),
                "latest_step": max(s for r, s in self.checkpoints if r == name),
                "created_at": STAMP,
            }
            for name in names
        ]
        return httpx.Response(200, json={"runs": runs, "total": len(runs)})

    def _valid(self, run: str) -> list[dict[str, Any]]:
        return sorted(
            (
                record
                for (r, _), record in self.checkpoints.items()
                if r == run and record["state"] in ("durable", "replicated")
            ),
            key=lambda record: record["step"],
        )

    def _latest(self, run: str, request: httpx.Request) -> httpx.Response:
        valid = self._valid(run)
        if not valid:
            return error(404, "no_valid_checkpoint", f"run {run} has no valid checkpoint")
        record = dict(valid[-1])
        record["locations"] = [
            {"region": replica["region"], "uri": replica["uri"]} for replica in record["replicas"]
        ]
        node = request.url.params.get("node")
        record["local"] = {"node": node, "path": "/ssd/local/copy"} if node == "node-a" else None
        return httpx.Response(200, json=record)

    def _plan(self, run: str, step: int, request: httpx.Request) -> httpx.Response:
        if self.plan_override is not None:
            return httpx.Response(200, json=self.plan_override)
        record = self.checkpoints.get((run, step))
        if record is None:
            return error(404, "checkpoint_not_found", f"no checkpoint {run}:{step}")
        if record["state"] not in ("durable", "replicated"):
            return error(409, "not_durable", f"{run}:{step} is {record['state']}")
        preferred = request.url.params.get("region")
        regions = [r["region"] for r in record["replicas"]]
        if preferred in regions:
            regions.remove(preferred)
            regions.insert(0, preferred)
        rank = request.url.params.get("rank")
        files = [f for f in record["files"] if rank is None or f["rank"] == int(rank)]
        sources = [
            {
                "region": region,
                "files": [{**f, "url": self.url(region, run, step, f)} for f in files],
            }
            for region in regions
        ]
        return httpx.Response(
            200,
            json={"run": run, "step": step, "world_size": record["world_size"], "sources": sources},
        )

    def url(self, region: str, run: str, step: int, entry: dict[str, Any]) -> str:
        key = quote(object_key(run, step, entry["rank"], entry["path"]))
        if region == "west":
            return f"http://{S3_HOST}/bucket/{key}?X-Amz-Signature=sig"
        return f"/v1/regions/{region}/objects/{key}"

    def _object(self, request: httpx.Request, region: str, key: str) -> httpx.Response:
        if region in self.broken:
            return httpx.Response(self.broken[region], text="broken")
        if self.flaky.get(region, 0) > 0:
            self.flaky[region] -= 1
            return httpx.Response(503, text="slow down")
        data = self.objects.get(region, {}).get(key)
        if data is None:
            return error(404, "object_not_found", key)
        if (region, key) in self.corrupt and data:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        header = request.headers.get("range")
        if header is None or region in self.ignore_range:
            return httpx.Response(200, content=data)
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", header)
        assert match, f"unexpected Range header {header!r}"
        start, end = int(match[1]), int(match[2])
        if start >= len(data):
            return httpx.Response(416, headers={"content-range": f"bytes */{len(data)}"})
        end = min(end, len(data) - 1)
        return httpx.Response(
            206,
            content=data[start : end + 1],
            headers={"content-range": f"bytes {start}-{end}/{len(data)}"},
        )


# -- the fake itself ----------------------------------------------------------


def test_fake_serves_byte_ranges_with_content_range():
    fake = FakeApi()
    fake.add_checkpoint("r", 1, {"a.bin": bytes(range(256))})
    with httpx.Client(base_url=BASE_URL, transport=fake.transport()) as http:
        url = fake.url("east", "r", 1, {"rank": 0, "path": "a.bin"})
        response = http.get(url, headers={"Range": "bytes=10-19"})
    assert response.status_code == 206
    assert response.content == bytes(range(10, 20))
    assert response.headers["content-range"] == "bytes 10-19/256"


def test_fake_presigned_host_refuses_bearer_token():
    fake = FakeApi()
    fake.add_checkpoint("r", 1, {"a.bin": b"x"})
    url = fake.url("west", "r", 1, {"rank": 0, "path": "a.bin"})
    with httpx.Client(transport=fake.transport()) as http:
        assert http.get(url).content == b"x"
        assert http.get(url, headers={"Authorization": "Bearer t"}).status_code == 400
