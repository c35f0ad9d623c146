"""Cache-aware prefill through the real router: two prefill workers with the prefix cache
on report their cached blocks over their links, and a conversation's next turn goes to
the one holding its earlier turns (its usage shows the reuse); after a link reconnect
the router's view of that worker is its snapshot, not what it held before.

The router's link to each prefill runs through a ``FaultProxy``, so a test can cut it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import trio

from pdtrio.config import InstanceConfig, PdtrioConfig, RouterConfig
from pdtrio.faults import FaultProxy
from pdtrio.protocol.sampling import SamplingParams
from pdtrio.router.app import RouterApp
from pdtrio.testing import LOOPBACK
from pdtrio.worker.server import Worker
from tests.cluster import (
    Cluster,
    serve_app,
    synthetic_worker,
    wait_for_answer,
    wait_until_idle,
)

LIVENESS_S = 20.0  # bounds a hung test, measures nothing
BLOCK = 16  # the engines' block size (EngineConfig's default)
PREFILL_BLOCKS = 64
# least_loaded: ties take turns, so without the cache in the pick a conversation's turns
# would alternate between the two prefills
ROUTER = RouterConfig(link_timeout_s=0.5, link_heartbeat_s=0.1, prefill_policy="least_loaded")


@attrs.define
class Prefills:
    cluster: Cluster  # its workers: the two prefills, then the decode
    proxies: list[FaultProxy]  # the router's link to each prefill, in order

    @property
    def url(self) -> str:
        return self.cluster.url

    @property
    def workers(self) -> list[Worker]:
        return self.cluster.workers

    def prefilled_on(self) -> list[int]:
        """Which prefills computed any prompt token so far."""
        return [
            index
            for index, worker in enumerate(self.workers[:2])
            if worker.engine.statistics().prefix_cache_miss_tokens
        ]


@asynccontextmanager
async def two_prefills() -> AsyncIterator[Prefills]:
    workers = [
        synthetic_worker("prefill", prefix_cache=True, num_kv_blocks=PREFILL_BLOCKS),
        synthetic_worker("prefill", prefix_cache=True, num_kv_blocks=PREFILL_BLOCKS),
        synthetic_worker("decode"),
    ]
    async with trio.open_nursery() as nursery:
        ready = [await nursery.start(worker.run) for worker in workers]
        proxies = []
        instances = []
        for prefill in ready[:2]:
            proxy = FaultProxy(LOOPBACK, 0, LOOPBACK, prefill["http_port"])
            port = await nursery.start(proxy.run)
            proxies.append(proxy)
            instances.append(InstanceConfig(role="prefill", url=f"http://{LOOPBACK}:{port}"))
        instances.append(InstanceConfig(role="decode", url=ready[2]["url"]))
        app = RouterApp(PdtrioConfig(router=ROUTER, instances=tuple(instances)))
        url = await serve_app(app, nursery)
        await wait_for_prefills(url, 2)
        yield Prefills(Cluster(url=url, workers=workers, router_app=app), proxies)
        nursery.cancel_scope.cancel()


async def wait_for_prefills(url: str, count: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=LIVENESS_S) as http:
        await wait_for_answer(
            lambda: http.get("/health"),
            lambda health: health.json().get("prefill_instances") == count,
            LIVENESS_S,
        )


def shared_tokens(earlier: list[dict[str, str]]) -> int:
    """The tokens a prompt that begins with ``earlier``'s messages finds cached after it:
    the synthetic engine's chat ids are [1, UTF-8 of "<role>content\\n"..., 3], and only
    full blocks are cached."""
    text = "".join(f"<{m['role']}>{m['content']}\n" for m in earlier)
    return (1 + len(text.encode())) // BLOCK * BLOCK


async def turn(http: httpx.AsyncClient, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": "synthetic", "messages": messages, "max_tokens": 4, "temperature": 0}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def next_turn(
    messages: list[dict[str, str]], answer: dict[str, Any], say: str
) -> list[dict[str, str]]:
    reply = answer["choices"][0]["message"]["content"]
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": say}]


SYSTEM = {"role": "system", "content": "You answer in made-up words, at some length. " * 3}


async def test_a_conversations_turns_go_to_the_prefill_that_holds_its_earlier_turns() -> None:
    with trio.fail_after(LIVENESS_S):
        async with two_prefills() as cluster:
            async with httpx.AsyncClient(base_url=cluster.url, timeout=LIVENESS_S) as http:
                messages = [SYSTEM, {"role": "user", "content": "Tell me about turn one."}]
                answer = await turn(http, messages)
                assert cached(answer) == 0
                for number in range(2, 6):
                    earlier = messages
                    messages = next_turn(messages, answer, f"And now turn {number}?")
                    answer = await turn(http, messages)
                    # all of the earlier turn's full blocks were reused: same prefill
                    assert cached(answer) == shared_tokens(earlier) > 0, number
                assert len(cluster.prefilled_on()) == 1
            await wait_until_idle(cluster.cluster)


async def test_after_a_link_reconnect_the_index_is_the_workers_snapshot_not_stale() -> None:
    with trio.fail_after(LIVENESS_S):
        async with two_prefills() as cluster:
            async with httpx.AsyncClient(base_url=cluster.url, timeout=LIVENESS_S) as http:
                first = [SYSTEM, {"role": "user", "content": "Tell me about turn one."}]
                answer = await turn(http, first)
                second = next_turn(first, answer, "And turn two?")
                answer = await turn(http, second)
                assert cached(answer) == shared_tokens(first)
                (holder,) = cluster.prefilled_on()
                other = 1 - holder

                # the holder's link drops: meanwhile the other prefill gets the first turn
                # again, and the holder's cache loses the conversation to other work
                proxy = cluster.proxies[holder]
                proxy.update(refuse=True)
                proxy.reset_all()
                await wait_for_prefills(cluster.url, 1)
                again = await turn(http, first)
                assert cached(again) == 0  # (the other prefill had none of it)
                await evict_everything(cluster.workers[holder])
                proxy.update(refuse=False)
                await wait_for_prefills(cluster.url, 2)

                # the third turn: a router still believing the holder's old blocks would send
                # it there, to find nothing; the snapshot says the other has the first turn
                third = next_turn(second, answer, "And turn three?")
                answer = await turn(http, third)
                assert cached(answer) == shared_tokens(first) > 0
                assert cluster.workers[other].engine.statistics().prefix_cache_hit_tokens > 0
            await wait_until_idle(cluster.cluster)


async def evict_everything(worker: Worker) -> None:
    """Prefill, on the worker's engine itself, a prompt that needs every KV block: each
    cached block nobody holds is evicted for it (as other routers' traffic would)."""
    filler = [5 + i % 200 for i in range(PREFILL_BLOCKS * BLOCK - 1)]
    result = await worker.engine.prefill("filler", filler, SamplingParams(), max_tokens=1)
    assert result.finish_reason is not None  # one token: nothing is held
    worker.engine.free_request("filler")
