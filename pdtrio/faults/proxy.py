"""A TCP proxy that injects faults, on command, between any two parts of a deployment.

It forwards bytes both ways between each accepted connection and a fresh
connection to the target, and applies the :class:`~pdtrio.faults.plan.Fault`
in force: latency per chunk, a bandwidth cap per direction, a stall (sockets
stay open, nothing moves: what a hung peer looks like from outside), a reset
after N bytes, a refused listener, HTTP requests of one kind held (told by the
start of their request line) while the others pass. A change takes effect at
once on new and, where it makes sense, open connections (:attr:`FaultProxy.fault`).

A reset is a real RST (``SO_LINGER`` 0), and a reset from either peer is
passed on as one, so each side sees what it would see on a broken network.
"""

from __future__ import annotations

import functools
import itertools
import socket
import struct
from collections.abc import Callable
from typing import Final, final

import attrs
import trio

from pdtrio.faults.plan import Fault, TokenBucket

_QUEUED_CHUNKS: Final = 256
"""Chunks read but not yet forwarded, per direction (they wait out the latency there)."""

_LINGER_ZERO: Final = struct.pack("ii", 1, 0)


def abort(stream: trio.SocketStream) -> None:
    """Close ``stream`` with a TCP RST rather than a FIN: ``SO_LINGER`` 0, then close."""
    try:
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_ZERO)
    except OSError:
        pass  # already closed or never connected: closing is all there is left to do
    stream.socket.close()


@final
@attrs.define
class ProxyCounters:
    """What the proxy has done since it started, for tests and for an operator's summary."""

    connections_accepted: int = 0
    connections_open: int = 0
    connections_reset: int = 0
    """Closed by an RST: a fault, :meth:`FaultProxy.reset_all`, or a peer's own reset."""
    requests_held: int = 0
    """Requests held by :attr:`Fault.hold_requests` (counted when first held)."""
    bytes_to_target: int = 0
    bytes_to_client: int = 0


@final
@attrs.define(eq=False)
class _Connection:
    """One accepted connection and its upstream; ``scope`` ends both of its pumps."""

    number: int
    client: trio.SocketStream
    peer: str
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    upstream: trio.SocketStream | None = None
    forwarded: int = 0
    reset_reason: str | None = None
    """Set when the connection must end in an RST; the reason is what the log line says."""

    def reset(self, reason: str) -> None:
        if self.reset_reason is None:
            self.reset_reason = reason
        self.scope.cancel()


def _releases(chunk: bytes, fault: Fault) -> bool:
    return not fault.holds(chunk)


def _describe_peer(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
    except OSError:
        return "?"
    return f"{host}:{port}"


@final
class FaultProxy:
    """Listens on ``listen_host:listen_port`` (0: any free port) and forwards to the target.

    ``on_event`` gets one line per connection opened or closed (the command
    line prints them). Run it with ``port = await nursery.start(proxy.run)``;
    change the fault with ``proxy.fault = attrs.evolve(proxy.fault, stall=True)``
    or :meth:`update`.
    """

    def __init__(
        self,
        listen_host: str,
        listen_port: int,
        target_host: str,
        target_port: int,
        *,
        fault: Fault | None = None,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.target_host = target_host
        self.target_port = target_port
        self.counters = ProxyCounters()
        self._fault = fault or Fault()
        self._changed = trio.Event()
        self._on_event = on_event or (lambda line: None)
        self._connections: dict[int, _Connection] = {}
        self._numbers = itertools.count(1)
        self._accepting: trio.CancelScope | None = None

    # --- the fault in force ---------------------------------------------------------------

    @property
    def fault(self) -> Fault:
        return self._fault

    @fault.setter
    def fault(self, fault: Fault) -> None:
        """Put ``fault`` in force now; whatever waited on the old one looks again."""
        self._fault = fault
        if fault.refuse and self._accepting is not None:
            self._accepting.cancel()  # closes the listener: new connections are refused
        changed, self._changed = self._changed, trio.Event()
        changed.set()

    def update(self, **changes: object) -> Fault:
        """Change some of the fault's fields (``update(stall=False)``); returns the new fault."""
        self.fault = attrs.evolve(self._fault, **changes)  # type: ignore[arg-type]
        return self._fault

    def reset_all(self) -> int:
        """Reset (RST) every open connection, both sides, now; returns how many there were."""
        connections = list(self._connections.values())
        for connection in connections:
            connection.reset("reset_all")
        return len(connections)

    async def _until(self, condition: Callable[[Fault], bool]) -> None:
        """Return once the fault in force satisfies ``condition`` (at once if it does)."""
        while not condition(self._fault):
            await self._changed.wait()

    # --- listening --------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; reports the port it listens on (kept across a refuse/unrefuse).

        The listener is bound even when the proxy starts refusing, to learn the
        port, and closed at once.
        """
        async with trio.open_nursery() as connections:
            listeners: list[trio.SocketListener] | None = await trio.open_tcp_listeners(
                self.listen_port, host=self.listen_host
            )
            assert listeners is not None
            self.listen_port = int(listeners[0].socket.getsockname()[1])
            if self._fault.refuse:
                for listener in listeners:
                    listener.socket.close()
                listeners = None
            task_status.started(self.listen_port)
            while True:
                if listeners is None:
                    await self._until(lambda fault: not fault.refuse)
                    listeners = await trio.open_tcp_listeners(
                        self.listen_port, host=self.listen_host
                    )
                try:
                    with trio.CancelScope() as self._accepting:
                        if self._fault.refuse:  # refused again while the listener was bound
                            self._accepting.cancel()
                        async with trio.open_nursery() as accepting:
                            for listener in listeners:
                                accepting.start_soon(self._accept, listener, connections)
                finally:
                    self._accepting = None
                    for listener in listeners:
                        listener.socket.close()
                    listeners = None

    async def _accept(self, listener: trio.SocketListener, connections: trio.Nursery) -> None:
        while True:
            stream = await listener.accept()
            connections.start_soon(self._serve, stream)

    # --- one connection ---------------------------------------------------------------

    async def _serve(self, client: trio.SocketStream) -> None:
        connection = _Connection(next(self._numbers), client, _describe_peer(client))
        self._connections[connection.number] = connection
        self.counters.connections_accepted += 1
        self.counters.connections_open += 1
        self._on_event(
            f"connection {connection.number} opened from {connection.peer} "
            f"({self._fault.describe()})"
        )
        try:
            with connection.scope:
                # a stalled proxy accepts and holds: the target never hears of it
                await self._until(lambda fault: not fault.stall)
                try:
                    connection.upstream = await trio.open_tcp_stream(
                        self.target_host, self.target_port
                    )
                except OSError as exc:
                    connection.reset(f"target unreachable: {exc}")
                    return
                async with trio.open_nursery() as pumps:
                    pumps.start_soon(self._pump, connection, client, connection.upstream, True)
                    pumps.start_soon(self._pump, connection, connection.upstream, client, False)
        finally:
            del self._connections[connection.number]
            self.counters.connections_open -= 1
            streams = [s for s in (client, connection.upstream) if s is not None]
            if connection.reset_reason is not None:
                self.counters.connections_reset += 1
                for stream in streams:
                    abort(stream)
                how = f"reset ({connection.reset_reason})"
            else:
                for stream in streams:
                    stream.socket.close()
                how = "closed"
            self._on_event(
                f"connection {connection.number} {how} after {connection.forwarded} bytes"
            )

    async def _pump(
        self,
        connection: _Connection,
        source: trio.SocketStream,
        destination: trio.SocketStream,
        to_target: bool,
    ) -> None:
        """One direction: a reader that stamps each chunk, a writer that forwards it when due.

        Two tasks, so that latency delays each chunk rather than the reading:
        a chunk that arrives 10 ms after the one before it leaves 10 ms after it too.
        """
        send, receive = trio.open_memory_channel[tuple[float, bytes]](_QUEUED_CHUNKS)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read, connection, source, send, to_target)
            await self._write(connection, receive, destination, to_target)

    @staticmethod
    def _broken(connection: _Connection, to_target: bool, exc: BaseException) -> None:
        """A peer's reset (or a write into a reset socket): the other peer gets one too."""
        side = "client" if to_target else "target"
        connection.reset(f"{side} side: {exc or type(exc).__name__}")

    async def _read(
        self,
        connection: _Connection,
        source: trio.SocketStream,
        send: trio.MemorySendChannel[tuple[float, bytes]],
        to_target: bool,
    ) -> None:
        async with send:
            try:
                while True:
                    await self._until(lambda fault: not fault.stall)  # leave it in the kernel
                    chunk = await source.receive_some(self._fault.chunk_bytes())
                    await send.send((trio.current_time(), chunk))
                    if not chunk:
                        return
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self._broken(connection, to_target, exc)

    async def _write(
        self,
        connection: _Connection,
        receive: trio.MemoryReceiveChannel[tuple[float, bytes]],
        destination: trio.SocketStream,
        to_target: bool,
    ) -> None:
        try:
            await self._forward(connection, receive, destination, to_target)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self._broken(connection, to_target, exc)

    async def _forward(
        self,
        connection: _Connection,
        receive: trio.MemoryReceiveChannel[tuple[float, bytes]],
        destination: trio.SocketStream,
        to_target: bool,
    ) -> None:
        bucket: TokenBucket | None = None
        async for arrived_at, chunk in receive:
            if not chunk:
                await self._until(lambda fault: not fault.stall)
                await trio.sleep_until(arrived_at + self._fault.latency_s)
                await destination.send_eof()
                return
            if to_target and self._fault.holds(chunk):
                self.counters.requests_held += 1
                request_line = chunk.split(b"\r\n", 1)[0].decode("latin-1")
                self._on_event(f"connection {connection.number} holds {request_line!r}")
                await self._until(functools.partial(_releases, chunk))
            await trio.sleep_until(arrived_at + self._fault.latency_s)
            rate = self._fault.bandwidth_bytes_per_s
            if rate is not None:
                if bucket is None:
                    bucket = TokenBucket.for_rate(rate)
                elif bucket.rate != rate:
                    bucket.set_rate(rate, trio.current_time())
                await trio.sleep(bucket.take(len(chunk), trio.current_time()))
            await self._until(lambda fault: not fault.stall)
            limit = self._fault.reset_after_bytes
            if limit is not None:
                chunk = chunk[: max(0, limit - connection.forwarded)]
            # counted before the send, so the other direction sees the budget already spent
            connection.forwarded += len(chunk)
            if to_target:
                self.counters.bytes_to_target += len(chunk)
            else:
                self.counters.bytes_to_client += len(chunk)
            if chunk:
                await destination.send_all(chunk)
            if limit is not None and connection.forwarded >= limit:
                connection.reset(f"reset after {limit} bytes")
                await trio.sleep_forever()  # the reset cancels this


__all__ = ["FaultProxy", "ProxyCounters", "abort"]
