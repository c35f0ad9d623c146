"""What the router reads of the engines it fronts, and when: /health every second, to
find one that went down; /metrics only while placement wants loads (a pick lately, or an
engine whose last load showed work), so an idle router does little more than wait.

Against in-process fakes of vLLM's HTTP contract (tests/router/fake_vllm.py).
"""

from __future__ import annotations

import httpx
import trio

from tests.router.fake_vllm import MODEL, FakeVllm
from tests.router.test_vllm_front import fronted


async def _complete(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
        )
        assert response.status_code == 200


async def _quiet_metrics(engines: list[FakeVllm], window_s: float) -> None:
    """Until ``window_s`` went by with no /metrics read of ``engines``, /health read on
    each more than once meanwhile."""
    while True:
        metrics = [engine.reads["/metrics"] for engine in engines]
        health = [engine.reads["/health"] for engine in engines]
        await trio.sleep(window_s)
        if [engine.reads["/metrics"] for engine in engines] == metrics and all(
            engine.reads["/health"] >= before + 2
            for engine, before in zip(engines, health, strict=True)
        ):
            return


async def test_an_idle_router_reads_health_but_not_loads() -> None:
    async with fronted() as (url, [prefill], [decode], _):
        await _complete(url)
        engines = [prefill, decode]
        with trio.fail_after(30):  # liveness bound: the loads' reads stop once idle
            await _quiet_metrics(engines, window_s=2.5)
        # a request after the quiet spell: the loads are read again
        before = [engine.reads["/metrics"] for engine in engines]
        await _complete(url)
        with trio.fail_after(10):
            while True:
                now = [engine.reads["/metrics"] for engine in engines]
                if all(read > was for read, was in zip(now, before, strict=True)):
                    break
                await trio.sleep(0.05)


async def test_an_engine_that_goes_down_while_idle_is_found_by_its_health() -> None:
    async with fronted(decodes=2) as (url, _, [decode, other], _):
        await _complete(url)
        with trio.fail_after(30):
            await _quiet_metrics([decode, other], window_s=2.5)
        decode.health_status = 503
        async with httpx.AsyncClient(base_url=url) as client:
            with trio.fail_after(10):  # liveness bound: health is read every second
                while True:
                    engines = (await client.get("/health")).json()["engines"]
                    down = [e for e in engines if not e["healthy"]]
                    if down:
                        break
                    await trio.sleep(0.05)
        assert [e["url"] for e in down] == [decode.url]
