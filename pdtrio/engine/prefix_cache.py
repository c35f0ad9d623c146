"""Prefix caching: full KV blocks shared between requests, found by a hash chain.

A full block's hash is ``H(parent's hash, its token ids)``, the chain starting from a
salt that names what else changes the KV (the model, its dtype, the block size); so
a block hash stands for the whole prefix up to the block's end, and two prompts
share a block exactly when they agree on every token up to it.  The hashes are
blake2b, stable across processes and machines (never Python's salted ``hash()``),
so other processes may one day compare them.  A partial last block is never
cached: decode writes its next tokens into it.

Blocks carry reference counts: a request holds a reference to every block of its
table, the cached ones it found included.  A block no request holds is free again,
unless it is cached: then it stays as it is, reusable, until an allocation needs
the room (least recently released first) and evicts it.  A block some request
holds is never evicted, so a request that started keeps its KV to the end.

Every hash stored or evicted goes into a bounded journal, so each router's link can
report what changed since its last report (``wire.KvEvents``, :meth:`PrefixCache.events_since`)
without a queue of its own; a link that fell behind the journal gets the whole set again.

Torch-free: both engines use it, through :class:`pdtrio.engine.blocks.BlockOwnership`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Protocol, final

import attrs

from pdtrio.engine.api import NoRoom
from pdtrio.protocol.link.wire import KvEvents
from pdtrio.protocol.placement.prefix_index import block_hashes, chain_root, layout_salt


class BlockSource(Protocol):
    """What the cache needs of the engine's allocator (``pdtrio.engine.blocks``, which
    imports this module: named here by what it does, not imported)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    def allocate(self, n: int) -> list[int]: ...

    def free(self, ids: Iterable[int]) -> None: ...


@final
@attrs.frozen
class PrefixCacheStatistics:
    hit_tokens: int  # prompt tokens whose KV was found cached (since start)
    miss_tokens: int  # prompt tokens looked up and computed
    evicted_blocks: int  # cached blocks evicted to make room (since start)
    cached_blocks: int  # blocks cached now, held by a request or not
    # decode: the blocks of received prompts found cached here, and those pulled (since start)
    decode_reused_blocks: int = 0
    decode_pulled_blocks: int = 0


# changes the journal keeps for links to catch up on; one further behind gets a snapshot
JOURNAL_LIMIT = 4096


@final
class PrefixCache:
    """Reference counts over an allocator's blocks, and the cached blocks by hash.

    ``enabled`` False: nothing is ever cached, and a block is freed at its last
    release, as without a cache.  ``max_cached_blocks`` > 0 caps how many blocks
    are cached at once (0: only the cache's size does).
    """

    def __init__(
        self, allocator: BlockSource, *, enabled: bool = False, max_cached_blocks: int = 0
    ) -> None:
        if max_cached_blocks < 0:
            raise ValueError(f"max_cached_blocks must be >= 0, got {max_cached_blocks}")
        self.allocator = allocator
        self.enabled = enabled
        self.max_cached_blocks = max_cached_blocks
        self._refs: dict[int, int] = {}  # block id -> requests holding it (> 0)
        self._block_of: dict[bytes, int] = {}  # cached blocks by hash
        self._hash_of: dict[int, bytes] = {}
        # cached blocks nobody holds, least recently released first: evicted in this order
        self._reclaimable: OrderedDict[int, None] = OrderedDict()
        self._hit_tokens = 0
        self._miss_tokens = 0
        self._evicted = 0
        self._decode_reused = 0
        self._decode_pulled = 0
        # the hashes stored or evicted lately, in order, and how many ever were (a cursor)
        self._journal: deque[bytes] = deque(maxlen=JOURNAL_LIMIT)
        self._journal_end = 0

    @property
    def num_held(self) -> int:
        """Blocks some request holds."""
        return len(self._refs)

    @property
    def num_reclaimable(self) -> int:
        """Cached blocks no request holds: free for an allocation that needs them."""
        return len(self._reclaimable)

    @property
    def num_available(self) -> int:
        return self.allocator.num_free + len(self._reclaimable)

    def refs(self, block_id: int) -> int:
        return self._refs.get(block_id, 0)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_of

    def statistics(self) -> PrefixCacheStatistics:
        return PrefixCacheStatistics(
            hit_tokens=self._hit_tokens,
            miss_tokens=self._miss_tokens,
            evicted_blocks=self._evicted,
            cached_blocks=len(self._hash_of),
            decode_reused_blocks=self._decode_reused,
            decode_pulled_blocks=self._decode_pulled,
        )

    def count_lookup(self, hit_tokens: int, looked_up_tokens: int) -> None:
        self._hit_tokens += hit_tokens
        self._miss_tokens += looked_up_tokens - hit_tokens

    def count_received(self, reused_blocks: int, pulled_blocks: int) -> None:
        """A decode received a prompt's KV: ``reused_blocks`` were cached here already."""
        self._decode_reused += reused_blocks
        self._decode_pulled += pulled_blocks

    # --- references ------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks, one reference each, evicting cached blocks nobody holds if
        the free list is short; NoRoom and nothing changed if even that is not enough."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        short = n - self.allocator.num_free
        if short > len(self._reclaimable):
            raise NoRoom(
                f"need {n} KV blocks, {self.num_available} of {self.allocator.num_blocks} free"
            )
        for _ in range(max(0, short)):
            self._evict_one()
        ids = self.allocator.allocate(n)
        for block_id in ids:
            self._refs[block_id] = 1
        return ids

    def acquire(self, block_ids: Iterable[int]) -> None:
        """One more reference to each block (cached ones found by :meth:`match`)."""
        for block_id in block_ids:
            held = self._refs.get(block_id, 0)
            if not held:
                if block_id not in self._reclaimable:
                    raise ValueError(f"KV block {block_id} is neither held nor cached")
                del self._reclaimable[block_id]
            self._refs[block_id] = held + 1

    def release(self, block_ids: Sequence[int]) -> None:
        """One reference less to each block; a block nobody holds is freed, or kept
        reclaimable if cached.  Releasing a block nobody holds is a bug, and releases nothing."""
        counts: dict[int, int] = {}
        for block_id in block_ids:
            counts[block_id] = counts.get(block_id, 0) + 1
            if counts[block_id] > self._refs.get(block_id, 0):
                raise ValueError(f"double free of KV block {block_id}")
        freed: list[int] = []
        # the table's last blocks first: a chain's tail is evicted before its head, which
        # keeps the head findable (a lookup stops at the first block it lacks)
        for block_id in reversed(block_ids):
            left = self._refs[block_id] - 1
            if left:
                self._refs[block_id] = left
                continue
            del self._refs[block_id]
            if block_id in self._hash_of:
                self._reclaimable[block_id] = None
            else:
                freed.append(block_id)
        if freed:
            self.allocator.free(reversed(freed))

    # --- the cache ---------------------------------------------------------------------

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (no reference taken)."""
        found: list[int] = []
        if not self.enabled:
            return found
        for block_hash in hashes:
            block_id = self._block_of.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def insert(self, block_id: int, block_hash: bytes) -> None:
        """Cache a held block whose KV is computed and will not change, under its hash.

        A hash cached already (another request computed the same prefix meanwhile)
        keeps its block: this one is freed at its last release as usual."""
        if not self.enabled or block_hash in self._block_of or block_id in self._hash_of:
            return
        if block_id not in self._refs:
            raise ValueError(f"KV block {block_id} is not held: only computed blocks are cached")
        if self.max_cached_blocks and len(self._hash_of) >= self.max_cached_blocks:
            if not self._reclaimable:
                return  # full of blocks in use: this one goes uncached
            self._evict_one()
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        self._journal.append(block_hash)
        self._journal_end += 1

    def _evict_one(self) -> None:
        block_id, _ = self._reclaimable.popitem(last=False)
        block_hash = self._hash_of.pop(block_id)
        del self._block_of[block_hash]
        self._journal.append(block_hash)
        self._journal_end += 1
        self._evicted += 1
        self.allocator.free([block_id])

    # --- reports ---------------------------------------------------------------------

    @property
    def journal_end(self) -> int:
        """How many changes the cache has seen: a cursor for :meth:`events_since`."""
        return self._journal_end

    def events_since(self, cursor: int | None) -> tuple[int, KvEvents | None]:
        """What changed since ``cursor`` (None: a new reader) and the cursor to ask with
        next: the hashes stored and removed since, each as it is now; the whole set (a
        snapshot) for a new reader or one the journal no longer reaches back to; None
        when nothing changed, or always when the cache is off."""
        end = self._journal_end
        if not self.enabled:
            return end, None
        if cursor is None or end - cursor > len(self._journal):
            return end, KvEvents(snapshot=True, stored=tuple(self._block_of))
        if cursor == end:
            return end, None
        changed = set(islice(self._journal, len(self._journal) - (end - cursor), None))
        stored = tuple(h for h in changed if h in self._block_of)
        removed = tuple(h for h in changed if h not in self._block_of)
        return end, KvEvents(snapshot=False, stored=stored, removed=removed)


__all__ = ["PrefixCache", "PrefixCacheStatistics", "block_hashes", "chain_root", "layout_salt"]
