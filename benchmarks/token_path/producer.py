"""The ingest section's producer: a decode worker that only streams, as fast as a socket takes it.

It serves one websocket on loopback, answers every ``DecodeStart`` with a
``DecodeAccepted`` until all of the run's streams are started, then sends
pre-encoded ``TokenFrame`` messages for them in a loop until the router hangs
up or time runs out.  Plain blocking sockets and wsproto: nothing in here
should be what limits the router.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import wsproto
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    Request,
)

from pdtrio.protocol.link import wire
from pdtrio.testing import LOOPBACK

_BLAST_BYTES = 256 * 1024


def token_frames(request_ids: list[str], entries: int, tokens: int) -> list[bytes]:
    """One frame per stream, of ``entries`` entries of ``tokens`` tokens, each for another stream.

    A token's text is " t<id>", as the synthetic engine's.
    """
    streams = len(request_ids)
    frames = []
    for frame in range(streams):
        batch = []
        for i in range(entries):
            ids = [300 + (frame * 7 + i + t) % 700 for t in range(tokens)]
            request_id = request_ids[(frame * entries + i) % streams]
            batch.append(wire.TokenEntry(request_id, ids, "".join(f" t{x}" for x in ids)))
        frames.append(wire.encode(wire.TokenFrame(batch)))
    return frames


def _accept_starts(sock: socket.socket, ws: wsproto.WSConnection, streams: int) -> list[str] | None:
    """Do the handshake and accept ``streams`` starts; their request ids (None: the router left)."""
    started: list[str] = []
    parts: list[bytes] = []
    while len(started) < streams:
        data = sock.recv(65536)
        if not data:
            return None
        ws.receive_data(data)
        out = b""
        for event in ws.events():
            if isinstance(event, Request):
                out += ws.send(AcceptConnection())
            elif isinstance(event, Ping):
                out += ws.send(event.response())
            elif isinstance(event, CloseConnection):
                return None
            elif isinstance(event, BytesMessage):
                parts.append(bytes(event.data))
                if not event.message_finished:
                    continue
                message = wire.to_worker_decoder.decode(b"".join(parts))
                parts.clear()
                if isinstance(message, wire.DecodeStart):
                    started.append(message.request_id)
                    out += ws.send(
                        BytesMessage(data=wire.encode(wire.DecodeAccepted(message.request_id)))
                    )
        if out:
            sock.sendall(out)
    return started


def run(spec: dict[str, Any]) -> None:
    """Print ``PORT <port>``, serve one router, then stream to it for at most ``max_s``."""
    listener = socket.create_server((LOOPBACK, 0))
    listener.settimeout(spec["max_s"])
    print(f"PORT {listener.getsockname()[1]}", flush=True)
    sock, _ = listener.accept()
    listener.close()
    with sock:
        sock.settimeout(10)
        ws = wsproto.WSConnection(wsproto.ConnectionType.SERVER)
        request_ids = _accept_starts(sock, ws, spec["streams"])
        if request_ids is None:
            return
        frames = token_frames(request_ids, spec["entries"], spec["tokens"])
        blob = b"".join(ws.send(BytesMessage(data=frame)) for frame in frames)
        while len(blob) < _BLAST_BYTES:
            blob += blob
        end = time.monotonic() + spec["max_s"]
        try:
            while time.monotonic() < end:
                sock.sendall(blob)
        except OSError:
            pass  # the router hung up: the run is over
