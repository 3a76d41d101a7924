"""The dashboard in a real browser: `tierckpt serve` with two SeaweedFS
regions, real checkpoints, the west region down so its copies stay pending;
headless Chromium (Debian's package, driven by Playwright) signs in with a
token, reads the runs page and the run page, and screenshots both into
test-artifacts/. The same outage is checked in /metrics, and the agent's log
(not a terminal) is JSON lines."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devsupport.agent import s3_region, token_entry, write_checkpoint
from devsupport.processes import agent_config, cli
from devsupport.seaweed import SeaweedServer

pytestmark = pytest.mark.e2e

CHROMIUM = Path(os.environ.get("TIERCKPT_TEST_CHROMIUM", "/usr/bin/chromium"))
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
READER, TRAINER = "reader-secret-token", "trainer-secret-token"
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def require_browser() -> None:
    """Debian's chromium (`make test` installs it as root). Missing: a failure
    in CI, a skip with the reason elsewhere."""
    if CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK):
        return
    reason = (
        f"{CHROMIUM} not found: install Debian's chromium (`apt-get install chromium`, "
        "which `make test` does when run as root)"
    )
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def poll(url: str, predicate: Any, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    headers = {"Authorization": f"Bearer {READER}"}
    while True:
        answer: dict[str, Any] = httpx.get(url, headers=headers, timeout=5).json()
        if predicate(answer):
            return answer
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting on {url}: {answer}")
        time.sleep(0.1)


def metric(text: str, name: str, **labels: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


@pytest.fixture
def browser_context(tmp_path: Path) -> Iterator[Any]:
    require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),  # fresh --user-data-dir
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 900},
        )
        try:
            yield context
        finally:
            context.close()


def test_dashboard_shows_a_region_outage(
    browser_context: Any,
    tmp_path: Path,
    seaweed: SeaweedServer,
    s3_bucket: str,
    seaweed_west: SeaweedServer,
) -> None:
    west_bucket = seaweed_west.create_bucket(f"west-{uuid.uuid4().hex[:12]}")
    config = agent_config(
        tmp_path,
        node="ui-node",
        catalog_url=f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}",
        worker={"poll_interval": 0.1, "backoff_base": 0.2, "backoff_max": 1.0},
        regions=[
            s3_region("east", seaweed.endpoint_url, s3_bucket, prefix="ui"),
            # Stopped below: each job attempt fails at once and the worker's
            # quick backoff retries it (not the SDK's own).
            {
                **s3_region("west", seaweed_west.endpoint_url, west_bucket, prefix="ui"),
                "request_attempts": 1,
            },
        ],
        tokens=[token_entry("ui", READER, "reader"), token_entry("train", TRAINER, "trainer")],
    )
    ssd = config.ssd
    log = tmp_path / "serve.log"
    ARTIFACTS.mkdir(exist_ok=True)

    with config.serve(log).start() as agent:
        env = {"TIERCKPT_TOKEN": TRAINER}
        first = write_checkpoint(
            ssd / "llama" / "step-100", {"model.bin": 3 << 20, "opt.bin": 1 << 20}
        )
        done = cli("register", "llama", "100", str(first), "--wait", server=agent.url, env=env)
        assert done.returncode == 0, done.stderr
        assert "llama:100 is durable" in done.stdout or "replicated" in done.stdout
        poll(f"{agent.url}/v1/runs/llama/checkpoints/100", lambda a: a["state"] == "replicated")

        seaweed_west.stop()
        try:
            trainer = {"Authorization": f"Bearer {TRAINER}"}
            for run, step, parent in (
                ("llama", 200, ("llama", 100)),
                ("llama", 300, ("llama", 200)),
                ("llama-ft", 10, ("llama", 300)),
            ):
                path = write_checkpoint(ssd / run / f"step-{step}", {"model.bin": 2 << 20})
                answer = httpx.post(
                    f"{agent.url}/v1/checkpoints",
                    json={
                        "run": run,
                        "step": step,
                        "path": str(path),
                        "parent": {"run": parent[0], "step": parent[1]},
                    },
                    headers=trainer,
                    timeout=10,
                )
                assert answer.status_code == 202, answer.text
            for run, step in (("llama", 200), ("llama", 300), ("llama-ft", 10)):
                poll(
                    f"{agent.url}/v1/runs/{run}/checkpoints/{step}",
                    lambda a: a["state"] == "durable",
                )
            # Replication into west fails and is retried (never dropped).
            poll(
                f"{agent.url}/v1/runs/llama/checkpoints/300",
                lambda a: any(
                    j["kind"] == "replicate" and j["attempts"] >= 1 and j["last_error"]
                    for j in a["jobs"]
                ),
            )

            # The outage in /metrics: west's copies pending, its recovery point behind.
            scrape = httpx.get(f"{agent.url}/metrics", timeout=10).text
            assert metric(scrape, "tierckpt_replicas", region="west", state="pending") == 3
            assert metric(scrape, "tierckpt_last_durable_step", run="llama", region="east") == 300
            assert metric(scrape, "tierckpt_last_durable_step", run="llama", region="west") == 100
            assert (metric(scrape, "tierckpt_replication_lag_seconds", region="west") or 0) > 0
            assert (metric(scrape, "tierckpt_pending_bytes", region="west") or 0) == 3 * (2 << 20)

            page = browser_context.new_page()
            # Without a token: the sign-in form (401), never the data.
            answer = page.goto(f"{agent.url}/ui", timeout=20_000)
            assert answer is not None and answer.status == 401
            assert page.locator("#token").count() == 1
            assert "llama" not in page.content()
            page.fill("#token", READER)
            page.click("button[type=submit]")
            page.wait_for_selector("#runs")
            assert "token=" not in page.url  # dropped from the address bar
            cookie = next(c for c in browser_context.cookies() if c["name"] == "tierckpt_ui")
            assert cookie["httpOnly"] and cookie["path"] == "/ui"

            row = page.locator('#runs tr[data-run="llama"]')
            assert row.count() == 1
            cells = row.locator("td").all_inner_texts()
            assert cells[3] == "300"  # latest valid
            assert any(c.startswith("step 300") for c in cells)  # east
            assert any(c.startswith("step 100") for c in cells)  # west, behind
            west = page.locator('#regions tr[data-region="west"] td').all_inner_texts()
            assert west[1] == "3"  # copies pending
            page.screenshot(path=str(ARTIFACTS / "dashboard-runs.png"), full_page=True)

            page.click('#runs a:text-is("llama")')
            page.wait_for_selector("#checkpoints")
            assert page.inner_text("#run-name") == "llama"
            assert page.inner_text("#latest-valid") == "300"

            def region_state(step: int, region: str) -> str:
                cell = page.locator(
                    f'#checkpoints tr[data-step="{step}"] td[data-region="{region}"]'
                )
                return str(cell.get_attribute("data-state"))

            assert region_state(100, "east") == region_state(100, "west") == "committed"
            assert region_state(300, "east") == "committed"
            assert region_state(300, "west") == "pending"
            assert "retrying" in page.inner_text('#checkpoints tr[data-step="300"]')
            marks = page.locator(
                'svg.timeline rect.replica[data-region="west"][data-state="pending"]'
            )
            assert marks.count() == 2
            failures = page.inner_text("#failures")
            assert "replicate" in failures and "west" in failures
            assert page.locator('svg.lineage circle[data-run="llama-ft"]').count() == 1
            lag = page.locator('#lag tr[data-region="west"] td').all_inner_texts()
            assert lag[2] == "2" and lag[3] != "-"  # two pending, waiting for a while
            page.screenshot(path=str(ARTIFACTS / "dashboard-run-outage.png"), full_page=True)
        finally:
            seaweed_west.start()

    # Not a terminal: the agent logged JSON lines, requests with their id.
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert any(r.get("request_id") and r["logger"] == "tierckpt.http" for r in lines)
    assert any(r.get("job_kind") == "replicate" and r.get("region") == "west" for r in lines)
