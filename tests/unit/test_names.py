"""One run-name rule (service/names.py), checked the same way by a request
body, a run named in a URL and a configured region."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from tierckpt.service.checkpoints.schemas import CheckpointRef
from tierckpt.service.config import RegionSettings
from tierckpt.service.names import RUN_NAME, is_region_name

GOOD = ["a", "llama-7b", "run_1.2", "A" * 128, "...", ".a", "a.."]
BAD = ["", "a" * 129, "a b", "a/b", "a:1", "a,b", "é", ".", "..", "a\n", "..\n", "a\nb"]


@pytest.mark.parametrize("name", GOOD)
def test_every_check_accepts_a_good_name(name: str) -> None:
    assert CheckpointRef(run=name, step=1).run == name
    assert RUN_NAME.match(name)
    assert is_region_name(name)
    assert RegionSettings(name=name, kind="posix", root="/x").name == name


@pytest.mark.parametrize("name", BAD)
def test_every_check_refuses_a_bad_name(name: str) -> None:
    with pytest.raises(ValidationError):
        CheckpointRef(run=name, step=1)
    assert not RUN_NAME.match(name)
    assert not is_region_name(name)
    with pytest.raises(ValidationError, match=r"region name must match \[A-Za-z0-9\._-\]\{1,128\}"):
        RegionSettings(name=name, kind="posix", root="/x")


def test_the_dot_segments_have_their_own_message() -> None:
    for name in (".", ".."):
        with pytest.raises(ValidationError, match=re.escape("run must not be '.' or '..'")):
            CheckpointRef(run=name, step=1)
