"""Chaos: registrations in a loop while everything around them breaks.

Real processes throughout: `tierckpt serve` (SIGKILLed at random moments and
restarted), two SeaweedFS servers as two regions (the second one stopped and
started again), a PostgreSQL catalog (SQLite when no server is reachable),
and objects corrupted behind the service's back with boto3 (then found by
`POST …/verify` and the scrubber, and repaired). A poller asks `latest`
continuously and records every answer.

Afterwards:
- every registered checkpoint is replicated to both regions with bytes
  identical to the source (read back with an independent boto3 client and
  hashlib), or failed with a reason (counted; none are expected);
- every `latest` answer ever given named a checkpoint whose files hash to
  the source and which the final catalog holds as durable/replicated.

The figures (kills, outages, corruptions, losses) are printed at the end.
The CI form runs `TIERCKPT_CHAOS_SECONDS` (default 20) of chaos; `make chaos`
runs the long form (300 s).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from devsupport import postgres as pg
from devsupport.agent import s3_region
from devsupport.processes import ServeProcess, agent_config
from devsupport.seaweed import SeaweedServer

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

RUN = "chaos"
PREFIX = "chaos"
SECONDS = float(os.environ.get("TIERCKPT_CHAOS_SECONDS", "20"))
SEED = int(os.environ.get("TIERCKPT_CHAOS_SEED", str(random.SystemRandom().randrange(1 << 30))))
# End states of a checkpoint (with no job left); "durable" too while a
# region is down.
SETTLED = {"replicated", "failed", "corrupt", "deleted"}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def object_key(step: int, path: str) -> str:
    return f"{PREFIX}/{RUN}/step-{step:012d}/rank-00000/{path}"


def manifest_key(step: int) -> str:
    return f"{PREFIX}/{RUN}/step-{step:012d}/MANIFEST.json"


@dataclass
class Figures:
    seed: int = SEED
    catalog: str = ""
    chaos_seconds: float = SECONDS
    registrations: int = 0
    register_retries: int = 0
    kills: int = 0
    region_outages: int = 0
    corruptions: int = 0
    corruptions_repaired: int = 0
    verifies_requested: int = 0
    latest_answers: int = 0
    latest_invalid: int = 0
    latest_unreachable: int = 0
    replicated: int = 0
    durable_only: int = 0
    failed: int = 0
    losses: int = 0
    jobs_redone: int = 0
    # Tracebacks in the agent's log (unexpected errors, not retried faults).
    agent_tracebacks: int = 0
    problems: list[str] = field(default_factory=list)


@dataclass
class Corruption:
    step: int
    region: str
    path: str
    at: float
    repaired_at: float | None = None


class Chaos:
    """Everything the threads share; each thread owns one kind of trouble."""

    def __init__(self, agent: ServeProcess, west: SeaweedServer, clients: dict[str, Any]) -> None:
        self.agent = agent
        self.west = west
        self.clients = clients  # region -> independent boto3 client
        self.buckets: dict[str, str] = {}
        self.sources: dict[int, dict[str, str]] = {}  # step -> path -> sha256
        self.latest_seen: list[tuple[float, dict[str, Any]]] = []
        self.corruptions: list[Corruption] = []
        self.open_corruption: set[int] = set()  # steps with an unrepaired bad object
        self.verify_wanted: set[int] = set()  # corrupted, verify not asked for yet
        self.figures = Figures()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.rng = random.Random(SEED)

    # -- helpers -------------------------------------------------------------

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.agent.url, timeout=10)

    def thread(self, target: Any, name: str) -> threading.Thread:
        def guarded() -> None:
            try:
                target()
            except BaseException as exc:  # reported by the test, not lost in a thread
                self.errors.append(exc)
                self.stop.set()

        return threading.Thread(target=guarded, name=name, daemon=True)

    def pause(self, low: float, high: float) -> bool:
        """Sleep a random while; False once the chaos is over."""
        return not self.stop.wait(self.rng.uniform(low, high))

    # -- the trainer: register in a loop --------------------------------------

    def trainer(self, ssd: Path) -> None:
        step = 0
        with self.http() as http:
            while not self.stop.is_set():
                step += 1
                directory = ssd / f"step-{step}"
                files = {
                    "model.bin": os.urandom(self.rng.choice([64 << 10, 1 << 20, 6 << 20])),
                    "optim.bin": os.urandom(self.rng.randrange(1, 512 << 10)),
                    "meta/config.json": json.dumps({"step": step}).encode(),
                }
                for relative, data in files.items():
                    (directory / relative).parent.mkdir(parents=True, exist_ok=True)
                    (directory / relative).write_bytes(data)
                self.sources[step] = {path: sha256(data) for path, data in files.items()}
                body = {"run": RUN, "step": step, "path": str(directory), "metrics": {"s": step}}
                while True:  # the agent may be down: retry until it answers
                    try:
                        answer = http.post("/v1/checkpoints", json=body)
                    except httpx.HTTPError:
                        answer = None
                    if answer is not None and answer.status_code in (200, 202):
                        break
                    if answer is not None and answer.status_code not in (429, 503):
                        raise AssertionError(f"register {step}: {answer.status_code} {answer.text}")
                    self.figures.register_retries += 1
                    time.sleep(0.2)
                self.figures.registrations += 1
                self.pause(0.1, 0.5)

    # -- the orchestrator: ask `latest` all the time ---------------------------

    def poller(self) -> None:
        with httpx.Client(base_url=self.agent.url, timeout=5) as http:
            while not self.stop.is_set():
                try:
                    answer = http.get(f"/v1/runs/{RUN}/latest")
                except httpx.HTTPError:
                    self.figures.latest_unreachable += 1
                    time.sleep(0.05)
                    continue
                if answer.status_code == 200:
                    self.latest_seen.append((time.monotonic(), answer.json()))
                elif answer.status_code not in (404, 503):
                    raise AssertionError(f"latest: {answer.status_code} {answer.text}")
                time.sleep(0.03)

    # -- trouble ---------------------------------------------------------------

    def killer(self) -> None:
        while self.pause(2.0, 5.0):
            self.agent.kill()
            self.figures.kills += 1
            time.sleep(self.rng.uniform(0, 0.5))
            self.agent.start(timeout=120)

    def region_outages(self) -> None:
        first = max(2.0, SECONDS * 0.2)
        if not self.pause(first, first + 1):
            return
        while True:
            self.west.stop()
            self.figures.region_outages += 1
            self.stop.wait(self.rng.uniform(2, 5))
            self.west.start()
            if not self.pause(25, 45):
                return

    def corruptor(self) -> None:
        with self.http() as http:
            while self.pause(2.5, 5.0):
                self.request_verifies(http)
                self.check_repairs()
                self.corrupt_one(http)
            self.request_verifies(http)

    def corrupt_one(self, http: httpx.Client) -> None:
        """Overwrite one object of a replicated checkpoint in one region
        (never a second one while the first is unrepaired)."""
        candidates = [s for s in sorted(self.sources) if s not in self.open_corruption]
        self.rng.shuffle(candidates)
        for step in candidates[:5]:
            try:
                detail = http.get(f"/v1/runs/{RUN}/checkpoints/{step}")
            except httpx.HTTPError:
                return
            if detail.status_code != 200 or detail.json()["state"] != "replicated":
                continue
            regions = ["east"] + (["west"] if self.west.running else [])
            region = self.rng.choice(regions)
            path = self.rng.choice(sorted(self.sources[step]))
            size = next(f["size"] for f in detail.json()["files"] if f["path"] == path)
            # Mostly the same size, so only the hash can tell.
            garbage = os.urandom(size if self.rng.random() < 0.7 else size + 17)
            try:
                self.clients[region].put_object(
                    Bucket=self.buckets[region], Key=object_key(step, path), Body=garbage
                )
            except Exception:
                return  # the region went down under us: nothing was corrupted
            self.corruptions.append(Corruption(step, region, path, time.monotonic()))
            self.open_corruption.add(step)
            self.verify_wanted.add(step)
            self.figures.corruptions += 1
            return

    def request_verifies(self, http: httpx.Client) -> None:
        for step in sorted(self.verify_wanted):
            try:
                answer = http.post(f"/v1/runs/{RUN}/checkpoints/{step}/verify")
            except httpx.HTTPError:
                continue  # the agent is down; next round
            if answer.status_code == 202:
                self.figures.verifies_requested += 1
                self.verify_wanted.discard(step)

    def check_repairs(self) -> None:
        """A corrupted object hashes to the source again: repaired."""
        for corruption in self.corruptions:
            if corruption.repaired_at is not None:
                continue
            if repaired(self, corruption):
                corruption.repaired_at = time.monotonic()
                if not any(
                    c.step == corruption.step and c.repaired_at is None for c in self.corruptions
                ):
                    self.open_corruption.discard(corruption.step)


def repaired(chaos: Chaos, corruption: Corruption) -> bool:
    try:
        body = (
            chaos.clients[corruption.region]
            .get_object(
                Bucket=chaos.buckets[corruption.region],
                Key=object_key(corruption.step, corruption.path),
            )["Body"]
            .read()
        )
    except Exception:
        return False  # region down: not known yet
    return sha256(body) == chaos.sources[corruption.step][corruption.path]


def _settled(detail: dict[str, Any]) -> bool:
    busy = any(j["state"] in ("queued", "running") for j in detail.get("jobs") or [])
    return detail["state"] in SETTLED | {"durable"} and not busy


@pytest.fixture
def chaos_catalog(tmp_path: Path) -> Iterator[str]:
    if pg.postgres_available():
        url = pg.create_temp_database(prefix="tierckpt_chaos_")
        try:
            yield url
        finally:
            pg.drop_database(url)
    else:
        yield f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}"


def test_chaos_loses_nothing(
    tmp_path: Path,
    chaos_catalog: str,
    seaweed: SeaweedServer,
    seaweed_west: SeaweedServer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    east_bucket = seaweed.create_bucket(f"chaos-east-{uuid.uuid4().hex[:10]}")
    west_bucket = seaweed_west.create_bucket(f"chaos-west-{uuid.uuid4().hex[:10]}")
    config = agent_config(
        tmp_path,
        name="chaos",
        node="chaos-node",
        catalog_url=chaos_catalog,
        regions=[
            s3_region("east", seaweed.endpoint_url, east_bucket, prefix=PREFIX),
            s3_region("west", seaweed_west.endpoint_url, west_bucket, prefix=PREFIX),
        ],
        server={"rate_limit_per_second": 0},
        upload={"part_size_mb": 5, "parts_in_flight": 4},
        worker={"poll_interval": 0.1, "lease_seconds": 5, "backoff_base": 0.2,
                "backoff_max": 2.0},
        # The scrubber re-reads on its own, too: corruption is found
        # even where no verify was asked for.
        scrub={"interval_seconds": 5, "min_age_hours": 0},
    )  # fmt: skip
    ssd = config.ssd
    agent = config.serve(tmp_path / "serve.log")
    chaos = Chaos(agent, seaweed_west, {"east": seaweed.client(), "west": seaweed_west.client()})
    chaos.buckets = {"east": east_bucket, "west": west_bucket}
    chaos.figures.catalog = "postgresql" if chaos_catalog.startswith("postgresql") else "sqlite"
    agent.start(timeout=120)
    try:
        threads = [
            chaos.thread(lambda: chaos.trainer(ssd), "trainer"),
            chaos.thread(chaos.poller, "poller"),
            chaos.thread(chaos.killer, "killer"),
            chaos.thread(chaos.region_outages, "regions"),
            chaos.thread(chaos.corruptor, "corruptor"),
        ]
        for thread in threads:
            thread.start()
        chaos.stop.wait(SECONDS)
        chaos.stop.set()
        for thread in threads:
            thread.join(180)
        assert not chaos.errors, chaos.errors
        if not seaweed_west.running:
            seaweed_west.start()
        if agent.proc is None or agent.proc.poll() is not None:
            agent.start(timeout=120)
        if chaos.figures.corruptions == 0:
            # A short window on a loaded machine may end before any checkpoint
            # was replicated: corrupt one now, so every run exercises repair.
            with chaos.http() as http:
                deadline = time.monotonic() + 120
                while chaos.figures.corruptions == 0 and time.monotonic() < deadline:
                    chaos.corrupt_one(http)
                    time.sleep(0.5)
                chaos.request_verifies(http)
        settle(chaos)
        check_everything(chaos)
        log = (tmp_path / "serve.log").read_text(errors="replace")
        chaos.figures.agent_tracebacks = log.count("Traceback (most recent call last)")
    finally:
        if not seaweed_west.running:
            seaweed_west.start()
        agent.kill()
        with capsys.disabled():
            print("\nchaos figures:", json.dumps(chaos.figures.__dict__, indent=2))
    assert chaos.figures.losses == 0, chaos.figures.problems
    assert chaos.figures.latest_invalid == 0, chaos.figures.problems
    assert chaos.figures.failed == 0, chaos.figures.problems
    assert not chaos.figures.problems, chaos.figures.problems
    # The chaos did happen (a run that did nothing proves nothing).
    assert chaos.figures.kills >= 1 and chaos.figures.region_outages >= 1
    assert chaos.figures.corruptions >= 1 and chaos.figures.registrations >= 5
    assert chaos.figures.corruptions_repaired == chaos.figures.corruptions


def details(http: httpx.Client, steps: list[int]) -> dict[int, dict[str, Any]]:
    return {s: http.get(f"/v1/runs/{RUN}/checkpoints/{s}").raise_for_status().json() for s in steps}


def settle(chaos: Chaos, timeout: float = 240) -> None:
    """Wait until every checkpoint has reached its end state with no work
    left, after one more verify of every corrupted checkpoint so that no
    injected corruption can go unnoticed. (The scrubber keeps queueing
    verifies: a checkpoint seen idle once is done.)"""
    steps = sorted(chaos.sources)
    deadline = time.monotonic() + timeout
    done: set[int] = set()
    with chaos.http() as http:
        for step in sorted({c.step for c in chaos.corruptions}):
            wait_idle(http, step, deadline)
            answer = http.post(f"/v1/runs/{RUN}/checkpoints/{step}/verify")
            assert answer.status_code in (202, 409), answer.text
        while True:
            found = details(http, [s for s in steps if s not in done])
            for step, detail in found.items():
                # "durable" is not an end state here: west is up again, so
                # replication must finish.
                if _settled(detail) and detail["state"] != "durable":
                    done.add(step)
            if len(done) == len(steps):
                return
            if time.monotonic() > deadline:
                left = {s: (d["state"], d["jobs"]) for s, d in found.items() if s not in done}
                raise AssertionError(
                    f"not settled after {timeout}s: {dict(list(left.items())[:5])}"
                )
            time.sleep(0.5)


def wait_idle(http: httpx.Client, step: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        detail = http.get(f"/v1/runs/{RUN}/checkpoints/{step}").json()
        if _settled(detail):
            return
        time.sleep(0.3)


def check_everything(chaos: Chaos) -> None:
    figures = chaos.figures
    with chaos.http() as http:
        final = details(http, sorted(chaos.sources))
    for step, detail in final.items():
        source = chaos.sources[step]
        state = detail["state"]
        figures.jobs_redone += sum(
            1 for j in detail["jobs"] if j["kind"] in ("upload", "replicate") and j["attempts"] > 1
        )
        if state == "failed":
            figures.failed += 1
            if not detail["error"]:
                figures.losses += 1
                figures.problems.append(f"step {step} failed without a reason")
            else:
                figures.problems.append(f"step {step} failed: {detail['error']}")
            continue
        if state not in ("durable", "replicated"):
            figures.losses += 1
            figures.problems.append(f"step {step} ended {state}: {detail['error']}")
            continue
        figures.replicated += state == "replicated"
        figures.durable_only += state == "durable"
        catalog_files = {f["path"]: f["sha256"] for f in detail["files"]}
        if catalog_files != source:
            figures.losses += 1
            figures.problems.append(f"step {step}: catalog hashes differ from the source")
            continue
        committed = [r["region"] for r in detail["replicas"] if r["state"] == "committed"]
        for region in committed:
            client, bucket = chaos.clients[region], chaos.buckets[region]
            for path, digest in source.items():
                body = client.get_object(Bucket=bucket, Key=object_key(step, path))["Body"].read()
                if sha256(body) != digest:
                    figures.losses += 1
                    figures.problems.append(f"step {step} {region} {path}: bytes differ")
            manifest = json.loads(
                client.get_object(Bucket=bucket, Key=manifest_key(step))["Body"].read()
            )
            if {f["path"]: f["sha256"] for f in manifest["files"]} != source:
                figures.losses += 1
                figures.problems.append(f"step {step} {region}: manifest differs from the source")
    figures.corruptions_repaired = sum(1 for c in chaos.corruptions if repaired(chaos, c))

    # Every `latest` answer: a registered step, the source's hashes, and a
    # checkpoint the final catalog holds as durable (none was taken back).
    figures.latest_answers = len(chaos.latest_seen)
    for _at, answer in chaos.latest_seen:
        step = answer["step"]
        problem = None
        if step not in chaos.sources:
            problem = "an unregistered step"
        elif answer["state"] not in ("durable", "replicated"):
            problem = f"state {answer['state']}"
        elif {f["path"]: f["sha256"] for f in answer["files"]} != chaos.sources[step]:
            problem = "files that do not hash to the source"
        elif final[step]["state"] not in ("durable", "replicated"):
            problem = f"a checkpoint that ended {final[step]['state']}"
        elif not answer["locations"]:
            problem = "no location"
        if problem:
            figures.latest_invalid += 1
            figures.problems.append(f"latest answered step {step} with {problem}")
    best = max(
        (s for s, d in final.items() if d["state"] in ("durable", "replicated")), default=None
    )
    with chaos.http() as http:
        latest = http.get(f"/v1/runs/{RUN}/latest")
    if best is not None and (latest.status_code != 200 or latest.json()["step"] != best):
        figures.problems.append(f"final latest is {latest.text[:200]}, expected step {best}")
