"""Containment for hypercorn's trio connection handling (checked with hypercorn 0.18.0
and h11 0.16.0, the versions pinned in constraints.txt).

hypercorn runs each connection as a task of its server's nursery, and an exception
that escapes a connection ends that nursery: the whole server process stops. Two
races in hypercorn let bytes from any peer, before it has authenticated, raise one:

- A websocket upgrade with a frame in the same write. The app is spawned for the
  upgrade and refuses it (an HTTP 403, ``websocket.close`` before accepting); the
  reading task meanwhile meets the frame, which came before any acceptance, and
  answers it with a 400 of its own. Whichever response is second meets h11 in the
  wrong state (``LocalProtocolError: can't handle event type Response when
  role=SERVER and state=SEND_BODY``), or both tasks write at once
  (``BusyResourceError``).
- A connection closed while the app answers: the reading task answers the broken
  request and closes the socket (``send_eof``) outside the connection's send lock,
  while the app's response is written under it: ``BusyResourceError`` in the app,
  which hypercorn logs with a traceback ("Error in ASGI Framework").

``install()`` fixes both where they happen, and contains whatever else escapes a
connection: it ends that connection only, and is logged within a budget.
"""

from __future__ import annotations

import logging
from importlib.metadata import version
from typing import Any, Final

import trio

from pdtrio.logs import LogBudget

log = logging.getLogger("pdtrio.http")

CHECKED_VERSIONS: Final = {"hypercorn": "0.18.0", "h11": "0.16.0"}

_installed = False
_connection_failures = LogBudget()


def install() -> None:
    """Apply the fixes to hypercorn's classes; idempotent.

    The race fixes replace two of hypercorn's methods, so they apply only to the
    versions they were checked against; the containment of a failing connection
    applies to any version.
    """
    global _installed
    if _installed:
        return
    _installed = True
    from hypercorn.trio.tcp_server import TCPServer

    original_run = TCPServer.run

    async def run_contained(self: Any) -> None:
        try:
            await original_run(self)
        except* Exception as failures:
            _connection_failures.log(
                log,
                logging.WARNING,
                "connection",
                "a connection failed and was closed (the server goes on): %r",
                failures.exceptions[0],
            )
            await trio.aclose_forcefully(self.stream)

    TCPServer.run = run_contained  # type: ignore[method-assign]

    found = {name: version(name) for name in CHECKED_VERSIONS}
    if found != CHECKED_VERSIONS:
        log.warning(
            "hypercorn's connection handling is only contained, not fixed: "
            "the fixes were checked with %s, this is %s",
            CHECKED_VERSIONS,
            found,
        )
        return
    _close_under_the_send_lock(TCPServer)
    _refuse_early_websocket_frames_once()


def _close_under_the_send_lock(tcp_server: Any) -> None:
    """A connection's close (``send_eof``) waits for a write under way, as writes wait
    for each other, instead of meeting it."""
    from hypercorn.events import Closed

    original_send = tcp_server.protocol_send

    async def protocol_send(self: Any, event: Any) -> None:
        if isinstance(event, Closed):
            async with self.send_lock:
                await self._close()
            await self.protocol.handle(Closed())
        else:
            await original_send(self, event)

    tcp_server.protocol_send = protocol_send


def _refuse_early_websocket_frames_once() -> None:
    """Frames sent before a websocket upgrade is accepted (a client must wait for the
    101) get one answer: a 400 when the app has not answered yet, then the app is told
    the peer is gone and the connection closes; nothing when the app already refused."""
    from hypercorn.protocol.events import Body, Data, StreamClosed
    from hypercorn.protocol.ws_stream import ASGIWebsocketState, WSStream

    original_handle = WSStream.handle

    async def handle(self: Any, event: Any) -> None:
        if self.closed or not isinstance(event, Body | Data) or self.handshake.accepted:
            await original_handle(self, event)
            return
        if self.state is not ASGIWebsocketState.HANDSHAKE:
            return  # the app's refusal is out, or going out; it closes the connection
        self.closed = True  # before the write: the app's own answer, meanwhile, is dropped
        await self._send_error_response(400)
        if self.app_put is not None:
            await self.app_put({"type": "websocket.disconnect", "code": 1006})
        await self.send(StreamClosed(stream_id=self.stream_id))

    WSStream.handle = handle  # type: ignore[method-assign]
