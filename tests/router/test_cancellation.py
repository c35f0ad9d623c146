"""Clients that go away at any point leave nothing held on any worker."""

from __future__ import annotations

import json
import random

import httpx
import trio

from pdtrio.config import RouterConfig
from tests.cluster import (
    client,
    raw_post_then_hang_up,
    running_cluster,
    wait_for_answer,
    wait_until_idle,
    worker_backend,
)

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


async def test_prefills_timeout_bounds_prefill_only_not_the_decode_after_it() -> None:
    # prefill's timeout narrows the request's deadline while prefill runs: once it answered,
    # the stream may last well past that timeout
    router = RouterConfig(prefill_timeout_s=0.3, request_timeout_s=30)
    async with running_cluster(router=router, decode_step_s=0.05) as cluster:
        async with client(cluster) as http:
            response = await http.post(CHAT, content=_long_story(16))
        assert response.status_code == 200
        events = [e for e in response.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert '"error"' not in response.text
        assert '"finish_reason":"length"' in events[-2], events[-2]
        await wait_until_idle(cluster)


async def test_decode_that_can_never_hold_it_answers_400_and_leaks_nothing() -> None:
    def make(role: str):
        from tests.cluster import synthetic_worker

        return synthetic_worker(role, num_kv_blocks=4096 if role == "prefill" else 2)

    async with running_cluster(make_worker=make) as cluster:
        async with client(cluster) as http:
            response = await http.post(
                "/v1/completions", json={"model": "synthetic", "prompt": "x" * 40, "max_tokens": 50}
            )
        # refused up front (decode's reported total is too small), not after the first token
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"
        await wait_until_idle(cluster)


async def test_a_dead_prefill_is_skipped_and_taken_back_when_it_returns() -> None:
    import attrs

    from pdtrio.config import InstanceConfig, PdtrioConfig
    from pdtrio.router.app import RouterApp
    from pdtrio.worker.server import Worker
    from tests.cluster import serve_app, synthetic_worker

    async with trio.open_nursery() as nursery:
        decode = synthetic_worker("decode")
        decode_port = (await nursery.start(decode.run))["http_port"]
        steady = synthetic_worker("prefill")
        steady_port = (await nursery.start(steady.run))["http_port"]
        flaky_scope = trio.CancelScope()
        flaky = synthetic_worker("prefill")

        async def run_flaky(worker: Worker, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
            with flaky_scope:
                await worker.run(task_status=task_status)

        flaky_port = (await nursery.start(run_flaky, flaky))["http_port"]
        app = RouterApp(
            PdtrioConfig(
                instances=(
                    InstanceConfig(role="prefill", url=f"http://127.0.0.1:{steady_port}"),
                    InstanceConfig(role="prefill", url=f"http://127.0.0.1:{flaky_port}"),
                    InstanceConfig(role="decode", url=f"http://127.0.0.1:{decode_port}"),
                )
            )
        )
        url = await serve_app(app, nursery)
        flaky_scope.cancel()  # one prefill instance goes away
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            body = {"model": "synthetic", "prompt": "still served", "max_tokens": 3}
            for _ in range(6):
                response = await http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
            assert (await http.get("/health")).json()["prefill_instances"] == 1
            # it comes back on the same address; the router takes it back
            back = Worker(attrs.evolve(flaky.config, port=flaky_port), flaky.engine)
            await nursery.start(back.run)
            await wait_for_answer(
                lambda: http.get("/health"),
                lambda health: health.json()["prefill_instances"] == 2,
                30,
            )
            # it failed a request when it went: back in rotation once its backoff (1 s) ends
            assert app.router is not None
            await trio.sleep_until(
                worker_backend(app.router).instances[back.instance_id].suspended_until
            )
            with trio.fail_after(30):
                while not back.prefill.served_prefills:
                    assert (await http.post("/v1/completions", json=body)).status_code == 200
        nursery.cancel_scope.cancel()
