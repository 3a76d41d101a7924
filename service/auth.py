"""Bearer tokens with a role and a run pattern: who may do what to which run.

Tokens are configured as SHA-256 digests only; a presented token is hashed
and compared with every configured digest in constant time. With no tokens
configured, the agent is bound to loopback (config validation) and every
caller on this machine is treated as admin.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from dataclasses import dataclass
from fnmatch import fnmatchcase

from .config import TokenSettings
from .errors import Forbidden, Unauthorized


class Action(enum.IntEnum):
    READ = 1
    WRITE = 2  # register
    ADMIN = 3  # delete, pin, quarantine, retention


ROLE_ALLOWS = {"reader": Action.READ, "trainer": Action.WRITE, "admin": Action.ADMIN}
# A peer token allows no action of the API: only pushing peer copies
# (authorize_peer_push), which no other role may do.
PEER_ROLE = "peer"


@dataclass(frozen=True)
class Principal:
    name: str
    role: str
    runs: str

    def allows(self, action: Action, run: str | None) -> bool:
        if ROLE_ALLOWS.get(self.role, 0) < action:
            return False
        return run is None or fnmatchcase(run, self.runs)


LOOPBACK_ADMIN = Principal(name="loopback", role="admin", runs="*")


def authenticate(authorization: str | None, tokens: list[TokenSettings]) -> Principal:
    if not tokens:
        return LOOPBACK_ADMIN
    if not authorization or not authorization.lower().startswith("bearer "):
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    presented = hashlib.sha256(authorization[7:].strip().encode()).hexdigest()
    match = None
    for token in tokens:
        # No early exit: the time taken does not reveal which digest matched.
        if hmac.compare_digest(presented, token.sha256):
            match = token
    if match is None:
        raise Unauthorized("invalid token")
    return Principal(name=match.name, role=match.role, runs=match.runs)


def authorize(principal: Principal, action: Action, run: str | None = None) -> None:
    if not principal.allows(action, run):
        target = f" on run {run!r}" if run else ""
        raise Forbidden(
            f"token {principal.name!r} ({principal.role}) may not {action.name.lower()}{target}"
        )


def authorize_peer_push(principal: Principal) -> None:
    """Only agents push peer copies: a `peer` token, or, with no tokens
    configured, a loopback caller (the agent is then bound to loopback)."""
    if principal.role == PEER_ROLE or principal is LOOPBACK_ADMIN:
        return
    raise Forbidden(
        f"token {principal.name!r} ({principal.role}) may not push peer copies: "
        "only a token of role 'peer' may (set it as [peers] token on the pushing agent)"
    )
