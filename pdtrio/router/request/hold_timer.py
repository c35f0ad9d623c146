"""One timer task that ends every held stream's hold (adaptive egress spaces sends)."""

from __future__ import annotations

from collections import deque
from typing import Protocol, final

import trio


class Holding(Protocol):
    """A stream whose sends egress may hold (what the timer wakes)."""

    def end_hold(self, hold: int) -> None: ...


# the hold timer wakes a stream up to this much before its deadline, with others due then
_HOLD_SLACK_S = 0.002


@final
class HoldTimer:
    """Ends streams' holds at their deadlines: one timer task for every holding stream.

    A cancel scope with a deadline per hold costs about as much as the send it
    saves.  Holds share one spacing, so their deadlines come nearly in
    arrival order: a FIFO, woken from the front, every stream due within
    ``_HOLD_SLACK_S`` at once (a hold may end that much early).  When the
    spacing shrinks, a newer hold may wait behind an older one's deadline, by
    at most the change.
    """

    def __init__(self) -> None:
        self._due: deque[tuple[float, Holding, int]] = deque()
        self._idle = trio.lowlevel.ParkingLot()

    def add(self, deadline: float, stream: Holding, hold: int) -> None:
        self._due.append((deadline, stream, hold))
        if self._idle:
            self._idle.unpark()

    async def run(self) -> None:
        due = self._due
        while True:
            if not due:
                await self._idle.park()
                continue
            await trio.sleep_until(due[0][0])
            wake_by = trio.current_time() + _HOLD_SLACK_S
            while due and due[0][0] <= wake_by:
                _, stream, hold = due.popleft()
                stream.end_hold(hold)
