"""A decode instance that fails streams leaves rotation for a while, like a failing prefill."""

from __future__ import annotations

import trio

from pdtrio.config import RouterConfig
from tests.cluster import client, running_cluster, wait_until_idle, worker_backend

BODY = {"model": "synthetic", "prompt": "hi", "max_tokens": 3}


async def test_a_failing_decode_is_suspended_then_probed_again() -> None:
    # a backoff far longer than four requests take on a starved machine (0.5 s was not)
    router_config = RouterConfig(instance_backoff_s=60.0, decode_policy="round_robin")
    async with running_cluster(
        roles=("prefill", "decode", "decode"), router=router_config
    ) as cluster:
        _, first, _ = cluster.workers
        router = cluster.router_app.router
        assert router is not None
        workers = worker_backend(router)
        failing = workers.instances[first.instance_id]
        assert failing.link is not None
        workers.instances.instance_failed(
            failing, trio.current_time()
        )  # as a stream failing on it does
        frames_before = failing.link.statistics().frames_received
        async with client(cluster) as http:
            for _ in range(4):
                assert (await http.post("/v1/completions", json=BODY)).status_code == 200
            assert (
                failing.link.statistics().frames_received == frames_before
            )  # all went to the other
            # once its backoff is over it is probed, and served again; the backoff ends
            # here as the clock would end it (the table reads it against time passed in)
            assert failing.suspended_until > trio.current_time()
            failing.suspended_until = trio.current_time()
            for _ in range(4):
                assert (await http.post("/v1/completions", json=BODY)).status_code == 200
        assert failing.link.statistics().frames_received > frames_before
        assert failing.failures_in_a_row == 0 and failing.suspended_until == 0.0
        await wait_until_idle(cluster)
