"""A worker's /metrics: its engine's steps, its KV cache, its KV pulls by transport."""

from __future__ import annotations

import httpx

from tests.cluster import client, running_cluster, wait_until_idle
from tests.metrics import by_labels, value


async def test_worker_metrics_after_a_request() -> None:
    async with running_cluster(decode_step_s=0.001) as cluster:
        async with client(cluster) as http:
            response = await http.post(
                "/v1/completions",
                json={"model": "synthetic", "prompt": "a prompt of some length", "max_tokens": 8},
            )
            assert response.status_code == 200
        await wait_until_idle(cluster)
        texts = {}
        async with httpx.AsyncClient() as http:
            for worker in cluster.workers:
                answer = await http.get(f"http://127.0.0.1:{worker.http_port}/metrics")
                assert answer.status_code == 200
                assert answer.headers["content-type"].startswith("text/plain")
                texts[worker.config.role] = answer.text
            wrong = await http.post(f"http://127.0.0.1:{worker.http_port}/metrics")
            assert wrong.status_code == 405
    decode = texts["decode"]
    # the decode steps: 7 tokens after prefill's first, one request a step
    assert value(decode, "pdtrio_engine_step_seconds_count") >= 1
    assert value(decode, "pdtrio_engine_batch_size_count") >= 1
    assert value(decode, "pdtrio_engine_batch_size_sum") == value(
        decode, "pdtrio_engine_batch_size_count"
    )
    assert value(decode, "pdtrio_engine_generated_tokens_total") == 7
    # all done: every block free again, nothing waiting
    total = cluster.workers[1].engine.statistics().kv_blocks_total
    assert value(decode, "pdtrio_engine_kv_blocks_used") == 0
    assert value(decode, "pdtrio_engine_kv_blocks_free") == total
    assert value(decode, "pdtrio_engine_queue_length") == 0
    # decode pulled the prompt's KV from prefill once, by whichever transport it chose
    pulls = by_labels(decode, "pdtrio_kv_transfers_total", "transport")
    assert len(pulls) == 1 and sum(pulls.values()) == 1
    [(transport,)] = pulls
    assert transport in ("tcp", "nixl")
    layout = cluster.workers[1].engine.layout
    pulled = value(decode, "pdtrio_kv_transfer_bytes_total", transport=transport)
    assert pulled > 0 and pulled % layout.block_nbytes == 0
    assert value(decode, "pdtrio_kv_transfer_seconds_total", transport=transport) > 0
    # prefill pulls nothing; its steps are not decode steps
    assert value(texts["prefill"], "pdtrio_kv_transfer_bytes_total") == 0
