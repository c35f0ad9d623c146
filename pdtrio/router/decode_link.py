"""Router side of the router <-> decode websocket: one link per decode instance.

All requests to one decode instance share the link.  A single reader task
decodes each frame and hands each entry to its stream's bounded buffer
without ever awaiting the stream's consumer, so a slow client cannot stall
the others; the stream's own writer drains its buffer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, final

import msgpack
import trio

from pdtrio import codec
from pdtrio.protocol.stream_buffer import PushResult, StreamBuffer, StreamBufferError
from pdtrio.protocol.wire import (
    DecodeAbort,
    DecodeStart,
    MessageKind,
)
from pdtrio.router.ws_client import (
    ConnectionClosed,
    HandshakeError,
    WebSocketClient,
    connect_websocket,
)

log = logging.getLogger("pdtrio.router.decode_link")

_TOKENS = int(MessageKind.TOKENS)
_ACCEPTED = int(MessageKind.ACCEPTED)
_REJECTED = int(MessageKind.REJECTED)
_FAILED = int(MessageKind.FAILED)
_OVERFLOW = PushResult.OVERFLOW

_CONNECT_TIMEOUT_S = 10.0
_MAX_MESSAGE_SIZE = 64 * 1024 * 1024
# one read of the link takes up to this much; every frame in it is dispatched
# before the reader yields, so a stream's consumer wakes once per read, not per frame
_RECEIVE_SIZE = 64 * 1024
# what a frame that is not msgpack, or not the shape we expect, raises on the way in
_BAD_FRAME = (
    ValueError,  # msgpack: ExtraData, FormatError, StackError, bad UTF-8
    IndexError,
    TypeError,
    KeyError,
    AttributeError,
    StreamBufferError,
)


class DecodeLinkClosed(Exception):
    """The link to the decode instance is down."""


# what a broken or refused websocket raises
LINK_ERRORS = (
    OSError,
    trio.BrokenResourceError,
    HandshakeError,
    ConnectionClosed,
)


@final
class DecodeStream:
    """One request's view of the link: acceptance, then merged token deltas.

    One task at a time waits on it (the request's pipeline); the link's
    reader calls :meth:`notify` after each change.
    """

    __slots__ = (
        "request_id",
        "buffer",
        "accepted",
        "rejection",
        "failure",
        "overflowed",
        "cutoff",
        "on_overflow",
        "_updated",
        "_waiter",
    )

    def __init__(self, request_id: str, max_pending_tokens: int) -> None:
        self.request_id = request_id
        self.buffer = StreamBuffer(max_pending_tokens=max_pending_tokens)
        self.accepted = False
        self.rejection: tuple[str, str] | None = None  # (reason, message)
        self.failure: str | None = None
        self.overflowed = False
        # the consumer's scope: cancelled on overflow, even while it is stuck writing to its client
        self.cutoff: trio.CancelScope | None = None
        # called once on overflow: the consumer may be stuck in a write nobody can cancel
        # (hypercorn shields its socket sends), so upstream is released from here
        self.on_overflow: Callable[[], None] | None = None
        self._updated = False
        self._waiter: trio.lowlevel.Task | None = None

    def notify(self) -> None:
        """Something new arrived: wake the waiter (never blocks)."""
        self._updated = True
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            trio.lowlevel.reschedule(waiter)

    async def wait_update(self) -> None:
        """Wait until something new arrived (tokens, acceptance, failure).

        Returns at once (after a checkpoint) when something arrived since the
        last wait.  A trio.Event per wait would cost an allocation per wake-up.
        """
        if not self._updated:
            if self._waiter is not None:
                raise RuntimeError(f"another task is already waiting on {self.request_id}")
            self._waiter = trio.lowlevel.current_task()

            def abort(_: Any) -> trio.lowlevel.Abort:
                self._waiter = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        else:
            await trio.lowlevel.checkpoint()
        self._updated = False



@final
class DecodeLink:
    def __init__(self, instance_id: str, url: str, *, max_pending_tokens: int) -> None:
        self.instance_id = instance_id
        self.url = url
        self.max_pending_tokens = max_pending_tokens
        self._ws: WebSocketClient | None = None
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
        ws: WebSocketClient | None = None
        try:
            with trio.move_on_after(_CONNECT_TIMEOUT_S) as timer:
                ws = await connect_websocket(
                    self.url, max_message_size=_MAX_MESSAGE_SIZE, receive_size=_RECEIVE_SIZE
                )
            if ws is None or timer.cancelled_caught:
                raise HandshakeError(f"{self.url}: no websocket within {_CONNECT_TIMEOUT_S:g}s")
            self._ws = ws
            self.ever_connected = True
            task_status.started()
            await self._read(ws)
        finally:
            self._ws = None
            self._fail_all("the connection to decode instance was lost")
            if ws is not None:
                await ws.aclose()

    async def _read(self, ws: WebSocketClient) -> None:
        streams = self._streams
        unpackb = msgpack.unpackb
        dispatch_entries = self.dispatch_entries
        while True:
            try:
                batch = await ws.receive_messages()
            except ConnectionClosed:
                return
            self.frames_received += len(batch)
            # every frame of the read goes to its streams before anyone else runs
            for data in batch:
                try:
                    # the options of pdtrio.codec.unpack, without its call
                    message = unpackb(data, raw=False, strict_map_key=True, use_list=True)
                    kind = message[0]
                    if kind == _TOKENS:
                        dispatch_entries(message[1])
                        continue
                    stream = streams.get(message[1])
                    if stream is None:
                        continue
                    if kind == _ACCEPTED:
                        stream.accepted = True
                    elif kind == _REJECTED:
                        stream.rejection = (str(message[2]), str(message[3]))
                    elif kind == _FAILED:
                        stream.failure = str(message[2])
                    else:
                        continue
                    stream.notify()
                except _BAD_FRAME as exc:
                    log.warning("bad frame from %s: %r", self.instance_id, exc)

    def dispatch_entries(self, entries: list[list[Any]]) -> None:
        """Hand each entry to its stream; never waits (the hot path)."""
        get = self._streams.get
        self.entries_received += len(entries)
        for entry in entries:
            stream = get(entry[0])
            if stream is None:
                continue  # aborted or already gone
            if stream.buffer.push(entry[2], len(entry[1]), entry[3], entry[4]) is _OVERFLOW:
                stream.overflowed = True
                if stream.cutoff is not None:
                    stream.cutoff.cancel()
                if stream.on_overflow is not None:
                    stream.on_overflow()
                    stream.on_overflow = None
            if not stream._updated:
                stream.notify()

    def _fail_all(self, message: str) -> None:
        for stream in self._streams.values():
            if stream.failure is None:
                stream.failure = message
            stream.notify()

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
        except ConnectionClosed as exc:
            raise DecodeLinkClosed(f"decode instance {self.instance_id} closed the link") from exc
