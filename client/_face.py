"""The constructor both public clients share.

:class:`CheckpointClient` and :class:`AsyncCheckpointClient` take the same
settings; they differ only in the kind of transport their API calls go
through (blocking or async) and in how they open their connections and
start the journal's replayer, which each says in :meth:`ClientFace._open`.
The settings themselves, and which transport restore downloads use, are
decided here once. :class:`ClientCore` stays free of I/O (its flows are
tested without a network).
"""

from __future__ import annotations

import os
from typing import Generic, TypeVar

import httpx

from . import _api
from ._api import DEFAULT_URL
from ._core import ClientCore
from ._download import TransferOptions

TransportT = TypeVar("TransportT", httpx.BaseTransport, httpx.AsyncBaseTransport)


class ClientFace(ClientCore, Generic[TransportT]):
    """``Client(url, token, timeout, *, retries, transport, async_transport,
    transfer, journal)``, for either face.

    ``transport`` replaces the network for API calls (tests, custom TLS).
    ``async_transport`` carries restore downloads; it defaults to
    ``transport`` when that one can serve async requests (as
    ``httpx.MockTransport`` can); with neither, restores read presigned URLs
    through a tuned transport of their own. ``transfer`` tunes restore
    downloads. ``journal`` (a file path) makes ``register`` survive an
    unreachable service: the registration is kept in that local journal and
    replayed in the background (see :mod:`tierckpt.client.journal`).
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        token: str | None = None,
        timeout: float = 30.0,
        *,
        retries: int = _api.RETRY_ATTEMPTS,
        transport: TransportT | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
        transfer: TransferOptions | None = None,
        journal: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(base_url, token, timeout, retries, transfer, journal)
        if async_transport is None and isinstance(transport, httpx.AsyncBaseTransport):
            async_transport = transport
        self._download_transport = async_transport
        self._open(transport)

    def _open(self, transport: TransportT | None) -> None:
        """Open the API connections over ``transport`` and, with a journal,
        get its replayer going."""
        raise NotImplementedError
