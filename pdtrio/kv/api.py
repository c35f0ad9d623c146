"""The transport seam: how decode pulls a request's KV blocks from prefill."""

from __future__ import annotations

from typing import Protocol

import trio

from pdtrio.protocol.wire import KvHandle


class KvTransferError(Exception):
    """The blocks could not be moved (peer gone, lease expired, bad length, bad bytes)."""


class KvBlockSource(Protocol):
    """What a transport server needs from the prefill worker."""

    def holds(self, request_id: str, block_ids: tuple[int, ...]) -> bool: ...

    async def read_blocks(self, block_ids: tuple[int, ...]) -> bytes: ...

    def release(self, request_id: str) -> bool:
        """Decode has the bytes: free the blocks."""
        ...


class KvBlockSink(Protocol):
    """Where pulled blocks land: the decode engine."""

    async def write_blocks(self, block_ids: tuple[int, ...], data: bytes) -> None:
        """Fill the blocks; EngineError if the bytes do not fit them."""
        ...


class KvTransport(Protocol):
    async def serve(
        self,
        source: KvBlockSource,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve block reads until cancelled; reports the bound (host, port)."""
        ...

    async def pull(
        self, handle: KvHandle, sink: KvBlockSink, dest_block_ids: tuple[int, ...]
    ) -> None:
        """Copy the handle's blocks into ``dest_block_ids`` of ``sink``. Raises KvTransferError."""
        ...
