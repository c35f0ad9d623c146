"""When, on this router's clock, the KV leases of the handles prefill sent it end.

A KV handle carries its lease as a TTL (``KvHandle.lease_ttl_s``: what was left as
prefill sent it), never as a wall-clock instant another machine's clock would be
compared with. The router counts it from the reply's arrival on its own trio
clock (:meth:`LeaseClock.received`, called by the worker link that reads the
reply), waits for decode room no longer than what is left (:meth:`left_s`), and
hands decode what is left as the start is sent (:meth:`to_send`), so each hop
counts from its own receipt.

It also makes the router's release tokens (:meth:`LeaseClock.release_token`): the proof,
sent with a prefill call, that lets a release free that KV over any link.

One per router (its worker backend's), handed to every link: the prefill link that
reads a reply and the decode link that sends its start are two links.  Kept by the
handle's grant (``access_token``, random per lease): a float per lease,
dropped when the router releases the KV or when the lease ends. A handle this
clock never saw (no grant, or built by hand) counts from now.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import final

import msgspec

from pdtrio.protocol.link.wire import DecodeStart, KvHandle, lease_deadline, with_lease_left


@final
class LeaseClock:
    def __init__(self) -> None:
        # grant -> when its lease ends (trio clock), in the order the replies came
        self._ends: dict[str, float] = {}
        # the key of this router's release tokens: no other peer (or router) can make one
        self._release_key = secrets.token_bytes(32)

    def release_token(self, request_id: str) -> str:
        """This router's proof that it asked for the request's prefill (sent with the
        call): a release showing it frees the KV on any link.  Derived, not stored."""
        return hashlib.blake2b(
            request_id.encode(), key=self._release_key, digest_size=16
        ).hexdigest()

    def __len__(self) -> int:
        return len(self._ends)

    def received(self, handle: KvHandle, now: float) -> None:
        """A prefill reply brought ``handle`` at ``now``: its TTL counts from here."""
        ends = self._ends
        # leases end in about the order they came (one kv_lease_s per prefill): the
        # ended ones at the front go; one that outlives those behind it holds them a
        # lease at most
        while ends:
            token = next(iter(ends))
            if ends[token] > now:
                break
            del ends[token]
        if handle.access_token:
            ends[handle.access_token] = lease_deadline(handle, now)

    def ends_at(self, handle: KvHandle, now: float) -> float:
        """When the handle's lease ends (trio clock)."""
        end = self._ends.get(handle.access_token) if handle.access_token else None
        return lease_deadline(handle, now) if end is None else end

    def left_s(self, handle: KvHandle, now: float) -> float:
        """Seconds left of the handle's lease at ``now`` (0 once it has ended)."""
        return max(0.0, self.ends_at(handle, now) - now)

    def to_send(self, start: DecodeStart, now: float) -> DecodeStart:
        """The start as sent at ``now``: its handle's TTL what is left of the lease."""
        handle = start.kv_handle
        if not handle.access_token or handle.access_token not in self._ends:
            return start
        passed_on = with_lease_left(handle, self._ends[handle.access_token], now)
        return msgspec.structs.replace(start, kv_handle=passed_on)

    def forget(self, access_token: str) -> None:
        """The router released the lease: nothing more to count."""
        self._ends.pop(access_token, None)
