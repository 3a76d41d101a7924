"""Bodies of the per-run retention endpoints."""

from __future__ import annotations

from pydantic import BaseModel

from ..config import RetentionPolicySettings


class RetentionOut(BaseModel):
    run: str
    policy: RetentionPolicySettings
    overridden: bool  # False: the server's [retention] default applies
    would_delete: list[int]


class RetentionApplied(BaseModel):
    run: str
    delete_queued: list[int]
