"""How many requests run at once: per API key and in all (beyond: 429, retry shortly)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import final

from pdtrio.protocol.openai import too_many_requests


@final
class ClientLimits:
    """Counts running completion requests; 0 turns a limit off."""

    def __init__(self, *, per_key: int, total: int) -> None:
        self.per_key = per_key
        self.total = total
        self.running = 0
        self._by_key: Counter[str] = Counter()

    @contextmanager
    def admit(self, key_id: str) -> Iterator[None]:
        """Hold a place for one request while it runs; a 429 when there is none."""
        if self.total and self.running >= self.total:
            raise too_many_requests(
                f"the server is running its limit of {self.total} requests; retry shortly"
            )
        if self.per_key and self._by_key[key_id] >= self.per_key:
            raise too_many_requests(
                f"this API key already has {self.per_key} requests running, its limit; "
                "retry shortly"
            )
        self.running += 1
        self._by_key[key_id] += 1
        try:
            yield
        finally:
            self.running -= 1
            self._by_key[key_id] -= 1
            if not self._by_key[key_id]:
                del self._by_key[key_id]
