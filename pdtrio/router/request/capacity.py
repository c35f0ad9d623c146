"""Waiting for decode KV room: a bounded FIFO of prefilled requests.

A request that no decode instance has room for now waits here instead of
failing.  Only the head of the queue is woken when capacity changes; it takes
its room (the caller promises the blocks on a decode link before its next
checkpoint) and, leaving, wakes the next one, so waiters go in arrival order
and never race for the same blocks.  A newcomer goes straight through only
when nobody is waiting.  Nothing polls: every wake-up is a capacity report,
an answered start or a link that came or went.

A request reserves its place when it arrives, before prefill, and the place
becomes its waiter's when it starts waiting: the limit counts requests being
prefilled too, so a burst is refused at the door (429) instead of all going
to prefill and running it out of KV.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar, final

import trio

_T = TypeVar("_T")


class QueueFull(Exception):
    """The admission queue is at its limit: the caller answers 429."""


@final
class _Waiter:
    __slots__ = ("woken",)

    def __init__(self) -> None:
        self.woken = trio.Event()


@final
class CapacityQueue(Generic[_T]):
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._waiters: deque[_Waiter] = deque()
        # places held by requests on their way here (prefilling): counted against the limit
        self._reserved = 0

    def __len__(self) -> int:
        return len(self._waiters) + self._reserved

    @property
    def full(self) -> bool:
        """No one more may wait (or reserve a place)."""
        return len(self._waiters) + self._reserved >= self.limit

    def reserve(self) -> None:
        """Hold a place for a request that will wait later; QueueFull at the limit."""
        if self.full:
            raise QueueFull
        self._reserved += 1

    def unreserve(self) -> None:
        """Give a reserved place back.  Just before :meth:`wait_for`: it becomes the waiter's."""
        self._reserved -= 1

    def changed(self) -> None:
        """Capacity may have changed: the head waiter looks again (never blocks)."""
        if self._waiters:
            self._waiters[0].woken.set()

    def take_now(self, take: Callable[[], _T | None]) -> _T | None:
        """What ``take`` returns, when nobody waits ahead; else None (then :meth:`wait_for`)."""
        return None if self._waiters else take()

    async def wait_for(self, take: Callable[[], _T | None], *, admitted: bool = False) -> _T:
        """What ``take`` returns once it returns something, in FIFO order with other waiters.

        Call :meth:`take_now` first: this always queues.  ``take`` must not
        checkpoint; neither does this between its success and returning, so
        the caller claims the room before anyone else runs.  Raises
        :class:`QueueFull` at the limit, unless ``admitted``: a request that counted
        against the limit at the door and is back for another decode (its first tokens may
        be out) is not refused for it. Cancellation leaves the queue, and so does what
        ``take`` raises (a waiter that stops waiting: the next looks).
        """
        if self.full and not admitted:
            raise QueueFull
        waiter = _Waiter()
        self._waiters.append(waiter)
        try:
            while True:
                await waiter.woken.wait()
                taken = take()
                if taken is not None:
                    return taken
                waiter.woken = trio.Event()  # still no room: sleep until the next change
        finally:
            self._waiters.remove(waiter)
            self.changed()  # the next in line gets its turn (a woken task runs after our caller)
