"""How many requests run at once: per API key and in all (beyond: 429, retry shortly)."""

from __future__ import annotations

from typing import final

from pdtrio.protocol.openai import too_many_requests


@final
class ClientLimits:
    """Counts running completion requests; 0 turns a limit off."""

    def __init__(self, *, per_key: int, total: int) -> None:
        self.per_key = per_key
        self.total = total
        self.running = 0
        self._by_key: dict[str, int] = {}

    def admit(self, key_id: str) -> None:
        """Hold a place for one request while it runs (the caller gives it back with
        :meth:`release`, in a ``finally``: not a context manager, whose generator is
        half a dozen calls a request); a 429 when there is none."""
        if self.total and self.running >= self.total:
            raise too_many_requests(
                f"the server is running its limit of {self.total} requests; retry shortly"
            )
        by_key = self._by_key
        if self.per_key and by_key.get(key_id, 0) >= self.per_key:
            raise too_many_requests(
                f"this API key already has {self.per_key} requests running, its limit; "
                "retry shortly"
            )
        self.running += 1
        by_key[key_id] = by_key.get(key_id, 0) + 1

    def release(self, key_id: str) -> None:
        """The place :meth:`admit` held is free again."""
        self.running -= 1
        by_key = self._by_key
        left = by_key[key_id] - 1
        if left:
            by_key[key_id] = left
        else:
            del by_key[key_id]
