"""What a worker link sends: the messages posted to it, and the one writer task that
drains them.

A message posted to an idle link (nothing queued, no write under way) is written at
once from the poster's task, a frame whole in one ``os.write`` that never waits
(``WebSocketClient.send_now``): waking the writer for it was a task step more per
message.  Otherwise the writer sends whatever is queued in one write, so a burst
shares a syscall; what the kernel left of a message written at once goes first.
Either way no await falls inside a frame, so a request cancelled mid-way can never
tear one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import final

import trio

from pdtrio.router.workers.ws_client import ConnectionClosed, WebSocketClient

# messages waiting for the writer; a caller that finds it full waits for room
_OUTBOX_LIMIT = 4096


@final
class LinkOutbox:
    """The messages going to the worker over the link's current connection, in order."""

    def __init__(self, on_quieter: Callable[[], None]) -> None:
        self.ws: WebSocketClient | None = None  # the current connection (None: down)
        # encoded messages for the writer, in order; a list swapped out whole per write
        self._queued: list[bytes | Iterator[bytes]] = []
        self._writer_waiting = trio.lowlevel.ParkingLot()
        self._room_waiting = trio.lowlevel.ParkingLot()
        self._on_quieter = on_quieter  # told when the last of what was queued went

    @property
    def busy(self) -> bool:
        """Whether messages wait to go."""
        ws = self.ws
        return bool(self._queued) or (ws is not None and ws.has_unsent)

    def connected(self, ws: WebSocketClient) -> None:
        """Send on ``ws`` from now.  What was queued for the old connection is dropped:
        the worker ended those requests itself."""
        self.ws = ws
        self._queued.clear()

    def disconnected(self) -> None:
        """The connection is gone: nothing more goes, and no poster waits for room."""
        self.ws = None
        self._queued.clear()
        self._room_waiting.unpark_all()

    def post_nowait(self, data: bytes) -> None:
        """Queue a message past the outbox's limit (releases and aborts: never block)."""
        ws = self.ws
        if ws is None:
            return  # the worker ended the link's requests itself
        self._send_or_queue(ws, data)

    async def post(self, data: bytes | Iterator[bytes]) -> bool:
        """Queue a message for the writer, waiting while the outbox is full; False when
        the link is down (nothing was sent)."""
        while len(self._queued) >= _OUTBOX_LIMIT and self.ws is not None:
            await self._room_waiting.park()
        ws = self.ws
        if ws is None:
            return False
        self._send_or_queue(ws, data)
        return True

    def _send_or_queue(self, ws: WebSocketClient, data: bytes | Iterator[bytes]) -> None:
        """Write an idle link's message from the poster's task, else queue it for the
        writer: waking the writer would be a task step more per message, for a batch
        of one most of the time."""
        if not self._queued and type(data) is bytes and ws.send_now(data):
            if not ws.has_unsent:
                return
            # the kernel took only its start: the writer sends the rest first
        else:
            self._queued.append(data)
        if self._writer_waiting:
            self._writer_waiting.unpark()

    async def write(self, ws: WebSocketClient) -> None:
        """The writer: send what is queued on ``ws``, each time in one write, until the
        connection closes."""
        while True:
            if not self._queued and not ws.has_unsent:
                await self._writer_waiting.park()
                continue
            batch = self._queued
            self._queued = []
            if self._room_waiting:
                self._room_waiting.unpark_all()
            try:
                await ws.send_messages(batch)
            except ConnectionClosed:
                return  # the reader sees the close; the worker ends a lost link's requests
            del batch  # a huge prefill call must not live on until the next write
            if not self._queued:
                self._on_quieter()
