"""SGLang's disaggregated-serving HTTP protocol (the bootstrap protocol), as its router does it.

Both legs go at once, with the same body: the client's request plus
``bootstrap_host`` and ``bootstrap_port`` (the prefill instance's bootstrap
server, where decode finds the KV) and a ``bootstrap_room`` (a random 63-bit
number naming the transfer on both sides).  The client gets decode's answer;
prefill's only says it is done.  A prefill that fails leaves decode waiting
for KV that never comes, so the router closes the decode leg then.

Pure data (sans-IO): the bodies; the room's randomness is the caller's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ROOM_BITS = 63


def bootstrap_body(
    client_body: Mapping[str, Any], host: str, port: int, room: int
) -> dict[str, Any]:
    """The client's request as both legs carry it."""
    if not 0 <= room < 1 << ROOM_BITS:
        raise ValueError(f"bootstrap_room must be a {ROOM_BITS}-bit number, got {room}")
    body = dict(client_body)
    body["bootstrap_host"] = host
    body["bootstrap_port"] = port
    body["bootstrap_room"] = room
    return body


def prefill_leg_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """Prefill's leg: the same request, its answer read whole (not streamed)."""
    leg = {key: value for key, value in body.items() if key != "stream_options"}
    leg["stream"] = False
    return leg
