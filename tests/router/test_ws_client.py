"""The router's lean websocket client against a hand-driven wsproto server on loopback.

The server writes frames in arbitrary splits (so the client's fast path and its
wsproto path both see partial headers, partial payloads and many frames per read)
and the tests check what a user of the client sees: the messages, in order, and
how the connection ends.
"""

from __future__ import annotations

import os
import random
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import pytest
import trio
import wsproto
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    Pong,
    RejectConnection,
    Request,
    TextMessage,
)

from pdtrio.router.workers.ws_client import ConnectionClosed, HandshakeError, connect_websocket

Handler = Callable[[trio.SocketStream, wsproto.WSConnection], Awaitable[None]]


async def _serve_one(handler: Handler, *, task_status: trio.TaskStatus[int]) -> None:
    """Accept one connection, do the server handshake, run ``handler``."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    listener = listeners[0]
    task_status.started(listener.socket.getsockname()[1])
    async with listener:
        stream = await listener.accept()
    async with stream:
        ws = wsproto.WSConnection(wsproto.ConnectionType.SERVER)
        while True:
            ws.receive_data(await stream.receive_some(65536))
            if any(isinstance(e, Request) for e in ws.events()):
                break
        await stream.send_all(ws.send(AcceptConnection()))
        await handler(stream, ws)


async def _send_split(stream: trio.SocketStream, data: bytes, rng: random.Random) -> None:
    pos = 0
    while pos < len(data):
        size = rng.choice((1, 2, 3, 7, 100, 4096, 70000))
        await stream.send_all(data[pos : pos + size])
        pos += size
        await trio.lowlevel.checkpoint()


async def _read_events(stream: trio.SocketStream, ws: wsproto.WSConnection, want: type) -> list:
    seen = []
    while not any(isinstance(e, want) for e in seen):
        data = await stream.receive_some(65536)
        ws.receive_data(data or None)
        seen += list(ws.events())
    return seen


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_every_message_arrives_whole_and_in_order_whatever_the_read_split(seed: int) -> None:
    rng = random.Random(seed)
    expected: list[bytes | str] = [
        b"",
        b"x",
        bytes(range(125)),
        b"a" * 126,
        b"b" * 65535,
        b"c" * 65536,
        b"d" * 300_000,  # larger than one read: gathered
        "text, too: é",
    ]
    expected += [bytes([i % 256]) * rng.randint(1, 40) for i in range(500)]
    pongs: list[bytes] = []

    async def handler(stream: trio.SocketStream, ws: wsproto.WSConnection) -> None:
        out = b""
        for message in expected:
            if isinstance(message, str):
                out += ws.send(TextMessage(data=message))
            else:
                out += ws.send(BytesMessage(data=message))
        # a fragmented message with a ping between its fragments
        out += ws.send(BytesMessage(data=b"frag-", message_finished=False))
        out += ws.send(Ping(payload=b"are you there"))
        out += ws.send(BytesMessage(data=b"mented", message_finished=True))
        out += ws.send(BytesMessage(data=b"last"))
        await _send_split(stream, out, rng)
        events = await _read_events(stream, ws, Pong)
        pongs.extend(e.payload for e in events if isinstance(e, Pong))
        await _read_events(stream, ws, CloseConnection)

    received: list[bytes | str] = []
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_serve_one, handler)
        client = await connect_websocket(
            f"ws://127.0.0.1:{port}/pd/link", max_message_size=1 << 20, receive_size=4096
        )
        with trio.fail_after(20):
            while len(received) < len(expected) + 2:
                received += await client.receive_messages()
            await client.aclose()
    assert received == [*expected, b"frag-mented", b"last"]
    assert pongs == [b"are you there"]


async def test_a_close_from_the_server_is_answered_after_the_messages_before_it() -> None:
    answered: list[int] = []

    async def handler(stream: trio.SocketStream, ws: wsproto.WSConnection) -> None:
        await stream.send_all(
            ws.send(BytesMessage(data=b"one")) + ws.send(CloseConnection(code=1001, reason="bye"))
        )
        events = await _read_events(stream, ws, CloseConnection)
        answered.extend(e.code for e in events if isinstance(e, CloseConnection))

    async with trio.open_nursery() as nursery:
        port = await nursery.start(_serve_one, handler)
        client = await connect_websocket(f"ws://127.0.0.1:{port}/", max_message_size=1024)
        with trio.fail_after(10):
            assert await client.receive_messages() == [b"one"]
            with pytest.raises(ConnectionClosed) as closed:
                await client.receive_messages()
    assert closed.value.code == 1001 and closed.value.reason == "bye"
    assert answered == [1001]
    with pytest.raises(ConnectionClosed):
        await client.send_message(b"too late")


async def test_a_masked_frame_from_the_server_closes_with_a_protocol_error() -> None:
    answered: list[int] = []

    async def handler(stream: trio.SocketStream, ws: wsproto.WSConnection) -> None:
        # FIN+binary, masked, 3 bytes, mask key 0: servers must not mask
        await stream.send_all(b"\x82\x83\x00\x00\x00\x00abc")
        events = await _read_events(stream, ws, CloseConnection)
        answered.extend(e.code for e in events if isinstance(e, CloseConnection))

    async with trio.open_nursery() as nursery:
        port = await nursery.start(_serve_one, handler)
        client = await connect_websocket(f"ws://127.0.0.1:{port}/", max_message_size=1024)
        with trio.fail_after(10), pytest.raises(ConnectionClosed) as closed:
            await client.receive_messages()
    assert closed.value.code == 1002
    assert answered == [1002]


async def test_a_message_over_the_limit_closes_with_1009() -> None:
    async def handler(stream: trio.SocketStream, ws: wsproto.WSConnection) -> None:
        await stream.send_all(
            ws.send(BytesMessage(data=b"ok")) + ws.send(BytesMessage(data=b"x" * 2000))
        )
        await _read_events(stream, ws, CloseConnection)

    async with trio.open_nursery() as nursery:
        port = await nursery.start(_serve_one, handler)
        client = await connect_websocket(f"ws://127.0.0.1:{port}/", max_message_size=1024)
        with trio.fail_after(10):
            assert await client.receive_messages() == [b"ok"]
            with pytest.raises(ConnectionClosed) as closed:
                await client.receive_messages()
    assert closed.value.code == 1009


async def test_messages_sent_reach_the_server_and_a_dropped_connection_reads_as_1006() -> None:
    got: list[bytes] = []

    async def handler(stream: trio.SocketStream, ws: wsproto.WSConnection) -> None:
        while len(got) < 3:
            ws.receive_data(await stream.receive_some(65536))
            got.extend(e.data for e in ws.events() if isinstance(e, BytesMessage))
        # then hang up without a close frame

    async with trio.open_nursery() as nursery:
        port = await nursery.start(_serve_one, handler)
        client = await connect_websocket(f"ws://127.0.0.1:{port}/", max_message_size=1024)
        async with trio.open_nursery() as senders:
            for i in range(3):
                senders.start_soon(client.send_message, b"m%d" % i)
        with trio.fail_after(10), pytest.raises(ConnectionClosed) as closed:
            await client.receive_messages()
    assert sorted(got) == [b"m0", b"m1", b"m2"]
    assert closed.value.code == 1006


async def test_a_refused_handshake_is_a_handshake_error() -> None:
    async def refuse(*, task_status: trio.TaskStatus[int]) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        stream = await listeners[0].accept()
        async with stream:
            ws = wsproto.WSConnection(wsproto.ConnectionType.SERVER)
            ws.receive_data(await stream.receive_some(65536))
            list(ws.events())
            await stream.send_all(ws.send(RejectConnection(status_code=403)))
        await listeners[0].aclose()

    async with trio.open_nursery() as nursery:
        port = await nursery.start(refuse)
        with trio.fail_after(10), pytest.raises(HandshakeError, match="403"):
            await connect_websocket(f"ws://127.0.0.1:{port}/", max_message_size=1024)


async def test_a_message_given_in_pieces_arrives_whole_between_the_others() -> None:
    pieces = [b"head", b"", b"x" * 600_000, b"", b"y" * 10, b"z" * 300_000, b"tail"]
    messages: list[bytes] = []
    frames: list[int] = []

    async def handler(stream: trio.SocketStream, ws: wsproto.WSConnection) -> None:
        parts: list[bytes] = []
        frame = 0
        while len(messages) < 3:
            ws.receive_data(await stream.receive_some(65536))
            for event in ws.events():
                if isinstance(event, BytesMessage):
                    parts.append(event.data)
                    frame += len(event.data)
                    if event.frame_finished:
                        frames.append(frame)
                        frame = 0
                    if event.message_finished:
                        messages.append(b"".join(parts))
                        parts = []

    async with trio.open_nursery() as nursery:
        port = await nursery.start(_serve_one, handler)
        client = await connect_websocket(f"ws://127.0.0.1:{port}/", max_message_size=1024)
        await client.send_messages([b"before", iter(pieces), b"after"])
        await client.aclose()
    assert messages == [b"before", b"".join(pieces), b"after"]
    assert max(frames) <= 256 * 1024  # the big piece went out in fragments


class _Steps(trio.abc.Instrument):
    """Counts the steps of one task."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.steps += 1


@contextmanager
def _counting_steps() -> Iterator[_Steps]:
    """The steps this task takes inside the block."""
    steps = _Steps(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(steps)
    try:
        yield steps
    finally:
        trio.lowlevel.remove_instrument(steps)


async def _receive_messages(
    stream: trio.SocketStream, ws: wsproto.WSConnection, count: int
) -> list[bytes]:
    """The next ``count`` binary messages, each whole."""
    messages: list[bytes] = []
    parts: list[bytes] = []
    while len(messages) < count:
        ws.receive_data(await stream.receive_some(1 << 20))
        for event in ws.events():
            if isinstance(event, BytesMessage):
                parts.append(event.data)
                if event.message_finished:
                    messages.append(b"".join(parts))
                    parts = []
    return messages


async def test_a_batch_the_kernel_takes_at_once_is_no_schedule_point_and_a_big_one_waits() -> None:
    received = bytearray()
    reading = trio.Event()
    small = [b"s%d" % i for i in range(10)]
    big = [bytes([i]) * 200_000 for i in range(40)]  # 8 MB: more than loopback buffers

    async def handler(stream: trio.SocketStream, ws: wsproto.WSConnection) -> None:
        await reading.wait()  # the big batch fills the socket's buffers first
        received.extend(b"".join(await _receive_messages(stream, ws, len(small) + len(big))))

    async with trio.open_nursery() as nursery:
        port = await nursery.start(_serve_one, handler)
        client = await connect_websocket(f"ws://127.0.0.1:{port}/", max_message_size=1 << 20)
        with _counting_steps() as steps:
            await client.send_messages(small)
        assert steps.steps == 0  # written without giving the loop a turn
        reading.set()
        await client.send_messages(big)  # the rest of what the kernel refused waits for room
        await client.aclose()
    assert bytes(received) == b"".join(small + big)


async def test_a_send_after_the_stream_closed_under_it_raises() -> None:
    async def handler(stream: trio.SocketStream, ws: wsproto.WSConnection) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        port = await nursery.start(_serve_one, handler)
        client = await connect_websocket(f"ws://127.0.0.1:{port}/", max_message_size=1024)
        # the stream closed while the connection still reads as open (a reader that saw
        # the drop closes it so): its descriptor's number may be another file's by now,
        # so the write goes through the closed stream, which refuses it
        stream = client._stream  # noqa: SLF001 - the state a drop leaves
        assert isinstance(stream, trio.SocketStream)
        number = stream.socket.fileno()
        read_end, write_end = os.pipe()
        await stream.aclose()
        os.dup2(write_end, number)  # the number is a pipe's now
        try:
            with pytest.raises(ConnectionClosed):
                await client.send_messages([b"late"])
            os.set_blocking(read_end, False)
            with pytest.raises(BlockingIOError):
                os.read(read_end, 100)  # nothing went into the pipe
        finally:
            for fd in (read_end, write_end, number):
                os.close(fd)
        nursery.cancel_scope.cancel()


async def test_send_now_writes_an_idle_connection_s_message_at_once_and_in_order() -> None:
    got: list[bytes] = []
    want = 0
    reading = trio.Event()

    async def handler(stream: trio.SocketStream, ws: wsproto.WSConnection) -> None:
        await reading.wait()  # (want is known by then)
        got.extend(await _receive_messages(stream, ws, want))

    async with trio.open_nursery() as nursery:
        port = await nursery.start(_serve_one, handler)
        client = await connect_websocket(f"ws://127.0.0.1:{port}/", max_message_size=1 << 20)
        with _counting_steps() as steps:
            assert client.send_now(b"first")
        assert steps.steps == 0 and not client.has_unsent
        # the server reads nothing yet: fill the socket until the kernel takes a message
        # only in part (the rest held) or not at all
        sent = [b"first"]
        while not client.has_unsent:
            message = bytes([len(sent) % 256]) * 200_000
            if not client.send_now(message):
                break  # full: nothing of it was written
            sent.append(message)
        assert client.has_unsent  # (the kernel took a message in part: the case here)
        assert not client.send_now(b"x")  # the held rest goes first
        sent.append(b"after")
        want = len(sent)
        reading.set()
        await client.send_messages([b"after"])  # the held rest, then this
        assert not client.has_unsent
        await client.aclose()
    assert got == sent
