"""What the steps of one rebuild share: settings, stores, the catalog's
session maker, the object-read slots, the report being filled and the
regions the scan could not reach."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from ..config import Settings
from ..storage.base import ObjectInfo
from ..storage.factory import Stores
from .report import KEPT, MISSING, UNREACHABLE, RebuildReport


@dataclass
class Context:
    settings: Settings
    stores: Stores
    sessionmaker: async_sessionmaker[AsyncSession]
    slots: asyncio.Semaphore  # object reads in flight, across regions and checkpoints
    objects_in_flight: int
    report: RebuildReport
    unreachable: set[str]

    def status_unchecked(self, region: str, found: dict[str, ObjectInfo]) -> str:
        """The status of a region whose copy was not read: unreachable, no
        manifest there, or left as the catalog has it."""
        if region in self.unreachable:
            return UNREACHABLE
        if region not in found:
            return MISSING
        return KEPT
