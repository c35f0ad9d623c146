"""Block bookkeeping shared by the engines: free blocks, and which request owns which
(and, through :mod:`pdtrio.engine.prefix_cache`, which blocks requests share).

Torch-free: the synthetic engine uses it as it is, the torch engine over its
paged cache's allocator.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import final

from pdtrio.engine.api import EngineError, NoRoom
from pdtrio.engine.prefix_cache import PrefixCache, block_hashes
from pdtrio.protocol.kv_layout import blocks_needed


@final
class BlockAllocator:
    """Hands out block ids; all or nothing, and a block is freed exactly once."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        # pop() hands out low ids first, which keeps block tables readable
        self._free = list(range(num_blocks - 1, -1, -1))
        self._in_use = [False] * num_blocks
        # bumped each time a block is handed out: a block freed and reused since someone
        # recorded its generation no longer has it, whatever bytes it holds
        self._generation = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` free block ids, or NoRoom and nothing allocated."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise NoRoom(f"need {n} KV blocks, {len(self._free)} of {self.num_blocks} free")
        ids = [self._free.pop() for _ in range(n)]
        for block_id in ids:
            self._in_use[block_id] = True
            self._generation[block_id] += 1
        return ids

    def generations(self, ids: Iterable[int]) -> tuple[int, ...]:
        """Each block's generation: how many times it has been handed out."""
        generation = self._generation
        return tuple(generation[block_id] for block_id in ids)

    def free(self, ids: Iterable[int]) -> None:
        """Return blocks; freeing a block that is not allocated is a bug, and frees nothing."""
        ids = list(ids)
        seen: set[int] = set()
        for block_id in ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block id {block_id} out of range 0..{self.num_blocks - 1}")
            if not self._in_use[block_id] or block_id in seen:
                raise ValueError(f"double free of KV block {block_id}")
            seen.add(block_id)
        for block_id in ids:
            self._in_use[block_id] = False
        self._free.extend(reversed(ids))


@final
class BlockOwnership:
    """The block table of every request that owns blocks, over one allocator.

    A request holds a reference to each block of its table (``prefix_cache``): with
    the cache enabled, a prompt's table may begin with cached blocks other requests
    hold too, and releasing a request frees only what nobody else holds or caches.
    """

    def __init__(
        self, allocator: BlockAllocator, block_size: int, prefix_cache: PrefixCache | None = None
    ) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(allocator)
        if self.prefix_cache.allocator is not allocator:
            raise ValueError("the prefix cache must be over the same allocator")
        self._owned: dict[str, list[int]] = {}
        # the block hashes of a prompt being prefilled or received, until cache_prompt
        # caches its blocks
        self._prompt_hashes: dict[str, list[bytes]] = {}
        # a received prompt's (reused, pulled) block counts, counted once its KV is in place
        self._received: dict[str, tuple[int, int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_used(self) -> int:
        """Blocks some request holds (cached blocks nobody holds are free to reuse)."""
        return self.prefix_cache.num_held

    def owned(self, request_id: str) -> list[int]:
        return self._owned.get(request_id, [])

    def ensure(self, request_id: str, num_tokens: int) -> tuple[int, ...]:
        """Grow the request's block table to hold ``num_tokens``; all or nothing."""
        table = self._owned.get(request_id, [])
        missing = blocks_needed(num_tokens, self.block_size) - len(table)
        if missing > 0:
            table = table + self.prefix_cache.allocate(missing)
        self._owned[request_id] = table
        return tuple(table)

    def ensure_prompt(
        self, request_id: str, prompt_token_ids: Sequence[int], root: bytes
    ) -> tuple[tuple[int, ...], int]:
        """A new request's table for its prompt, starting with the cached blocks of its
        longest cached prefix: (the table, how many of the prompt's tokens are cached).

        At least the prompt's last token is left to compute (its logits give the first
        token), so a prompt cached whole recomputes its last block, into a block of its own.
        All or nothing: NoRoom leaves the request without blocks.  A request that owns
        blocks already just grows its table, as :meth:`ensure`, with nothing cached.
        """
        if self._owned.get(request_id):
            return self.ensure(request_id, len(prompt_token_ids)), 0
        cache = self.prefix_cache
        hashes = block_hashes(prompt_token_ids, self.block_size, root) if cache.enabled else []
        usable = (len(prompt_token_ids) - 1) // self.block_size
        found = cache.match(hashes[:usable])
        table = self._table_starting_with(request_id, found, len(prompt_token_ids))
        cached_tokens = len(found) * self.block_size
        if cache.enabled:
            cache.count_lookup(cached_tokens, len(prompt_token_ids))
            self._prompt_hashes[request_id] = hashes
        return table, cached_tokens

    def ensure_received(
        self, request_id: str, prompt_token_ids: Sequence[int], root: bytes, num_tokens: int
    ) -> tuple[tuple[int, ...], int]:
        """A decode's table for a prompt whose KV another instance computed, ``num_tokens``
        long: first the cached blocks of the prompt's longest cached prefix, then fresh
        blocks; (the table, how many leading blocks are reused).

        Every full prompt block may be reused (decode computes none of the prompt, unlike
        :meth:`ensure_prompt`); the rest are to be received, then cached by
        :meth:`cache_prompt`.  All or nothing: NoRoom leaves the request without blocks.
        With the cache off, or for a request that owns blocks already, nothing is reused:
        :meth:`ensure`.
        """
        cache = self.prefix_cache
        if not cache.enabled or self._owned.get(request_id):
            return self.ensure(request_id, num_tokens), 0
        hashes = block_hashes(prompt_token_ids, self.block_size, root)
        found = cache.match(hashes)
        table = self._table_starting_with(request_id, found, num_tokens)
        self._prompt_hashes[request_id] = hashes
        prompt_blocks = blocks_needed(len(prompt_token_ids), self.block_size)
        self._received[request_id] = (len(found), prompt_blocks - len(found))
        return table, len(found)

    def _table_starting_with(
        self, request_id: str, found: list[int], num_tokens: int
    ) -> tuple[int, ...]:
        """A new request's table: the cached blocks ``found``, then fresh ones up to
        ``num_tokens``; all or nothing (NoRoom leaves it without blocks)."""
        cache = self.prefix_cache
        # held before allocating, so the allocation cannot evict them
        cache.acquire(found)
        self._owned[request_id] = list(found)
        try:
            return self.ensure(request_id, num_tokens)
        except BaseException:
            self._owned.pop(request_id, None)
            cache.release(found)
            raise

    def cache_prompt(self, request_id: str) -> None:
        """The request's prompt KV is computed (or received): cache its full blocks for
        later prompts."""
        received = self._received.pop(request_id, None)
        if received is not None:
            self.prefix_cache.count_received(*received)
        hashes = self._prompt_hashes.pop(request_id, None)
        if not hashes:
            return
        for block_id, block_hash in zip(self._owned.get(request_id, []), hashes, strict=False):
            self.prefix_cache.insert(block_id, block_hash)

    def fork(
        self, parent_id: str, child_id: str, shared_tokens: int, num_tokens: int
    ) -> tuple[int, ...]:
        """A table for ``child_id`` (another choice of ``parent_id``, n > 1): references to
        the parent's full blocks of its first ``shared_tokens`` (the prompt's KV, never
        written again), then fresh blocks of its own up to ``num_tokens``.

        All or nothing: NoRoom leaves the child without blocks and the parent as it was;
        EngineError if ``child_id`` owns blocks already (an id in use).
        """
        if self._owned.get(child_id):
            raise EngineError(f"request {child_id} owns KV blocks already")
        parent = self._owned.get(parent_id, [])
        total = blocks_needed(num_tokens, self.block_size)
        shared = parent[: min(shared_tokens // self.block_size, len(parent), total)]
        # the parent holds the shared blocks, so the allocation cannot evict them
        own = self.prefix_cache.allocate(total - len(shared))
        self.prefix_cache.acquire(shared)
        table = shared + own
        self._owned[child_id] = table
        return tuple(table)

    def release(self, request_id: str) -> int:
        """Drop the request's references to its blocks; returns how many. Idempotent."""
        self._prompt_hashes.pop(request_id, None)
        self._received.pop(request_id, None)
        table = self._owned.pop(request_id, None)
        if not table:
            return 0
        self.prefix_cache.release(table)
        return len(table)
