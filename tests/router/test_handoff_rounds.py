"""No request lost to a handoff (issue 53), with real workers on loopback.

A handoff whose KV no decode can pull (prefill's KV port refuses every pull) goes again
from a new prefill, the blamed prefill avoided, and the client gets the answer an
undisturbed request gets; a request that finds no prefill waits for one to connect
(``prefill_wait_s``), or is refused at once when the wait is off; a client that leaves
while it waits frees everything.
"""

from __future__ import annotations

import socket
from typing import Any

import attrs
import httpx
import trio

from pdtrio.config import InstanceConfig, PdtrioConfig, RouterConfig
from pdtrio.router.app import RouterApp
from pdtrio.worker.server import Worker
from tests.cluster import (
    running_cluster,
    serve_app,
    synthetic_worker,
    wait_for_answer,
    wait_until_idle,
)
from tests.metrics import value

BODY = {"model": "synthetic", "prompt": "the same answer", "max_tokens": 12, "temperature": 0}


def _refusing_port() -> int:
    """A loopback port nothing listens on: a pull from it is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_a_handoff_refused_by_every_decode_is_served_from_a_new_prefill() -> None:
    dead_kv_port = _refusing_port()
    made: list[str] = []

    def make_worker(role: str) -> Worker:
        made.append(role)
        # the first prefill advertises a KV port that refuses every pull: each decode's
        # pull of its KV fails while its lease lives
        broken = role == "prefill" and made.count("prefill") == 1
        overrides = {"advertise_transfer_port": dead_kv_port} if broken else None
        return synthetic_worker(role, worker_overrides=overrides)

    router = RouterConfig(prefill_policy="round_robin", prefill_wait_s=0.0)
    async with running_cluster(
        roles=("prefill", "prefill", "decode", "decode"), router=router, make_worker=make_worker
    ) as cluster:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as http:
            answers = [await http.post("/v1/completions", json=BODY) for _ in range(4)]
            streamed = await http.post("/v1/completions", json={**BODY, "stream": True})
            metrics = (await http.get("/metrics")).text
        for answer in answers:
            assert answer.status_code == 200, answer.text
        texts = {answer.json()["choices"][0]["text"] for answer in answers}
        assert len(texts) == 1  # every answer the undisturbed one
        finishes = {answer.json()["choices"][0]["finish_reason"] for answer in answers}
        assert finishes == {"length"}
        assert streamed.status_code == 200
        assert "data: [DONE]" in streamed.text and '"error"' not in streamed.text
        # (round robin: half the requests met the broken prefill first)
        assert value(metrics, "pdtrio_migrations_total", reason="handoff_failed") >= 2
        await wait_until_idle(cluster)  # nothing held anywhere, the refused KV released


async def _cluster_whose_prefill_went(
    nursery: trio.Nursery, router: RouterConfig
) -> tuple[str, Worker, int, RouterApp]:
    """A router over a decode and a prefill that has just gone away (its port known)."""
    decode = synthetic_worker("decode")
    decode_port = (await nursery.start(decode.run))["http_port"]
    prefill = synthetic_worker("prefill")
    prefill_scope = trio.CancelScope()

    async def run_prefill(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with prefill_scope:
            await prefill.run(task_status=task_status)

    prefill_port = (await nursery.start(run_prefill))["http_port"]
    app = RouterApp(
        PdtrioConfig(
            router=router,
            instances=(
                InstanceConfig(role="prefill", url=f"http://127.0.0.1:{prefill_port}"),
                InstanceConfig(role="decode", url=f"http://127.0.0.1:{decode_port}"),
            ),
        )
    )
    url = await serve_app(app, nursery)
    prefill_scope.cancel()
    async with httpx.AsyncClient(base_url=url) as http:
        await wait_for_answer(
            lambda: http.get("/health"), lambda health: not health.json()["prefill_instances"], 10
        )
    return url, prefill, prefill_port, app


async def test_a_request_that_finds_no_prefill_waits_for_one_to_start() -> None:
    async with trio.open_nursery() as nursery:
        url, prefill, port, _ = await _cluster_whose_prefill_went(nursery, RouterConfig())

        async def start_prefill_later() -> None:
            await trio.sleep(1.5)
            back = Worker(attrs.evolve(prefill.config, port=port), prefill.engine)
            await nursery.start(back.run)

        nursery.start_soon(start_prefill_later)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            started = trio.current_time()
            answer = await http.post("/v1/completions", json=BODY)
            waited = trio.current_time() - started
        assert answer.status_code == 200, answer.text
        assert 1.0 < waited < 5.0
        nursery.cancel_scope.cancel()


async def test_with_no_prefill_wait_a_request_is_refused_at_once() -> None:
    async with trio.open_nursery() as nursery:
        router = RouterConfig(prefill_wait_s=0.0)
        url, *_ = await _cluster_whose_prefill_went(nursery, router)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            started = trio.current_time()
            answer = await http.post("/v1/completions", json=BODY)
            waited = trio.current_time() - started
        assert answer.status_code == 503
        assert answer.json()["error"]["message"] == "no prefill instance is available"
        assert waited < 1.0
        nursery.cancel_scope.cancel()


async def test_a_client_leaving_while_it_waits_for_a_prefill_frees_everything() -> None:
    async with trio.open_nursery() as nursery:
        router = RouterConfig(prefill_wait_s=60.0)
        url, _, _, app = await _cluster_whose_prefill_went(nursery, router)
        async with httpx.AsyncClient(base_url=url, timeout=0.5) as http:
            try:
                await http.post("/v1/completions", json={**BODY, "stream": True})
                raise AssertionError("answered with no prefill up")
            except httpx.ReadTimeout:
                pass  # the client gives up and closes its connection
        async with httpx.AsyncClient(base_url=url) as http:
            await wait_for_answer(
                lambda: http.get("/health"), lambda health: not health.json()["active_requests"]
            )
            metrics = (await http.get("/metrics")).text
        assert value(metrics, "pdtrio_requests_total", outcome="disconnected") == 1
        nursery.cancel_scope.cancel()
