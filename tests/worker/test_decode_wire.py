"""The router <-> worker wire, spoken by hand: msgpack frames only, never pickle.

Nothing here uses pdtrio's own encoders or decoders: messages are built as
plain lists, packed and unpacked with the independent ``msgpack`` package,
and read by position, so a change of shape on either side shows up here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import msgpack
import pytest
import trio
import trio.testing
import trio_websocket

from pdtrio.config import WorkerFaultsConfig
from pdtrio.engine.api import BlocksFreed, EngineOutput, StepFailed
from pdtrio.protocol.tokens.flush import FlushConfig
from pdtrio.worker.server import Worker
from tests.cluster import synthetic_worker, wait_for_stats

PICKLE_MARKERS = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")
MSGPACK = {"content-type": "application/msgpack"}

# worker-link message tags: the first element of every frame
START, ABORT, ACCEPTED, REJECTED, TOKENS, FAILED, CAPACITY = 1, 2, 3, 4, 5, 6, 7
HEARTBEAT = 12
PREFILL, PREFILLED, PREFILL_FAILED, RELEASE = 8, 9, 10, 11

# PrefillReply: [PREFILLED, request_id, prompt_token_ids, cached_tokens, first_token_id,
#                first_text, finish_reason, token_budget, kv_handle, usage]
R_ID, R_PROMPT, R_CACHED, R_FIRST, R_TEXT, R_FINISH, R_BUDGET, R_HANDLE, R_USAGE = range(1, 10)
# a KV handle's last field: the grant a release (or a pull) must show
H_GRANT = 8
# KvHandle: [request_id, instance_id, host, port, block_ids, num_tokens, layout, lease_ttl_s]
H_INSTANCE, H_PORT, H_BLOCKS = 1, 3, 4
# TokenEntry: [request_id, token_ids, text, finish_reason, usage]; Usage: [prompt, completion, cached]
E_ID, E_TOKENS, E_TEXT, E_FINISH, E_USAGE = range(5)


def _strict_unpack(data: bytes) -> Any:
    def no_ext(code: int, payload: bytes) -> None:
        raise AssertionError(f"msgpack ext type {code} on the wire")

    return msgpack.unpackb(data, raw=False, ext_hook=no_ext)


def prefill_request(
    request_id: str, prompt: Any, *, max_tokens: int | None, sampling: list[Any] | None = None
) -> bytes:
    # [PREFILL, request_id, prompt, sampling, max_tokens]; a prompt is [kind, body];
    # sampling is [temperature, top_p, top_k, seed, min_tokens, stop, ignore_eos], trailing
    # defaults may be left out
    return msgpack.packb([PREFILL, request_id, prompt, sampling or [], max_tokens])


def decode_start(reply: list[Any], *, sampling: list[Any] | None = None) -> bytes:
    # [START, request_id, prompt_token_ids, first_token_id, sampling, token_budget,
    #  tokens_generated, cached_tokens, kv_handle]
    return msgpack.packb(
        [
            START,
            reply[R_ID],
            reply[R_PROMPT],
            reply[R_FIRST],
            sampling or [],
            reply[R_BUDGET],
            1,
            reply[R_CACHED],
            reply[R_HANDLE],
        ]
    )


async def post(url: str, body: bytes) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.post(url, content=body, headers=MSGPACK)


async def _prefill(
    url: str, request_id: str, prompt: str, max_tokens: int, sampling: list[Any] | None = None
) -> list[Any]:
    response = await post(
        f"{url}/pd/prefill",
        prefill_request(request_id, ["text", prompt], max_tokens=max_tokens, sampling=sampling),
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/msgpack"
    assert not response.content.startswith(PICKLE_MARKERS)
    reply = _strict_unpack(response.content)
    assert isinstance(reply, list) and reply[R_ID] == request_id
    return reply


@attrs.define
class Pair:
    prefill: Worker
    decode: Worker
    prefill_url: str
    ws_url: str


@asynccontextmanager
async def running_pair(**decode_overrides: Any) -> AsyncIterator[Pair]:
    prefill = synthetic_worker("prefill")
    decode = synthetic_worker("decode", **decode_overrides)
    async with trio.open_nursery() as nursery:
        prefill_ready = await nursery.start(prefill.run)
        decode_ready = await nursery.start(decode.run)
        yield Pair(
            prefill,
            decode,
            f"http://127.0.0.1:{prefill_ready['http_port']}",
            f"ws://127.0.0.1:{decode_ready['http_port']}/pd/link",
        )
        nursery.cancel_scope.cancel()


async def _next_message(ws: trio_websocket.WebSocketConnection) -> bytes:
    """The next frame that is not a capacity report (those come whenever blocks change)."""
    while True:
        data = await ws.get_message()
        assert isinstance(data, bytes)
        message = _strict_unpack(data)
        if message[0] != CAPACITY:
            return data
        free, total, block_size = message[1:]
        assert 0 <= free <= total and block_size > 0


async def _tokens_until_finished(
    ws: trio_websocket.WebSocketConnection, request_ids: set[str], frames: list[bytes]
) -> dict[str, list[Any]]:
    """Every entry of the requests, merged per request, until each has finished."""
    streams: dict[str, list[Any]] = {}
    with trio.fail_after(30):
        while not request_ids <= {r for r, e in streams.items() if e[E_FINISH] is not None}:
            data = await _next_message(ws)
            assert isinstance(data, bytes)
            frames.append(data)
            message = _strict_unpack(data)
            if message[0] == HEARTBEAT:
                continue  # the worker's, after a silence (a slow machine)
            assert message[0] in (ACCEPTED, TOKENS), message
            if message[0] != TOKENS:
                continue
            for entry in message[1]:
                merged = streams.setdefault(entry[E_ID], [entry[E_ID], [], "", None, None])
                merged[E_TOKENS] += entry[E_TOKENS]
                merged[E_TEXT] += entry[E_TEXT]
                merged[E_FINISH] = entry[E_FINISH]
                merged[E_USAGE] = entry[E_USAGE]
    return streams


async def test_decode_frames_are_plain_msgpack_and_abort_frees_blocks() -> None:
    async with running_pair(decode_step_s=0.001) as pair:
        replies = [
            await _prefill(pair.prefill_url, f"req-{i}", f"prompt {i}", 20) for i in range(3)
        ]
        frames: list[bytes] = []
        async with trio_websocket.open_websocket_url(pair.ws_url) as ws:
            for reply in replies:
                await ws.send_message(decode_start(reply))
            await ws.send_message(msgpack.packb([ABORT, "req-2"]))
            streams = await _tokens_until_finished(ws, {"req-0", "req-1"}, frames)
        # prefill keeps the blocks until the router (here: this test) releases them, once
        # decode has produced a token; a release needs the grant in the request's handle
        for reply in replies:
            anyone = await post(
                f"{pair.prefill_url}/pd/release", msgpack.packb([RELEASE, reply[R_ID]])
            )
            assert _strict_unpack(anyone.content) == [False]
            released = await post(
                f"{pair.prefill_url}/pd/release",
                msgpack.packb([RELEASE, reply[R_ID], reply[R_HANDLE][H_GRANT]]),
            )
            assert released.status_code == 200
            assert _strict_unpack(released.content) == [True]
    assert frames and not any(f.startswith(PICKLE_MARKERS) for f in frames)
    kinds = [_strict_unpack(f)[0] for f in frames]
    assert ACCEPTED in kinds and TOKENS in kinds
    for reply in replies[:2]:
        stream = streams[reply[R_ID]]
        assert reply[R_BUDGET] == 20 and reply[R_USAGE] is None
        # decode counts every token of the budget, prefill's first one included
        assert stream[E_FINISH] == "length"
        assert len(stream[E_TOKENS]) == 19
        assert stream[E_USAGE] == [len(reply[R_PROMPT]), 20, 0]
    # prefill released each request's blocks when told to; decode freed its own
    assert pair.prefill.engine.statistics().kv_blocks_in_use == 0
    assert pair.decode.engine.statistics().kv_blocks_in_use == 0
    assert len(pair.prefill.leases) == 0


async def test_a_router_that_asks_for_batches_gets_what_queued_in_one_message() -> None:
    """``?batch=1``: every frame is an array of messages; what queued during a write shares
    one; the messages are the ones an unbatched link carries, in an order that still puts
    each accept's capacity report ahead of it.  (A stall of the links' writes at the first
    token frame makes frames queue for sure.)"""
    stall = WorkerFaultsConfig(decode_stall_s=0.2)
    async with running_pair(decode_step_s=0.001, faults=stall) as pair:
        replies = [
            await _prefill(pair.prefill_url, f"req-{i}", f"prompt {i}", 12) for i in range(8)
        ]
        sizes: list[int] = []
        messages: list[list[Any]] = []
        finished: set[str] = set()
        async with trio_websocket.open_websocket_url(pair.ws_url + "?batch=1") as ws:
            for reply in replies:
                await ws.send_message(decode_start(reply))
            with trio.fail_after(30):
                while len(finished) < len(replies):
                    data = await ws.get_message()
                    assert isinstance(data, bytes)
                    batch = _strict_unpack(data)
                    assert isinstance(batch, list) and batch
                    assert all(isinstance(m, list) and isinstance(m[0], int) for m in batch)
                    sizes.append(len(batch))
                    messages += batch
                    for message in batch:
                        if message[0] == TOKENS:
                            finished |= {e[E_ID] for e in message[1] if e[E_FINISH] is not None}
        assert max(sizes) > 1, sizes  # what queued during the stall went out together
        capacity_seen = False
        accepted = set()
        tokens: dict[str, int] = {}
        for message in messages:
            if message[0] == CAPACITY:
                capacity_seen = True
            elif message[0] == ACCEPTED:
                assert capacity_seen  # a report went out ahead of the first accept
                accepted.add(message[1])
            else:
                assert message[0] == TOKENS, message
                for entry in message[1]:
                    assert entry[E_ID] in accepted  # no token ahead of its accept
                    tokens[entry[E_ID]] = tokens.get(entry[E_ID], 0) + len(entry[E_TOKENS])
        assert tokens == {reply[R_ID]: 11 for reply in replies}


async def _batch(ws: trio_websocket.WebSocketConnection) -> list[list[Any]]:
    """The messages of the link's next write (a router that reads batches: ``?batch=1``)."""
    with trio.fail_after(10):
        data = await ws.get_message()
    assert isinstance(data, bytes)
    batch = _strict_unpack(data)
    assert isinstance(batch, list) and batch
    return batch


async def test_an_accept_and_its_report_ride_in_the_write_of_the_first_tokens() -> None:
    """Notices (an accept, a capacity report after the link's first) wait for the next
    frame that goes anyway, up to the flush window (a minute here), and share its write,
    in order: the report, the accept, the tokens.  The link's first report goes at once."""
    async with running_pair(decode_step_s=0.001, flush=FlushConfig(window_s=60.0)) as pair:
        reply = await _prefill(pair.prefill_url, "r", "hello", 4)
        async with trio_websocket.open_websocket_url(pair.ws_url + "?batch=1") as ws:
            first = await _batch(ws)
            assert [message[0] for message in first] == [CAPACITY]
            free, total = first[0][1:3]
            assert free == total
            await ws.send_message(decode_start(reply))
            write = await _batch(ws)
            kinds = [message[0] for message in write]
            assert kinds[:3] == [CAPACITY, ACCEPTED, TOKENS], kinds
            assert write[0][1] < total  # what the accept allocated, ahead of the accept
            assert write[1][1] == "r"
            finished = any(
                message[0] == TOKENS and any(e[E_FINISH] is not None for e in message[1])
                for message in write
            )
            while not finished:
                write = await _batch(ws)
                assert ACCEPTED not in [message[0] for message in write]
                finished = any(
                    message[0] == TOKENS and any(e[E_FINISH] is not None for e in message[1])
                    for message in write
                )


async def test_an_accept_with_no_tokens_behind_it_goes_out_at_the_flush_window() -> None:
    """A notice waits for company no longer than the flush window: decode's first step is
    half a minute away here, and the accept (with its report) comes long before."""
    async with running_pair(decode_step_s=30.0) as pair:
        reply = await _prefill(pair.prefill_url, "r", "hello", 4)
        async with trio_websocket.open_websocket_url(pair.ws_url + "?batch=1") as ws:
            assert [message[0] for message in await _batch(ws)] == [CAPACITY]
            await ws.send_message(decode_start(reply))
            kinds = [message[0] for message in await _batch(ws)]
            assert kinds == [CAPACITY, ACCEPTED], kinds
            await ws.send_message(msgpack.packb([ABORT, "r"]))
        await wait_for_stats(lambda: pair.decode.engine.statistics().kv_blocks_in_use == 0)


async def test_a_draining_decode_reports_no_room_at_once() -> None:
    """The report that says a draining worker has no room is no notice: routers must stop
    placing on it now, not a flush window (a minute here) later."""
    async with running_pair(flush=FlushConfig(window_s=60.0)) as pair:
        async with trio_websocket.open_websocket_url(pair.ws_url + "?batch=1") as ws:
            first = await _batch(ws)
            assert first[0][0] == CAPACITY and first[0][1] > 0
            pair.decode.begin_drain()
            report = await _batch(ws)
            assert [message[0] for message in report] == [CAPACITY]
            assert report[0][1] == 0


async def test_a_stop_string_spanning_the_first_token_is_cut_and_counted() -> None:
    async with running_pair(decode_step_s=0.001) as pair:
        whole = await _prefill(pair.prefill_url, "whole", "hello", 6)
        async with trio_websocket.open_websocket_url(pair.ws_url) as ws:
            await ws.send_message(decode_start(whole))
            text = (await _tokens_until_finished(ws, {"whole"}, []))["whole"][E_TEXT]
            full = whole[R_TEXT] + text
            # a stop string that begins in the first token's text and ends in the second's
            cut = len(whole[R_TEXT]) - 1
            stop = full[cut : cut + 4]
            sampling = [1.0, 1.0, 0, None, 0, [stop]]
            reply = await _prefill(pair.prefill_url, "cut", "hello", 6, sampling)
            assert reply[R_TEXT] + stop[0] == whole[R_TEXT]  # held back: it may begin the stop
            await ws.send_message(decode_start(reply, sampling=sampling))
            stream = (await _tokens_until_finished(ws, {"cut"}, []))["cut"]
    assert stream[E_FINISH] == "stop"
    assert reply[R_TEXT] + stream[E_TEXT] == full[:cut]
    assert stream[E_USAGE] == [len(reply[R_PROMPT]), 2, 0]  # the first token counted once


async def test_a_request_finished_by_prefill_carries_its_usage_and_holds_nothing() -> None:
    async with running_pair() as pair:
        reply = await _prefill(pair.prefill_url, "short", "hi", 1)
        assert reply[R_FINISH] == "length" and reply[R_BUDGET] == 1
        assert reply[R_HANDLE] is None
        assert reply[R_USAGE] == [len(reply[R_PROMPT]), 1, 0]
        assert pair.prefill.engine.statistics().kv_blocks_in_use == 0
        assert len(pair.prefill.leases) == 0


async def test_one_link_cannot_abort_another_links_request() -> None:
    async with running_pair(decode_step_s=0.002) as pair:
        reply = await _prefill(pair.prefill_url, "mine", "prompt", 30)
        async with (
            trio_websocket.open_websocket_url(pair.ws_url) as owner,
            trio_websocket.open_websocket_url(pair.ws_url) as other,
        ):
            await owner.send_message(decode_start(reply))
            assert _strict_unpack(await _next_message(owner))[:2] == [ACCEPTED, "mine"]
            await other.send_message(msgpack.packb([ABORT, "mine"]))
            stream = (await _tokens_until_finished(owner, {"mine"}, []))["mine"]
        assert stream[E_FINISH] == "length" and stream[E_USAGE][1] == 30
        assert pair.decode.stats()["decode_requests"] == 0


async def test_a_start_for_a_running_request_is_rejected() -> None:
    async with running_pair(decode_step_s=0.01) as pair:
        reply = await _prefill(pair.prefill_url, "twice", "prompt", 50)
        async with trio_websocket.open_websocket_url(pair.ws_url) as ws:
            await ws.send_message(decode_start(reply))
            assert _strict_unpack(await _next_message(ws))[:2] == [ACCEPTED, "twice"]
            await ws.send_message(decode_start(reply))
            while (message := _strict_unpack(await _next_message(ws)))[0] == TOKENS:
                pass
            assert message[:3] == [REJECTED, "twice", "bad_request"]
            await ws.send_message(msgpack.packb([ABORT, "twice"]))
        await wait_for_stats(lambda: not pair.decode.stats()["decode_requests"])
        assert pair.decode.engine.statistics().kv_blocks_in_use == 0


async def test_a_start_running_over_another_link_is_rejected_for_another_decode() -> None:
    # the router lost the first link (this worker has not seen it go yet) and tries again
    async with running_pair(decode_step_s=0.01) as pair:
        reply = await _prefill(pair.prefill_url, "again", "prompt", 50)
        async with (
            trio_websocket.open_websocket_url(pair.ws_url) as lost,
            trio_websocket.open_websocket_url(pair.ws_url) as new,
        ):
            await lost.send_message(decode_start(reply))
            assert _strict_unpack(await _next_message(lost))[:2] == [ACCEPTED, "again"]
            await new.send_message(decode_start(reply))
            assert _strict_unpack(await _next_message(new))[:3] == [
                REJECTED,
                "again",
                "already_running",
            ]
            await lost.send_message(msgpack.packb([ABORT, "again"]))
        await wait_for_stats(lambda: not pair.decode.stats()["decode_requests"])
        assert pair.decode.engine.statistics().kv_blocks_in_use == 0


async def test_a_start_with_a_foreign_layout_is_rejected_naming_both() -> None:
    prefill = synthetic_worker("prefill", vocab_size=1000)
    decode = synthetic_worker("decode", vocab_size=2000)
    async with trio.open_nursery() as nursery:
        prefill_ready = await nursery.start(prefill.run)
        decode_ready = await nursery.start(decode.run)
        reply = await _prefill(f"http://127.0.0.1:{prefill_ready['http_port']}", "r", "hi", 5)
        async with trio_websocket.open_websocket_url(
            f"ws://127.0.0.1:{decode_ready['http_port']}/pd/link"
        ) as ws:
            await ws.send_message(decode_start(reply))
            message = _strict_unpack(await _next_message(ws))
        nursery.cancel_scope.cancel()
    assert message[0] == REJECTED
    assert message[2] == "layout_mismatch"
    assert "vocab1000" in message[3] and "vocab2000" in message[3]
    assert "prefill has" in message[3] and "decode has" in message[3]


async def test_an_unreachable_kv_endpoint_is_rejected_and_frees_decode_blocks() -> None:
    async with running_pair() as pair:
        reply = await _prefill(pair.prefill_url, "gone", "hi", 5)
        assert reply[R_HANDLE] is not None
        with trio.socket.socket() as placeholder:  # a port with nobody listening
            await placeholder.bind(("127.0.0.1", 0))
            reply[R_HANDLE][H_PORT] = placeholder.getsockname()[1]
        async with trio_websocket.open_websocket_url(pair.ws_url) as ws:
            await ws.send_message(decode_start(reply))
            message = _strict_unpack(await _next_message(ws))
        assert message[0] == REJECTED and message[2] == "transfer_failed"
        assert pair.decode.engine.statistics().kv_blocks_in_use == 0


async def test_a_start_whose_handle_does_not_match_its_prompt_is_a_bad_request() -> None:
    async with running_pair() as pair:
        reply = await _prefill(pair.prefill_url, "odd", "hi there", 5)
        reply[R_HANDLE][H_BLOCKS] = reply[R_HANDLE][H_BLOCKS] * 3
        async with trio_websocket.open_websocket_url(pair.ws_url) as ws:
            await ws.send_message(msgpack.packb([START, "odd"]))  # not a start: dropped
            await ws.send_message(decode_start(reply))
            message = _strict_unpack(await _next_message(ws))
        assert message[:3] == [REJECTED, "odd", "bad_request"]
        assert "blocks" in message[3]
        assert pair.decode.engine.statistics().kv_blocks_in_use == 0


async def test_a_lease_nobody_claims_is_freed_when_it_expires() -> None:
    base = synthetic_worker("prefill")
    prefill = Worker(attrs.evolve(base.config, kv_lease_s=0.2), base.engine)
    async with trio.open_nursery() as nursery:
        ready = await nursery.start(prefill.run)
        reply = await _prefill(f"http://127.0.0.1:{ready['http_port']}", "orphan", "hello there", 5)
        assert reply[R_HANDLE] is not None
        assert prefill.engine.statistics().kv_blocks_in_use == len(reply[R_HANDLE][H_BLOCKS])
        await wait_for_stats(lambda: not len(prefill.leases), 10)  # its expiry, from outside
        assert prefill.engine.statistics().kv_blocks_in_use == 0
        assert prefill.stats()["kv_leases_expired"] == 1
        nursery.cancel_scope.cancel()


async def test_the_default_instance_id_names_role_host_and_port() -> None:
    async with running_pair() as pair:
        async with httpx.AsyncClient() as http:
            info = (await http.get(f"{pair.prefill_url}/pd/info")).json()
        port = pair.prefill_url.rsplit(":", 1)[1]
        assert info["instance_id"] == f"prefill@127.0.0.1:{port}"
        reply = await _prefill(pair.prefill_url, "who", "hi", 5)
        assert reply[R_HANDLE][H_INSTANCE] == info["instance_id"]


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/pd/release", b"\xc1", 400, "malformed"),
        ("/pd/release", msgpack.packb([1, 2, 3]), 400, "malformed"),
        ("/pd/release", msgpack.packb({"request_id": "x"}), 400, "malformed"),
        ("/pd/prefill", msgpack.packb([PREFILL, "r", ["text"], [], None]), 400, "malformed"),
        ("/pd/prefill", msgpack.packb([PREFILL, "r", ["tokens", [5, -1]], [], None]), 400, "-1"),
        (
            "/pd/prefill",
            msgpack.packb([PREFILL, "r", ["tokens", [5, 10**9]], [], None]),
            400,
            "range",
        ),
        ("/pd/prefill", msgpack.packb([PREFILL, "r", ["tokens", []], [], None]), 400, "empty"),
        ("/pd/prefill", msgpack.packb([PREFILL, "r", ["text", "hi"], [], 0]), 400, "max_tokens"),
        (
            "/pd/prefill",
            msgpack.packb([PREFILL, "r", ["text", "hi"], [], 10**7]),
            400,
            "context length",
        ),
    ],
)
async def test_bad_control_bodies_are_400s_with_a_message(
    path: str, body: bytes, status: int, says: str
) -> None:
    async with running_pair() as pair:
        response = await post(f"{pair.prefill_url}{path}", body)
        assert pair.prefill.engine.statistics().kv_blocks_in_use == 0
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert says in error["message"]
    assert error["type"] == "invalid_request_error"


class LosingEngine:
    """The synthetic engine, with a way to make a step lose a request (as a torch step can)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.inject: trio.MemorySendChannel[EngineOutput] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def run(
        self,
        outputs: trio.MemorySendChannel[EngineOutput],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        self.inject = outputs.clone()
        await self.inner.run(outputs, task_status=task_status)

    async def lose(self, request_id: str) -> None:
        assert self.inject is not None
        self.inner.abort(request_id)
        await self.inject.send(StepFailed((request_id,), "decode step failed: boom"))


async def test_a_request_the_engine_loses_ends_with_decode_failed_on_its_link() -> None:
    prefill = synthetic_worker("prefill")
    base = synthetic_worker("decode", decode_step_s=0.01)
    engine = LosingEngine(base.engine)
    decode = Worker(base.config, engine)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        prefill_ready = await nursery.start(prefill.run)
        decode_ready = await nursery.start(decode.run)
        url = f"http://127.0.0.1:{prefill_ready['http_port']}"
        reply = await _prefill(url, "lost", "prompt", 100)
        async with trio_websocket.open_websocket_url(
            f"ws://127.0.0.1:{decode_ready['http_port']}/pd/link"
        ) as ws:
            await ws.send_message(decode_start(reply))
            assert _strict_unpack(await _next_message(ws))[:2] == [ACCEPTED, "lost"]
            await engine.lose("lost")
            with trio.fail_after(10):
                while (message := _strict_unpack(await _next_message(ws)))[0] == TOKENS:
                    assert all(e[E_FINISH] is None for e in message[1])
        assert message == [FAILED, "lost", "decode step failed: boom"]
        assert decode.stats()["decode_requests"] == 0
        assert base.engine.statistics().kv_blocks_in_use == 0
        nursery.cancel_scope.cancel()


class LateFreeingEngine(LosingEngine):
    """The synthetic engine, freeing an aborted request's blocks only when told to (as the
    torch engine's thread does between steps), and saying so with ``BlocksFreed``."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.held: list[str] = []

    def abort(self, request_id: str) -> None:
        self.held.append(request_id)  # stops nothing: the test sends no more steps' worth

    async def free_held(self) -> None:
        assert self.inject is not None
        for request_id in self.held:
            self.inner.abort(request_id)
        await self.inject.send(BlocksFreed(tuple(self.held)))
        self.held.clear()


async def test_blocks_an_engine_frees_after_an_abort_are_reported_on_the_link() -> None:
    prefill = synthetic_worker("prefill")
    base = synthetic_worker("decode", decode_step_s=3600)  # (one step: the first token's)
    engine = LateFreeingEngine(base.engine)
    decode = Worker(base.config, engine)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        prefill_ready = await nursery.start(prefill.run)
        decode_ready = await nursery.start(decode.run)
        reply = await _prefill(f"http://127.0.0.1:{prefill_ready['http_port']}", "r", "hi", 100)
        async with trio_websocket.open_websocket_url(
            f"ws://127.0.0.1:{decode_ready['http_port']}/pd/link"
        ) as ws:
            reports: list[int] = []  # the free blocks each capacity report said

            async def report_saying(condition: Any) -> None:
                with trio.fail_after(10):
                    while not (reports and condition(reports[-1])):
                        message = _strict_unpack(await ws.get_message())
                        if message[0] == CAPACITY:
                            reports.append(message[1])

            await report_saying(lambda free: free > 0)
            total = reports[-1]
            await ws.send_message(decode_start(reply))
            await report_saying(lambda free: free < total)
            await ws.send_message(msgpack.packb([ABORT, "r"]))
            await wait_for_stats(lambda: decode.stats()["decode_requests"] == 0)
            await trio.testing.wait_all_tasks_blocked()
            assert base.engine.statistics().kv_blocks_in_use > 0  # the engine holds them yet
            await engine.free_held()
            await report_saying(lambda free: free == total)
        assert base.engine.statistics().kv_blocks_in_use == 0
        nursery.cancel_scope.cancel()


async def test_a_start_with_foreign_token_ids_fails_alone_and_the_link_goes_on() -> None:
    async with running_pair(decode_step_s=0.001) as pair:
        bad = await _prefill(pair.prefill_url, "bad", "prompt", 5)
        good = await _prefill(pair.prefill_url, "good", "prompt", 5)
        bad[R_PROMPT][-1] = -1
        async with trio_websocket.open_websocket_url(pair.ws_url) as ws:
            await ws.send_message(decode_start(bad))
            assert _strict_unpack(await _next_message(ws))[:2] == [ACCEPTED, "bad"]
            failed = _strict_unpack(await _next_message(ws))
            assert failed[:2] == [FAILED, "bad"] and "vocabulary" in failed[2]
            await ws.send_message(decode_start(good))
            stream = (await _tokens_until_finished(ws, {"good"}, []))["good"]
        assert stream[E_FINISH] == "length"
        assert pair.decode.stats()["decode_requests"] == 0
        assert pair.decode.engine.statistics().kv_blocks_in_use == 0


async def test_prefill_and_release_ride_the_link_by_hand() -> None:
    """The router's per-request legs on one websocket: prefill call, reply, release."""
    async with running_pair() as pair:
        prefill_ws = pair.prefill_url.replace("http://", "ws://", 1) + "/pd/link"
        async with trio_websocket.open_websocket_url(prefill_ws) as ws:
            for i in range(3):
                await ws.send_message(
                    prefill_request(f"call-{i}", ["text", f"prompt {i}"], max_tokens=20)
                )
            replies = {}
            for _ in range(3):
                reply = _strict_unpack(await _next_message(ws))
                assert reply[0] == PREFILLED
                replies[reply[R_ID]] = reply
            assert sorted(replies) == ["call-0", "call-1", "call-2"]
            assert pair.prefill.stats()["kv_leases"] == 3
            # a bad call is answered on the link, with the status the client would see
            await ws.send_message(prefill_request("bad", ["tokens", []], max_tokens=5))
            failed = _strict_unpack(await _next_message(ws))
            assert failed[:3] == [PREFILL_FAILED, "bad", 400]
            for request_id, reply in replies.items():
                grant = reply[R_HANDLE][H_GRANT]
                await ws.send_message(msgpack.packb([RELEASE, request_id, grant]))
            await ws.send_message(msgpack.packb([RELEASE, "never-heard-of"]))  # harmless
            await wait_for_stats(lambda: not pair.prefill.stats()["kv_leases"])
        stats = pair.prefill.stats()
        assert stats["kv_blocks_in_use"] == 0 and stats["prefills_in_progress"] == 0


async def test_a_released_prefill_in_progress_is_stopped_and_frees_its_blocks() -> None:
    # a slow prefill: 4,000 tokens at 1 ms each are still prefilling when released
    prefill = synthetic_worker("prefill", prefill_s_per_token=0.001)
    async with trio.open_nursery() as nursery:
        ready = await nursery.start(prefill.run)
        async with trio_websocket.open_websocket_url(
            f"ws://127.0.0.1:{ready['http_port']}/pd/link"
        ) as ws:
            await ws.send_message(prefill_request("slow", ["tokens", [5] * 4000], max_tokens=5))
            await wait_for_stats(lambda: prefill.stats()["prefills_in_progress"] > 0)
            await ws.send_message(msgpack.packb([RELEASE, "slow"]))
            await wait_for_stats(lambda: not prefill.stats()["prefills_in_progress"], 3)
        stats = prefill.stats()
        assert stats["kv_blocks_in_use"] == 0 and stats["kv_leases"] == 0
        assert stats["served_prefills"] == 0
        nursery.cancel_scope.cancel()


async def test_the_release_token_of_a_call_frees_its_kv_over_any_link_and_nothing_else() -> None:
    """A call's release token (its sixth field) frees its lease, or stops it while it runs,
    over another link too (the one that asked may be gone); another token frees nothing."""

    def call(request_id: str, tokens: int, release_token: str) -> bytes:
        # [PREFILL, request_id, prompt, sampling, max_tokens, release_token]
        return msgpack.packb([PREFILL, request_id, ["tokens", [5] * tokens], [], 5, release_token])

    prefill = synthetic_worker("prefill", prefill_s_per_token=0.001)
    async with trio.open_nursery() as nursery:
        ready = await nursery.start(prefill.run)
        url = f"ws://127.0.0.1:{ready['http_port']}/pd/link"
        async with (
            trio_websocket.open_websocket_url(url) as asker,
            trio_websocket.open_websocket_url(url) as other,
        ):
            await asker.send_message(call("answered", 16, "token-a"))
            reply = _strict_unpack(await _next_message(asker))
            assert reply[:2] == [PREFILLED, "answered"]
            assert prefill.stats()["kv_leases"] == 1
            for wrong in ("", "token-b"):
                await other.send_message(msgpack.packb([RELEASE, "answered", wrong]))
            await asker.send_message(msgpack.packb([RELEASE, "answered", "token-b"]))
            # (a release is read in order: the one after these frees the lease, if they did not)
            await other.send_message(msgpack.packb([RELEASE, "answered", "token-a"]))
            await wait_for_stats(lambda: not prefill.stats()["kv_leases"])
            assert prefill.stats()["kv_blocks_in_use"] == 0

            # a long prefill asked on one link is stopped by its token shown on another
            await asker.send_message(call("running", 4000, "token-r"))
            await wait_for_stats(lambda: prefill.stats()["prefills_in_progress"] > 0)
            await other.send_message(msgpack.packb([RELEASE, "running", "token-x"]))
            await other.send_message(msgpack.packb([RELEASE, "running", "token-r"]))
            await wait_for_stats(lambda: not prefill.stats()["prefills_in_progress"], 3)
        stats = prefill.stats()
        assert stats["kv_blocks_in_use"] == 0 and stats["kv_leases"] == 0
        assert stats["served_prefills"] == 1
        nursery.cancel_scope.cancel()


async def test_a_decode_worker_prefills_a_call_on_its_link_and_decodes_it_in_place() -> None:
    """Conditional disaggregation's worker side: the router asks the decode itself to
    prefill; its KV handle names the decode, and the start takes the blocks over."""
    async with running_pair() as pair:
        async with trio_websocket.open_websocket_url(pair.ws_url) as ws:
            await ws.send_message(prefill_request("p", ["text", "hi"], max_tokens=5))
            reply = _strict_unpack(await _next_message(ws))
            assert reply[0] == PREFILLED and reply[R_ID] == "p"
            assert reply[R_HANDLE][1] == pair.decode.instance_id  # [request_id, instance, ...]
            await ws.send_message(decode_start(reply))
            stream = (await _tokens_until_finished(ws, {"p"}, []))["p"]
        assert stream[E_FINISH] == "length"
        assert (
            pair.prefill.prefill.served_prefills == 0 and pair.decode.prefill.served_prefills == 1
        )


async def test_a_decode_worker_reports_its_room_when_a_local_prefills_lease_ends() -> None:
    """A prefill's lease on a decode worker ends (released here; pulled or expired alike)
    with a capacity report: the router must not keep those blocks counted as taken."""
    async with running_pair() as pair:
        async with trio_websocket.open_websocket_url(pair.ws_url) as ws:
            reports: list[tuple[int, int]] = []  # (free, total), as they came

            async def next_other() -> Any:
                """The next frame that is not a capacity report; those are kept."""
                with trio.fail_after(10):
                    while True:
                        message = _strict_unpack(await ws.get_message())
                        if message[0] != CAPACITY:
                            return message
                        reports.append((message[1], message[2]))

            await ws.send_message(prefill_request("p", ["text", "hi " * 40], max_tokens=5))
            reply = await next_other()
            assert reply[0] == PREFILLED
            held = len(reply[R_HANDLE][H_BLOCKS])
            assert held and pair.decode.engine.statistics().kv_blocks_in_use == held
            # the report ahead of the reply counts the lease's blocks taken
            free, total = reports[-1]
            assert free == total - held
            await ws.send_message(msgpack.packb([RELEASE, "p", reply[R_HANDLE][H_GRANT]]))
            with trio.fail_after(10):  # a report follows: all free, with no request
                while reports[-1][0] != total:
                    await next_other()  # (heartbeats, while nothing else comes)
        assert pair.decode.engine.statistics().kv_blocks_in_use == 0


async def test_a_big_bad_frame_is_dropped_and_its_memory_trimmed_and_the_link_goes_on() -> None:
    async with running_pair(decode_step_s=0.001) as pair:
        good = await _prefill(pair.prefill_url, "good", "prompt", 3)
        trimmer = pair.decode.link_server.heap_trimmer if pair.decode.link_server else None
        assert trimmer is not None
        async with trio_websocket.open_websocket_url(pair.ws_url) as ws:
            # past the size decoded on a thread; 0xc1 is never valid msgpack
            await ws.send_message(b"\xc1" * 400_000)
            await wait_for_stats(lambda: trimmer.trims >= 1, deadline_s=10)
            await ws.send_message(decode_start(good))
            stream = (await _tokens_until_finished(ws, {"good"}, []))["good"]
        assert stream[E_FINISH] == "length"


LOGPROBS, PREFILLED_WITH_LOGPROB = 13, 14
# sampling with its 14th field, logprobs (the alternatives asked for; -1: none)
LOGPROB_SAMPLING = [1.0, 1.0, 0, None, 0, [], False, [], 0.0, 0.0, 1.0, 0.0, [], 2]


async def test_logprobs_go_in_their_own_message_ahead_of_their_tokens_for_who_asked() -> None:
    # a stall at the first token frame makes frames (and logprobs) queue and merge
    stall = WorkerFaultsConfig(decode_stall_s=0.2)
    async with running_pair(decode_step_s=0.001, faults=stall) as pair:
        asked = await _prefill(pair.prefill_url, "asked", "hello", 12, LOGPROB_SAMPLING)
        plain = await _prefill(pair.prefill_url, "plain", "hello", 12)
        # the reply to who asked is its own kind: the first token's logprob after the rest
        assert asked[0] == PREFILLED_WITH_LOGPROB and plain[0] == PREFILLED
        assert len(plain) == 10  # (what a router from before logprobs reads)
        token, logprob, top_tokens, top_logprobs = asked[10]
        assert token == asked[R_TEXT] and top_tokens[0] == token and logprob == top_logprobs[0]
        assert len(top_tokens) == len(top_logprobs) == 2
        messages: list[list[Any]] = []
        finished: set[str] = set()
        async with trio_websocket.open_websocket_url(pair.ws_url + "?batch=1") as ws:
            await ws.send_message(decode_start(asked, sampling=LOGPROB_SAMPLING))
            await ws.send_message(decode_start(plain))
            with trio.fail_after(30):
                while finished != {"asked", "plain"}:
                    data = await ws.get_message()
                    assert isinstance(data, bytes)
                    for message in _strict_unpack(data):
                        messages.append(message)
                        if message[0] == TOKENS:
                            finished |= {e[E_ID] for e in message[1] if e[E_FINISH] is not None}
    logprobs_sent: dict[str, int] = {}
    tokens_sent: dict[str, int] = {}
    for message in messages:
        if message[0] == LOGPROBS:
            request_id, items = message[1], message[2]
            logprobs_sent[request_id] = logprobs_sent.get(request_id, 0) + len(items)
            for token, _, top_tokens, _ in items:
                assert top_tokens[0] == token  # (the synthetic engine's likeliest)
        elif message[0] == TOKENS:
            for entry in message[1]:
                request_id = entry[E_ID]
                tokens_sent[request_id] = tokens_sent.get(request_id, 0) + len(entry[E_TOKENS])
                if request_id == "asked":
                    # every token's logprob went out ahead of it
                    assert logprobs_sent["asked"] >= tokens_sent["asked"]
    assert tokens_sent == {"asked": 11, "plain": 11}
    assert logprobs_sent == {"asked": 11}  # nothing at all for the request that asked none
    # merged per request while frames queued: fewer messages than tokens
    assert sum(m[0] == LOGPROBS for m in messages) < 11
