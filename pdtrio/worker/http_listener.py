"""The worker's HTTP port: hypercorn's trio connection handling behind our own accept loop.

hypercorn bounds bodies, headers and idle time, but not how many connections
are open at once, and its ``serve`` creates its listeners itself.  So the
worker accepts connections here and hands each to hypercorn's ``TCPServer``,
under two bounds:

- connections on which no request has shown the worker secret yet (strangers);
  when they are at their bound, a new connection takes the place of the
  oldest, which is closed: a flood of strangers cannot keep anyone out, only
  make each stranger's time short (a router's connection shows the secret in
  its first request, within a round trip);
- connections on which a request showed the secret (peers: routers' links and
  probes, other workers), under a bound of their own, which strangers never
  take.

Without a secret configured every request shows it, so a connection is a peer
from its first request on.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import time
from typing import Any, Final, final

import trio

log = logging.getLogger("pdtrio.worker")

# an eviction is logged at most this often (a flood must not flood the log)
_EVICTION_LOG_INTERVAL_S: Final = 10.0

Peer = tuple[str, int]


@final
class HttpConnections:
    """The open connections of one HTTP port, by the peer's address, and their bounds."""

    def __init__(self, *, max_strangers: int, max_peers: int) -> None:
        self.max_strangers = max_strangers
        self.max_peers = max_peers
        # oldest first: the one to close when a new connection needs the room
        self._strangers: dict[Peer, trio.CancelScope] = {}
        self._peers: set[Peer] = set()
        self.evicted = 0  # strangers closed to make room for a new connection
        self._last_eviction_logged = -math.inf

    @property
    def strangers(self) -> int:
        return len(self._strangers)

    @property
    def peers(self) -> int:
        return len(self._peers)

    def opened(self, peer: Peer, scope: trio.CancelScope) -> None:
        """A new connection, served within ``scope``: a stranger, the oldest one makes room."""
        if len(self._strangers) >= self.max_strangers:
            oldest = next(iter(self._strangers))
            self._strangers.pop(oldest).cancel()
            self.evicted += 1
            now = time.monotonic()
            if now - self._last_eviction_logged >= _EVICTION_LOG_INTERVAL_S:
                self._last_eviction_logged = now
                log.warning(
                    "%d HTTP connections are open that have not shown the worker secret: "
                    "closing the oldest to make room (%d so far)",
                    self.max_strangers,
                    self.evicted,
                )
        self._strangers[peer] = scope

    def authenticated(self, peer: Any) -> None:
        """A request on ``peer``'s connection showed the secret: it is a peer from now on.

        ``peer`` is the ASGI scope's ``client``.  If the peers' bound is reached the
        connection stays a stranger (served all the same, but it may be closed for room).
        """
        if peer is None:
            return
        peer = tuple(peer)
        if peer in self._strangers and len(self._peers) < self.max_peers:
            del self._strangers[peer]
            self._peers.add(peer)

    def closed(self, peer: Peer) -> None:
        self._strangers.pop(peer, None)
        self._peers.discard(peer)


async def _shut_down_when_cut(stream: trio.SocketStream) -> None:
    """Shut the connection's socket down when it is cut (the worker stopping, an eviction).

    hypercorn shields its socket writes from cancellation: a write to a peer
    that stopped reading (a frozen router) would hold the connection, and the
    worker's exit, for as long as the peer's TCP stays up.  A shutdown makes
    that write fail at once.  Once hypercorn is done the socket is closed, and
    this does nothing.
    """
    try:
        await trio.sleep_forever()
    finally:
        with contextlib.suppress(OSError):
            stream.socket.shutdown(socket.SHUT_RDWR)


async def serve_http(
    app: Any,
    hyper_config: Any,
    connections: HttpConnections,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI ``app`` on ``host:port`` until cancelled; reports the bound port.

    ``hyper_config`` (a hypercorn ``Config``) gives the protocol settings: TLS,
    timeouts, size limits.  Its ``bind`` is not used.
    """
    # imported here: hypercorn is a worker-side dependency (like in Worker.run)
    from hypercorn.trio.tcp_server import TCPServer
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.utils import parse_socket_addr, wrap_app

    from pdtrio import hypercorn_guard

    hypercorn_guard.install()
    wrapped = wrap_app(app, hyper_config.wsgi_max_body_size, "asgi")
    context = WorkerContext(None)
    ssl_context = hyper_config.create_ssl_context() if hyper_config.ssl_enabled else None

    async def handle(stream: trio.SocketStream) -> None:
        try:
            peer = parse_socket_addr(stream.socket.family, stream.socket.getpeername())
        except OSError:  # gone before we looked
            await trio.aclose_forcefully(stream)
            return
        if peer is None:  # not an internet socket: cannot happen on a TCP listener
            await trio.aclose_forcefully(stream)
            return
        with trio.CancelScope() as scope:
            connections.opened(peer, scope)
            try:
                served: trio.abc.Stream = stream
                if ssl_context is not None:
                    served = trio.SSLStream(
                        stream, ssl_context, server_side=True, https_compatible=True
                    )
                async with trio.open_nursery() as connection:
                    connection.start_soon(_shut_down_when_cut, stream)
                    await TCPServer(wrapped, hyper_config, context, {}, served).run()  # type: ignore[arg-type]
                    connection.cancel_scope.cancel()
            finally:
                connections.closed(peer)
        # closed to make room, hypercorn's own close was cut short: the socket goes here
        await trio.aclose_forcefully(stream)

    # the kernel's longest accept queue (trio's default), not hypercorn's 100: a burst of
    # connections waits there for the accept loop instead of its SYNs being dropped (each
    # dropped one is retried a second later, whoever it is from)
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound_port = int(listeners[0].socket.getsockname()[1])
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(bound_port)
