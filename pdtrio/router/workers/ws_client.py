"""A lean websocket client for the router's worker links: wsproto over a trio stream.

This is the I/O shell.  The opening handshake is wsproto's; the frames that
follow are cut by :class:`~pdtrio.protocol.link.websocket_frames.ClientFrameReader`
(the sans-IO core, which says why it exists beside wsproto): each read is fed
to it whole and :meth:`WebSocketClient.receive_messages` hands the caller every
message that read completed as one batch, after sending the pongs and close
replies it asks for.  A whole binary message goes out as one frame made by
:func:`~pdtrio.protocol.link.websocket_frames.masked_binary_frame`; fragments,
pongs and closes are wsproto's, which keeps the connection's state.

One reader (whoever calls :meth:`WebSocketClient.receive_messages`); writes
are serialised with a ``trio.Lock``.  No extra task, no queue.

A batch of small messages on a plain TCP link is first written straight to the
socket (:func:`os.write` on its descriptor, which never waits): trio's
``send_all`` makes even a write the kernel takes at once a schedule point, a
task step more for every batch.  What the kernel does not take at once, and any error,
goes through ``send_all``, which waits for room and raises trio's errors.
:meth:`WebSocketClient.send_now` goes further for a caller that must not wait
(a request posting its message to an idle link): it writes one small message
at once, from the caller's task, or says it could not; what the kernel left of
it is sent first by the next :meth:`WebSocketClient.send_messages` (the caller
makes one).  A TLS link always writes through its stream.

Dependencies: wsproto is one of the package's (``pyproject.toml``), for this
client and for the frame cutter.  ``trio-websocket`` is not: it wraps wsproto
in a task and a queue per connection, the per-message path this client exists
to avoid, so nothing in the package imports it.  It is in the ``test`` extra
instead, as an independent client: the tests that speak to a worker's
``/pd/link`` by hand (``tests/worker/test_decode_wire.py``) use it beside this
one, so a bug shared by this client and the worker's side cannot hide, and
``benchmarks/token_path`` reads the raw decode websocket with it.
"""

from __future__ import annotations

import os
import ssl
import urllib.parse
from collections.abc import Iterable, Sequence
from typing import final

import trio
import wsproto
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    RejectConnection,
    Request,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from pdtrio.protocol.link.websocket_frames import ClientFrameReader, FrameBatch, masked_binary_frame

_MAX_RESPONSE_HEAD = 64 * 1024
# a message bigger than this is sent as fragments of this size
_FRAGMENT_BYTES = 256 * 1024
# how long a close frame may take to go out before the stream is dropped anyway
_CLOSE_SEND_TIMEOUT_S = 1.0


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
    url: str,
    *,
    max_message_size: int,
    receive_size: int = 65536,
    headers: Sequence[tuple[bytes, bytes]] = (),
    ssl_context: ssl.SSLContext | None = None,
) -> WebSocketClient:
    """Open a TCP connection to a ``ws://`` URL and do the opening handshake.

    Takes no timeout: the caller owns the cancel scope.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError(f"not a ws:// or wss:// URL: {url!r}")
    secure = parts.scheme == "wss"
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    stream: trio.abc.Stream = await trio.open_tcp_stream(
        parts.hostname, parts.port or (443 if secure else 80)
    )
    try:
        if secure:
            context = ssl_context or ssl.create_default_context()
            stream = trio.SSLStream(stream, context, server_hostname=parts.hostname)
            try:
                await stream.do_handshake()
            except ssl.SSLError as exc:
                raise HandshakeError(f"{url}: TLS handshake failed: {exc}") from None
        ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
        request = Request(host=parts.netloc, target=target, extra_headers=list(headers))
        await stream.send_all(ws.send(request))
        head = b""
        while (cut := head.find(b"\r\n\r\n")) < 0:
            if len(head) > _MAX_RESPONSE_HEAD:
                raise HandshakeError(f"{url}: the handshake response is too large")
            chunk = await stream.receive_some(65536)
            if not chunk:
                raise HandshakeError(
                    f"{url}: the server closed the connection during the handshake"
                )
            head += chunk
        # wsproto sees the response head only; what follows is frames, for the reader
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
                raise HandshakeError(
                    f"{url}: the server refused the websocket (HTTP {event.status_code})"
                )
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
        # shared with the reader: it receives the frames it does not cut, we send
        self._ws = ws
        self._reader = ClientFrameReader(
            ws, max_message_size=max_message_size, receive_size=receive_size
        )
        # what came with the handshake response: cut before the first read
        self._reader.receive_data(buffered)
        self._send_lock = trio.Lock()
        # the socket, for writes the kernel takes at once (plain TCP only)
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        # what the kernel left of a message send_now wrote: the next bytes on the wire
        self._unsent = b""
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
        reader = self._reader
        while True:
            if self._closed is not None:
                raise ConnectionClosed(self._closed.code, self._closed.reason)
            batch = reader.take_batch()
            if batch.closed is not None:
                # before answering, so that concurrent senders see it
                self._closed = ConnectionClosed(batch.closed.code, batch.closed.reason)
            if batch.replies or batch.close_reply is not None:
                await self._answer(batch)
            if batch.messages:
                return batch.messages
            if self._closed is not None:
                continue
            try:
                chunk = await self._stream.receive_some(reader.wanted_read_size())
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                chunk = b""
            if not chunk:
                if self._closed is None:  # else aclose() closed the stream under us
                    self._closed = ConnectionClosed(
                        1006, "the connection dropped without a close frame"
                    )
                await trio.aclose_forcefully(self._stream)
                continue
            reader.receive_data(chunk if isinstance(chunk, bytes) else bytes(chunk))

    async def _answer(self, batch: FrameBatch) -> None:
        for pong in batch.replies:
            try:
                await self._send_event(pong)
            except ConnectionClosed:
                break
        if batch.close_reply is not None:
            self._close_to_send = batch.close_reply
            await self._finish_close()

    async def _finish_close(self) -> None:
        close = self._close_to_send
        if close is None:
            return
        self._close_to_send = None
        with trio.move_on_after(_CLOSE_SEND_TIMEOUT_S, shield=True):
            try:
                await self._send_event(close)
            except ConnectionClosed:
                pass
        await trio.aclose_forcefully(self._stream)

    # --- sending -------------------------------------------------------------------

    async def send_message(self, data: bytes) -> None:
        """Send one binary message; raises :class:`ConnectionClosed` when closed."""
        await self.send_messages([data])

    @property
    def has_unsent(self) -> bool:
        """Part of a message :meth:`send_now` wrote waits for :meth:`send_messages`."""
        return bool(self._unsent)

    def send_now(self, data: bytes) -> bool:
        """Write the binary message ``data`` now, without waiting; False if it cannot be
        (a send under way, a closed or TLS connection, a message to fragment, a socket
        whose buffer is full): send it with :meth:`send_messages` then.

        True: it is on its way, whole or, when the kernel took only its start, the
        rest held for the next :meth:`send_messages` (see :attr:`has_unsent`), which
        sends it before anything else: make one soon.
        """
        if (
            self._socket is None
            or self._unsent
            or self._closed is not None
            or self._send_lock.locked()
            or len(data) > _FRAGMENT_BYTES
            or self._ws.state is not ConnectionState.OPEN
        ):
            return False
        frame = masked_binary_frame(data, os.urandom(4))
        sent = self._write_at_once(frame)
        if not sent:
            return False
        if sent < len(frame):
            self._unsent = frame[sent:]
        return True

    def _write_at_once(self, data: bytes) -> int:
        """How much of ``data`` the kernel took at once, without waiting: 0 on a TLS or
        closed connection, a full socket or an error (``send_all`` waits, or says how)."""
        # the descriptor is asked now: -1 once the socket is closed (its number may be
        # another file's by then)
        fd = -1 if self._socket is None else self._socket.fileno()
        if fd < 0:
            return 0
        try:
            return os.write(fd, data)
        except OSError:
            return 0

    async def _send_unsent(self) -> None:
        """What the kernel left of send_now's message: first, before any other byte."""
        unsent, self._unsent = self._unsent, b""
        await self._stream.send_all(unsent)

    async def send_messages(self, messages: Sequence[bytes | Iterable[bytes]]) -> None:
        """Send binary messages, in order; :class:`ConnectionClosed` when closed.

        A message is its bytes, or an iterable of its consecutive pieces (made
        as they are sent; an empty piece is a moment for others).  Small
        messages share one write.  A big one goes out in fragments of
        ``_FRAGMENT_BYTES``: masking 15 MB in one go holds the event loop for
        tens of milliseconds; a fragment at a time, others run in between.
        """
        if self._closed is not None:
            raise ConnectionClosed(self._closed.code, self._closed.reason)
        try:
            # the writer is nearly always alone here: no schedule point for the lock then
            self._send_lock.acquire_nowait()
        except trio.WouldBlock:
            await self._send_lock.acquire()
        try:
            try:
                if self._unsent:
                    await self._send_unsent()
                if self._ws.state is not ConnectionState.OPEN:
                    raise LocalProtocolError("the connection is closing")
                # a fresh mask per frame, drawn for the whole batch at once
                masks = os.urandom(4 * len(messages))
                pending: list[bytes] = []
                for index, data in enumerate(messages):
                    if isinstance(data, bytes) and len(data) <= _FRAGMENT_BYTES:
                        offset = 4 * index
                        pending.append(masked_binary_frame(data, masks[offset : offset + 4]))
                        continue
                    if pending:
                        await self._stream.send_all(b"".join(pending))
                        pending = []
                    await self._send_fragments([data] if isinstance(data, bytes) else data)
                if pending:
                    await self._send_at_once(b"".join(pending))
            except (LocalProtocolError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                closed = self._closed or ConnectionClosed(1006, "the connection is gone")
                raise ConnectionClosed(closed.code, closed.reason) from exc
        finally:
            self._send_lock.release()

    async def _send_at_once(self, data: bytes) -> None:
        """``send_all(data)``, without its schedule point when the kernel takes it all."""
        sent = self._write_at_once(data)
        if sent < len(data):
            await self._stream.send_all(data[sent:] if sent else data)

    async def _send_fragments(self, pieces: Iterable[bytes]) -> None:
        """One message from its pieces, in fragments of at most ``_FRAGMENT_BYTES``."""
        ws_send = self._ws.send
        # each fragment waits for the next: the last one is sent as the message's end
        held = b""
        for piece in pieces:
            if not piece:
                await trio.lowlevel.checkpoint()
                continue
            if len(held) + len(piece) <= _FRAGMENT_BYTES:
                held += piece  # small pieces (a header) share a fragment
                continue
            view = memoryview(piece)
            for start in range(0, len(piece), _FRAGMENT_BYTES):
                if held:
                    fragment = BytesMessage(data=held, message_finished=False)
                    await self._stream.send_all(ws_send(fragment))
                held = bytes(view[start : start + _FRAGMENT_BYTES])
        await self._stream.send_all(ws_send(BytesMessage(data=held, message_finished=True)))

    async def _send_event(self, event: Event) -> None:
        async with self._send_lock:
            try:
                if self._unsent:
                    await self._send_unsent()
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
