"""S3 endpoint resolution that botocore's cache can answer.

botocore resolves the endpoint of every request by evaluating S3's endpoint
rule set, behind a cache keyed on the rule set's parameters. S3's rule set
declares ``Key``, ``Prefix`` and ``CopySource`` as parameters without any
rule referring to them, so with a new object key every request misses the
cache and the whole rule tree is evaluated again, for the same endpoint:
a few milliseconds of the worker's CPU for every object it puts, copies,
heads or deletes (boto/botocore#3528; fixed upstream by dropping exactly
these three, boto/botocore#3692, in a botocore newer than the one aioboto3
pins). This drops them from a client's resolver the same way, each only
while the rule set's rules do not name it: a later rule set that does keeps
it, and the answer never changes.
"""

from __future__ import annotations

import json
import logging
from functools import cache
from typing import Any

from botocore import loaders

log = logging.getLogger("tierckpt.storage")

UNREFERENCED = ("Key", "Prefix", "CopySource")


def unreferenced(ruleset: dict[str, Any]) -> tuple[str, ...]:
    """Those of UNREFERENCED that ``ruleset`` (an endpoint-rule-set document)
    declares and none of its rules names (as a reference or in a template)."""
    rules = json.dumps(ruleset.get("rules", []))
    declared = ruleset.get("parameters", {})
    return tuple(
        name
        for name in UNREFERENCED
        if name in declared and f'"{name}"' not in rules and "{" + name + "}" not in rules
    )


@cache
def _s3_unreferenced() -> tuple[str, ...]:
    try:
        ruleset = loaders.create_loader().load_service_model("s3", "endpoint-rule-set-1")
    except Exception as exc:  # no rule set to read: change nothing
        log.debug("S3 endpoint rule set not readable: %s", exc)
        return ()
    return unreferenced(ruleset)


def make_cacheable(client: Any) -> tuple[str, ...]:
    """Drop the unreferenced parameters from ``client``'s endpoint resolver;
    the names dropped (none when the client has no such resolver)."""
    resolver = getattr(client, "_ruleset_resolver", None)
    definitions = getattr(resolver, "_param_definitions", None)
    if not isinstance(definitions, dict):
        return ()
    dropped = tuple(name for name in _s3_unreferenced() if name in definitions)
    if dropped:
        # A copy: the mapping may be the rule set's own, shared by other clients.
        resolver._param_definitions = {  # type: ignore[union-attr]
            name: definition for name, definition in definitions.items() if name not in dropped
        }
    return dropped
