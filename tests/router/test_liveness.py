"""Liveness of the worker link: heartbeats on an idle link, and a silent link dropped."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import trio

from pdtrio.config import ConfigError, RouterConfig, config_from_dict
from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.link.wire import (
    DecodeStart,
    Heartbeat,
    KvHandle,
    PrefillRequest,
    TextPrompt,
    encode,
    from_worker_decoder,
)
from pdtrio.protocol.sampling import SamplingParams
from pdtrio.router.stream_outcome import DecodeLoss, StreamFailed
from pdtrio.router.workers.link import WorkerLink, WorkerLinkHung, WorkerLinkLost
from pdtrio.router.workers.ws_client import HandshakeError
from pdtrio.worker.link_sender import DEFAULT_HEARTBEAT_S
from pdtrio.worker.router_link import _heartbeat_interval
from tests.cluster import serve_app, synthetic_worker, wait_for_stats

# generous: these bound liveness, they do not measure it
LIVENESS_S = 10.0


def test_a_heartbeat_is_a_tagged_message_of_the_worker_link() -> None:
    data = encode(Heartbeat())
    assert from_worker_decoder.decode(data) == Heartbeat()


def test_the_worker_takes_the_interval_the_router_names() -> None:
    assert _heartbeat_interval({"query_string": b"heartbeat_s=0.25"}) == 0.25
    assert _heartbeat_interval({"query_string": b""}) == DEFAULT_HEARTBEAT_S
    assert _heartbeat_interval({"query_string": b"heartbeat_s=nan"}) == DEFAULT_HEARTBEAT_S
    assert _heartbeat_interval({"query_string": b"heartbeat_s=oops"}) == DEFAULT_HEARTBEAT_S
    assert _heartbeat_interval({"query_string": b"heartbeat_s=0"}) > 0


def test_the_heartbeat_must_come_well_within_the_timeout() -> None:
    with pytest.raises(ConfigError, match="router"):
        config_from_dict({"router": {"link_timeout_s": 1.0, "link_heartbeat_s": 1.0}})
    with pytest.raises(ValueError, match="link_heartbeat_s"):
        RouterConfig(link_timeout_s=1.0, link_heartbeat_s=2.0)


async def test_heartbeats_keep_an_idle_link_alive() -> None:
    async with trio.open_nursery() as nursery:
        worker = synthetic_worker("prefill")  # sends nothing but heartbeats when idle
        ready = await nursery.start(worker.run)
        link = WorkerLink(
            "idle",
            f"ws://127.0.0.1:{ready['http_port']}/pd/link",
            max_pending_tokens=1024,
            link_timeout_s=0.5,
            heartbeat_s=0.02,
        )
        await nursery.start(link.run)
        # many timeouts' worth of heartbeats, and the link stays up throughout
        await wait_for_stats(lambda: link.statistics().frames_received >= 50, deadline_s=LIVENESS_S)
        assert link.connected and link.statistics().hangs == 0
        # it still serves
        with trio.fail_after(LIVENESS_S):
            reply = await link.prefill(
                PrefillRequest("r1", TextPrompt("hi"), SamplingParams(), max_tokens=1)
            )
        assert reply.request_id == "r1"
        nursery.cancel_scope.cancel()


async def _silent_server(nursery: trio.Nursery) -> str:
    """A websocket endpoint that accepts the link and then never sends a frame (a hung worker)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await receive()
        await send({"type": "websocket.accept"})
        await trio.sleep_forever()

    return await serve_app(app, nursery)


def _start_message(request_id: str) -> DecodeStart:
    layout = KvLayout("fake", 1, 1, 1, 16, "float32")
    handle = KvHandle(request_id, "p", "127.0.0.1", 1, (0,), 1, layout, 0.0)
    return DecodeStart(request_id, (1,), 2, SamplingParams(), 8, 1, 0, handle)


async def test_a_silent_link_is_dropped_with_its_streams_and_calls() -> None:
    async with trio.open_nursery() as nursery:
        url = await _silent_server(nursery)
        link = WorkerLink(
            "silent",
            url.replace("http://", "ws://") + "/pd/link",
            max_pending_tokens=1024,
            link_timeout_s=0.5,
            heartbeat_s=0.1,
        )
        outcome: list[BaseException] = []

        async def run_link(task_status: trio.TaskStatus[None]) -> None:
            try:
                await link.run(task_status=task_status)
            except WorkerLinkHung as exc:
                outcome.append(exc)

        await nursery.start(run_link)
        assert link.connected
        stream = await link.start(_start_message("r1"))
        with trio.fail_after(LIVENESS_S):
            with pytest.raises(WorkerLinkLost, match="sent nothing"):
                await link.prefill(
                    PrefillRequest("r2", TextPrompt("hi"), SamplingParams(), max_tokens=4)
                )
            while not isinstance(stream.outcome, StreamFailed):
                await stream.wait_update()
        assert "sent nothing" in stream.outcome.message
        assert stream.outcome.loss is DecodeLoss.LINK_TIMEOUT
        assert not link.connected and link.statistics().hangs == 1
        await trio.testing.wait_all_tasks_blocked()
        assert len(outcome) == 1
        nursery.cancel_scope.cancel()


async def test_a_reconnect_to_a_server_that_never_answers_the_handshake_times_out() -> None:
    # a stopped worker's kernel still accepts the TCP connection; nothing more comes
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, _hold_forever, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        link = WorkerLink(
            "stopped",
            f"ws://127.0.0.1:{port}/pd/link",
            max_pending_tokens=1024,
            connect_timeout_s=0.2,
        )
        with trio.fail_after(LIVENESS_S), pytest.raises(HandshakeError):
            await link.run()
        assert not link.connected
        nursery.cancel_scope.cancel()


async def _hold_forever(stream: trio.SocketStream) -> None:
    async with stream:
        await trio.sleep_forever()
