"""Step 2 of a rebuild: read one region's copy of a checkpoint and judge it.

Each region's MANIFEST.json is read (bounded) and parsed; every object it
lists is re-read and compared (``integrity.verifier``). Then:

- ``choose_manifest``: when regions disagree, the content whose objects
  verify in the most regions wins (then: whose objects are at least not
  proven bad; then configuration order, primary first).
- ``judge``: a region's status against the winning (or the catalog's)
  content. A region whose manifest disagrees is ``corrupt`` even if its own
  objects match it; a read error is no verdict (``unverified``), never
  corruption.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..integrity.verifier import Mismatch, Verification, reading, verify_objects
from ..storage.base import ObjectInfo, ObjectNotFound, ObjectStore
from ..storage.manifest import Content, InvalidManifest, Manifest, parse_manifest
from .context import Context
from .report import CORRUPT, MISSING, UNVERIFIED, VERIFIED

log = logging.getLogger("tierckpt.rebuild")

MAX_MANIFEST_BYTES = 256 << 20
NAMED_OBJECTS = 5  # bad objects named in a replica's error
MAX_ERROR = 4000


@dataclass
class RegionCheck:
    manifest: Manifest | None = None
    verification: Verification | None = None
    status: str | None = None  # set when there is no manifest to judge
    error: str | None = None


async def check_region(
    ctx: Context, store: ObjectStore, run: str, step: int, info: ObjectInfo
) -> RegionCheck:
    try:
        data = await _read_all(store, info.key, MAX_MANIFEST_BYTES)
        manifest = parse_manifest(data, run, step)
    except ObjectNotFound:
        return RegionCheck(status=MISSING, error="MANIFEST.json vanished during the rebuild")
    except InvalidManifest as exc:
        ctx.report.manifests_invalid.append(
            {"region": store.region, "key": info.key, "uri": store.uri(info.key), "error": str(exc)}
        )
        log.warning("%s: invalid manifest %s: %s", store.region, info.key, exc)
        return RegionCheck(status=MISSING, error=f"invalid MANIFEST.json: {exc}")
    except Exception as exc:
        log.warning("%s: reading %s failed: %s", store.region, info.key, exc)
        return RegionCheck(status=UNVERIFIED, error=f"reading MANIFEST.json failed: {exc}")
    if manifest.key_layout != store.key_layout:
        # Not corruption: the objects are where the manifest says, and this
        # agent would look for them elsewhere.
        error = (
            f"MANIFEST.json says key layout {manifest.key_layout or 'plain'}, the region is "
            f"configured with {store.key_layout or 'plain'} (hashed_prefix): set it to match "
            "to read this copy"
        )
        log.warning("%s: %s: %s", store.region, info.key, error)
        return RegionCheck(status=UNVERIFIED, error=error)
    verification = await verify_objects(
        store,
        manifest.files,
        slots=ctx.slots,
        width=ctx.objects_in_flight,
        collect_read_errors=True,
    )
    for failed in verification.unreadable:
        log.warning("%s: reading %s failed: %s", store.region, failed.entry.key, failed.error)
    return RegionCheck(manifest=manifest, verification=verification)


async def _read_all(store: ObjectStore, key: str, limit: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    async with reading(store, key) as stream:
        async for chunk in stream:
            total += len(chunk)
            if total > limit:
                raise InvalidManifest(f"larger than {limit} bytes")
            chunks.append(chunk)
    return b"".join(chunks)


def choose_manifest(checks: dict[str, RegionCheck], order: list[str]) -> str | None:
    """The region whose manifest wins: its content verifies in the most
    regions (then: is at least not proven bad in the most; then
    configuration order). None when no region holds a usable manifest."""
    held = [name for name in order if (c := checks.get(name)) and c.manifest is not None]
    if not held:
        return None

    def score(name: str) -> tuple[int, int, int]:
        content = checks[name].manifest.content  # type: ignore[union-attr]
        same = [
            checks[o].verification
            for o in held
            if checks[o].manifest.content == content  # type: ignore[union-attr]
        ]
        verified = sum(1 for v in same if v is not None and v.ok)
        not_bad = sum(1 for v in same if v is not None and not v.bad)
        return (-verified, -not_bad, order.index(name))

    return min(held, key=score)


def judge(check: RegionCheck, expected: Content | None, against: str) -> tuple[str, str | None]:
    """(status, error) of one region's copy against the expected content."""
    if check.manifest is None or check.verification is None:
        return check.status or MISSING, check.error
    v = check.verification
    problems = []
    if v.bad:
        bad = sorted(_described(m) for m in v.bad)
        problems.append(
            f"{len(bad)} of {len(check.manifest.files)} object(s) do not match "
            f"MANIFEST.json: {_name_some(bad)}"
        )
    if expected is not None and check.manifest.content != expected:
        problems.append(
            f"MANIFEST.json disagrees with {against} on {_difference(expected, check.manifest)}"
        )
    if problems:
        return CORRUPT, ("rebuild: " + "; ".join(problems))[:MAX_ERROR]
    if v.unreadable:
        unreadable = sorted(
            f"{u.entry.key} ({type(u.error).__name__}: {u.error})" for u in v.unreadable
        )
        return UNVERIFIED, (
            f"rebuild could not read {len(unreadable)} object(s): {_name_some(unreadable)}"
        )[:MAX_ERROR]
    if expected is None:
        return UNVERIFIED, "the catalog holds no complete file hashes for this checkpoint yet"
    return VERIFIED, None


def _described(mismatch: Mismatch) -> str:
    """``key (why)``: missing, or how its size or hash differs."""
    entry, key = mismatch.entry, mismatch.entry.key
    if mismatch.missing:
        return f"{key} (missing)"
    if mismatch.larger:
        return f"{key} (larger than the manifest's {entry.size} bytes)"
    if mismatch.size != entry.size:
        return f"{key} (size {mismatch.size} != {entry.size})"
    digest = mismatch.sha256 or ""
    return f"{key} (sha256 {digest[:12]}… != {entry.sha256[:12]}…)"


def _difference(expected: Content, manifest: Manifest) -> str:
    world_size, files = expected
    if manifest.world_size != world_size:
        return f"world_size ({manifest.world_size} != {world_size})"
    differing = sorted(
        {f"rank-{e.rank:05d}/{e.path}" for e in set(files).symmetric_difference(manifest.files)}
    )
    return f"{len(differing)} file(s): {_name_some(differing)}"


def _name_some(items: list[str]) -> str:
    shown = ", ".join(items[:NAMED_OBJECTS])
    if len(items) > NAMED_OBJECTS:
        shown += f", and {len(items) - NAMED_OBJECTS} more"
    return shown
