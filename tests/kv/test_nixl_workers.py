"""Two ``pdtrio worker`` processes, prefill and decode, hand KV over NIXL; the router runs here.

The synthetic decode engine checks that the blocks it received hold the prompt's
bytes before it decodes, so a wrong byte would fail the request.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio

from pdtrio.config import InstanceConfig, PdtrioConfig
from pdtrio.router.app import RouterApp
from pdtrio.testing import Processes, Service, synthetic_worker_config
from tests.cluster import serve_app, wait_for_answer

pytest.importorskip("nixl")

BODIES = [
    {"model": "synthetic", "prompt": "word " * length, "max_tokens": 6, "seed": length}
    for length in (1, 40, 300)
]


@pytest.fixture
def procs() -> Iterator[Processes]:
    with Processes(stop_grace_s=10) as group:
        yield group


def workers(procs: Processes, roles: tuple[str, ...], kv_transport: str) -> list[Service]:
    started = [
        procs.start_worker({**synthetic_worker_config(role), "kv_transport": kv_transport})
        for role in roles
    ]
    return [procs.wait_ready(process, timeout=120) for process in started]


async def completions(services: list[Service]) -> list[str]:
    instances = tuple(
        InstanceConfig(role=service.ready["role"], url=service.url) for service in services
    )
    texts = []
    async with trio.open_nursery() as nursery:
        url = await serve_app(RouterApp(PdtrioConfig(instances=instances)), nursery)
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            for body in BODIES:
                response = await http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                texts.append(response.json()["choices"][0]["text"])
        nursery.cancel_scope.cancel()
    return texts


async def get(service: Service, path: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10) as http:
        body: dict[str, Any] = (await http.get(f"{service.url}{path}")).json()
    return body


async def test_two_worker_processes_hand_kv_over_nixl_and_say_so(procs: Processes) -> None:
    prefill, decode = workers(procs, ("prefill", "decode"), "nixl")
    (both,) = workers(procs, ("both",), "nixl")
    assert prefill.ready["kv_transport"] == decode.ready["kv_transport"] == "nixl"
    disaggregated = await completions([prefill, decode])
    assert disaggregated == await completions([both])
    info = (await get(decode, "/pd/info"))["kv_transport"]
    assert info["pulls"]["nixl"] == len(BODIES) and info["pulls"]["tcp"] == 0
    assert [peer["transport"] for peer in info["peers"].values()] == ["nixl"]

    async def every_stats() -> list[dict[str, Any]]:
        return [await get(service, "/pd/stats") for service in (prefill, decode, both)]

    await wait_for_answer(
        every_stats,
        lambda stats: not any(s["kv_blocks_in_use"] or s["kv_leases"] for s in stats),
        10,
        what="no KV blocks or leases held on any worker",
    )
    assert (await get(prefill, "/pd/info"))["kv_transport"]["releases_notified"] == len(BODIES)


async def test_a_tcp_prefill_and_a_nixl_decode_fall_back_to_tcp(procs: Processes) -> None:
    (prefill,) = workers(procs, ("prefill",), "tcp")
    (decode,) = workers(procs, ("decode",), "auto")
    await completions([prefill, decode])
    info = (await get(decode, "/pd/info"))["kv_transport"]
    assert info["transport"] == "nixl"
    assert info["pulls"]["tcp"] == len(BODIES) and info["pulls"]["nixl"] == 0
    (peer,) = info["peers"].values()
    assert peer["transport"] == "tcp" and "kv_transport = 'tcp'" in peer["reason"]
