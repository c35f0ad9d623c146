"""The router's registry of running requests: how many, the drain, the sweeps.

Each request registers its cancel scope while it runs (:meth:`RunningRequests.started`,
:meth:`RunningRequests.ended`).  A drain refuses new requests, waits for the running
ones up to its time, then cancels what is left; the stall sweep looks at each running
request's writes for a client that stopped reading.

The watch sweep tells each request still running ``watch_after_s`` after it started
to watch for its client leaving (:meth:`RunningRequest.watch_client`): the watch is a
task in the request's own nursery, which the sweep owns nothing of.  A short request
ends before then and never pays for one: a task spawned, cancelled and joined was
about a twentieth of the router's CPU for a request of two tokens.  The sweep wakes at
most once each half of that time, for every request due by then: not once for each
request.  The price is that a client leaving is noticed up to one and a half
``watch_after_s`` late (its request is cut then, its KV freed), and that one leaving a
request that ends first is not noticed at all (its writes went nowhere; it is logged
as answered).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from typing import Protocol, final

import attrs
import trio

log = logging.getLogger("pdtrio.router")

# how long a request runs, at least, before a task watches for its client leaving: far
# below what a prefill of any length takes, above what a short answer does
CLIENT_WATCH_AFTER_S = 0.05


class RunningRequest(Protocol):
    """What the registry asks of a running request (``pdtrio.router.request.pipeline``)."""

    def hang_up_if_stalled(self, now: float, write_timeout: float, cut_grace: float) -> None:
        """Give up a write that has waited on its client more than ``write_timeout`` by
        ``now`` (``cut_grace`` once the request was cut): hang up, and end the request."""

    def watch_client(self) -> None:
        """From now on, end the request when its client leaves (a no-op once it ended):
        the watch is a task of the request's own."""


@final
@attrs.frozen
class RunningStatistics:
    """A snapshot of the registry (trio's ``statistics()`` habit: no live counters)."""

    running: int
    draining: bool  # new requests are refused
    drain_over: bool  # the drain's time is up: what still ran was cut


@final
class RunningRequests:
    """The running requests of one router.

    ``count_changed(+1 | -1)`` follows each start and end (the requests gauge);
    ``write_timeout_s`` and ``cut_grace_s`` are the stall sweep's bounds;
    ``watch_after_s`` the watch sweep's (0: each request watches its client from its
    start).
    """

    def __init__(
        self,
        count_changed: Callable[[int], None],
        write_timeout_s: float,
        cut_grace_s: float,
        watch_after_s: float = CLIENT_WATCH_AFTER_S,
    ) -> None:
        self._count_changed = count_changed
        self._write_timeout_s = write_timeout_s
        self._cut_grace_s = cut_grace_s
        self._watch_after_s = watch_after_s
        # requests whose client nobody watches yet, by their scope (one that ended is gone
        # from _running: its objects are not kept for the sweep), with when to start, in
        # that order
        self._unwatched: deque[tuple[float, trio.CancelScope]] = deque()
        self._unwatched_arrived = trio.lowlevel.ParkingLot()
        # each running request's cancel scope, and what it is (to look for stalled writes)
        self._running: dict[trio.CancelScope, RunningRequest] = {}
        self._idle = trio.Event()
        self._idle.set()
        self._busy_again = trio.lowlevel.ParkingLot()  # woken by the first request after idle
        # draining: new requests are refused; drain_over: running ones are cut
        self.draining = False
        self.drain_over = trio.Event()

    def __len__(self) -> int:
        return len(self._running)

    def statistics(self) -> RunningStatistics:
        return RunningStatistics(len(self._running), self.draining, self.drain_over.is_set())

    def started(self, scope: trio.CancelScope, request: RunningRequest, now: float) -> None:
        """Count a request running since ``now``; ``scope`` is cancelled when the drain's
        time is up; its client is watched from ``watch_after_s`` on."""
        self._running[scope] = request
        self._count_changed(1)
        if self._idle.is_set():
            self._idle = trio.Event()
            self._busy_again.unpark_all()
        if self.drain_over.is_set():
            scope.cancel()
        unwatched = self._unwatched
        unwatched.append((now + self._watch_after_s, scope))
        if len(unwatched) == 1:
            self._unwatched_arrived.unpark()

    async def until_busy(self) -> bool:
        """Until a request runs; whether it had to wait for one."""
        if self._running:
            return False
        await self._busy_again.park()
        return True

    def ended(self, scope: trio.CancelScope) -> None:
        if self._running.pop(scope, None) is None:
            return
        self._count_changed(-1)
        if not self._running:
            self._idle.set()

    async def hang_up_stalled_clients(self) -> None:
        """Look for writes that have waited on their client for the write timeout, or
        the cut's grace once their request was cut: one pass over the running requests
        every quarter of the shorter."""
        write_timeout, cut_grace = self._write_timeout_s, self._cut_grace_s
        while True:
            await trio.sleep(min(write_timeout, cut_grace) / 4)
            now = trio.current_time()
            for request in list(self._running.values()):
                request.hang_up_if_stalled(now, write_timeout, cut_grace)

    async def watch_lasting_requests(self) -> None:
        """Tell each request still running ``watch_after_s`` after its start to watch its
        client (:meth:`RunningRequest.watch_client`): in start order, each wake-up
        taking every request due by then, the next no sooner than half ``watch_after_s``
        later (requests that start close together are taken in one)."""
        unwatched = self._unwatched
        spacing = self._watch_after_s / 2
        taken_at = -math.inf
        while True:
            if not unwatched:
                await self._unwatched_arrived.park()
                continue
            due, _ = unwatched[0]
            now = trio.current_time()
            wake = max(due, taken_at + spacing)
            if wake > now:
                await trio.sleep_until(wake)
                now = trio.current_time()
            taken_at = now
            running = self._running
            while unwatched and unwatched[0][0] <= now:
                _, scope = unwatched.popleft()
                request = running.get(scope)
                if request is not None:
                    request.watch_client()

    async def drain(self, drain_s: float) -> None:
        """Refuse new requests, give running ones ``drain_s`` to finish, then cut them.

        Returns once no request is left (the cut ones get a bounded moment to say why).
        """
        if not self.draining:
            self.draining = True
            log.info("draining: %d requests running, up to %gs", len(self._running), drain_s)
        with trio.move_on_after(drain_s):
            await self._idle.wait()
        if not self.drain_over.is_set():
            if self._running:
                log.warning("drain time is up: cutting %d requests", len(self._running))
            self.drain_over.set()
            for scope in self._running:
                scope.cancel()
        # each cut request sends its error event and cleans up, both bounded by the grace
        with trio.move_on_after(2 * self._cut_grace_s + 1):
            await self._idle.wait()
