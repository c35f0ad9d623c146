"""A lean websocket client for the router's decode links: wsproto over a trio stream.

The decode link's reader is the hot loop of the router, and almost every frame
it reads is the same shape: one whole binary message in one unmasked frame
(decode sends token frames that way, and no extension is ever negotiated).
Those frames are cut straight out of the receive buffer, many per read, and
handed to the caller as one batch, so the per-frame cost is a few byte
lookups and a slice.  Everything else -- control frames (ping, close), text
or fragmented messages, anything malformed -- goes to wsproto whole, frame by
frame, and wsproto owns the connection state and the handshake.

One reader (whoever calls :meth:`WebSocketClient.receive_messages`); writes
are serialised with a ``trio.Lock``.  No extra task, no queue.
"""

from __future__ import annotations

import urllib.parse
from typing import final

import trio
import wsproto
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

__all__ = [
    "ConnectionClosed",
    "HandshakeError",
    "WebSocketClient",
    "WebSocketError",
    "connect_websocket",
]

# FIN + binary opcode, no RSV bits: a whole binary message in one frame
_FIN_BINARY = 0x82
_MAX_RESPONSE_HEAD = 64 * 1024
# one read never asks for more than this, however large the frame being gathered
_MAX_READ = 16 * 1024 * 1024


class WebSocketError(Exception):
    """Base of the client's errors."""


class HandshakeError(WebSocketError):
    """The websocket could not be opened (refused, bad response, closed early)."""


class ConnectionClosed(WebSocketError):
    """The websocket is closed; ``code`` and ``reason`` say how (1006: no close frame)."""

    def __init__(self, code: int, reason: str | None = None) -> None:
        super().__init__(f"websocket closed: {code} {reason or ''}".rstrip())
        self.code = code
        self.reason = reason


async def connect_websocket(
    url: str, *, max_message_size: int, receive_size: int = 65536
) -> WebSocketClient:
    """Open a TCP connection to a ``ws://`` URL and do the opening handshake.

    Takes no timeout: the caller owns the cancel scope.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "ws" or not parts.hostname:
        raise ValueError(f"not a ws:// URL: {url!r}")
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    stream = await trio.open_tcp_stream(parts.hostname, parts.port or 80)
    try:
        ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
        await stream.send_all(ws.send(Request(host=parts.netloc, target=target)))
        head = b""
        while (cut := head.find(b"\r\n\r\n")) < 0:
            if len(head) > _MAX_RESPONSE_HEAD:
                raise HandshakeError(f"{url}: the handshake response is too large")
            chunk = await stream.receive_some(65536)
            if not chunk:
                raise HandshakeError(f"{url}: the server closed the connection during the handshake")
            head += chunk
        # wsproto sees the response head only; what follows is frames, and ours to parse
        try:
            ws.receive_data(head[: cut + 4])
        except RemoteProtocolError as exc:
            raise HandshakeError(f"{url}: bad handshake response: {exc}") from None
        for event in ws.events():
            if isinstance(event, AcceptConnection):
                return WebSocketClient(
                    stream,
                    ws,
                    head[cut + 4 :],
                    max_message_size=max_message_size,
                    receive_size=receive_size,
                )
            if isinstance(event, RejectConnection):
                raise HandshakeError(f"{url}: the server refused the websocket (HTTP {event.status_code})")
        raise HandshakeError(f"{url}: no handshake response")
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise


@final
class WebSocketClient:
    """An open client websocket. Use :func:`connect_websocket` to make one."""

    def __init__(
        self,
        stream: trio.abc.Stream,
        ws: wsproto.WSConnection,
        buffered: bytes,
        *,
        max_message_size: int,
        receive_size: int,
    ) -> None:
        self._stream = stream
        self._ws = ws
        self._max_message_size = max_message_size
        self._receive_size = receive_size
        self._send_lock = trio.Lock()
        # bytes read but not parsed yet: the start of an incomplete frame
        self._buffer = b""
        # what came with the handshake response, parsed before the first read
        self._early = buffered
        # reads gathered, unparsed, until a large frame of known size is whole
        self._chunks: list[bytes] = []
        self._gathered = 0
        self._need = 0
        # a fragmented message (only ever through wsproto) being put together
        self._fragments: list[bytes | str] | None = None
        self._fragments_size = 0
        self._close_to_send: CloseConnection | None = None
        self._closed: ConnectionClosed | None = None

    @property
    def closed(self) -> ConnectionClosed | None:
        """How the connection closed, or None while it is open."""
        return self._closed

    # --- receiving -------------------------------------------------------------------

    async def receive_messages(self) -> list[bytes | str]:
        """Wait for the next read and return every message it completed (at least one).

        Raises :class:`ConnectionClosed` once the connection is closed (after
        the messages that arrived before the close were returned).
        """
        messages: list[bytes | str] = []
        while not messages:
            if self._closed is not None:
                raise ConnectionClosed(self._closed.code, self._closed.reason)
            if self._early:
                data, self._early = self._early, b""
                controls = self._parse(data, messages)
                if controls or self._close_to_send is not None:
                    await self._answer(controls)
                continue
            want = self._receive_size
            if self._need:
                want = min(_MAX_READ, max(want, self._need - self._gathered))
            try:
                chunk = await self._stream.receive_some(want)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                chunk = b""
            data = chunk if isinstance(chunk, bytes) else bytes(chunk)
            if not data:
                if self._closed is None:
                    self._closed = ConnectionClosed(1006, "the connection dropped without a close frame")
                await trio.aclose_forcefully(self._stream)
                continue
            if self._need:
                self._chunks.append(data)
                self._gathered += len(data)
                if self._gathered < self._need:
                    continue
                data = b"".join(self._chunks)
                self._chunks = []
                self._gathered = self._need = 0
            elif self._buffer:
                data = self._buffer + data
                self._buffer = b""
            controls = self._parse(data, messages)
            if controls or self._close_to_send is not None:
                await self._answer(controls)
        return messages

    def _parse(self, data: bytes, messages: list[bytes | str]) -> list[Event] | None:
        """Cut whole frames out of ``data`` into ``messages``; keep the incomplete rest.

        Returns the control events to answer (pongs, the close reply).
        """
        pos = 0
        end = len(data)
        limit = self._max_message_size
        controls: list[Event] | None = None
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
                    return self._fail(1009, f"a message of {length} bytes is over the limit")
                if stop > end:
                    break
                messages.append(data[start:stop])
                pos = stop
                continue
            extent = _frame_stop(data, pos, end)
            if extent is None:
                break
            stop, length = extent
            if length > limit:
                return self._fail(1009, f"a frame of {length} bytes is over the limit")
            if stop > end:
                break
            events = self._through_wsproto(data[pos:stop], messages)
            pos = stop
            if events:
                controls = (controls or []) + events
            if self._close_to_send is not None or self._closed is not None:
                return controls
        rest = data[pos:]
        if rest:
            extent = _frame_stop(rest, 0, len(rest))
            if extent is not None and extent[0] > self._receive_size:
                # a large frame: gather its bytes without parsing each read
                self._chunks = [rest]
                self._gathered = len(rest)
                self._need = extent[0]
            else:
                self._buffer = rest
        return controls

    def _through_wsproto(self, frame: bytes, messages: list[bytes | str]) -> list[Event] | None:
        ws = self._ws
        out: list[Event] | None = None
        try:
            ws.receive_data(frame)
        except LocalProtocolError:
            return None  # already closing: nothing more to read
        for event in ws.events():
            if isinstance(event, (BytesMessage, TextMessage)):
                data = event.data
                if isinstance(data, bytearray):
                    data = bytes(data)
                if self._fragments is None:
                    if event.message_finished:
                        messages.append(data)
                        continue
                    self._fragments = []
                    self._fragments_size = 0
                self._fragments.append(data)
                self._fragments_size += len(data)
                if self._fragments_size > self._max_message_size:
                    return self._fail(1009, "a fragmented message is over the limit")
                if event.message_finished:
                    parts = self._fragments
                    self._fragments = None
                    joined: bytes | str = (
                        "".join(parts) if isinstance(event, TextMessage) else b"".join(parts)  # type: ignore[arg-type]
                    )
                    messages.append(joined)
            elif isinstance(event, Ping):
                out = (out or []) + [event.response()]
            elif isinstance(event, CloseConnection):
                if ws.state is ConnectionState.REMOTE_CLOSING:
                    # the server closed: answer it
                    self._close_to_send = event.response()
                else:
                    # wsproto found the peer's frames malformed: close with its code
                    self._close_to_send = CloseConnection(event.code, event.reason)
                self._closed = ConnectionClosed(event.code, event.reason)
                return out
        return out

    def _fail(self, code: int, reason: str) -> list[Event] | None:
        self._close_to_send = CloseConnection(code, reason)
        self._closed = ConnectionClosed(code, reason)
        return None

    async def _answer(self, controls: list[Event] | None) -> None:
        for event in controls or ():
            try:
                await self._send_event(event)
            except ConnectionClosed:
                break
        await self._finish_close()

    async def _finish_close(self) -> None:
        close = self._close_to_send
        if close is None:
            return
        self._close_to_send = None
        with trio.move_on_after(1, shield=True):
            try:
                await self._send_event(close)
            except ConnectionClosed:
                pass
        await trio.aclose_forcefully(self._stream)

    # --- sending -------------------------------------------------------------------

    async def send_message(self, data: bytes) -> None:
        """Send one binary message; raises :class:`ConnectionClosed` when closed."""
        if self._closed is not None:
            raise ConnectionClosed(self._closed.code, self._closed.reason)
        await self._send_event(BytesMessage(data=data))

    async def _send_event(self, event: Event) -> None:
        async with self._send_lock:
            try:
                payload = self._ws.send(event)
                await self._stream.send_all(payload)
            except (LocalProtocolError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                closed = self._closed or ConnectionClosed(1006, "the connection is gone")
                raise ConnectionClosed(closed.code, closed.reason) from exc

    async def aclose(self, code: int = 1000, reason: str | None = None) -> None:
        """Send a close frame (bounded, shielded) and close the TCP stream.

        Does not wait for the server's answer: the decode side treats a
        dropped link as closed anyway.
        """
        if self._closed is None:
            self._closed = ConnectionClosed(code, reason)
            self._close_to_send = CloseConnection(code, reason)
        await self._finish_close()
        await trio.aclose_forcefully(self._stream)


def _frame_stop(data: bytes, pos: int, end: int) -> tuple[int, int] | None:
    """(end offset of the frame starting at ``pos``, payload length), or None while its header is incomplete."""
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

