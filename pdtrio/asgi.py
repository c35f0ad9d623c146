"""Small ASGI helpers shared by the router and the worker apps."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyTooLarge(Exception):
    pass


class ClientDisconnected(Exception):
    pass


def declared_body_too_large(scope: Scope, limit: int) -> bool:
    """The request declares a ``Content-Length`` over ``limit``: refuse it before reading
    a byte (hypercorn has checked that the header is a number)."""
    declared = header(scope, b"content-length")
    return declared is not None and declared.isdigit() and int(declared) > limit


async def read_body(receive: Receive, limit: int) -> bytearray:
    """The request body, at most ``limit`` bytes, grown chunk by chunk.

    Not joined at the end: joining a body of megabytes is one call of
    milliseconds (15 MB: 5-7, mostly page faults) on the event loop; a chunk at
    a time is a fraction of one.
    """
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        if len(body) + len(chunk) > limit:
            raise BodyTooLarge
        body += chunk
        if not message.get("more_body", False):
            return body


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if extra_headers:
        headers.extend(extra_headers)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_json(
    send: Send,
    status: int,
    payload: Any,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    await send_bytes(send, status, body, b"application/json", extra_headers)


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of a request header (``name`` in lower case), or None."""
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def hang_up(scope: Scope) -> bool:
    """Shut down the TCP connection ``scope``'s request came on; True if it was found.

    For a client that stopped reading: hypercorn shields its socket writes
    from cancellation and has no write timeout, so a request whose response
    fills the socket's buffers would wait on it for as long as the peer's TCP
    stays up (forever, for a stopped process), its task counted as running
    and the server unable to shut down.  A shutdown makes the waiting write
    fail at once; hypercorn then closes the connection and tells the app the
    client is gone.

    ASGI gives no handle on the socket: it is found among this process's file
    descriptors (Linux's ``/proc/self/fd``) by its two addresses, which the
    scope names.  Elsewhere, or for a connection not over TCP, nothing is done.
    """
    server, client = scope.get("server"), scope.get("client")
    if not server or not client or len(server) < 2 or len(client) < 2:
        return False
    local, peer = (server[0], int(server[1])), (client[0], int(client[1]))
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for name in names:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            # a duplicate to look through: closing it leaves the server's descriptor alone
            duplicate = socket.socket(fileno=os.dup(int(name)))
        except (OSError, ValueError):
            continue
        with duplicate:
            try:
                if duplicate.type != socket.SOCK_STREAM:
                    continue
                if duplicate.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                if duplicate.getsockname()[:2] != local or duplicate.getpeername()[:2] != peer:
                    continue
                # on the socket itself, not the descriptor: the server's write wakes and fails
                duplicate.shutdown(socket.SHUT_RDWR)
            except OSError:
                continue
            return True
    return False
