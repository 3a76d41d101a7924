"""The dashboard writes sizes as the CLI does, without the service importing rich."""

from __future__ import annotations

import pytest
from rich.filesize import decimal

from tierckpt.service.ui.svg import size


@pytest.mark.parametrize(
    "value",
    [0, 1, 2, 999, 1000, 1001, 999_949, 999_950, 10**6, 123_456_789, 10**24 - 1, 10**24, 10**27],
)
def test_sizes_read_as_in_the_cli(value: int) -> None:
    assert size(value) == decimal(value)
