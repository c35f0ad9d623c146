"""asgi.hang_up: the connection a request came on, found by its addresses and shut down."""

from __future__ import annotations

import trio

from pdtrio.asgi import hang_up


async def test_hang_up_shuts_down_the_connection_the_scope_names_and_no_other() -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    async with listener:
        named = await trio.open_tcp_stream("127.0.0.1", port)
        other = await trio.open_tcp_stream("127.0.0.1", port)
        served = [await listener.accept(), await listener.accept()]
        client = named.socket.getsockname()
        assert hang_up({"server": ("127.0.0.1", port), "client": list(client)})
        with trio.fail_after(5):
            assert await named.receive_some(10) == b""  # the server's end shut down
        # the other connection is untouched
        await served[1].send_all(b"still here")
        with trio.fail_after(5):
            assert await other.receive_some(10) == b"still here"
        for stream in (named, other, *served):
            await stream.aclose()


def test_hang_up_without_addresses_or_a_known_connection_does_nothing() -> None:
    assert not hang_up({})
    assert not hang_up({"server": ("127.0.0.1", 1), "client": None})
    assert not hang_up({"server": ("127.0.0.1", 1), "client": ("127.0.0.1", 2)})
