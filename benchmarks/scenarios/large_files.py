"""Large files as users see them: upload and restore of a checkpoint made of a
few large files, against boto3 and against the store's plain-PUT ceiling.

The checkpoint: 256 MiB + 129 MiB + 4 small files (96 + 48 MiB with
``--quick``), fresh random bytes for every variant of every repetition (no
dedup, no warm cache of a previous round). The S3 server's data are on a
tmpfs (``tmpfs_store``): a remote store shares nothing with the agent's disk,
and one on that disk would make every upload pay twice for one device. What
each repetition wrote is deleted and vacuumed before the next.

Upload variants, in rotating order each repetition:

- ``tierckpt``: ``CheckpointClient.register``, then the checkpoint's list
  entry polled every 50 ms until durable: the time the client learns it is
  durable (**client-seen**, the headline). The catalog's own created_at →
  durable_at is beside it, labelled.
- ``boto3 upload_file``: each file with ``upload_file``, one after another,
  default ``TransferConfig`` (8 MiB parts, 10 threads).
- ``plain PUT``: each file with one ``curl -T`` to a presigned PUT URL (made
  before the timing), one after another: no multipart, no hashing, a lean C
  client; the ceiling of what the store takes from one stream per file.

Every upload figure is also given as a fraction of the plain PUT of the same
repetition. Restore: ``CheckpointClient.restore`` (verified: SHA-256 of every
file, fsync, rename) against ``download_file`` of the same objects, into
fresh directories on the agent's disk, after one untimed read of every
object (the first read after an upload is slow for any client) and one
untimed restore (each client's buffers and connections warm, as boto3's
already are from that read).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from boto3.s3.transfer import TransferConfig

from devsupport.seaweed import SeaweedServer, boto3_client
from tierckpt.client import CheckpointClient

from ..context import REGION_PREFIX, Agent, BenchContext, log, s3_region, settle
from ..data import KiB, MiB, write_random
from ..procstat import tree_cpu_seconds
from ..stats import GB, MB, ratios, row
from ..tmpfs_store import empty, tmpfs_seaweed

NAME = "large_files"
TITLE = (
    "Large-file checkpoint, store on a tmpfs: tierckpt (client-seen) vs boto3 vs plain PUT "
    "(MB/s, higher is better)"
)
REQUIRES: tuple[str, ...] = ()

RUN = "bench-large"
BUCKET = "bench-large"
POLL_SECONDS = 0.05
FULL = [("model.safetensors", 256 * MiB), ("optim.bin", 129 * MiB)]
QUICK = [("model.safetensors", 96 * MiB), ("optim.bin", 48 * MiB)]
SMALL = [("config.json", 4 * KiB), ("tokenizer.json", 60 * KiB), ("rng.pt", 16 * KiB)]
SMALL += [("trainer_state.json", 8 * KiB)]
UPLOADS = ("tierckpt", "boto3 upload_file", "plain PUT")
RESTORES = ("tierckpt restore", "boto3 download_file")
TARGETS = "targets: ≥ 1.1× boto3 and ≥ 0.9× plain PUT (upload, client-seen); ≥ 1.2× boto3 (restore)"


def _files(ctx: BenchContext, directory: Path) -> list[tuple[str, int]]:
    files = (QUICK if ctx.quick else FULL) + SMALL
    for relative, size in files:
        write_random(directory / relative, size)
    return files


class _Run:
    """One agent and one tmpfs store for the scenario's repetitions."""

    def __init__(self, ctx: BenchContext, store: SeaweedServer, agent: Agent) -> None:
        self.ctx, self.store, self.agent = ctx, store, agent
        self.s3: Any = boto3_client(store.endpoint_url)

    def fresh(self, name: str) -> tuple[Path, list[tuple[str, int]]]:
        directory = self.ctx.ssd / RUN / f"{name.replace(' ', '-')}-{self.ctx.next_step()}"
        return directory, _files(self.ctx, directory)

    def tierckpt(self, directory: Path, files: list[tuple[str, int]]) -> dict[str, Any]:
        step = self.ctx.next_step()
        params = {"min_step": step, "max_step": step, "limit": 1}
        with (
            CheckpointClient(self.agent.url) as client,
            httpx.Client(base_url=self.agent.url, timeout=30) as http,
        ):
            cpu_before = tree_cpu_seconds(self.agent.pid)
            began = time.perf_counter()
            client.register(RUN, step, directory)
            register_seconds = time.perf_counter() - began
            while True:
                state = http.get(f"/v1/runs/{RUN}/checkpoints", params=params).json()
                state = state["checkpoints"][0]["state"]
                if state in ("durable", "replicated"):
                    break
                if state in ("failed", "corrupt", "deleted"):
                    raise RuntimeError(f"{RUN}:{step} ended {state}")
                time.sleep(POLL_SECONDS)
            seconds = time.perf_counter() - began
            agent_cpu = tree_cpu_seconds(self.agent.pid) - cpu_before
            detail = client.get(RUN, step)
        assert detail.created_at and detail.durable_at
        return {
            "seconds": seconds,
            "server_seconds": (detail.durable_at - detail.created_at).total_seconds(),
            "register_seconds": register_seconds,
            "agent_cpu_seconds": agent_cpu,
            "step": step,
        }

    def boto3(self, directory: Path, files: list[tuple[str, int]]) -> dict[str, Any]:
        prefix = f"baseline/boto3/{directory.name}"
        began = time.perf_counter()
        for relative, _ in files:
            self.s3.upload_file(
                str(directory / relative), BUCKET, f"{prefix}/{relative}", Config=TransferConfig()
            )
        return {"seconds": time.perf_counter() - began}

    def plain_put(self, directory: Path, files: list[tuple[str, int]]) -> dict[str, Any]:
        prefix = f"baseline/put/{directory.name}"
        urls = [
            self.s3.generate_presigned_url(
                "put_object", Params={"Bucket": BUCKET, "Key": f"{prefix}/{relative}"}
            )
            for relative, _ in files
        ]
        began = time.perf_counter()
        for (relative, _), url in zip(files, urls, strict=True):
            # "Expect:" off: curl would otherwise wait for a 100 Continue first.
            subprocess.run(
                [
                    "curl",
                    "-sSf",
                    "-H",
                    "Expect:",
                    "-T",
                    str(directory / relative),
                    url,
                    "-o",
                    "/dev/null",
                ],
                check=True,
            )
        return {"seconds": time.perf_counter() - began}

    def measures(self) -> dict[str, Callable[[Path, list[tuple[str, int]]], dict[str, Any]]]:
        return {UPLOADS[0]: self.tierckpt, UPLOADS[1]: self.boto3, UPLOADS[2]: self.plain_put}


def _uploads(run_: _Run) -> dict[str, list[dict[str, Any]]]:
    ctx = run_.ctx
    measures = run_.measures()
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in UPLOADS}
    for rep in range(ctx.reps):
        order = UPLOADS[rep % 3 :] + UPLOADS[: rep % 3]
        for name in order:
            directory, files = run_.fresh(name)
            total = sum(size for _, size in files)
            settle()
            result = measures[name](directory, files)
            result["bytes"] = total
            results[name].append(result)
            shutil.rmtree(directory, ignore_errors=True)
            log(
                f"large files rep {rep + 1}/{ctx.reps} {name:<18} "
                f"{total / result['seconds'] / MB:7.1f} MB/s"
            )
        empty(run_.store, BUCKET)
    return results


def _restores(run_: _Run) -> tuple[dict[str, list[float]], int]:
    """Restore seconds per variant, from one checkpoint uploaded here."""
    ctx = run_.ctx
    directory, files = run_.fresh("restore-source")
    step = run_.tierckpt(directory, files)["step"]
    total = sum(size for _, size in files)
    keys = [
        f"{REGION_PREFIX}/{RUN}/step-{step:012d}/rank-00000/{relative}" for relative, _ in files
    ]
    target = ctx.work / "large-restore"
    for key in keys:  # the untimed first read of every object
        run_.s3.download_file(BUCKET, key, str(target.with_suffix(".warm")))
    target.with_suffix(".warm").unlink(missing_ok=True)
    seconds: dict[str, list[float]] = {name: [] for name in RESTORES}
    with CheckpointClient(run_.agent.url) as client:
        # And one untimed restore: the warm-up above also warmed boto3's
        # allocator and connections in this process; this one does the same
        # for tierckpt's (its range buffers are kept for the next restore).
        client.restore(RUN, target, step=step)
        shutil.rmtree(target, ignore_errors=True)
        for rep in range(ctx.reps):
            order = RESTORES[rep % 2 :] + RESTORES[: rep % 2]
            for name in order:
                shutil.rmtree(target, ignore_errors=True)
                settle()
                began = time.perf_counter()
                if name == RESTORES[0]:
                    client.restore(RUN, target, step=step)
                else:
                    target.mkdir(parents=True)
                    for (relative, _), key in zip(files, keys, strict=True):
                        (target / relative).parent.mkdir(parents=True, exist_ok=True)
                        run_.s3.download_file(BUCKET, key, str(target / relative))
                seconds[name].append(time.perf_counter() - began)
                log(
                    f"large files restore rep {rep + 1}/{ctx.reps} {name:<20} "
                    f"{total / seconds[name][-1] / MB:7.1f} MB/s"
                )
    shutil.rmtree(target, ignore_errors=True)
    shutil.rmtree(directory, ignore_errors=True)
    return seconds, total


def _rows(
    uploads: dict[str, list[dict[str, Any]]], restores: dict[str, list[float]], restored: int
) -> list[dict[str, Any]]:
    mbps = {name: [r["bytes"] / r["seconds"] / MB for r in uploads[name]] for name in UPLOADS}
    put = mbps["plain PUT"]
    tier = mbps["tierckpt"]
    rows = [
        row(
            "tierckpt (client-seen)",
            "upload throughput",
            "MB/s",
            tier,
            ratio_label="tierckpt / boto3",
            ratio_values=ratios(tier, mbps["boto3 upload_file"]),
            note="register sent → the client's poll (every 50 ms) sees durable",
        ),
        row(
            "tierckpt (client-seen)",
            "fraction of plain PUT",
            "×",
            ratios(tier, put),
            note="same repetition's plain PUT of the same sizes",
        ),
        row(
            "tierckpt (server clock)",
            "upload throughput",
            "MB/s",
            [r["bytes"] / r["server_seconds"] / MB for r in uploads["tierckpt"]],
            note="catalog created_at → durable_at (no client round trips): beside the headline",
        ),
        row(
            "boto3 upload_file",
            "upload throughput",
            "MB/s",
            mbps["boto3 upload_file"],
            ratio_label="fraction of plain PUT",
            ratio_values=ratios(mbps["boto3 upload_file"], put),
            note="default TransferConfig, files one after another",
        ),
        row("plain PUT (curl -T)", "upload throughput", "MB/s", put, note="the ceiling"),
        row(
            "tierckpt agent CPU",
            "per GB uploaded",
            "s/GB",
            [r["agent_cpu_seconds"] / (r["bytes"] / GB) for r in uploads["tierckpt"]],
            note="hash + upload + catalog, while uploading",
        ),
    ]
    tier_restore = [restored / s / MB for s in restores[RESTORES[0]]]
    boto_restore = [restored / s / MB for s in restores[RESTORES[1]]]
    rows.append(
        row(
            "tierckpt restore",
            "restore throughput",
            "MB/s",
            tier_restore,
            ratio_label="tierckpt / boto3",
            ratio_values=ratios(tier_restore, boto_restore),
            note="verified (SHA-256 of every file), fsynced, renamed into place",
        )
    )
    rows.append(
        row(
            "boto3 download_file",
            "restore throughput",
            "MB/s",
            boto_restore,
            note="default TransferConfig, no hash check, no fsync",
        )
    )
    return rows


def run(ctx: BenchContext) -> dict[str, Any]:
    with tmpfs_seaweed(ctx.work, (BUCKET,)) as (store, where):
        region = {**s3_region("east", store), "bucket": BUCKET}
        agent = ctx.start_agent("large", regions=[region])
        try:
            run_ = _Run(ctx, store, agent)
            uploads = _uploads(run_)
            restores, restored = _restores(run_)
        finally:
            ctx.stop_agent(agent)
    sizes = (QUICK if ctx.quick else FULL) + SMALL
    return {
        "rows": _rows(uploads, restores, restored),
        "notes": [
            f"{' + '.join(f'{s / MiB:g} MiB' for _, s in sizes[:2])} + {len(SMALL)} small files, "
            f"fresh random bytes per variant and repetition; {ctx.reps} repetitions in "
            "rotating order; ratios paired per repetition.",
            f"The S3 server's data are on a tmpfs ({where}); each repetition's objects are "
            "deleted and the volumes vacuumed before the next.",
            TARGETS,
        ],
        "details": {"uploads": uploads, "restores": restores, "restored_bytes": restored},
    }
