"""Cache-aware placement in front of vLLM and SGLang instances: engines report no cached
blocks, so the router's approximate prefix index (what it sent where) sends a
conversation's next turn to the prefill and the decode that served its earlier ones."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

from pdtrio.config import InstanceConfig, PdtrioConfig, RouterConfig
from pdtrio.protocol.link.wire import ChatPrompt
from pdtrio.router.app import RouterApp
from pdtrio.router.engines.pool import EnginePool
from tests.cluster import serve_app, wait_for_stats
from tests.router.fake_sglang import FakeSglang
from tests.router.fake_vllm import MODEL, FakeVllm
from tests.router.test_vllm_front import fronted


def _router(**settings: Any) -> RouterConfig:
    # (no egress spacing, a failed instance out of rotation for the test's length)
    return RouterConfig(instance_backoff_s=60.0, egress_max_delay_s=0.0, **settings)


def _pool(app: RouterApp) -> EnginePool:
    pool = app.router.backend.pool  # type: ignore[union-attr]
    assert pool is not None
    return pool


def _turn(system: str, turns: int) -> list[dict[str, str]]:
    """A conversation's messages at its ``turns``-th user message."""
    messages = [{"role": "system", "content": system}]
    for turn in range(turns):
        if turn:
            messages.append({"role": "assistant", "content": f" answer {turn}"})
        messages.append({"role": "user", "content": f"question {turn + 1} of {system}"})
    return messages


def _served(engines: list[FakeVllm], system: str) -> list[str]:
    """Which of ``engines`` got each leg of ``system``'s conversation, in order of turns."""
    legs = [
        (len(leg["messages"]), engine.name)
        for engine in engines
        for leg in engine.legs()
        if leg["messages"][0]["content"] == system
    ]
    return [name for _, name in sorted(legs)]


async def _ask(client: httpx.AsyncClient, system: str, turns: int) -> None:
    response = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": _turn(system, turns), "max_tokens": 2},
    )
    assert response.status_code == 200, response.text


async def test_a_conversations_turns_stay_on_its_prefill_and_decode_when_load_is_equal() -> None:
    async with fronted(prefills=2, decodes=2, router=_router()) as (url, prefills, decodes, _):
        async with httpx.AsyncClient(base_url=url) as client:
            for turns in (1, 2, 3):
                await _ask(client, "you are a pirate", turns)
            health = (await client.get("/health")).json()
    # least_loaded alone takes turns between equally loaded instances: the cache decides
    for engines in (prefills, decodes):
        served = _served(engines, "you are a pirate")
        assert len(served) == 3 and len(set(served)) == 1, served
    # two legs a turn; a key per message of the longest turn (6), on each of two instances
    assert health["prefix_index"]["recorded"] == 6
    assert health["prefix_index"]["entries"] == 2 * 6


async def test_with_cache_weight_0_the_policy_alone_decides() -> None:
    router = _router(prefill_cache_weight=0.0, decode_cache_weight=0.0)
    async with fronted(prefills=2, decodes=2, router=router) as (url, prefills, decodes, app):
        async with httpx.AsyncClient(base_url=url) as client:
            for turns in (1, 2):
                await _ask(client, "you are a pirate", turns)
        assert _pool(app).prefixes.statistics().recorded == 4  # (known, but not weighed)
    # (least_loaded's turns between equally loaded instances)
    assert sorted(_served(prefills, "you are a pirate")) == ["p0", "p1"]
    assert sorted(_served(decodes, "you are a pirate")) == ["d0", "d1"]


async def test_another_conversation_lands_elsewhere_and_each_keeps_its_own() -> None:
    router = _router(prefill_policy="round_robin", decode_policy="round_robin")
    async with fronted(prefills=2, decodes=2, router=router) as (url, prefills, decodes, _):
        async with httpx.AsyncClient(base_url=url) as client:
            for turns in (1, 2, 3):
                await _ask(client, "you are a pirate", turns)
                await _ask(client, "you are a poet", turns)
    _each_on_its_own(prefills, 3)
    _each_on_its_own(decodes, 3)


def _each_on_its_own(engines: list[Any], turns: int) -> None:
    """Every turn of each conversation on one instance, the two on different ones."""
    [pirates] = set(_served(engines, "you are a pirate"))
    [poets] = set(_served(engines, "you are a poet"))
    assert pirates != poets
    assert len(_served(engines, "you are a pirate")) == len(_served(engines, "you are a poet"))
    assert len(_served(engines, "you are a poet")) == turns


async def test_a_failed_leg_records_nothing_and_a_down_instance_is_forgotten() -> None:
    async with fronted(prefills=2, router=_router()) as (url, prefills, [decode], app):
        pool = _pool(app)
        prefills[0].fail_status = 500
        async with httpx.AsyncClient(base_url=url) as client:
            await _ask(client, "you are a pirate", 1)  # p0 fails it (5xx), p1 serves
        prefills[0].fail_status = 0
        messages = _turn("you are a pirate", 1)
        keys = pool.prefix_keys(ChatPrompt(tuple((m["role"], m["content"]) for m in messages)))
        assert len(keys) == 2
        now = trio.current_time()
        assert pool.prefixes.cached_prefix(prefills[0].url, keys, now) == 0
        assert pool.prefixes.cached_prefix(prefills[1].url, keys, now) == 2
        assert pool.prefixes.cached_prefix(decode.url, keys, now) == 2
        # p1 goes down (a restart, say): what it had cached is unknown from then on
        prefills[1].health_status = 503
        await wait_for_stats(lambda: not pool.instances[prefills[1].url].healthy)
        assert pool.prefixes.cached_prefix(prefills[1].url, keys, trio.current_time()) == 0
        assert pool.prefixes.cached_prefix(decode.url, keys, trio.current_time()) == 2
        # one that leaves the pool (deregistered) likewise
        pool.engine_deregistered(decode.url)
        assert pool.prefixes.cached_prefix(decode.url, keys, trio.current_time()) == 0
        assert pool.prefixes.statistics().entries == 0


@asynccontextmanager
async def sglang_fronted(
    prefills: int, decodes: int, router: RouterConfig
) -> AsyncIterator[tuple[str, list[FakeSglang], list[FakeSglang], RouterApp]]:
    async with trio.open_nursery() as nursery:
        rooms: dict[Any, Any] = {}
        engines = [
            FakeSglang(f"p{i}", {}, rooms=rooms, bootstrap_port=8998 + i) for i in range(prefills)
        ] + [FakeSglang(f"d{i}", {}, rooms=rooms) for i in range(decodes)]
        for engine in engines:
            engine.url = await serve_app(engine, nursery)
        prefill, decode = engines[:prefills], engines[prefills:]
        config = PdtrioConfig(
            router=router,
            instances=tuple(
                InstanceConfig(
                    role="prefill", url=e.url, kind="sglang", bootstrap_port=e.bootstrap_port
                )
                for e in prefill
            )
            + tuple(InstanceConfig(role="decode", url=e.url, kind="sglang") for e in decode),
        )
        app = RouterApp(config)
        url = await serve_app(app, nursery)
        yield url, prefill, decode, app
        nursery.cancel_scope.cancel()


async def test_sglang_a_conversations_turns_stay_on_its_prefill_and_decode() -> None:
    router = _router(prefill_policy="round_robin", decode_policy="round_robin")
    async with sglang_fronted(2, 2, router) as (url, prefills, decodes, app):
        pool = _pool(app)
        async with httpx.AsyncClient(base_url=url) as client:
            for turns in (1, 2):
                for asked, system in enumerate(("you are a pirate", "you are a poet"), 1):
                    await _ask(client, system, turns)
                    # (SGLang's prefill answers after decode's stream: both legs recorded)
                    legs = 2 * (2 * (turns - 1) + asked)
                    await wait_for_stats(lambda: pool.prefixes.statistics().recorded == legs)  # noqa: B023
    _each_on_its_own(list(prefills), 2)
    _each_on_its_own(list(decodes), 2)
