"""Requests waiting on a decode that hangs end or move with its streams (issue 49).

A hung worker (SIGSTOPped, a wedged loop) keeps its TCP connection: the router
finds it silent only after the link timeout.  What waits on it meanwhile (a
stream, a start it has not answered, a request queued for its room) must not
wait for it to wake: it goes on on another decode, or ends, within the link
timeout and ``decode_reconnect_wait_s``.  In-process: the router's link to each
decode runs through a ``FaultProxy`` whose stall is what a stopped worker looks
like from outside.  The SIGSTOP itself is in tests/e2e/test_hung_workers.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import httpx
import trio

from pdtrio.config import InstanceConfig, PdtrioConfig, RouterConfig
from pdtrio.faults import FaultProxy
from pdtrio.router.app import RouterApp
from pdtrio.testing import LOOPBACK
from tests.cluster import (
    Cluster,
    serve_app,
    synthetic_worker,
    wait_for_stats,
    wait_until_idle,
    worker_backend,
)

# generous: these bound liveness, they do not measure it
LIVENESS_S = 20.0
# well inside the lease: a request the lease ended would say so
KV_LEASE_S = 10.0


@attrs.define
class Proxied:
    cluster: Cluster
    proxies: list[FaultProxy]  # one per decode, in order


@asynccontextmanager
async def proxied_cluster(router: RouterConfig, *, decodes: int) -> AsyncIterator[Proxied]:
    """A prefill and ``decodes`` decodes, each of which one default request fills (for
    ~12 s), the router's link to each decode through a proxy."""
    lease = {"kv_lease_s": KV_LEASE_S}
    workers = [synthetic_worker("prefill", worker_overrides=lease, max_model_len=256)]
    workers += [
        synthetic_worker(
            "decode", max_model_len=256, num_kv_blocks=16, tokens_per_step=1, decode_step_s=0.05
        )
        for _ in range(decodes)
    ]
    async with trio.open_nursery() as nursery:
        ready = [await nursery.start(worker.run) for worker in workers]
        proxies = []
        instances = [InstanceConfig(role="prefill", url=ready[0]["url"])]
        for decode in ready[1:]:
            proxy = FaultProxy(LOOPBACK, 0, LOOPBACK, decode["http_port"])
            port = await nursery.start(proxy.run)
            proxies.append(proxy)
            instances.append(InstanceConfig(role="decode", url=f"http://{LOOPBACK}:{port}"))
        app = RouterApp(PdtrioConfig(router=router, instances=tuple(instances)))
        url = await serve_app(app, nursery)
        cluster = Cluster(url=url, workers=workers, router_app=app)
        router_state = app.router
        assert router_state is not None
        await wait_for_stats(
            lambda: len(worker_backend(router_state).instances.decode_links()) == decodes,
            LIVENESS_S,
        )
        yield Proxied(cluster, proxies)
        nursery.cancel_scope.cancel()


def _router(reconnect_wait_s: float, *, migration_limit: int = 2) -> RouterConfig:
    return RouterConfig(
        link_timeout_s=0.5,
        link_heartbeat_s=0.1,
        decode_reconnect_wait_s=reconnect_wait_s,
        migration_limit=migration_limit,
    )


@attrs.define
class Waiting:
    """A stream that fills the first decode, and a request waiting for its room."""

    stream_events: list[str] = attrs.Factory(list)
    answers: list[httpx.Response] = attrs.Factory(list)
    answered: trio.Event = attrs.Factory(trio.Event)


async def _fill_and_queue_one(
    proxied: Proxied, http: httpx.AsyncClient, nursery: trio.Nursery
) -> Waiting:
    waiting = Waiting()
    flowing = trio.Event()

    async def fill() -> None:
        body = {"model": "synthetic", "prompt": "hi", "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line:
                    waiting.stream_events.append(line)
                    if len(waiting.stream_events) >= 3:
                        flowing.set()  # decode's own tokens flow (prefill's came first)

    async def wait_for_room() -> None:
        body = {"model": "synthetic", "prompt": "hi", "max_tokens": 4}
        waiting.answers.append(await http.post("/v1/completions", json=body))
        waiting.answered.set()

    nursery.start_soon(fill)
    await flowing.wait()
    router = proxied.cluster.router_app.router
    assert router is not None
    workers = worker_backend(router)
    nursery.start_soon(wait_for_room)
    # it holds its place in the decode queue from its arrival
    await wait_for_stats(lambda: len(workers.decode_queue) == 1, LIVENESS_S)
    return waiting


async def test_a_request_queued_for_a_hung_decodes_room_ends_with_its_streams() -> None:
    """The only decode hangs while a request waits for its room: the request is answered
    when the decode's stream ends, not when prefill's KV lease runs out."""
    async with (
        proxied_cluster(_router(reconnect_wait_s=0.5), decodes=1) as proxied,
        httpx.AsyncClient(base_url=proxied.cluster.url, timeout=LIVENESS_S) as http,
    ):
        with trio.fail_after(LIVENESS_S):
            async with trio.open_nursery() as nursery:
                waiting = await _fill_and_queue_one(proxied, http, nursery)
                proxied.proxies[0].update(stall=True)
        (answer,) = waiting.answers
        assert answer.status_code == 503, answer.text
        message = answer.json()["error"]["message"]
        assert message.startswith("no decode instance could take the request"), message
        # the stream it waited behind ended the same way: an error event, then [DONE]
        events = waiting.stream_events
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "decode_failed"
        proxied.proxies[0].update(stall=False)
        await wait_until_idle(proxied.cluster, LIVENESS_S)
        assert proxied.cluster.blocks_in_use() == 0


async def test_a_request_queued_for_a_hung_decodes_room_moves_to_one_that_connects() -> None:
    """The same, with another decode connecting while it waits: it is served there.  The
    stream that filled the hung decode does not migrate (one request fills a decode: a
    migrated stream would take the room the queued request waits for, and hold it past
    prefill's lease); it hangs once decode's tokens flow, when it can no longer be placed
    again as one before its first token would be."""
    router_config = _router(reconnect_wait_s=LIVENESS_S / 2, migration_limit=0)
    async with (
        proxied_cluster(router_config, decodes=2) as proxied,
        httpx.AsyncClient(base_url=proxied.cluster.url, timeout=LIVENESS_S) as http,
    ):
        hung, other = proxied.proxies
        other.update(refuse=True)
        other.reset_all()
        router = proxied.cluster.router_app.router
        assert router is not None
        workers = worker_backend(router)
        await wait_for_stats(lambda: len(workers.instances.decode_links()) == 1, LIVENESS_S)
        with trio.fail_after(LIVENESS_S):
            async with trio.open_nursery() as nursery:
                waiting = await _fill_and_queue_one(proxied, http, nursery)
                hung.update(stall=True)
                # the other comes back once the hung one's link is dropped
                await wait_for_stats(lambda: not workers.instances.decode_links(), LIVENESS_S)
                other.update(refuse=False)
                await waiting.answered.wait()
        (answer,) = waiting.answers
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] == "length"
        hung.update(stall=False)
        await wait_until_idle(proxied.cluster, LIVENESS_S)
        assert proxied.cluster.blocks_in_use() == 0
