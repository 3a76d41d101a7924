"""What a rebuild found and did: per checkpoint, per region, and in total.

Plain data with a JSON form (``--json``); the CLI renders it for people
(``tierckpt.client.rebuild_report``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..models import CheckpointState

# Per-region outcome of a checkpoint (RegionResult.status).
VERIFIED = "verified"  # manifest present, every object verified -> committed
CORRUPT = "corrupt"  # manifest present, an object is missing/different, or the manifest disagrees
MISSING = "missing"  # no (usable) manifest in that region -> pending
UNVERIFIED = "unverified"  # could not be read (outage): no verdict -> pending
UNREACHABLE = "unreachable"  # region unreachable during the scan -> pending
KEPT = "kept"  # already in the catalog; not re-examined
STATUSES = (VERIFIED, CORRUPT, MISSING, UNVERIFIED, UNREACHABLE, KEPT)

VALID_STATES = (CheckpointState.DURABLE, CheckpointState.REPLICATED)


class CatalogUnreachable(Exception):
    """The catalog could not be migrated or written: nothing can be rebuilt."""


@dataclass
class RegionResult:
    status: str
    replica: str | None  # the replica's state in the catalog after the rebuild
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "replica": self.replica, "error": self.error}


@dataclass
class CheckpointResult:
    run: str
    step: int
    action: str  # created | updated | unchanged | skipped
    state: str | None
    world_size: int | None = None
    file_count: int | None = None
    total_bytes: int | None = None
    regions: dict[str, RegionResult] = field(default_factory=dict)
    jobs_enqueued: int = 0
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "step": self.step,
            "action": self.action,
            "state": self.state,
            "world_size": self.world_size,
            "file_count": self.file_count,
            "total_bytes": self.total_bytes,
            "regions": {name: r.to_json() for name, r in self.regions.items()},
            "jobs_enqueued": self.jobs_enqueued,
            "error": self.error,
        }


@dataclass
class RebuildReport:
    regions: list[str]
    checkpoints: list[CheckpointResult] = field(default_factory=list)
    regions_unreachable: list[dict[str, str]] = field(default_factory=list)
    manifests_invalid: list[dict[str, str]] = field(default_factory=list)

    @property
    def nothing_reachable(self) -> bool:
        return bool(self.regions) and len(self.regions_unreachable) == len(self.regions)

    def totals(self) -> dict[str, int]:
        actions = Counter(c.action for c in self.checkpoints)
        statuses = Counter(r.status for c in self.checkpoints for r in c.regions.values())
        return {
            "checkpoints": len(self.checkpoints),
            **{a: actions[a] for a in ("created", "updated", "unchanged", "skipped")},
            "valid": sum(1 for c in self.checkpoints if c.state in VALID_STATES),
            **{f"replicas_{s}": statuses[s] for s in STATUSES},
            "jobs_enqueued": sum(c.jobs_enqueued for c in self.checkpoints),
            "regions_unreachable": len(self.regions_unreachable),
            "manifests_invalid": len(self.manifests_invalid),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoints": [c.to_json() for c in self.checkpoints],
            "regions_unreachable": self.regions_unreachable,
            "manifests_invalid": self.manifests_invalid,
            "totals": self.totals(),
        }
