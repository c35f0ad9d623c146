"""The transport seam: how decode pulls a request's KV blocks from prefill.

A transport runs for the worker's lifetime (``run``): on a prefill instance it
serves the KV transfer port named in every KV handle; on every instance it
keeps whatever it knows about its peers.  ``pull`` moves one handle's blocks
into blocks decode has allocated, or raises :class:`KvTransferError`; it returns
what prefill says it wrote in them (``KvDigests``), which decode checks before it
admits the request (``pdtrio.kv.digest``).
"""

from __future__ import annotations

from typing import Any, Protocol

import trio

from pdtrio.engine.api import KvRegion
from pdtrio.protocol.link.wire import KvDigests, KvHandle
from pdtrio.security import PeerCredentials


class KvTransferError(Exception):
    """The blocks could not be moved (peer gone, lease expired, bad length, bad bytes)."""


class KvTransportUnavailable(Exception):
    """The configured transport cannot run here (``kv_transport = "nixl"`` without NIXL)."""


class KvMemory(Protocol):
    """The engine's KV cache as memory a one-sided transport registers once."""

    def kv_region(self) -> KvRegion: ...


class KvBlockSource(Protocol):
    """What a transport server needs from the prefill worker."""

    def holds(
        self, request_id: str, block_ids: tuple[int, ...], access_token: str | None = None
    ) -> bool:
        """Whether a lease holds the blocks; a peer's ``access_token`` must be its grant
        (None: asked from inside the worker)."""
        ...

    async def read_blocks(self, block_ids: tuple[int, ...]) -> bytes: ...

    def kv_digests(self, request_id: str, block_ids: tuple[int, ...]) -> KvDigests | None:
        """What prefill wrote in these blocks of the request's, with their generations
        now, for a grant's answer; None when it recorded nothing for them."""
        ...


class KvBlockSink(KvMemory, Protocol):
    """Where pulled blocks land: the decode engine."""

    async def write_blocks(self, block_ids: tuple[int, ...], data: bytes) -> None:
        """Fill the blocks; EngineError if the bytes do not fit them."""
        ...

    async def read_blocks(self, block_ids: tuple[int, ...]) -> bytes:
        """The blocks' bytes (what a digest of memory this process cannot map reads)."""
        ...


class KvTransport(Protocol):
    # the credential KV ports ask for (ours, and the peers' we pull from): set by the worker
    secret: PeerCredentials

    @property
    def name(self) -> str:
        """What this worker runs: ``"nixl"`` or ``"tcp"`` (``auto`` has chosen once running)."""
        ...

    async def run(
        self,
        source: KvBlockSource | None,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[tuple[str, int] | None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run until cancelled: serve block reads from ``source`` when given (prefill).

        Reports the bound transfer endpoint (host, port), or None without a source.
        Raises KvTransportUnavailable before reporting if it cannot run at all.
        """
        ...

    async def pull(
        self, handle: KvHandle, sink: KvBlockSink, dest_block_ids: tuple[int, ...]
    ) -> KvDigests | None:
        """Copy the handle's blocks into ``dest_block_ids`` of ``sink``: what prefill says it
        wrote in them (None: it said nothing). Raises KvTransferError."""
        ...

    def info(self) -> dict[str, Any]:
        """What ``/pd/info`` shows: the transport, and what it chose for each peer."""
        ...
