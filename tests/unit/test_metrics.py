"""Observability pieces without a server: metric hooks, log formats, the
dashboard's SVG, the CLI's per-region tables and the register --wait progress."""

from __future__ import annotations

import io
import json
import logging
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from tierckpt.client import CheckpointClient, cli
from tierckpt.client import _render as render
from tierckpt.client.models import Checkpoint, RunSummary
from tierckpt.service.observability import context, metrics
from tierckpt.service.observability.catalog import catalog_families
from tierckpt.service.observability.catalog import render as render_families
from tierckpt.service.observability.logs import (
    ConsoleFormatter,
    JsonFormatter,
    make_handler,
    resolve_format,
)
from tierckpt.service.observability.middleware import RequestContext
from tierckpt.service.ui import svg
from tierckpt.service.ui.views import CheckpointView, LineageNode, ReplicaView

try:
    from test_client_fakeapi import BASE_URL, FakeApi
except ImportError:  # tests/unit collected as a package
    from .test_client_fakeapi import BASE_URL, FakeApi


def sample(name: str, **labels: str) -> float:
    value = metrics.REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


# -- metric hooks -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "size", "expected"),
    [
        (None, 1000, 1000),
        ("bytes=0-99", 1000, 100),
        ("bytes=900-", 1000, 100),
        ("bytes=-10", 1000, 10),
        ("bytes=990-5000", 1000, 10),
        ("bytes=0-1,5-9", 1000, 1000),  # several ranges: counted as the whole object
        ("garbage", 1000, 1000),
    ],
)
def test_served_length_follows_the_range_header(header, size, expected):
    assert metrics.served_length(header, size) == expected


def test_job_outcomes_and_region_series_start_at_zero():
    metrics.init_regions(["unit-r"])
    assert (
        metrics.REGISTRY.get_sample_value("tierckpt_uploaded_bytes_total", {"region": "unit-r"})
        == 0
    )
    before = sample("tierckpt_job_runs_total", kind="unit", outcome="retried")
    metrics.observe_job("unit", "retry")
    metrics.observe_job("unit", "fail")
    metrics.observe_job("unit", "release")
    assert sample("tierckpt_job_runs_total", kind="unit", outcome="retried") == before + 1
    assert sample("tierckpt_job_runs_total", kind="unit", outcome="failed") >= 1
    assert sample("tierckpt_job_runs_total", kind="unit", outcome="released") >= 1


async def test_a_replication_noted_as_repair_counts_as_repaired():
    job = SimpleNamespace(id=1, kind="replicate", region="unit-rep", checkpoint_id=99, attempts=1)

    class NoCatalog:
        def __call__(self):  # the catalog is down: bind_job must still bind
            raise ConnectionError("down")

    bound = await context.bind_job(job, NoCatalog())  # type: ignore[arg-type]
    assert bound.run is None and context.current_job() is bound
    context.note(repair=True)
    metrics.observe_replication("unit-rep", 500)
    assert sample("tierckpt_scrub_results_total", region="unit-rep", result="repaired") == 1
    assert sample("tierckpt_replicated_bytes_total", region="unit-rep") == 500
    assert sample("tierckpt_replication_duration_seconds_count", region="unit-rep") == 1
    context.JOB.set(None)


async def test_catalog_down_still_answers_with_catalog_up_zero():
    class Broken:
        def __call__(self):
            raise ConnectionRefusedError("catalog gone")

    resources = SimpleNamespace(
        settings=SimpleNamespace(
            regions=[SimpleNamespace(name="east")],
            durability=SimpleNamespace(min_regions=1),
            server=SimpleNamespace(node="n1"),
        ),
        sessionmaker=Broken(),
    )
    text = render_families(await catalog_families(resources, 3)).decode()  # type: ignore[arg-type]
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["tierckpt_catalog_up"] == 0
    assert values["tierckpt_worker_busy_jobs"] == 3
    assert values["tierckpt_agent_info"] == 1
    assert "tierckpt_jobs" not in values


# -- logs --------------------------------------------------------------------------


def _record(message: str = "hello %s", *args: Any, **extra: Any) -> logging.LogRecord:
    record = logging.LogRecord("tierckpt.test", logging.WARNING, __file__, 1, message, args, None)
    record.__dict__.update(extra)
    return record


def test_json_lines_carry_request_and_job_context():
    stream = io.StringIO()
    handler = make_handler("json", stream)
    token = context.REQUEST_ID.set("req-1")
    try:
        job = context.JobContext(
            job_id=5, kind="upload", region="east", checkpoint_id=9, attempt=2, run="r", step=3
        )
        context.JOB.set(job)
        handler.handle(_record("hello %s", "world", color_message="x"))
        context.JOB.set(None)
    finally:
        context.REQUEST_ID.reset(token)
    handler.handle(_record("plain"))
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "hello world" and first["level"] == "warning"
    assert first["request_id"] == "req-1"
    assert (first["job_id"], first["job_kind"], first["run"], first["step"]) == (
        5,
        "upload",
        "r",
        3,
    )
    assert first["region"] == "east" and first["attempt"] == 2
    assert "color_message" not in first
    assert first["ts"].endswith("Z")
    assert "request_id" not in second and "job_id" not in second


def test_json_formatter_keeps_tracebacks_on_one_line():
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord("t", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = JsonFormatter().format(record)
    assert "\n" not in line
    assert "ValueError: boom" in json.loads(line)["exc"]


def test_console_format_is_for_people():
    record = _record("uploaded", job_id=4, run="llama", step=100)
    line = ConsoleFormatter().format(record)
    assert "WARNING" in line and "tierckpt.test: uploaded" in line
    assert line.endswith("[job_id=4 run=llama step=100]")


def test_auto_format_is_json_unless_a_terminal():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert resolve_format("auto", io.StringIO()) == "json"
    assert resolve_format("auto", Tty()) == "console"
    assert resolve_format("console", io.StringIO()) == "console"


async def test_request_id_middleware_keeps_safe_ids_and_replaces_others():
    seen: list[str | None] = []

    async def app(scope, receive, send):
        seen.append(context.REQUEST_ID.get())
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    middleware = RequestContext(app)
    for incoming, kept in ((b"abc-123", True), (b"bad id\n<script>", False)):
        sent: list[dict[str, Any]] = []

        async def send(message, sent=sent):
            sent.append(message)

        scope = {
            "type": "http",
            "method": "GET",
            "path": "/x",
            "headers": [(b"x-request-id", incoming)],
        }
        await middleware(scope, None, send)  # type: ignore[arg-type]
        header = dict(sent[0]["headers"])[b"x-request-id"].decode()
        assert (header == incoming.decode()) is kept
        assert seen[-1] == header
    assert context.REQUEST_ID.get() is None  # reset after the request


# -- dashboard SVG -------------------------------------------------------------------


def _view(step: int, at: datetime, states: dict[str, str], **extra: Any) -> CheckpointView:
    view = CheckpointView(
        step=step,
        state=extra.pop("state", "durable"),
        created_at=at,
        durable_at=at,
        total_bytes=10,
        file_count=1,
        error=None,
        parent=None,
        pinned=False,
        quarantined=False,
    )
    for region, state in states.items():
        view.replicas[region] = ReplicaView(region, state, lag=4.0, error=None, **extra)
    return view


def test_timeline_has_a_lane_per_region_coloured_by_replica_state():
    now = datetime(2026, 1, 1, 12, 0, 0)
    views = [
        _view(100, now, {"east": "committed", "west": "committed"}),
        _view(
            200,
            now + timedelta(minutes=5),
            {"east": "committed", "west": "pending"},
            retrying="EndpointConnectionError: <west> down",
            attempts=4,
        ),
    ]
    out = str(svg.timeline(views, ["east", "west"]))
    assert out.startswith("<svg") and out.endswith("</svg>")
    assert 'data-region="west" data-step="200" data-state="pending"' in out
    assert 'data-region="east" data-step="200" data-state="committed"' in out
    assert "east (primary)" in out
    assert "retrying (attempt 4)" in out and "&lt;west&gt;" in out  # escaped
    assert "<west>" not in out
    assert 'stroke-dasharray="3 2"' in out


def test_timeline_and_lineage_without_checkpoints():
    assert "no checkpoints yet" in str(svg.timeline([], ["east"]))
    assert "no checkpoints" in str(svg.lineage([], [], "r"))


def test_lineage_draws_forks_across_runs_and_unknown_parents():
    t = datetime(2026, 1, 1)
    nodes = [
        LineageNode("base", 50, None, None),
        LineageNode("r", 100, "durable", t),
        LineageNode("r", 200, "replicated", t + timedelta(seconds=5)),
        LineageNode("r-ft", 10, "durable", t + timedelta(seconds=9)),
    ]
    edges = [(("base", 50), ("r", 100)), (("r", 100), ("r", 200)), (("r", 200), ("r-ft", 10))]
    out = str(svg.lineage(nodes, edges, "r"))
    assert out.count('class="edge"') == 3
    assert 'data-run="r-ft" data-step="10"' in out
    assert "base:50 — not in this catalog" in out
    assert 'href="/ui/runs/r-ft#step-10"' in out


def test_durations_read_naturally():
    assert svg.duration(None) == "-"
    assert svg.duration(0.25) == "250 ms"
    assert svg.duration(42) == "42.0 s"
    assert svg.duration(600) == "10.0 min"
    assert svg.duration(7200) == "2.0 h"


# -- CLI views ---------------------------------------------------------------------------


def _text(renderable: Any) -> str:
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(renderable)
    return console.file.getvalue()  # type: ignore[attr-defined]


def test_runs_table_has_a_column_per_region_with_the_recovery_point():
    now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    runs = [
        RunSummary.model_validate(
            {
                "run": "llama",
                "checkpoints": 3,
                "latest_step": 300,
                "created_at": "2026-01-01T10:00:00Z",
                "regions": [
                    {"region": "east", "step": 300, "created_at": "2026-01-01T11:58:00Z"},
                    {"region": "west", "step": 100, "created_at": "2026-01-01T11:00:00Z"},
                ],
            }
        ),
        RunSummary.model_validate({"run": "fresh", "checkpoints": 1, "latest_step": 5}),
    ]
    text = _text(render.runs_table(runs, now=now))
    header = text.splitlines()[0]
    assert header.split()[:7] == [
        "run",
        "checkpoints",
        "latest",
        "valid",
        "recovery",
        "point",
        "east",
    ]
    assert "west" in header
    llama = next(line for line in text.splitlines() if line.startswith("llama"))
    assert "300 (2m 00s)" in llama and "100 (1h 00m)" in llama
    fresh = next(line for line in text.splitlines() if line.startswith("fresh"))
    assert "no valid checkpoint" in fresh and fresh.count("none") == 2


def test_status_table_has_a_column_per_region():
    checkpoint = Checkpoint.model_validate(
        {
            "run": "llama",
            "step": 200,
            "state": "durable",
            "replicas": [
                {"region": "east", "state": "committed"},
                {"region": "west", "state": "pending"},
            ],
        }
    )
    text = _text(render.checkpoints_table([checkpoint]))
    assert text.splitlines()[0].split()[-2:] == ["east", "west"]
    assert text.splitlines()[1].split()[-2:] == ["committed", "pending"]


def test_register_wait_progress_shows_each_transition(monkeypatch):
    fake = FakeApi()
    fake.add_checkpoint("llama", 7, {"w.bin": b"w"}, state="registered")
    fake.state_script[("llama", 7)] = ["registered", "uploading", "uploading", "durable"]
    out = io.StringIO()
    console = Console(file=out, width=120, color_system=None, force_terminal=True)
    with console.status("waiting") as status:
        progress = render.WaitProgress(status, console)
        with CheckpointClient(BASE_URL, transport=fake.transport()) as client:
            final = cli._wait_durable(client, "llama", 7, 10, progress, poll_interval=0.01)
    assert final.state == "durable"
    printed = [line.split()[-1] for line in out.getvalue().splitlines() if "s  " in line]
    assert [p for p in printed if p in ("registered", "uploading", "durable")] == [
        "registered",
        "uploading",
        "durable",
    ]
    line = render.progress_line(final)
    assert line.plain == "llama:7 durable · east committed · west committed"
