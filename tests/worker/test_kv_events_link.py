"""KV events on the worker link: a router that asks (``?kv_events=1``) learns which block
hashes the worker's prefix cache holds, a snapshot first on each connection, then what a
prefill stored (ahead of its reply) and what an allocation evicted; nothing extra on the
wire when the cache is off or the router does not ask."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio_websocket

from pdtrio.protocol.link import wire
from pdtrio.protocol.placement.prefix_index import CachedBlocks, layout_block_hashes
from pdtrio.protocol.sampling import SamplingParams
from pdtrio.worker.server import Worker
from tests.cluster import synthetic_worker

LIVENESS_S = 30  # a bound on a hung test, not a timing assertion
BLOCK = 16


@asynccontextmanager
async def prefill_worker(**overrides: object) -> AsyncIterator[tuple[Worker, str]]:
    worker = synthetic_worker("prefill", **overrides)
    async with trio.open_nursery() as nursery:
        ready = await nursery.start(worker.run)
        yield worker, f"ws://127.0.0.1:{ready['http_port']}/pd/link"
        nursery.cancel_scope.cancel()


async def next_message(ws: trio_websocket.WebSocketConnection) -> wire.FromWorker:
    """The next message that is not a heartbeat (those fill any silence)."""
    while True:
        data = await ws.get_message()
        assert isinstance(data, bytes)
        message = wire.from_worker_decoder.decode(data)
        if type(message) is not wire.Heartbeat:
            return message


async def prefill(
    ws: trio_websocket.WebSocketConnection, request_id: str, token_ids: list[int]
) -> tuple[list[wire.KvEvents], wire.PrefillReply]:
    """Prefill ``token_ids`` over the link: the KV events that came before the reply, and it."""
    call = wire.PrefillRequest(request_id, wire.TokenPrompt(tuple(token_ids)), SamplingParams(), 1)
    await ws.send_message(wire.encode(call))
    events: list[wire.KvEvents] = []
    while True:
        message = await next_message(ws)
        if isinstance(message, wire.KvEvents):
            events.append(message)
        elif isinstance(message, wire.PrefillReply):
            return events, message
        else:
            raise AssertionError(f"unexpected {message!r}")


async def test_a_router_that_asks_gets_a_snapshot_then_each_prefills_blocks_ahead_of_its_reply() -> (
    None
):
    prompt = list(range(10, 10 + 5 * BLOCK + 3))  # five full blocks and a partial one
    with trio.fail_after(LIVENESS_S):
        async with prefill_worker(prefix_cache=True) as (worker, url):
            hashes = layout_block_hashes(prompt, worker.engine.layout)
            async with trio_websocket.open_websocket_url(url + "?kv_events=1") as ws:
                assert await next_message(ws) == wire.KvEvents(snapshot=True, stored=())
                events, reply = await prefill(ws, "r1", prompt)
                assert [(e.snapshot, set(e.stored), e.removed) for e in events] == [
                    (False, set(hashes), ())
                ]
                # the same prompt again: nothing new is cached, nothing is reported
                events, _ = await prefill(ws, "r2", prompt)
                assert events == []
            # a router connecting now (a reconnect) gets the whole set at once
            async with trio_websocket.open_websocket_url(url + "?kv_events=1") as ws:
                snapshot = await next_message(ws)
                assert isinstance(snapshot, wire.KvEvents) and snapshot.snapshot
                assert set(snapshot.stored) == set(hashes)


async def test_evicted_blocks_are_reported_removed_and_the_view_matches_a_fresh_snapshot() -> None:
    # room for 8 blocks: a second prompt of 7 evicts most of the first one's
    first = list(range(10, 10 + 6 * BLOCK + 4))
    second = list(range(500, 500 + 6 * BLOCK + 4))
    with trio.fail_after(LIVENESS_S):
        async with prefill_worker(prefix_cache=True, num_kv_blocks=8) as (worker, url):
            view = CachedBlocks()
            async with trio_websocket.open_websocket_url(url + "?kv_events=1") as ws:
                snapshot = await next_message(ws)
                assert isinstance(snapshot, wire.KvEvents)
                view.apply(snapshot)
                for request_id, prompt in (("a", first), ("b", second)):
                    events, reply = await prefill(ws, request_id, prompt)
                    for event in events:
                        view.apply(event)
                    # one token asked: it ended at prefill, its blocks stay cached, unheld
                    assert reply.kv_handle is None
                layout = worker.engine.layout
                # the second prompt's allocation evicted some of the first's blocks: said so
                assert any(h not in view for h in layout_block_hashes(first, layout))
                assert view.prefix_blocks(layout_block_hashes(second, layout)) == 6
            async with trio_websocket.open_websocket_url(url + "?kv_events=1") as ws:
                fresh = await next_message(ws)
                assert isinstance(fresh, wire.KvEvents) and fresh.snapshot
                # what the events built is what a reconnecting router would be told
                assert all(h in view for h in fresh.stored) and len(fresh.stored) == len(view)


async def test_nothing_extra_on_the_wire_with_the_cache_off_or_unasked() -> None:
    prompt = list(range(10, 10 + 3 * BLOCK))
    with trio.fail_after(LIVENESS_S):
        for cache, query in ((False, "?kv_events=1"), (True, ""), (True, "?kv_events=0")):
            async with prefill_worker(prefix_cache=cache) as (_, url):
                async with trio_websocket.open_websocket_url(url + query) as ws:
                    events, reply = await prefill(ws, "r1", prompt)
                    assert events == [] and reply.request_id == "r1", (cache, query)
