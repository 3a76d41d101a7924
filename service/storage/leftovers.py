"""Open multipart uploads nobody will complete: what a killed upload leaves."""

from __future__ import annotations

import logging

from .base import ObjectStore, StoreError

log = logging.getLogger("tierckpt.storage")


async def abort_left_uploads(store: ObjectStore, prefix: str) -> None:
    """Abort the uploads still open under ``prefix``, best effort: a store that
    refuses to list them (an S3 policy without s3:ListBucketMultipartUploads)
    must not stop the upload or the deletion that asks; the bucket's lifecycle
    rule is then the only sweeper."""
    try:
        aborted = await store.abort_incomplete(prefix)
    except StoreError as exc:
        log.warning("could not clear open uploads under %s in %s: %s", prefix, store.region, exc)
        return
    if aborted:
        log.info("aborted %d open upload(s) under %s in %s", aborted, prefix, store.region)
