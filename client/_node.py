"""This node's name as the agent knows it, and a warning when the two differ.

The agent answers ``latest(..., node=)`` with the memory-tier and T0 copies
of the node it is told; those copies are its own node's (``[server] node``).
A client that names its node otherwise (``$TIERCKPT_NODE``, else the host
name) is told of none of them, and every restore downloads from a region:
slower, and silent unless said. So the client says it, once per pair.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING

from .errors import TierckptError

if TYPE_CHECKING:
    from .sync_client import CheckpointClient

log = logging.getLogger("tierckpt.client")

_warned: set[tuple[str, str]] = set()


def default_node() -> str:
    """This node's name as the agent knows it: $TIERCKPT_NODE, else the host
    name (the agent's default ``[server] node``)."""
    return os.environ.get("TIERCKPT_NODE") or socket.gethostname()


def check_node(node: str, agent_node: str | None, agent_url: str = "") -> bool:
    """Whether ``node`` (the client's) is the agent's; a warning, once, when not."""
    if not agent_node or agent_node == node:
        return True
    if (node, agent_node) not in _warned:
        _warned.add((node, agent_node))
        log.warning(
            "this client's node is %r but the agent%s is [server] node = %r: restores skip "
            "the agent's memory and local (T0) copies and download from a region. Set "
            "TIERCKPT_NODE=%s on this node (or pass node=%r)",
            node,
            f" at {agent_url}" if agent_url else "",
            agent_node,
            agent_node,
            agent_node,
        )
    return False


def confirm_node(client: CheckpointClient, node: str) -> bool:
    """:func:`check_node` against the agent ``client`` talks to (one call;
    True when the agent cannot say)."""
    try:
        agent_node = client.memory_info().node
    except TierckptError:
        return True
    return check_node(node, agent_node, client.base_url)
