"""Clients that go away at any point leave nothing held on any worker."""

from __future__ import annotations

import json
import random

import trio

from pdtrio.config import RouterConfig
from tests.cluster import client, raw_post_then_hang_up, running_cluster, wait_until_idle

CHAT = "/v1/chat/completions"


def _long_story(max_tokens: int) -> bytes:
    return json.dumps(
        {
            "model": "synthetic",
            "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()


async def test_random_disconnects_free_every_block() -> None:
    rng = random.Random(1234)
    async with running_cluster(decode_step_s=0.002, prefill_s_per_token=0.0005) as cluster:
        async with trio.open_nursery() as nursery:
            for _ in range(24):
                # a fresh connection each: closing it is what the server sees
                async def one(cut: int = rng.randint(0, 40)) -> None:
                    await raw_post_then_hang_up(cluster.url, CHAT, _long_story(200), events=cut)

                nursery.start_soon(one)
        await wait_until_idle(cluster)
        stats = cluster.stats()
        assert all(s["kv_blocks_in_use"] == 0 for s in stats), stats
        assert all(s["kv_leases"] == 0 for s in stats), stats


async def test_disconnect_during_prefill_frees_prefill_blocks() -> None:
    async with running_cluster(prefill_s_per_token=0.02) as cluster:
        body = json.dumps({"model": "synthetic", "prompt": "p" * 100, "max_tokens": 5}).encode()
        with trio.move_on_after(0.3):
            await raw_post_then_hang_up(cluster.url, "/v1/completions", body, events=1)
        await wait_until_idle(cluster)
        prefill = cluster.stats()[0]
        assert prefill["served_prefills"] == 0
        assert prefill["kv_blocks_in_use"] == 0


async def test_deadline_ends_request_with_error_and_frees_blocks() -> None:
    router = RouterConfig(request_timeout_s=0.5)
    async with running_cluster(router=router, decode_step_s=0.05) as cluster:
        async with client(cluster) as http:
            response = await http.post(
                CHAT,
                json={
                    "model": "synthetic",
                    "messages": [{"role": "user", "content": "slow"}],
                    "max_tokens": 100,
                    "stream": True,
                },
            )
        events = [e for e in response.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert '"error"' in events[-2] and "did not complete" in events[-2]
        await wait_until_idle(cluster)


async def test_decode_without_room_answers_503_and_leaks_nothing() -> None:
    def make(role: str):
        from tests.cluster import synthetic_worker

        return synthetic_worker(role, num_kv_blocks=4096 if role == "prefill" else 2)

    async with running_cluster(make_worker=make) as cluster:
        async with client(cluster) as http:
            response = await http.post(
                "/v1/completions", json={"model": "synthetic", "prompt": "x" * 40, "max_tokens": 50}
            )
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "service_unavailable"
        await wait_until_idle(cluster)
