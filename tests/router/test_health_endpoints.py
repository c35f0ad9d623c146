"""Liveness and readiness apart, for orchestrators: the router's and each worker's."""

from __future__ import annotations

import httpx

from pdtrio.config import SecurityConfig
from tests.cluster import running_cluster


async def test_the_router_is_live_and_ready_then_not_ready_while_draining() -> None:
    async with (
        running_cluster() as cluster,
        httpx.AsyncClient(base_url=cluster.url, timeout=10) as http,
    ):
        live = await http.get("/health/live")
        assert live.status_code == 200 and live.json()["status"] == "live"
        ready = await http.get("/health/ready")
        assert ready.status_code == 200, ready.text
        assert ready.json()["status"] == "ready"
        assert (await http.get("/health")).status_code == 200  # as before

        router = cluster.router_app.router
        assert router is not None
        router.requests.draining = True
        ready = await http.get("/health/ready")
        assert ready.status_code == 503
        assert ready.json()["reason"] == "the router is draining: it takes no new requests"
        assert (await http.get("/health/live")).status_code == 200  # alive all the same
        router.requests.draining = False


async def test_the_router_is_not_ready_without_a_decode_and_says_so() -> None:
    async with (
        running_cluster(roles=("prefill",)) as cluster,
        httpx.AsyncClient(base_url=cluster.url, timeout=10) as http,
    ):
        ready = await http.get("/health/ready")
        assert ready.status_code == 503
        assert ready.json()["reason"] == "no decode instance is up"
        assert (await http.get("/health/live")).status_code == 200


async def test_health_paths_stay_open_with_api_keys_unless_protected() -> None:
    async with running_cluster(security=SecurityConfig(api_keys=("k",))) as cluster:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as http:
            for path in ("/health", "/health/live", "/health/ready"):
                assert (await http.get(path)).status_code == 200, path
    protected = SecurityConfig(api_keys=("k",), protect_health=True)
    async with running_cluster(security=protected) as cluster:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as http:
            for path in ("/health", "/health/live", "/health/ready"):
                assert (await http.get(path)).status_code == 401, path


async def test_a_worker_is_live_and_ready_then_not_ready_while_draining() -> None:
    async with running_cluster(security=SecurityConfig(worker_secret="s")) as cluster:
        for worker in cluster.workers:
            url = f"http://127.0.0.1:{worker.http_port}"
            async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                # no secret needed: an orchestrator's probe holds none
                assert (await http.get("/health/live")).json() == {"status": "live"}
                assert (await http.get("/health/ready")).json() == {"status": "ready"}
                worker.begin_drain()
                ready = await http.get("/health/ready")
                assert ready.status_code == 503
                assert ready.json()["reason"] == "the worker is draining: it takes no new requests"
                assert (await http.get("/health/live")).status_code == 200
