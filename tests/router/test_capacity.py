"""A busy decode makes requests wait (or refuses them up front), never 200-then-error."""

from __future__ import annotations

import httpx
import trio

from pdtrio.config import RouterConfig
from pdtrio.engine.budget import token_budget
from pdtrio.worker.server import Worker
from tests.cluster import Cluster, client, running_cluster, synthetic_worker, wait_until_idle

# a 3-token prompt plus the default budget capped by the context: 256 tokens = 16 blocks,
# so 128 blocks hold 8 default requests at once
_SMALL = {
    "max_model_len": 256,
    "num_kv_blocks": 128,
    "tokens_per_step": 8,
    "decode_step_s": 0.002,
}


def _small_worker(role: str) -> Worker:
    return synthetic_worker(role, **_SMALL)


async def _offer(cluster: Cluster, count: int) -> list[httpx.Response]:
    responses: list[httpx.Response] = []
    limits = httpx.Limits(max_connections=count + 8, max_keepalive_connections=count + 8)
    async with client(cluster, limits=limits, timeout=60) as http:

        async def one() -> None:
            body = {"model": "synthetic", "prompt": "hi", "stream": True}
            responses.append(await http.post("/v1/completions", json=body))

        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(one)
    return responses


def _complete(response: httpx.Response) -> bool:
    text = response.text
    return (
        response.status_code == 200
        and '"error"' not in text
        and '"finish_reason":"length"' in text.replace(" ", "")
        and text.endswith("data: [DONE]\n\n")
    )


def test_an_unset_max_tokens_is_the_default_not_the_context() -> None:
    assert token_budget(10, None, max_model_len=100_000, kv_capacity_tokens=10**6) == 2048
    assert token_budget(10, None, max_model_len=100, kv_capacity_tokens=1000) == 90
    assert (
        token_budget(10, None, max_model_len=9000, kv_capacity_tokens=10**6, default_max_tokens=7)
        == 7
    )


async def test_excess_requests_wait_for_decode_room() -> None:
    async with running_cluster(make_worker=_small_worker) as cluster:
        responses = await _offer(cluster, 64)
        assert len(responses) == 64
        bad = [r for r in responses if not _complete(r)]
        assert not bad, (len(bad), bad[0].status_code, bad[0].text[-300:])
        await wait_until_idle(cluster)
        assert cluster.blocks_in_use() == 0


async def test_a_full_queue_answers_429_up_front() -> None:
    router = RouterConfig(admission_queue_limit=16)
    async with running_cluster(make_worker=_small_worker, router=router) as cluster:
        responses = await _offer(cluster, 100)
        complete = [r for r in responses if _complete(r)]
        refused = [r for r in responses if r.status_code == 429]
        assert len(complete) + len(refused) == 100, [
            (r.status_code, r.text[-200:]) for r in responses if r not in complete + refused
        ][:3]
        assert len(complete) >= 8 + 16 and refused
        for response in refused:
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == "queue_full"
        await wait_until_idle(cluster)
        assert cluster.blocks_in_use() == 0


async def test_a_request_no_decode_can_hold_is_a_400_before_any_byte() -> None:
    def make(role: str) -> Worker:
        # prefill could hold it; decode never can (128 blocks of 16 tokens)
        blocks = 128 if role == "decode" else 1024
        return synthetic_worker(role, num_kv_blocks=blocks, max_model_len=8192)

    async with running_cluster(make_worker=make) as cluster:
        async with client(cluster) as http:
            response = await http.post(
                "/v1/completions",
                json={"model": "synthetic", "prompt": "hi", "max_tokens": 4000, "stream": True},
            )
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "max_tokens"
            assert error["code"] == "context_length_exceeded"
            # a request that fits still runs
            ok = await http.post(
                "/v1/completions", json={"model": "synthetic", "prompt": "hi", "max_tokens": 50}
            )
            assert ok.status_code == 200
        await wait_until_idle(cluster)
        assert cluster.blocks_in_use() == 0
