"""Bearer tokens: hashed storage, roles, run patterns."""

from __future__ import annotations

import hashlib

import pytest

from tierckpt.service.auth import LOOPBACK_ADMIN, Action, authenticate, authorize
from tierckpt.service.config import TokenSettings
from tierckpt.service.errors import Forbidden, Unauthorized

TOKENS = [
    TokenSettings(
        name="trainers",
        sha256=hashlib.sha256(b"t-secret").hexdigest(),
        role="trainer",
        runs="llama-*",
    ),
    TokenSettings(name="ops", sha256=hashlib.sha256(b"a-secret").hexdigest(), role="admin"),
]


def test_no_tokens_means_loopback_admin() -> None:
    assert authenticate(None, []) is LOOPBACK_ADMIN


@pytest.mark.parametrize("header", [None, "Basic abc", "Bearer wrong"])
def test_missing_or_wrong_token_is_401(header: str | None) -> None:
    with pytest.raises(Unauthorized):
        authenticate(header, TOKENS)


def test_roles_and_patterns() -> None:
    trainer = authenticate("Bearer t-secret", TOKENS)
    assert trainer.name == "trainers"
    authorize(trainer, Action.WRITE, "llama-7b")
    authorize(trainer, Action.READ, "llama-7b")
    with pytest.raises(Forbidden):
        authorize(trainer, Action.WRITE, "gpt-2")
    with pytest.raises(Forbidden):
        authorize(trainer, Action.ADMIN, "llama-7b")
    admin = authenticate("bearer a-secret", TOKENS)
    authorize(admin, Action.ADMIN, "anything")
