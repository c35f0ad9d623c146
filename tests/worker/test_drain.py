"""A draining worker refuses new work (routers send it elsewhere) and finishes what it runs."""

from __future__ import annotations

from typing import Any

import httpx
import trio

from pdtrio.protocol.link.wire import DRAINING_ERROR_TYPE, PrefillFailed, PrefillRequest, TextPrompt
from pdtrio.protocol.sampling import SamplingParams
from tests.cluster import client, running_cluster, wait_for_stats, wait_until_idle


async def _stream(http: httpx.AsyncClient, max_tokens: int, into: list[str]) -> None:
    body = {"model": "synthetic", "prompt": "hi", "max_tokens": max_tokens, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        into.append((await response.aread()).decode())


def _pulls(worker: Any) -> int:
    """KV pulls the (decode) worker completed: one a decode it started, whenever it ended."""
    return sum(worker.transport.info().get("pulls", {}).values())


async def test_a_draining_decode_finishes_its_streams_and_takes_no_new_ones() -> None:
    async with running_cluster(roles=("prefill", "decode", "decode")) as cluster:
        _, first, second = cluster.workers
        long_answers: list[str] = []
        async with client(cluster) as http, trio.open_nursery() as nursery:
            nursery.start_soon(_stream, http, 300, long_answers)
            # pulled, not only received: a start received just before the drain began is
            # refused by it (the router then places the request on the other decode)
            await wait_for_stats(lambda: any(_pulls(w) for w in (first, second)))
            busy, other = (first, second) if _pulls(first) else (second, first)
            drained: list[bool] = []

            async def drain() -> None:
                drained.append(await busy.drain(30.0))

            nursery.start_soon(drain)
            await wait_for_stats(lambda: busy.draining)
            short_answers: list[str] = []
            for _ in range(4):
                await _stream(http, 4, short_answers)
            assert all("data: [DONE]" in a and '"error"' not in a for a in short_answers)
            # counted, not looked at while running: the long one may end before the
            # short ones do on a starved machine
            assert (_pulls(busy), _pulls(other)) == (1, 4)
            assert other.link_server is not None and other.link_server.link_count == 1
        assert drained == [True]
        assert "data: [DONE]" in long_answers[0] and '"error"' not in long_answers[0]
        assert long_answers[0].count('"text"') > 1
        await wait_until_idle(cluster)


async def test_a_draining_prefill_refuses_with_its_own_error_type_and_routers_go_elsewhere() -> (
    None
):
    async with running_cluster(roles=("prefill", "prefill", "decode")) as cluster:
        stopping, staying, _ = cluster.workers
        stopping.begin_drain()
        answer = await stopping.prefill.prefill_call(
            PrefillRequest("direct-1", TextPrompt("hi"), SamplingParams(), 4)
        )
        assert isinstance(answer, PrefillFailed) and answer.status == 503
        assert answer.error_type == DRAINING_ERROR_TYPE
        async with client(cluster) as http:
            for _ in range(4):
                response = await http.post(
                    "/v1/completions", json={"model": "synthetic", "prompt": "hi", "max_tokens": 4}
                )
                assert response.status_code == 200, response.text
        assert staying.prefill.served_prefills == 4 and stopping.prefill.served_prefills == 0
        assert await stopping.drain(1.0)
        await wait_until_idle(cluster)
