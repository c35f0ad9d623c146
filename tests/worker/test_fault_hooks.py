"""Fault hooks inside workers (``[faults]``): what the client sees, and that nothing leaks.

In-process clusters; the hooks that exit the process are in tests/e2e/test_worker_faults_e2e.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio

from pdtrio.config import (
    ConfigError,
    RouterConfig,
    WorkerConfig,
    WorkerFaultsConfig,
    config_from_dict,
)
from pdtrio.kv.tcp import TcpKvTransport
from pdtrio.worker.fault_hooks import FaultyKvTransport
from pdtrio.worker.server import Worker
from tests.cluster import (
    Cluster,
    client,
    running_cluster,
    synthetic_worker,
    wait_for_answer,
    wait_until_idle,
)
from tests.metrics import value

# generous: these bound liveness, they do not measure it
LIVENESS_S = 15.0
# a short link timeout, so the link faults show quickly
FAST_LINKS = RouterConfig(link_timeout_s=0.5, link_heartbeat_s=0.1)


def _body(max_tokens: int = 4, *, stream: bool = False) -> dict[str, Any]:
    return {"model": "synthetic", "prompt": "hello", "max_tokens": max_tokens, "stream": stream}


def _faulty(faults: dict[str, WorkerFaultsConfig], **overrides: Any) -> Callable[[str], Worker]:
    """Workers in start order; ``faults`` names, by "role#n" (1-based), the faulty ones."""
    made: dict[str, int] = {}

    def make(role: str) -> Worker:
        made[role] = made.get(role, 0) + 1
        return synthetic_worker(role, faults=faults.get(f"{role}#{made[role]}"), **overrides)

    return make


async def _idle(cluster: Cluster) -> None:
    await wait_until_idle(cluster, LIVENESS_S)
    for stats in cluster.stats():
        assert stats["kv_blocks_in_use"] == 0, stats
        assert stats["running_requests"] == 0, stats
        assert stats["prefills_in_progress"] == 0, stats


async def _health(http: httpx.AsyncClient) -> dict[str, Any]:
    response = await http.get("/health")
    health: dict[str, Any] = response.json()
    return health


async def _wait_health(
    http: httpx.AsyncClient, condition: Callable[[dict[str, Any]], bool]
) -> None:
    await wait_for_answer(lambda: _health(http), condition, LIVENESS_S)


async def _stream_events(http: httpx.AsyncClient, body: dict[str, Any]) -> list[str]:
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        return [line async for line in response.aiter_lines() if line]


# --- configuration -----------------------------------------------------------------


def test_every_hook_is_off_by_default_and_costs_nothing() -> None:
    assert WorkerConfig().faults == WorkerFaultsConfig()
    worker = synthetic_worker("both")
    assert worker.faults is None
    assert not isinstance(worker.transport, FaultyKvTransport)


def test_the_faults_section_is_read_from_the_worker_config(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config: WorkerConfig = config_from_dict(
        {"role": "prefill", "faults": {"prefill_error_status": 500, "heartbeats_off": True}},
        WorkerConfig,
    )
    assert config.faults.prefill_error_status == 500
    with caplog.at_level("WARNING", logger="pdtrio.worker.faults"):
        worker = synthetic_worker("prefill", faults=config.faults)
    assert worker.faults is not None
    assert "fault hooks on: prefill_error_status=500, heartbeats_off=True" in caplog.text
    with pytest.raises(ConfigError, match="faults"):
        config_from_dict({"faults": {"prefill_error_status": 200}}, WorkerConfig)
    with pytest.raises(ConfigError, match="faults"):
        config_from_dict({"faults": {"no_such_hook": True}}, WorkerConfig)


# --- prefill -----------------------------------------------------------------------


async def test_a_prefill_answering_500_is_retried_on_the_other_prefill() -> None:
    faults = {"prefill#1": WorkerFaultsConfig(prefill_error_status=500)}
    async with running_cluster(
        roles=("prefill", "prefill", "decode"), make_worker=_faulty(faults)
    ) as cluster:
        async with client(cluster) as http:
            for _ in range(4):  # round-robin: the faulty one is tried
                response = await http.post("/v1/completions", json=_body())
                assert response.status_code == 200, response.text
        faulty = cluster.workers[0].faults
        assert faulty is not None and faulty.prefills > 0
        await _idle(cluster)


async def test_a_prefill_answering_500_alone_is_the_clients_error() -> None:
    faults = {"prefill#1": WorkerFaultsConfig(prefill_error_status=500)}
    async with running_cluster(make_worker=_faulty(faults)) as cluster:
        async with client(cluster) as http:
            response = await http.post("/v1/completions", json=_body())
        assert response.status_code == 502, response.text
        assert "prefill_error_status=500" in response.json()["error"]["message"]
        await _idle(cluster)


async def test_a_hung_prefill_is_a_504_and_is_released() -> None:
    faults = {"prefill#1": WorkerFaultsConfig(prefill_hang=True)}
    router = RouterConfig(prefill_timeout_s=0.5)
    async with running_cluster(make_worker=_faulty(faults), router=router) as cluster:
        async with client(cluster) as http:
            with trio.fail_after(LIVENESS_S):
                response = await http.post("/v1/completions", json=_body())
        assert response.status_code == 504, response.text
        assert response.json()["error"]["message"] == "prefill did not answer in time"
        await _idle(cluster)  # prefills_in_progress back to 0: the release stopped it
        assert cluster.workers[0].prefill.served_prefills == 0


# --- decode ------------------------------------------------------------------------


async def test_a_decode_stalled_past_the_link_timeout_takes_its_stream_again_once_back() -> None:
    # the only decode stalls at its first token frame: its link times out; once the stall
    # is over (it happens once) the link reconnects and the request is started there
    # again from prefill's KV, which prefill still holds
    faults = {"decode#1": WorkerFaultsConfig(decode_stall_s=2.0)}
    async with running_cluster(
        make_worker=_faulty(faults, decode_step_s=0.01), router=FAST_LINKS
    ) as cluster:
        async with client(cluster) as http:
            body = {**_body(200, stream=True), "stream_options": {"include_usage": True}}
            with trio.fail_after(LIVENESS_S):
                events = await _stream_events(http, body)
            assert events[-1] == "data: [DONE]"
            chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
            assert not [chunk for chunk in chunks if "error" in chunk], chunks
            assert chunks[-1]["usage"]["completion_tokens"] == 200
            metrics = (await http.get("/metrics")).text
            assert value(metrics, "pdtrio_retries_total", phase="decode") >= 1
            assert value(metrics, "pdtrio_migrations_total") == 0
            with trio.fail_after(LIVENESS_S):
                response = await http.post("/v1/completions", json=_body())
            assert response.status_code == 200, response.text
        await _idle(cluster)


async def test_an_idle_link_without_heartbeats_is_dropped_and_reconnects() -> None:
    faults = {"decode#1": WorkerFaultsConfig(heartbeats_off=True)}
    async with running_cluster(make_worker=_faulty(faults), router=FAST_LINKS) as cluster:
        async with client(cluster) as http:
            await _wait_health(http, lambda h: h["decode_instances"] == 0)  # dropped
            await _wait_health(http, lambda h: h["decode_instances"] == 1)  # reconnected
            assert (await _health(http))["prefill_instances"] == 1  # its heartbeats go on
        await _idle(cluster)


# --- KV transfer ---------------------------------------------------------------------


async def test_a_failing_kv_transfer_is_retried_on_the_other_decode() -> None:
    faults = {"decode#1": WorkerFaultsConfig(kv_transfer_fail=True)}
    async with running_cluster(
        roles=("prefill", "decode", "decode"), make_worker=_faulty(faults)
    ) as cluster:
        async with client(cluster) as http:
            for _ in range(4):
                response = await http.post("/v1/completions", json=_body())
                assert response.status_code == 200, response.text
        transport = cluster.workers[1].transport
        assert isinstance(transport, FaultyKvTransport) and transport.failed_pulls > 0
        await _idle(cluster)


# one decode, refused: the router's wait for another decode to connect is cut short
_NO_OTHER_DECODE = RouterConfig(decode_reconnect_wait_s=0.2)


async def test_a_failing_kv_transfer_with_one_decode_is_a_503() -> None:
    faults = {"decode#1": WorkerFaultsConfig(kv_transfer_fail=True)}
    async with running_cluster(make_worker=_faulty(faults), router=_NO_OTHER_DECODE) as cluster:
        async with client(cluster) as http:
            response = await http.post("/v1/completions", json=_body())
        assert response.status_code == 503, response.text
        assert "kv_transfer_fail" in response.json()["error"]["message"]
        await _idle(cluster)


async def test_a_kv_transfer_stalled_past_the_pull_deadline_is_rejected() -> None:
    faults = WorkerFaultsConfig(kv_transfer_stall_s=30.0)

    def make(role: str) -> Worker:
        if role != "decode":
            return synthetic_worker(role)
        worker = synthetic_worker(role, faults=faults)
        # the same hook around a transport with a short pull deadline (its own timeout_s)
        worker.transport = FaultyKvTransport(TcpKvTransport(timeout_s=0.3), faults)
        return worker

    async with running_cluster(make_worker=make, router=_NO_OTHER_DECODE) as cluster:
        async with client(cluster) as http:
            with trio.fail_after(LIVENESS_S):
                response = await http.post("/v1/completions", json=_body())
        assert response.status_code == 503, response.text
        message = response.json()["error"]["message"]
        assert "stalled past its deadline (0.3 s)" in message, message
        await _idle(cluster)


# --- layout --------------------------------------------------------------------------


@pytest.mark.parametrize("faulty", ["prefill#1", "decode#1"])
async def test_a_layout_mismatch_is_refused_clearly(faulty: str) -> None:
    faults = {faulty: WorkerFaultsConfig(layout_mismatch=True)}
    async with running_cluster(make_worker=_faulty(faults)) as cluster:
        prefill, decode = cluster.workers
        assert prefill.kv_layout.block_size != decode.kv_layout.block_size
        info_block_size = prefill.info()["layout"][4], decode.info()["layout"][4]
        assert info_block_size == (prefill.kv_layout.block_size, decode.kv_layout.block_size)
        async with client(cluster) as http:
            response = await http.post("/v1/completions", json=_body())
            health = (await http.get("/health")).json()
        # the router pairs only matching layouts: the request is refused before any prefill
        assert response.status_code == 503, response.text
        message = response.json()["error"]["message"]
        assert "cannot be paired" in message and "block_size" in message, message
        ignored = {entry["instance"]: entry["reason"] for entry in health["ignored"]}
        assert set(ignored) == {prefill.instance_id, decode.instance_id}, health
        assert all("cannot be paired" in reason for reason in ignored.values())
        await _idle(cluster)
        assert prefill.stats()["kv_leases"] == 0
