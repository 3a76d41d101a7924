"""Build one store per configured region, chosen by the region's kind."""

from __future__ import annotations

from ..config import RegionSettings, Settings
from .base import ObjectStore
from .posix import PosixStore
from .s3 import S3Store


def build_store(region: RegionSettings, pool_size: int = 32) -> ObjectStore:
    if region.kind == "posix":
        return PosixStore(region)
    return S3Store(region, pool_size=pool_size)


class Stores(dict[str, ObjectStore]):
    """Region name -> store, in configuration order (the first is primary)."""

    @property
    def primary(self) -> ObjectStore:
        return next(iter(self.values()))

    async def aclose(self) -> None:
        for store in self.values():
            await store.aclose()


def build_stores(settings: Settings) -> Stores:
    pool = max(32, settings.upload.parts_in_flight * 2 + settings.upload.files_in_flight)
    return Stores((r.name, build_store(r, pool)) for r in settings.regions)
