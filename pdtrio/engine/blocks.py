"""Block bookkeeping shared by the engines: free blocks, and which request owns which.

Torch-free: the synthetic engine uses it as it is, the torch engine over its
paged cache's allocator.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import final

from pdtrio.engine.api import NoRoom
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
        return ids

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
    """The block table of every request that owns blocks, over one allocator."""

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self._owned: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_used(self) -> int:
        return self.allocator.num_used

    def owned(self, request_id: str) -> list[int]:
        return self._owned.get(request_id, [])

    def ensure(self, request_id: str, num_tokens: int) -> tuple[int, ...]:
        """Grow the request's block table to hold ``num_tokens``; all or nothing."""
        table = self._owned.get(request_id, [])
        missing = blocks_needed(num_tokens, self.block_size) - len(table)
        if missing > 0:
            table = table + self.allocator.allocate(missing)
        self._owned[request_id] = table
        return tuple(table)

    def release(self, request_id: str) -> int:
        """Free the request's blocks; returns how many. Idempotent."""
        table = self._owned.pop(request_id, None)
        if not table:
            return 0
        self.allocator.free(table)
        return len(table)
