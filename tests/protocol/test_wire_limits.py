"""Values a peer may put in a wire message that msgspec's plain types would let through."""

from __future__ import annotations

import msgpack
import pytest

from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.link import wire
from pdtrio.protocol.link.wire import KvHandle, WireError

_LAYOUT = KvLayout("m", 1, 1, 1, 16, "float32")


@pytest.mark.parametrize("port", [-1, 65536, 2**63])
def test_a_kv_handle_with_an_impossible_port_is_a_wire_error(port: int) -> None:
    # (2**63 used to reach getaddrinfo, whose OverflowError no caller expects)
    fields = msgpack.unpackb(wire.encode(KvHandle("r", "p", "h", 1, (0,), 1, _LAYOUT, 1.0)))
    fields[3] = port
    with pytest.raises(WireError, match=r"\$\[3\]"):  # (array-like: the port's place)
        wire.Decoder(KvHandle).decode(msgpack.packb(fields))
