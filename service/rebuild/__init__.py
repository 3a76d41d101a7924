"""Catalog rebuild (disaster recovery): recreate a lost catalog from the
regions' MANIFEST.json objects, re-verifying every object before anything is
called valid. Entry point: ``tierckpt rebuild-catalog --config FILE``.

Every region holds, per checkpoint, ``{run}/step-{step:012d}/MANIFEST.json``
(written last: the commit marker) listing world_size, parent, metrics and
every file with its size and SHA-256. From those alone the catalog is
recreated, and **nothing is called valid before its bytes are re-read**.
One module per step:

- ``runner``: migrate the catalog (an empty database gets the schema), then
  run the steps below for each (run, step), a few at a time.
- ``scan``: list every configured region for ``{run}/step-{12 digits}/
  MANIFEST.json``; an unreachable region is reported, the others are used.
- ``check``: per (run, step) and region, read and parse the manifest (one
  that is not valid is reported and ignored), stream every object it lists
  and compare size and hash; choose the winning content and judge each
  region against it. Read errors are not corruption: they leave the replica
  ``pending``; a missing object or a differing size or hash is ``corrupt``.
- ``catalog``: one transaction per checkpoint writes the outcome; the state
  comes from ``refresh_state``, and replicate jobs are queued for the
  replicas an intact copy can repair.
- ``report``: what was found and done, as data (``--json``); the CLI renders
  it for people.

Idempotent: a (run, step) already in the catalog keeps its rows; only its
missing or ``pending`` replicas are examined (against the catalog's
hashes), so running the rebuild twice changes nothing the second time.
"""

from .catalog import REBUILT_NODE
from .report import CatalogUnreachable, CheckpointResult, RebuildReport, RegionResult
from .runner import rebuild

__all__ = [
    "REBUILT_NODE",
    "CatalogUnreachable",
    "CheckpointResult",
    "RebuildReport",
    "RegionResult",
    "rebuild",
]
