"""Prefill's KV leases: blocks held for a decode that may never come."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import final

import attrs
import trio

from pdtrio.kv.digest import WrittenBlocks
from pdtrio.security import tokens_match


def release_token_matches(presented: str, release_token: str) -> bool:
    """Whether a release shows the router's release token (an empty one matches nothing)."""
    return tokens_match(presented, release_token) and bool(release_token)


@final
@attrs.frozen
class Lease:
    request_id: str
    block_ids: tuple[int, ...]
    expiry: float  # trio clock
    access_token: str = attrs.field(default="", repr=False)  # the grant in the KV handle
    # the router's proof that it asked for the prefill (PrefillRequest.release_token)
    release_token: str = attrs.field(default="", repr=False)
    # what prefill wrote in the blocks, for decode to check (None: not recorded)
    written: WrittenBlocks | None = attrs.field(default=None, repr=False)


@final
class KvLeases:
    """Tracks held blocks and frees them on release or at expiry, never later."""

    def __init__(self, free: Callable[[str], None]) -> None:
        self._free = free
        self._leases: dict[str, Lease] = {}
        self._changed = trio.Event()
        self.expired_count = 0

    def __len__(self) -> int:
        return len(self._leases)

    def hold(
        self,
        request_id: str,
        block_ids: tuple[int, ...],
        expiry: float,
        access_token: str = "",
        release_token: str = "",
        written: WrittenBlocks | None = None,
    ) -> None:
        self._leases[request_id] = Lease(
            request_id, block_ids, expiry, access_token, release_token, written
        )
        self._changed.set()

    def written(self, request_id: str) -> WrittenBlocks | None:
        """What prefill recorded of the leased blocks' contents, if it did."""
        lease = self._leases.get(request_id)
        return None if lease is None else lease.written

    def holds(
        self, request_id: str, block_ids: tuple[int, ...], access_token: str | None = None
    ) -> bool:
        """Whether a lease holds these blocks (and, for a peer, grants them to its token).

        ``access_token`` None: asked from inside this worker, no grant needed.
        """
        lease = self._leases.get(request_id)
        if lease is None or not set(block_ids) <= set(lease.block_ids):
            return False
        return access_token is None or tokens_match(access_token, lease.access_token)

    def release(self, request_id: str) -> bool:
        """Free the blocks now. Returns whether a lease was held."""
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return False
        self._free(request_id)
        return True

    def release_granted(self, request_id: str, access_token: str) -> bool:
        """A peer's release: frees the blocks only if ``access_token`` is their grant, or
        the release token of the router that asked for them (never a read's grant)."""
        lease = self._leases.get(request_id)
        if lease is None:
            return False
        granted = tokens_match(access_token, lease.access_token)
        # (both compared: no timing tells which one matched)
        owner = release_token_matches(access_token, lease.release_token)
        if not (granted or owner):
            return False
        return self.release(request_id)

    def hand_over(self, request_id: str) -> bool:
        """The blocks stay with the request (colocated decode took them): stop the clock."""
        return self._leases.pop(request_id, None) is not None

    async def run_expiry(self) -> None:
        """Free every lease at its expiry; waits on changes, never polls."""
        while True:
            self._changed = trio.Event()
            now = trio.current_time()
            for lease in [lease for lease in self._leases.values() if lease.expiry <= now]:
                self.expired_count += 1
                self.release(lease.request_id)
            earliest = min((lease.expiry for lease in self._leases.values()), default=math.inf)
            with trio.move_on_at(earliest):
                await self._changed.wait()
