"""What a response knows of its client: how far it got, and whose the connection is."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from pdtrio.asgi import Message
from pdtrio.protocol.link.wire import Usage
from pdtrio.protocol.openai import OpenAIError
from pdtrio.protocol.openai.answers import AnswerDelta
from pdtrio.protocol.openai.sse import StreamShaper
from pdtrio.router.request.client_response import ClientResponse


class _Server:
    """The ASGI side: what was sent, a send that waits while ``stuck`` is set, and the
    messages ``receive`` hands the app."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.stuck = False
        self.unstuck = trio.Event()
        self.hung_up = 0
        self._to_app, self._received = trio.open_memory_channel[Message](8)

    async def send(self, message: Message) -> None:
        self.sent.append(message)
        if self.stuck:
            await self.unstuck.wait()

    async def receive(self) -> Message:
        return await self._received.receive()

    def disconnect(self) -> None:
        self._to_app.send_nowait({"type": "http.disconnect"})

    def hang_up(self) -> bool:
        self.hung_up += 1
        self.unstuck.set()
        return True


def _response(server: _Server) -> ClientResponse:
    shaper = StreamShaper(
        kind="completion", request_id="r", model="m", created=0,
        include_usage=False, continuous_usage_stats=False,
    )  # fmt: skip
    return ClientResponse(
        request_id="r", kind="completion", model="m", created=0, shaper=shaper,
        send=server.send, hang_up=server.hang_up, draining=lambda: False,
    )  # fmt: skip


def _bodies(server: _Server) -> list[Any]:
    return [m["body"] for m in server.sent if m["type"] == "http.response.body"]


async def test_a_disconnect_after_the_last_event_is_the_server_closing() -> None:
    server = _Server()
    response = _response(server)
    await response.deliver(AnswerDelta(" t1", 1, None, None))
    await response.deliver(AnswerDelta(" t2", 1, "stop", Usage(1, 2), final=True))
    gone: list[bool] = []
    server.disconnect()
    await response.watch_disconnect(server.receive, lambda: gone.append(True))
    assert not gone and not response.client_gone and response.torn


async def test_a_client_leaving_mid_stream_is_gone() -> None:
    server = _Server()
    response = _response(server)
    await response.deliver(AnswerDelta(" t1", 1, None, None))
    gone: list[bool] = []
    server.disconnect()
    await response.watch_disconnect(server.receive, lambda: gone.append(True))
    assert gone == [True] and response.client_gone
    assert not response.hung_up and not response.client_stalled and not response.torn


async def test_a_cut_write_tears_the_stream_and_no_error_event_follows() -> None:
    server = _Server()
    response = _response(server)
    await response.deliver(AnswerDelta(" t1", 1, None, None))
    server.stuck = True
    with trio.move_on_after(0) as cut:
        await response.deliver(AnswerDelta(" t2", 1, None, None))
    assert cut.cancelled_caught and response.torn
    sent = len(server.sent)
    server.stuck = False
    await response.fail(OpenAIError("too late", status=500), headers_sent=True)
    assert len(server.sent) == sent


async def test_an_error_event_ends_a_whole_stream() -> None:
    server = _Server()
    response = _response(server)
    await response.deliver(AnswerDelta(" t1", 1, None, None))
    await response.fail(OpenAIError("failed", status=500), headers_sent=True)
    assert b"failed" in _bodies(server)[-1] and response.torn


async def test_a_client_that_stops_reading_is_hung_up_on_and_its_disconnect_is_ours(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = _Server()
    response = _response(server)
    server.stuck = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(response.deliver, AnswerDelta(" t1", 1))
        await trio.testing.wait_all_tasks_blocked()
        t0 = trio.current_time()
        # the first look notes the send under way; one a write timeout later gives it up
        assert not response.hang_up_if_stalled(t0, 5.0, 1.0, cut=False)
        assert response.hang_up_if_stalled(t0 + 5.0, 5.0, 1.0, cut=False)
    assert response.client_stalled and response.hung_up and server.hung_up == 1
    gone: list[bool] = []
    server.disconnect()
    await response.watch_disconnect(server.receive, lambda: gone.append(True))
    assert not gone and not response.client_gone
    # the connection is gone: no error event is tried on it
    sent = len(server.sent)
    await response.fail(OpenAIError("too slow", status=500), headers_sent=True)
    assert len(server.sent) == sent


async def test_a_client_gone_with_a_send_stuck_on_it_is_hung_up_on_once_and_stays_gone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = _Server()
    response = _response(server)
    await response.deliver(AnswerDelta(" t1", 1, None, None))
    server.disconnect()
    await response.watch_disconnect(server.receive, lambda: None)
    server.stuck = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(response.deliver, AnswerDelta(" t2", 1))
        await trio.testing.wait_all_tasks_blocked()
        t0 = trio.current_time()
        # its leaving cut the request: the cut's grace applies, and the request is not
        # ended again by the hang-up
        assert not response.hang_up_if_stalled(t0, 5.0, 1.0, cut=True)
        assert not response.hang_up_if_stalled(t0 + 1.0, 5.0, 1.0, cut=True)
    assert server.hung_up == 1
    assert response.client_gone and response.hung_up and not response.client_stalled
    server.unstuck = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(response.deliver, AnswerDelta(" t3", 1))
        await trio.testing.wait_all_tasks_blocked()
        t1 = trio.current_time()
        assert not response.hang_up_if_stalled(t1, 5.0, 1.0, cut=True)
        assert not response.hang_up_if_stalled(t1 + 1.0, 5.0, 1.0, cut=True)
        nursery.cancel_scope.cancel()
    assert server.hung_up == 1
