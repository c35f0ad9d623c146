"""What a worker reports on its link unasked: its decode room, that it is alive, and what its
prefix cache stored and evicted."""

from __future__ import annotations

from typing import Annotated

import msgspec

from pdtrio.protocol.link.message_base import MAX_TOKEN_IDS, MessageKind, Positional


class DecodeCapacity(Positional, frozen=True, tag=int(MessageKind.CAPACITY)):
    """Decode's KV room now: sent when the link opens and whenever the free count changes.

    It goes out before the accept it may reflect, so a router that sees
    ``DecodeAccepted`` already holds a report that counts that request's blocks.
    """

    free_blocks: int
    total_blocks: int
    block_size: int


class Heartbeat(Positional, frozen=True, tag=int(MessageKind.HEARTBEAT)):
    """The worker is alive: sent when it has sent nothing else for a heartbeat interval.

    Any frame proves liveness; this one only fills silence, so the router can
    tell a hung worker (stopped, wedged) from an idle one.
    """


# a block hash of the prefix cache (``pdtrio.protocol.placement.prefix_index.block_hashes``)
BlockHashes = Annotated[tuple[bytes, ...], msgspec.Meta(max_length=MAX_TOKEN_IDS)]


class KvEvents(Positional, frozen=True, tag=int(MessageKind.KV_EVENTS)):
    """What the worker's prefix cache stored and evicted since the link's last report: many
    block hashes in one message, sent ahead of the link's next frame (never one per block).

    ``snapshot``: ``stored`` is the whole cache (``removed`` empty), sent first on each
    connection, so the router's view is rebuilt, never stale; else the two are
    disjoint, each hash's state now.  Only to a router that asks (``?kv_events=1``) and
    only with the cache on: a router from before them never gets one.
    """

    snapshot: bool
    stored: BlockHashes = ()
    removed: BlockHashes = ()
