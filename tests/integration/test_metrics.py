"""/metrics against a real agent: real uploads into SeaweedFS, replication
into a second (POSIX) region, verify, restore plan and served bytes, on SQLite
and PostgreSQL; the catalog gauges, the recovery point, and the token rule."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from devsupport.agent import (
    Agent,
    posix_region,
    running_agent,
    s3_region,
    token_entry,
    write_checkpoint,
)
from devsupport.seaweed import SeaweedServer

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> tuple[set[str], Samples]:
    families: set[str] = set()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return families, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def scrape(agent: Agent, **headers: str) -> tuple[set[str], Samples]:
    answer = await agent.http.get("/metrics", headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain; version=")
    return parse(answer.text)


def epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).astimezone(UTC).timestamp()


async def wait_no_active_jobs(agent: Agent, run: str, step: int) -> dict[str, Any]:
    for _ in range(1200):
        detail = (await agent.http.get(f"/v1/runs/{run}/checkpoints/{step}")).json()
        if not any(j["state"] in ("queued", "running") for j in detail["jobs"]):
            return detail
        await _sleep()
    raise AssertionError(f"jobs of {run}:{step} never finished")


async def _sleep() -> None:
    import asyncio

    await asyncio.sleep(0.05)


async def test_scrape_after_real_uploads_replication_verify_and_restore(
    catalog_url: str, tmp_path: Path, seaweed: SeaweedServer, s3_bucket: str
) -> None:
    regions = [
        s3_region("east", seaweed.endpoint_url, s3_bucket),
        posix_region("west", tmp_path / "west"),
    ]
    # West filled by replicate jobs (not by uploads from T0) so the
    # replication families are exercised too.
    upload = {"fan_out": False}
    async with running_agent(catalog_url, tmp_path, regions, upload=upload) as agent:
        families, before = await scrape(agent)
        # Every family exists from the first scrape (alerts need no warm-up).
        for name in (
            "tierckpt_registrations",
            "tierckpt_uploaded_bytes",
            "tierckpt_upload_duration_seconds",
            "tierckpt_replicated_bytes",
            "tierckpt_replication_duration_seconds",
            "tierckpt_restore_planned_bytes",
            "tierckpt_served_bytes",
            "tierckpt_scrub_results",
            "tierckpt_job_runs",
            "tierckpt_jobs",
            "tierckpt_replicas",
            "tierckpt_pending_bytes",
            "tierckpt_replication_lag_seconds",
            "tierckpt_last_durable_timestamp_seconds",
            "tierckpt_last_durable_step",
            "tierckpt_catalog_up",
            "tierckpt_agent_info",
            "process_resident_memory_bytes",
        ):
            assert name in families, name
        assert value(before, "tierckpt_catalog_up") == 1
        assert value(before, "tierckpt_agent_info", node="node-test") == 1

        sizes = {10: {"w.bin": 6 << 20, "meta.json": b"{}"}, 20: {"w.bin": 1 << 20, "x": b"x"}}
        totals = {}
        for step, files in sizes.items():
            ckpt = write_checkpoint(agent.ssd / f"s{step}", files)
            totals[step] = sum(v if isinstance(v, int) else len(v) for v in files.values())
            answer = await agent.register("m", step, ckpt)
            assert answer.status_code == 202, answer.text
            assert len(answer.headers["x-request-id"]) >= 8
        done = {step: await agent.wait_state("m", step, ("replicated",)) for step in sizes}
        # A repeated identical registration is not a new one.
        assert (await agent.register("m", 20, agent.ssd / "s20")).status_code == 200

        verify = await agent.http.post("/v1/runs/m/checkpoints/20/verify")
        assert verify.status_code == 202
        await wait_no_active_jobs(agent, "m", 20)

        plan = await agent.http.get("/v1/runs/m/checkpoints/20/download", params={"region": "west"})
        assert plan.status_code == 200
        west_file = next(f for f in plan.json()["sources"][0]["files"] if f["path"] == "w.bin")
        served = await agent.http.get(west_file["url"], headers={"Range": "bytes=0-99999"})
        assert served.status_code == 206 and len(served.content) == 100_000

        _, after = await scrape(agent)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    everything = totals[10] + totals[20]
    assert delta("tierckpt_registrations_total", priority="normal") == 2
    assert delta("tierckpt_uploaded_bytes_total", region="east") == everything
    assert delta("tierckpt_upload_duration_seconds_count", region="east") == 2
    assert delta("tierckpt_upload_duration_seconds_sum", region="east") > 0
    assert delta("tierckpt_replicated_bytes_total", region="west") == everything
    assert delta("tierckpt_replication_duration_seconds_count", region="west") == 2
    assert delta("tierckpt_scrub_results_total", region="east", result="verified") == 1
    assert delta("tierckpt_scrub_results_total", region="west", result="verified") == 1
    assert delta("tierckpt_scrub_results_total", region="east", result="corrupt") == 0
    assert delta("tierckpt_restore_planned_bytes_total", region="west") == totals[20]
    assert delta("tierckpt_served_bytes_total", region="west") == 100_000
    assert delta("tierckpt_job_runs_total", kind="upload", outcome="succeeded") == 2
    assert delta("tierckpt_job_runs_total", kind="replicate", outcome="succeeded") == 2
    assert delta("tierckpt_job_runs_total", kind="verify", outcome="succeeded") == 2
    assert (
        delta("tierckpt_http_requests_total", method="POST", route="/v1/checkpoints", status="202")
        == 2
    )

    # Catalog gauges: nothing left to do, every copy committed.
    assert value(after, "tierckpt_replicas", region="east", state="committed") == 2
    assert value(after, "tierckpt_replicas", region="west", state="committed") == 2
    assert value(after, "tierckpt_pending_bytes", region="west") == 0
    assert value(after, "tierckpt_replication_lag_seconds", region="west") == 0
    assert value(after, "tierckpt_jobs", kind="upload", state="queued", region="east") == 0
    assert value(after, "tierckpt_checkpoints", state="replicated") == 2
    # The recovery point: step 20 in both regions, stamped with its registration.
    for region in ("east", "west"):
        assert value(after, "tierckpt_last_durable_step", run="m", region=region) == 20
        stamp = value(after, "tierckpt_last_durable_timestamp_seconds", run="m", region=region)
        assert abs(stamp - epoch(done[20]["created_at"])) < 0.01
    assert value(after, "tierckpt_last_registered_step", run="m") == 20


async def test_pending_work_outage_gauges_and_private_metrics(
    catalog_url: str, tmp_path: Path
) -> None:
    """Worker off: registered work stays queued and shows as pending; with
    metrics_public = false a reader token is needed."""
    tokens = [
        token_entry("ci", "trainer-token", "trainer"),
        token_entry("ro", "ro-token", "reader"),
    ]
    regions = [posix_region("east", tmp_path / "east"), posix_region("west", tmp_path / "west")]
    async with running_agent(
        catalog_url,
        tmp_path,
        regions,
        start_worker=False,
        tokens=tokens,
        server={"node": "node-test", "metrics_public": False},
    ) as agent:
        ckpt = write_checkpoint(agent.ssd / "s5", {"a.bin": 4096, "b.bin": 1000})
        answer = await agent.http.post(
            "/v1/checkpoints",
            json={"run": "q", "step": 5, "path": str(ckpt)},
            headers={"Authorization": "Bearer trainer-token", "X-Request-ID": "trace-abc.1"},
        )
        assert answer.status_code == 202, answer.text
        assert answer.headers["x-request-id"] == "trace-abc.1"  # a caller's id is kept
        await agent.in_catalog("q")  # the gauges are the catalog's

        denied = await agent.http.get("/metrics")
        assert denied.status_code == 401
        assert denied.json()["error"]["code"] == "unauthorized"
        _, samples = await scrape(agent, Authorization="Bearer ro-token")

    assert value(samples, "tierckpt_jobs", kind="upload", state="queued", region="east") == 1
    assert (
        value(
            samples, "tierckpt_oldest_job_age_seconds", kind="upload", state="queued", region="east"
        )
        >= 0
    )
    assert value(samples, "tierckpt_pending_bytes", region="east") == 5096
    assert value(samples, "tierckpt_pending_bytes", region="west") == 5096
    assert value(samples, "tierckpt_replicas", region="west", state="pending") == 1
    assert value(samples, "tierckpt_checkpoints", state="registered") == 1
    assert value(samples, "tierckpt_last_registered_step", run="q") == 5
    # No valid checkpoint yet: no recovery point series for the run.
    assert not any(name == "tierckpt_last_durable_step" for name, _ in samples)
    assert value(samples, "tierckpt_worker_busy_jobs") == 0
