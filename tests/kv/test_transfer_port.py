"""The KV transfer port holds nothing for a peer that connects and stalls."""

from __future__ import annotations

import pytest
import trio

from pdtrio.kv import tcp
from tests.cluster import synthetic_worker


@pytest.mark.parametrize("says", [b"", tcp.SESSION_BLOCKS, tcp.SESSION_BLOCKS + b"\x00\x00"])
async def test_a_peer_that_stalls_is_dropped_at_the_transfer_deadline(
    monkeypatch: pytest.MonkeyPatch, says: bytes
) -> None:
    monkeypatch.setattr(tcp, "DEFAULT_TRANSFER_TIMEOUT_S", 0.3)
    prefill = synthetic_worker("prefill")
    async with trio.open_nursery() as nursery:
        ready = await nursery.start(prefill.run)
        stream = await trio.open_tcp_stream("127.0.0.1", ready["transfer_port"])
        async with stream:
            if says:
                await stream.send_all(says)  # then nothing more: a half-sent request
            with trio.fail_after(10):  # liveness bound, not a timing assertion
                assert await stream.receive_some(1024) == b""  # the port hung up
        assert prefill.stats()["kv_blocks_in_use"] == 0
        nursery.cancel_scope.cancel()
