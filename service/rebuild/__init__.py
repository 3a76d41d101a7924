"""Catalog rebuild (disaster recovery): recreate a lost catalog from the
regions' MANIFEST.json objects, re-verifying every object before anything is
called valid. Entry point: ``tierckpt rebuild-catalog --config FILE``."""

from .rebuild import (
    REBUILT_NODE,
    CatalogUnreachable,
    CheckpointResult,
    RebuildReport,
    RegionResult,
    rebuild,
    render_report,
)

__all__ = [
    "REBUILT_NODE",
    "CatalogUnreachable",
    "CheckpointResult",
    "RebuildReport",
    "RegionResult",
    "rebuild",
    "render_report",
]
