"""Cutting a websocket client's incoming bytes into messages, without I/O.

Why this exists beside wsproto: wsproto turns every frame into an event
object, and on the decode link (one token per frame, almost every frame a
whole unmasked binary message) that per-frame path capped the router's ingest
at ~30k tokens/s.  Cutting those frames straight out of each read as plain
byte slices, many per read, and handing them over as one batch, took it to
~770k tokens/s (and from 109k to 1.38M tokens/s at 16 tokens per frame),
measured on this machine.  Everything else -- control frames (ping, close),
text, fragmented messages, anything malformed -- still goes to wsproto's
:class:`~wsproto.WSConnection`, one whole frame at a time, and wsproto keeps
owning the connection state (the shell sends through the same object).

Use: feed what the socket read to :meth:`ClientFrameReader.receive_data`
(reading at most :meth:`ClientFrameReader.wanted_read_size` bytes), then
:meth:`ClientFrameReader.take_batch` returns the whole messages completed so
far, the control frames to send back (pongs) and, once the connection is
closing, the close frame to send and how it closed.

A peer that breaks the protocol (a masked frame, a bad opcode or UTF-8, a
message over ``max_message_size``) is not raised as an exception: it is
reported like a close -- :attr:`FrameBatch.closed` with code 1002, 1007 or
1009 and ``by_peer=False``, and :attr:`FrameBatch.close_reply` holding the
close frame the client must send -- after the messages that arrived before
the violation.  That is exactly what the shell has to do with it, and no
message read before the violation is lost.  So no input, however malformed,
makes this module raise; the only exception it raises is
:class:`ReaderClosedError`, for a caller that feeds bytes after the close was
reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, final

from wsproto import WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import BytesMessage, CloseConnection, Ping, Pong, TextMessage
from wsproto.utilities import LocalProtocolError

# FIN + binary opcode, no RSV bits: a whole binary message in one frame
_FIN_BINARY: Final = 0x82
# one read never asks for more than this, however large the frame being gathered
MAX_READ_SIZE: Final = 16 * 1024 * 1024

# the RFC 6455 close code this module produces itself (wsproto produces the others)
CLOSE_MESSAGE_TOO_BIG: Final = 1009


class WebSocketFrameError(Exception):
    """Base of this module's errors."""


class ReaderClosedError(WebSocketFrameError):
    """Bytes were fed after the reader reported the connection closed (a caller bug)."""


@final
@dataclass(frozen=True, slots=True)
class Closure:
    """How the connection closed.

    ``by_peer``: the server sent a close frame (``code``/``reason`` are its
    own); False when the client closes because the server broke the protocol
    (1002 malformed, 1007 bad UTF-8, 1009 a message over the limit), or 1006
    when frames arrive after the caller already finished the close through
    the shared ``WSConnection``.
    """

    code: int
    reason: str | None
    by_peer: bool


@final
@dataclass(frozen=True, slots=True)
class FrameBatch:
    """What the bytes fed so far completed."""

    messages: list[bytes | str] = field(default_factory=list)
    """Whole messages, in order: ``bytes`` for binary, ``str`` for text."""
    replies: list[Pong] = field(default_factory=list)
    """Pongs to send, in order."""
    close_reply: CloseConnection | None = None
    """The close frame to send (once), then close the stream."""
    closed: Closure | None = None
    """Set once the connection is closing; every later batch repeats it."""


@final
class ClientFrameReader:
    """The receiving half of a client websocket after the handshake.

    ``ws`` is the client :class:`~wsproto.WSConnection` that did the handshake
    (now open); the reader feeds it the frames it does not cut itself, and
    the caller sends through it.  One reader, one consumer.
    """

    def __init__(self, ws: WSConnection, *, max_message_size: int, receive_size: int) -> None:
        self._ws = ws
        self._max_message_size = max_message_size
        self._receive_size = receive_size
        # bytes fed but not cut yet (the start of an incomplete frame, or new data)
        self._buffer = b""
        # reads gathered, uncut, until a frame larger than one read is whole:
        # cutting waits for all of it instead of re-scanning the buffer per read
        self._chunks: list[bytes] = []
        self._gathered = 0
        self._need = 0
        # a fragmented message (only ever through wsproto) being put together
        self._fragments: list[bytes | str] | None = None
        self._fragments_size = 0
        self._closure: Closure | None = None

    @property
    def closed(self) -> Closure | None:
        """How the connection closed, or None while it is open."""
        return self._closure

    def wanted_read_size(self) -> int:
        """How many bytes the next read should ask for.

        The receive size, or, while a larger frame is being gathered, what it
        still needs (at most :data:`MAX_READ_SIZE`), so it takes few reads.
        """
        if self._need:
            return min(MAX_READ_SIZE, max(self._receive_size, self._need - self._gathered))
        return self._receive_size

    def receive_data(self, data: bytes) -> None:
        """Feed bytes read from the socket (cut on the next :meth:`take_batch`)."""
        if self._closure is not None:
            raise ReaderClosedError("the connection is closed: nothing more can be read")
        if not data:
            return
        if self._need:
            self._chunks.append(data)
            self._gathered += len(data)
            if self._gathered >= self._need:
                self._buffer = b"".join(self._chunks)
                self._chunks = []
                self._gathered = self._need = 0
        elif self._buffer:
            self._buffer += data
        else:
            self._buffer = data

    def take_batch(self) -> FrameBatch:
        """Cut every whole frame fed so far; keep the incomplete rest for later."""
        batch = FrameBatch(closed=self._closure)
        if self._need or not self._buffer or self._closure is not None:
            return batch
        data = self._buffer
        self._buffer = b""
        messages = batch.messages
        pos = 0
        end = len(data)
        limit = self._max_message_size
        while end - pos >= 2:
            b0 = data[pos]
            b1 = data[pos + 1]
            if b0 == _FIN_BINARY and b1 < 0x80 and self._fragments is None:
                # the fast path: a whole, unmasked binary message
                if b1 < 126:
                    start = pos + 2
                    length = b1
                elif b1 == 126:
                    if end - pos < 4:
                        break
                    start = pos + 4
                    length = (data[pos + 2] << 8) | data[pos + 3]
                else:
                    if end - pos < 10:
                        break
                    start = pos + 10
                    length = int.from_bytes(data[pos + 2 : start], "big")
                stop = start + length
                if length > limit:
                    return self._violation(
                        batch,
                        CLOSE_MESSAGE_TOO_BIG,
                        f"a message of {length} bytes is over the limit",
                    )
                if stop > end:
                    break
                messages.append(data[start:stop])
                pos = stop
                continue
            extent = _frame_extent(data, pos, end)
            if extent is None:
                break
            stop, length = extent
            if length > limit:
                return self._violation(
                    batch, CLOSE_MESSAGE_TOO_BIG, f"a frame of {length} bytes is over the limit"
                )
            if stop > end:
                break
            batch = self._through_wsproto(data[pos:stop], batch)
            pos = stop
            if batch.closed is not None:
                return batch
        if pos < end:
            rest = data[pos:] if pos else data
            extent = _frame_extent(rest, 0, len(rest))
            if extent is not None and extent[0] > self._receive_size:
                # a large frame: gather its bytes without cutting each read
                self._chunks = [rest]
                self._gathered = len(rest)
                self._need = extent[0]
            else:
                self._buffer = rest
        return batch

    def _through_wsproto(self, frame: bytes, batch: FrameBatch) -> FrameBatch:
        """Hand one whole frame to wsproto; return ``batch`` with what it made of it."""
        ws = self._ws
        try:
            ws.receive_data(frame)
        except LocalProtocolError:
            # the caller already finished the close through ``ws``: nothing more to read
            return self._close(batch, None, Closure(1006, "the connection is closed", False))
        for event in ws.events():
            if isinstance(event, (BytesMessage, TextMessage)):
                raw = event.data
                data: bytes | str = bytes(raw) if isinstance(raw, bytearray) else raw
                if self._fragments is None:
                    if event.message_finished:
                        batch.messages.append(data)
                        continue
                    self._fragments = []
                    self._fragments_size = 0
                self._fragments.append(data)
                self._fragments_size += len(data)
                if self._fragments_size > self._max_message_size:
                    return self._violation(
                        batch, CLOSE_MESSAGE_TOO_BIG, "a fragmented message is over the limit"
                    )
                if event.message_finished:
                    parts = self._fragments
                    self._fragments = None
                    batch.messages.append(_join(parts, text=isinstance(event, TextMessage)))
            elif isinstance(event, Ping):
                batch.replies.append(event.response())
            elif isinstance(event, CloseConnection):
                state = ws.state
                if state is ConnectionState.REMOTE_CLOSING:
                    # the server closed first: answer it
                    closure = Closure(event.code, event.reason, by_peer=True)
                    return self._close(batch, event.response(), closure)
                if state is ConnectionState.CLOSED:
                    # the server answered a close the caller sent
                    return self._close(batch, None, Closure(event.code, event.reason, True))
                # wsproto found the frame malformed (the state did not move): close with its code
                return self._violation(batch, event.code, event.reason or "")
        return batch

    def _violation(self, batch: FrameBatch, code: int, reason: str) -> FrameBatch:
        # once the caller has sent its own close (LOCAL_CLOSING), there is none to send
        reply = CloseConnection(code, reason) if self._ws.state is ConnectionState.OPEN else None
        return self._close(batch, reply, Closure(code, reason, by_peer=False))

    def _close(
        self, batch: FrameBatch, reply: CloseConnection | None, closure: Closure
    ) -> FrameBatch:
        self._closure = closure
        self._buffer = b""
        self._chunks = []
        self._gathered = self._need = 0
        self._fragments = None
        return FrameBatch(batch.messages, batch.replies, reply, closure)


def masked_binary_frame(payload: bytes, mask: bytes) -> bytes:
    """A client's whole binary message as one frame (RFC 6455 5.2), masked with ``mask``.

    What ``WSConnection.send(BytesMessage(payload))`` produces with that mask
    (the caller draws a fresh one per frame), at a fraction of its cost: the
    link's messages are small and many, and wsproto's frame object and its
    per-call masker were a tenth of the router's CPU for a short request.
    The mask goes over the payload as one big-integer XOR.
    """
    if len(mask) != 4:
        raise ValueError("a websocket mask is 4 bytes")
    size = len(payload)
    if size < 126:
        header = bytes((_FIN_BINARY, 0x80 | size))
    elif size < 1 << 16:
        header = bytes((_FIN_BINARY, 0x80 | 126)) + size.to_bytes(2, "big")
    else:
        header = bytes((_FIN_BINARY, 0x80 | 127)) + size.to_bytes(8, "big")
    if not size:
        return header + mask
    repeated = mask * (size // 4 + 1)
    key = int.from_bytes(repeated[:size] if size % 4 else repeated[:-4], "big")
    masked = (int.from_bytes(payload, "big") ^ key).to_bytes(size, "big")
    return header + mask + masked


def _join(parts: list[bytes | str], *, text: bool) -> bytes | str:
    if text:
        return "".join(part for part in parts if isinstance(part, str))
    return b"".join(part for part in parts if isinstance(part, bytes))


def _frame_extent(data: bytes, pos: int, end: int) -> tuple[int, int] | None:
    """(end offset, payload length) of the frame at ``pos``; None while its header is incomplete."""
    if end - pos < 2:
        return None
    b1 = data[pos + 1]
    length = b1 & 0x7F
    header = 2
    if length == 126:
        header = 4
        if end - pos < header:
            return None
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
    elif length == 127:
        header = 10
        if end - pos < header:
            return None
        length = int.from_bytes(data[pos + 2 : pos + 10], "big")
    if b1 & 0x80:
        header += 4  # masked (a server must not; wsproto will say so)
    return pos + header + length, length
