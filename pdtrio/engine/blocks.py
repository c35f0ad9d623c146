"""Block bookkeeping shared by the engines: which request owns which KV blocks."""

from __future__ import annotations

from typing import final

from pdtrio.engine.api import NoRoom


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@final
class BlockOwnership:
    """A free list plus the block table of every request that owns blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # pop() hands out low ids first, which keeps tests readable
        self._free = list(range(num_blocks - 1, -1, -1))
        self._owned: dict[str, list[int]] = {}

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def owned(self, request_id: str) -> list[int]:
        return self._owned.get(request_id, [])

    def owns(self, request_id: str) -> bool:
        return request_id in self._owned

    def ensure(self, request_id: str, num_tokens: int) -> tuple[int, ...]:
        """Grow the request's block table to hold ``num_tokens``; all or nothing."""
        table = self._owned.get(request_id, [])
        missing = blocks_needed(num_tokens, self.block_size) - len(table)
        if missing > len(self._free):
            raise NoRoom(
                f"need {missing} more KV blocks for {num_tokens} tokens, {len(self._free)} free"
            )
        if missing > 0:
            table = table + [self._free.pop() for _ in range(missing)]
        self._owned[request_id] = table
        return tuple(table)

    def release(self, request_id: str) -> int:
        """Free the request's blocks; returns how many. Idempotent."""
        table = self._owned.pop(request_id, None)
        if not table:
            return 0
        self._free.extend(reversed(table))
        return len(table)

    def owners(self) -> list[str]:
        return list(self._owned)
