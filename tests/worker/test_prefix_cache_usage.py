"""The prefix cache through the real HTTP path: a chat's second turn reports the tokens its
prefill reused as ``prompt_tokens_details.cached_tokens``, disaggregated and colocated."""

from __future__ import annotations

import httpx
import openai
import pytest
import trio

from tests.cluster import running_cluster, wait_until_idle
from tests.metrics import value

SYSTEM = "You answer in made-up words. " * 6
FIRST = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say something."}]
SECOND = [
    *FIRST,
    {"role": "assistant", "content": "t1 t2 t3"},
    {"role": "user", "content": "Say more."},
]
BLOCK = 16  # the cluster's engines' block size (EngineConfig's default)


def shared_prefix_tokens() -> int:
    """The synthetic engine's chat ids are [1, UTF-8 bytes of "<role>content\\n"..., 3]: the
    two turns share the 1 and the first turn's messages."""
    text = "".join(f"<{m['role']}>{m['content']}\n" for m in FIRST)
    return 1 + len(text.encode())


@pytest.mark.parametrize("roles", [("prefill", "decode"), ("both",)])
async def test_a_second_turn_reports_the_cached_tokens(roles: tuple[str, ...]) -> None:
    cached = shared_prefix_tokens() // BLOCK * BLOCK
    async with running_cluster(roles=roles, prefix_cache=True, decode_step_s=0.001) as cluster:
        api = openai.OpenAI(
            base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=30
        )

        def turns() -> list[object]:
            first = api.chat.completions.create(model="synthetic", messages=FIRST, max_tokens=4)
            second = api.chat.completions.create(model="synthetic", messages=SECOND, max_tokens=4)
            streamed = list(
                api.chat.completions.create(
                    model="synthetic",
                    messages=SECOND,
                    max_tokens=4,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            return [first.usage, second.usage, streamed[-1].usage]

        first, second, streamed = await trio.to_thread.run_sync(turns)
        await wait_until_idle(cluster)
        prefill = cluster.workers[0]
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"http://127.0.0.1:{prefill.http_port}/metrics")).text
    assert first.prompt_tokens_details.cached_tokens == 0  # type: ignore[attr-defined]
    assert second.prompt_tokens_details.cached_tokens == cached  # type: ignore[attr-defined]
    # the same prompt again: everything but its last block, which is computed for its logits
    prompt_tokens = second.prompt_tokens  # type: ignore[attr-defined]
    again = (prompt_tokens - 1) // BLOCK * BLOCK
    assert streamed.prompt_tokens_details.cached_tokens == again  # type: ignore[attr-defined]
    statistics = prefill.engine.statistics()
    assert statistics.prefix_cache_hit_tokens == cached + again
    assert statistics.kv_blocks_in_use == 0 and statistics.prefix_cache_blocks > 0
    assert value(metrics, "pdtrio_engine_prefix_cache_hit_tokens_total") == cached + again
    assert value(metrics, "pdtrio_engine_prefix_cache_miss_tokens_total") == (
        first.prompt_tokens + 2 * prompt_tokens - cached - again  # type: ignore[attr-defined]
    )
    assert value(metrics, "pdtrio_engine_prefix_cache_blocks") == statistics.prefix_cache_blocks
    assert value(metrics, "pdtrio_engine_prefix_cache_evicted_blocks_total") == 0


async def test_a_prompt_decode_holds_whole_moves_no_kv_and_prefill_still_gets_its_release() -> None:
    prompt = list(range(10, 10 + 2 * BLOCK))  # two full blocks: nothing partial to pull
    async with running_cluster(prefix_cache=True, decode_step_s=0.001) as cluster:
        prefill, decode = cluster.workers
        async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as http:
            for _ in range(2):
                body = {"model": "synthetic", "prompt": prompt, "max_tokens": 4}
                response = await http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
        # the router released the second prefill's lease as ever (at decode's first token),
        # though decode pulled none of its blocks
        await wait_until_idle(cluster)
        assert len(prefill.leases) == 0 and prefill.engine.statistics().kv_blocks_in_use == 0
        assert sum(decode.transport.info()["pulls"].values()) == 1  # the first time only
        statistics = decode.engine.statistics()
        assert statistics.prefix_cache_decode_reused_blocks == 2
        assert statistics.prefix_cache_decode_pulled_blocks == 2


async def test_choices_of_a_later_turn_share_the_blocks_decode_reused() -> None:
    first = list(range(10, 10 + 2 * BLOCK + 3))
    second = [*first, 7, 8, 9]  # first's two full blocks and more
    async with running_cluster(prefix_cache=True, decode_step_s=0.001) as cluster:
        decode = cluster.workers[1]
        async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as http:
            for prompt, n in ((first, 1), (second, 2)):
                body = {"model": "synthetic", "prompt": prompt, "max_tokens": 4, "n": n}
                response = await http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                # (the synthetic engine checks each choice's blocks hold the prompt's KV)
                assert len(response.json()["choices"]) == n
        await wait_until_idle(cluster)
        statistics = decode.engine.statistics()
        assert statistics.prefix_cache_decode_reused_blocks == 2
        assert statistics.prefix_cache_decode_pulled_blocks == 3 + 1
