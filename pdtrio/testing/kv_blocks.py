"""A prefill's KV blocks as a worker serves them to a KV transport, reduced to a synthetic
engine and its leases: the ``KvBlockSource`` that transport tests and the KV benchmarks
hand a transport's server."""

from __future__ import annotations

from pdtrio.engine.synthetic import SyntheticEngine
from pdtrio.protocol.link.wire import KvDigests
from pdtrio.worker.leases import KvLeases


class LeasedBlocks:
    """An engine and its leases: a peer reads only with a lease's grant.  ``digests``:
    grants carry prefill's record of what it wrote (False: none, a bare pull).  Counts
    releases in ``released``."""

    def __init__(self, engine: SyntheticEngine, *, digests: bool = True) -> None:
        self.engine = engine
        self.leases = KvLeases(engine.free_request)
        self.released: list[tuple[str, bool]] = []
        self._digests = digests

    def holds(
        self, request_id: str, block_ids: tuple[int, ...], access_token: str | None = None
    ) -> bool:
        return self.leases.holds(request_id, block_ids, access_token)

    async def read_blocks(self, block_ids: tuple[int, ...]) -> bytes:
        return await self.engine.read_blocks(block_ids)

    def kv_digests(self, request_id: str, block_ids: tuple[int, ...]) -> KvDigests | None:
        written = self.leases.written(request_id) if self._digests else None
        if written is None:
            return None
        return written.for_grant(block_ids, self.engine.block_generations(block_ids))

    def release(self, request_id: str) -> bool:
        released = self.leases.release(request_id)
        self.released.append((request_id, released))
        return released

    def release_granted(self, request_id: str, access_token: str) -> bool:
        if not self.leases.holds(request_id, (), access_token):
            return False
        return self.release(request_id)

    def blocks_in_use(self) -> int:
        return self.engine.statistics().kv_blocks_in_use
