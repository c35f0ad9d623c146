"""msgpack framing for the wire messages in ``pdtrio.protocol.wire``. Never pickle."""

from __future__ import annotations

from typing import Any

import msgpack

from pdtrio.protocol.wire import WireError

MSGPACK_CONTENT_TYPE = "application/msgpack"

def pack(message: Any) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> Any:
    try:
        # ext types are refused: nothing but plain data crosses the wire
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise WireError(f"undecodable frame: {exc}") from exc
