"""Conditional disaggregation through the real router: with
``router.local_prefill_max_tokens`` set, a request missing little of its prompt from the
prefix cache of the decode it would go to is prefilled on that decode (no prefill hop,
no KV transfer); one missing more goes through a prefill instance as before.  The
decision is counted in ``/metrics`` and named in the access line.

Synthetic engines (their chat tokens are the UTF-8 bytes of the messages, so a prompt's
token count is about its length in characters), prefix caches on everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio

from pdtrio.config import InstanceConfig, PdtrioConfig, RouterConfig
from pdtrio.router.app import RouterApp
from tests.cluster import Cluster, serve_app, synthetic_worker, wait_for_answer, wait_until_idle

# a chat turn (synthetic, 4 tokens, greedy) and the next turn's messages, as there
from tests.router.test_cache_aware_routing import next_turn, turn

LIVENESS_S = 20.0  # bounds a hung test, measures nothing
THRESHOLD = 64  # tokens missing from decode's cache at most, for a local prefill


@asynccontextmanager
async def cluster_of(roles: list[str], **router: Any) -> AsyncIterator[Cluster]:
    """Workers of ``roles`` (synthetic, prefix caches on) behind a router of ``router``."""
    workers = [synthetic_worker(role, prefix_cache=True) for role in roles]
    async with trio.open_nursery() as nursery:
        ready = [await nursery.start(worker.run) for worker in workers]
        instances = tuple(
            InstanceConfig(role=role, url=info["url"])  # type: ignore[arg-type]
            for role, info in zip(roles, ready, strict=True)
        )
        config = RouterConfig(link_timeout_s=5.0, link_heartbeat_s=0.5, **router)
        app = RouterApp(PdtrioConfig(router=config, instances=instances))
        url = await serve_app(app, nursery)
        async with httpx.AsyncClient(base_url=url, timeout=LIVENESS_S) as http:
            # every decode linked and its KV room reported (a decode that has not said is
            # no candidate for a local prefill)
            await wait_for_answer(
                lambda: http.get("/metrics"),
                lambda metrics: (
                    metrics.text.count("pdtrio_instance_kv_free_blocks{") == roles.count("decode")
                ),
                LIVENESS_S,
            )
        yield Cluster(url=url, workers=workers, router_app=app)
        nursery.cancel_scope.cancel()


def computed(cluster: Cluster, index: int) -> int:
    """Prompt tokens worker ``index`` computed so far (looked up, not found cached)."""
    return cluster.workers[index].engine.statistics().prefix_cache_miss_tokens


def placements(metrics: str) -> dict[str, float]:
    found = {}
    for line in metrics.splitlines():
        if line.startswith("pdtrio_prefill_placements_total{"):
            where = line.split('where="', 1)[1].split('"', 1)[0]
            found[where] = float(line.rsplit(" ", 1)[1])
    return found


def gauge(metrics: str, name: str, instance: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + "{") and f'instance="{instance}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} for {instance}")


LONG = [{"role": "user", "content": "Tell me everything about a long topic, please. " * 10}]
SHORT = [{"role": "system", "content": "Be brief. " * 4}, {"role": "user", "content": "Hi?"}]


async def test_little_missing_from_decode_prefills_there_much_goes_through_prefill(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pdtrio.access")
    with trio.fail_after(LIVENESS_S):
        async with cluster_of(["prefill", "decode"], local_prefill_max_tokens=THRESHOLD) as c:
            async with httpx.AsyncClient(base_url=c.url, timeout=LIVENESS_S) as http:
                # ~480 tokens, none cached anywhere: the prefill instance computes them
                long_answer = await turn(http, LONG)
                assert long_answer["choices"][0]["finish_reason"] == "length"
                assert computed(c, 0) > 400 and computed(c, 1) == 0

                # ~60 tokens: decode prefills them itself (the prefill instance idle)
                before = computed(c, 0)
                first = await turn(http, SHORT)
                assert computed(c, 0) == before and computed(c, 1) > 0
                assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

                # the conversation's next turn: its earlier turn is in decode's cache, the
                # rest is short: decode again, reusing what it has
                answer = await turn(http, next_turn(SHORT, first, "More?"))
                assert computed(c, 0) == before
                assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                assert answer["usage"]["completion_tokens"] == 4

                # the long conversation's next turn: decode kept the blocks it pulled for
                # the first, so only the reply and the new message are missing there
                answer = await turn(http, next_turn(LONG, long_answer, "Go on."))
                assert computed(c, 0) == before
                assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 400

                metrics = (await http.get("/metrics")).text
                assert placements(metrics) == {"remote": 1.0, "local": 3.0}
                assert f"pdtrio_local_prefill_max_tokens {float(THRESHOLD)}" in metrics
                name = "pdtrio_ttft_by_prefill_placement_seconds_count"
                assert f'{name}{{where="remote"}} 1.0' in metrics
                assert f'{name}{{where="local"}} 3.0' in metrics
                decode = c.workers[1].instance_id
                assert gauge(metrics, "pdtrio_instance_cached_blocks", decode) > 0
            await wait_until_idle(c)
    access = [r.getMessage() for r in caplog.records if r.name == "pdtrio.access"]
    assert [line.split("prefill_at=", 1)[1] for line in access] == ["remote"] + ["local"] * 3


async def test_off_by_default_every_prompt_goes_through_a_prefill_instance() -> None:
    with trio.fail_after(LIVENESS_S):
        async with cluster_of(["prefill", "decode"]) as c:
            async with httpx.AsyncClient(base_url=c.url, timeout=LIVENESS_S) as http:
                first = await turn(http, SHORT)
                await turn(http, next_turn(SHORT, first, "More?"))
                assert computed(c, 1) == 0 and computed(c, 0) > 0
                assert placements((await http.get("/metrics")).text) == {
                    "remote": 2.0,
                    "local": 0.0,
                }
            await wait_until_idle(c)


def reused_on_decode(cluster: Cluster, index: int) -> int:
    """Prompt blocks decode ``index`` found cached for a prompt prefilled elsewhere."""
    return cluster.workers[index].engine.statistics().prefix_cache_decode_reused_blocks


async def test_without_local_prefill_a_conversation_is_decoded_where_its_prefix_is() -> None:
    """Two decodes in turn by policy: the cache-aware pick sends each later turn to the
    decode holding the earlier ones, which pulls only the new blocks (with
    ``decode_cache_weight = 0`` the turns alternate, and both decodes reuse some)."""
    with trio.fail_after(LIVENESS_S):
        async with cluster_of(["prefill", "decode", "decode"], decode_policy="round_robin") as c:
            async with httpx.AsyncClient(base_url=c.url, timeout=LIVENESS_S) as http:
                answer = await turn(http, LONG)
                messages = LONG
                for number in range(2, 5):
                    messages = next_turn(messages, answer, f"Turn {number}?")
                    answer = await turn(http, messages)
                reused = [reused_on_decode(c, 1), reused_on_decode(c, 2)]
                assert sorted(reused)[0] == 0 and sorted(reused)[1] >= 3 * 25, reused
            await wait_until_idle(c)


async def test_a_conversation_stays_on_the_decode_that_holds_it() -> None:
    """Two decodes: each conversation's turns are prefilled and decoded where its earlier
    turns are cached (the cache-aware pick among decodes), though load would alternate."""
    with trio.fail_after(LIVENESS_S):
        async with cluster_of(
            ["prefill", "decode", "decode"],
            local_prefill_max_tokens=THRESHOLD,
            decode_policy="round_robin",
        ) as c:
            async with httpx.AsyncClient(base_url=c.url, timeout=LIVENESS_S) as http:
                first = await turn(http, SHORT)
                holder = 1 if computed(c, 1) else 2
                messages = SHORT
                answer = first
                for number in range(2, 5):
                    messages = next_turn(messages, answer, f"Turn {number}?")
                    answer = await turn(http, messages)
                    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                assert computed(c, 3 - holder) == 0  # the other decode prefilled nothing
                assert computed(c, 0) == 0
            await wait_until_idle(c)
