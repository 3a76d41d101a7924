"""A storage plugin for ``torch.distributed.checkpoint`` (DCP) through tierckpt.

::

    from tierckpt.client.dcp import TierckptReader, TierckptWriter

    dcp.save(state, storage_writer=TierckptWriter(client, "llm", step, "/ssd/ckpt"))
    dcp.load(state, storage_reader=TierckptReader(client, "llm", "/ssd/ckpt"))  # latest valid

Both work in a process group of any size, and a checkpoint saved by N ranks
loads into M ranks (resharding is DCP's; the plugin reads what each rank's
load plan asks for).

Save (:class:`TierckptWriter`, DCP's ``FileSystemWriter`` underneath): each
rank writes its files into ``root/run/step-N/rank-R`` on its node and
registers that directory as its rank: the other ranks once their data is
written, the coordinator after it has written ``.metadata`` too, so the
checkpoint (valid once every rank's part is durable) always holds it.

Load (:class:`TierckptReader`) needs a durable checkpoint (the chunk hashes
are the upload's; ``step=None`` is the latest valid one): each rank reads
only the byte ranges its load plan needs, from the nearest copy (this node's
T0 copy when the agent calls it intact, then the regions in the restore
plan's order), and verifies every range by the per-chunk SHA-256s the upload
recorded (a range is rounded out to whole chunks; a chunk that does not
verify is read again, alone, from the next copy). A tensor that a rank needs
only part of (after resharding) is not read whole: only its archive's head
and the bytes of the slice. Files uploaded before chunk hashes existed are
verified whole instead (the T0 copy hashed, or a download into a scratch
directory under ``root``). ``reader.bytes_read`` / ``bytes_by_source`` say
what a rank read.

Importing this module does not import torch; the classes do, on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._dcp_plugin import TierckptReader, TierckptWriter

__all__ = ["TierckptReader", "TierckptWriter"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import _dcp_plugin

        return getattr(_dcp_plugin, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
