"""Router side of the router <-> decode websocket: one link per decode instance.

All requests to one decode instance share the link.  A single reader task
decodes each frame and hands each entry to its stream's bounded buffer
without ever awaiting the stream's consumer, so a slow client cannot stall
the others; the stream's own writer drains its buffer.
"""

from __future__ import annotations

import logging
from typing import Any, final

import trio
import trio_websocket

from pdtrio import codec
from pdtrio.protocol.stream_buffer import PushResult, StreamBuffer
from pdtrio.protocol.wire import (
    DecodeAbort,
    DecodeStart,
    MessageKind,
    WireError,
)

log = logging.getLogger("pdtrio.router.decode_link")

_TOKENS = int(MessageKind.TOKENS)
_ACCEPTED = int(MessageKind.ACCEPTED)
_REJECTED = int(MessageKind.REJECTED)
_FAILED = int(MessageKind.FAILED)


class DecodeLinkClosed(Exception):
    """The link to the decode instance is down."""


# what a broken or refused websocket raises
LINK_ERRORS = (
    OSError,
    trio.BrokenResourceError,
    trio_websocket.HandshakeError,
    trio_websocket.ConnectionClosed,
)


@final
class DecodeStream:
    """One request's view of the link: acceptance, then merged token deltas."""

    __slots__ = (
        "request_id",
        "buffer",
        "wakeup",
        "accepted",
        "rejection",
        "failure",
        "overflowed",
    )

    def __init__(self, request_id: str, max_pending_tokens: int) -> None:
        self.request_id = request_id
        self.buffer = StreamBuffer(max_pending_tokens=max_pending_tokens)
        self.wakeup = trio.Event()
        self.accepted = False
        self.rejection: tuple[str, str] | None = None  # (reason, message)
        self.failure: str | None = None
        self.overflowed = False

    async def wait_update(self) -> None:
        """Wait until something new arrived (tokens, acceptance, failure)."""
        await self.wakeup.wait()
        self.wakeup = trio.Event()

    @property
    def has_update(self) -> bool:
        return self.wakeup.is_set()


@final
class DecodeLink:
    def __init__(self, instance_id: str, url: str, *, max_pending_tokens: int) -> None:
        self.instance_id = instance_id
        self.url = url
        self.max_pending_tokens = max_pending_tokens
        self._ws: trio_websocket.WebSocketConnection | None = None
        self._streams: dict[str, DecodeStream] = {}
        self.ever_connected = False
        self.frames_received = 0
        self.entries_received = 0

    @property
    def connected(self) -> bool:
        return self._ws is not None

    @property
    def active_requests(self) -> int:
        return len(self._streams)

    async def run(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Connect and read frames until the link breaks (then the caller reconnects)."""
        try:
            async with trio_websocket.open_websocket_url(
                self.url,
                max_message_size=64 * 1024 * 1024,
                message_queue_size=64,
                connect_timeout=10,
                disconnect_timeout=2,
            ) as ws:
                self._ws = ws
                self.ever_connected = True
                task_status.started()
                await self._read(ws)
        finally:
            self._ws = None
            self._fail_all("the connection to decode instance was lost")

    async def _read(self, ws: trio_websocket.WebSocketConnection) -> None:
        streams = self._streams
        while True:
            try:
                data = await ws.get_message()
            except trio_websocket.ConnectionClosed:
                return
            if isinstance(data, str):
                continue
            try:
                message = codec.unpack(data)
                kind = message[0]
            except (WireError, IndexError, TypeError, KeyError):
                log.warning("bad frame from %s", self.instance_id)
                continue
            self.frames_received += 1
            if kind == _TOKENS:
                self.dispatch_entries(message[1])
            elif kind == _ACCEPTED:
                stream = streams.get(message[1])
                if stream is not None:
                    stream.accepted = True
                    stream.wakeup.set()
            elif kind == _REJECTED:
                stream = streams.get(message[1])
                if stream is not None:
                    stream.rejection = (str(message[2]), str(message[3]))
                    stream.wakeup.set()
            elif kind == _FAILED:
                stream = streams.get(message[1])
                if stream is not None:
                    stream.failure = str(message[2])
                    stream.wakeup.set()

    def dispatch_entries(self, entries: list[list[Any]]) -> None:
        """Hand each entry to its stream; never waits (the hot path)."""
        streams = self._streams
        self.entries_received += len(entries)
        for entry in entries:
            stream = streams.get(entry[0])
            if stream is None:
                continue  # aborted or already gone
            result = stream.buffer.push(entry[2], len(entry[1]), entry[3], entry[4])
            if result is PushResult.OVERFLOW:
                stream.overflowed = True
            stream.wakeup.set()

    def _fail_all(self, message: str) -> None:
        for stream in self._streams.values():
            if stream.failure is None:
                stream.failure = message
            stream.wakeup.set()

    def open_stream(self, request_id: str) -> DecodeStream:
        stream = DecodeStream(request_id, self.max_pending_tokens)
        self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def send_start(self, start: DecodeStart) -> None:
        await self._send(start.to_wire())

    async def send_abort(self, request_id: str) -> None:
        await self._send(DecodeAbort(request_id).to_wire())

    async def _send(self, message: list[Any]) -> None:
        ws = self._ws
        if ws is None:
            raise DecodeLinkClosed(f"decode instance {self.instance_id} is not connected")
        try:
            await ws.send_message(codec.pack(message))
        except trio_websocket.ConnectionClosed as exc:
            raise DecodeLinkClosed(f"decode instance {self.instance_id} closed the link") from exc
