"""A job for a region this agent has no configuration for fails for good."""

from __future__ import annotations

from typing import Any, cast

import pytest

from tierckpt.service.jobs.worker import PermanentJobError, region_store
from tierckpt.service.models import Job


def test_a_configured_region_gives_its_store() -> None:
    store = object()
    stores = cast(dict[str, Any], {"east": store})
    assert region_store(stores, Job(kind="upload", checkpoint_id=1, region="east")) is store


@pytest.mark.parametrize("region", ["west", None])
def test_an_unknown_or_missing_region_is_permanent(region: str | None) -> None:
    stores = cast(dict[str, Any], {"east": object()})
    with pytest.raises(PermanentJobError, match="is not configured on this agent"):
        region_store(stores, Job(kind="upload", checkpoint_id=1, region=region))
