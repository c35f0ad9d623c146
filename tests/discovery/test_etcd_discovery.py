"""Discovery through a real etcd: worker processes register, routers watch and route.

Workers are real ``pdtrio worker`` processes (synthetic engine) so that they can
be killed without deregistering, stopped with SIGTERM, and bound on a wildcard;
routers run in this process, served by hypercorn, so the tests can look inside.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import pytest
import trio

from pdtrio.config import DiscoveryConfig, PdtrioConfig, RouterConfig
from pdtrio.discovery.etcd import EtcdClient
from pdtrio.protocol.link.registration import decode_registration
from pdtrio.router.app import RouterApp
from pdtrio.router.core import Router
from pdtrio.testing.etcd import EtcdServer
from pdtrio.testing.processes import Processes, Service, synthetic_worker_config
from tests.cluster import serve_app, wait_for_answer, wait_for_stats, worker_backend

WAIT_S = 20.0  # a bound on waiting for the system to act, never a performance threshold
LEASE_TTL_S = 2
PREFIX = "/pdtrio-test/instances/"


@pytest.fixture
def processes() -> Any:
    with Processes(stop_grace_s=5.0) as group:
        yield group


def discovery(etcd: EtcdServer) -> DiscoveryConfig:
    return DiscoveryConfig(etcd_endpoints=(etcd.endpoint,), prefix=PREFIX, lease_ttl_s=LEASE_TTL_S)


def worker_config(etcd: EtcdServer, role: str, name: str, **overrides: Any) -> dict[str, Any]:
    config = synthetic_worker_config(role, decode_step_s=0.01)
    config["instance_id"] = name
    config["drain_s"] = 10.0
    config["discovery"] = {
        "etcd_endpoints": [etcd.endpoint],
        "prefix": PREFIX,
        "lease_ttl_s": LEASE_TTL_S,
    }
    config.update(overrides)
    return config


async def start_worker(processes: Processes, config: dict[str, Any]) -> Service:
    return await trio.to_thread.run_sync(lambda: processes.worker(config, timeout=60))


@attrs.define
class RunningRouter:
    url: str
    app: RouterApp

    @property
    def router(self) -> Router:
        router = self.app.router
        assert router is not None
        return router

    def routable(self) -> set[str]:
        return {i.instance_id for i in worker_backend(self.router).instances.values() if i.usable}

    def known(self) -> set[str]:
        return set(worker_backend(self.router).instances)


@asynccontextmanager
async def running_router(etcd: EtcdServer, **router: Any) -> AsyncIterator[RunningRouter]:
    config = PdtrioConfig(router=RouterConfig(drain_s=1.0, **router), discovery=discovery(etcd))
    app = RouterApp(config)
    async with trio.open_nursery() as nursery:
        url = await serve_app(app, nursery)
        yield RunningRouter(f"http://{url.removeprefix('http://')}", app)
        nursery.cancel_scope.cancel()


async def until(condition: Callable[[], bool], what: str, within_s: float = WAIT_S) -> None:
    await wait_for_stats(condition, within_s, what=what)


def body(max_tokens: int = 16) -> dict[str, Any]:
    return {"model": "synthetic", "prompt": "hello there", "max_tokens": max_tokens}


async def complete(http: httpx.AsyncClient, max_tokens: int = 16) -> httpx.Response:
    return await http.post("/v1/completions", json=body(max_tokens))


async def stats(service: Service) -> dict[str, Any]:
    async with httpx.AsyncClient() as http:
        answer: dict[str, Any] = (await http.get(f"{service.url}/pd/stats")).json()
        return answer


@attrs.define
class Load:
    """Clients sending requests back to back until stopped; every answer is kept."""

    statuses: list[int] = attrs.field(factory=list)
    failures: list[str] = attrs.field(factory=list)

    async def run(self, url: str, clients: int, stop: trio.Event) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http, trio.open_nursery() as n:
            for _ in range(clients):
                n.start_soon(self._client, http, stop)

    async def _client(self, http: httpx.AsyncClient, stop: trio.Event) -> None:
        while not stop.is_set():
            async with http.stream("POST", "/v1/completions", json={**body(), "stream": True}) as r:
                text = (await r.aread()).decode()
            self.statuses.append(r.status_code)
            if r.status_code != 200 or '"error"' in text or "data: [DONE]" not in text:
                self.failures.append(f"{r.status_code} {text[-300:]}")


# --- joining, leaving, dying -------------------------------------------------------------


async def test_workers_join_and_leave_under_load_without_a_failed_request(
    etcd: EtcdServer, processes: Processes
) -> None:
    first_prefill = await start_worker(processes, worker_config(etcd, "prefill", "p1"))
    first_decode = await start_worker(processes, worker_config(etcd, "decode", "d1"))
    async with running_router(etcd) as router:
        await until(lambda: router.routable() == {"p1", "d1"}, "the first pair is routable")
        load = Load()
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(load.run, router.url, 4, stop)
            await until(lambda: len(load.statuses) >= 8, "requests flow")
            # two more join while requests run
            second_prefill = await start_worker(processes, worker_config(etcd, "prefill", "p2"))
            second_decode = await start_worker(processes, worker_config(etcd, "decode", "d2"))
            await until(lambda: router.routable() == {"p1", "d1", "p2", "d2"}, "all four")
            served = len(load.statuses)
            await until(lambda: len(load.statuses) >= served + 16, "requests after the join")
            # the first two leave gracefully (SIGTERM: deregister, finish, exit)
            first_prefill.process.send_signal(signal.SIGTERM)
            first_decode.process.send_signal(signal.SIGTERM)
            await until(lambda: router.known() == {"p2", "d2"}, "the first pair is gone")
            for service in (first_prefill, first_decode):
                code = await trio.to_thread.run_sync(lambda s=service: s.process.wait(timeout=15))
                assert code == 0
            served = len(load.statuses)
            await until(lambda: len(load.statuses) >= served + 16, "requests after the leave")
            stop.set()
        assert load.failures == [], load.failures[:3]
        assert (await stats(second_prefill))["served_prefills"] > 0
        assert (await stats(second_decode))["router_links"] == 1


async def test_a_killed_worker_leaves_routing_when_its_lease_expires(
    etcd: EtcdServer, processes: Processes
) -> None:
    await start_worker(processes, worker_config(etcd, "prefill", "p1"))
    survivor = await start_worker(processes, worker_config(etcd, "decode", "d1"))
    doomed = await start_worker(processes, worker_config(etcd, "decode", "d2"))
    async with running_router(etcd) as router:
        await until(lambda: router.routable() == {"p1", "d1", "d2"}, "three instances")
        load = Load()
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(load.run, router.url, 6, stop)
            await wait_for_answer(
                lambda: stats(doomed), lambda seen: seen["decode_requests"] > 0, WAIT_S
            )
            # killed mid-stream: no deregistration; the link's heartbeat notices first
            doomed.process.kill()
            await trio.to_thread.run_sync(doomed.process.wait)
            await until(lambda: "d2" not in router.routable(), "the dead link leaves rotation")
            assert "d2" in router.known()  # still registered: its lease runs
            served = len(load.statuses)
            await until(lambda: len(load.statuses) >= served + 12, "requests after the kill")
            await until(lambda: "d2" not in router.known(), "the lease expires", LEASE_TTL_S + 10)
            stop.set()
        # its streams that had tokens ended with a proper error event (one killed before its
        # first token was replaced by the other decode), nothing hung; the rest all served
        # (at most the 6 clients' requests in flight on it when it died)
        assert len(load.failures) <= 6, load.failures
        assert all("decode_failed" in failure for failure in load.failures), load.failures
        async with EtcdClient([etcd.endpoint]) as client:
            kvs, _ = await client.get_prefix(PREFIX)
        assert sorted(decode_registration(kv.value).instance_id for kv in kvs) == ["d1", "p1"]
        # nothing stranded on the survivor
        await wait_for_answer(
            lambda: stats(survivor), lambda seen: not seen["kv_blocks_in_use"], WAIT_S
        )


async def test_a_stopped_worker_deregisters_before_it_exits(
    etcd: EtcdServer, processes: Processes
) -> None:
    prefill = await start_worker(processes, worker_config(etcd, "prefill", "p1"))
    async with EtcdClient([etcd.endpoint]) as client:
        await until_async_registered(client, {"p1"})  # (it registers just after its ready line)
        kvs, _ = await client.get_prefix(PREFIX)
        registration = decode_registration(kvs[0].value)
        assert registration.instance_id == "p1"
        assert registration.url == prefill.url
        assert registration.transfer_port == prefill.ready["transfer_port"]
        prefill.process.send_signal(signal.SIGTERM)
        assert await trio.to_thread.run_sync(lambda: prefill.process.wait(timeout=15)) == 0
        # gone at once, not at lease expiry
        assert (await client.get_prefix(PREFIX))[0] == []


async def test_a_model_whose_instances_all_left_is_waited_for_then_refused_with_a_503(
    etcd: EtcdServer, processes: Processes
) -> None:
    """Its instances away (deregistered: a restart, a partition that outlived their
    leases) a model the router has served is still the router's: a request waits for one (``prefill_wait_s``)
    and gets a 503 that says why, never a 404 that says the model does not exist."""
    workers = [
        await start_worker(processes, worker_config(etcd, role, name))
        for role, name in (("prefill", "p1"), ("decode", "d1"))
    ]
    async with running_router(etcd, prefill_wait_s=1.0) as router:
        await until(lambda: router.routable() == {"p1", "d1"}, "the router sees both")
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
            assert (await complete(http)).status_code == 200
        for worker in workers:
            worker.process.send_signal(signal.SIGTERM)
            await trio.to_thread.run_sync(lambda w=worker: w.process.wait(timeout=15))
        await until(lambda: router.routable() == set(), "both gone from routing")
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
            started = trio.current_time()
            answer = await complete(http)
            waited = trio.current_time() - started
            listed = (await http.get("/v1/models")).json()["data"]
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["message"] == "no prefill instance is available"
        assert waited >= 1.0
        assert [model["id"] for model in listed] == ["synthetic"]


# --- several routers, etcd going away ----------------------------------------------------


async def test_two_routers_share_the_same_etcd_and_workers(
    etcd: EtcdServer, processes: Processes
) -> None:
    prefill = await start_worker(processes, worker_config(etcd, "prefill", "p1"))
    decode = await start_worker(processes, worker_config(etcd, "decode", "d1"))
    async with running_router(etcd) as one, running_router(etcd) as two:
        for router in (one, two):
            await until(lambda r=router: r.routable() == {"p1", "d1"}, "both routers see both")
        for router in (one, two):
            async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
                for _ in range(3):
                    response = await complete(http)
                    assert response.status_code == 200, response.text
        assert (await stats(decode))["router_links"] == 2
        assert (await stats(prefill))["router_links"] == 2
        assert (await stats(prefill))["served_prefills"] == 6


async def test_an_etcd_outage_leaves_routing_on_the_last_view_and_a_restart_resumes_it(
    etcd: EtcdServer, processes: Processes
) -> None:
    await start_worker(processes, worker_config(etcd, "prefill", "p1"))
    await start_worker(processes, worker_config(etcd, "decode", "d1"))
    async with (
        running_router(etcd) as router,
        httpx.AsyncClient(base_url=router.url, timeout=30) as http,
    ):
        await until(lambda: router.routable() == {"p1", "d1"}, "the pair is routable")
        await etcd.stop()
        await until(lambda: not router.router.discovery.connected, "the router sees the outage")
        health = (await http.get("/health")).json()
        assert health["status"] == "ok"
        assert health["discovery"]["connected"] is False and health["discovery"]["problem"]
        for _ in range(4):
            response = await complete(http)
            assert response.status_code == 200, response.text
        # an outage longer than the lease (the thing tested): the workers register again
        # once etcd is back
        await trio.sleep(LEASE_TTL_S + 1)
        await etcd.start()
        await until(lambda: router.router.discovery.connected, "the router watches again")
        # a worker that joins after the restart is seen: the watch is live again
        await start_worker(processes, worker_config(etcd, "decode", "d2"))
        await until(lambda: router.routable() == {"p1", "d1", "d2"}, "the new worker is seen")
        async with EtcdClient([etcd.endpoint]) as client:
            await until_async_registered(client, {"p1", "d1", "d2"})
        response = await complete(http)
        assert response.status_code == 200, response.text


async def until_async_registered(client: EtcdClient, names: set[str]) -> None:
    async def registered() -> set[str]:
        kvs, _ = await client.get_prefix(PREFIX)
        return {decode_registration(kv.value).instance_id for kv in kvs}

    await wait_for_answer(registered, lambda seen: seen == names, WAIT_S, what=f"{names} in etcd")


# --- pairing and addresses ----------------------------------------------------------------


async def test_a_layout_mismatched_worker_is_ignored_and_reported(
    etcd: EtcdServer, processes: Processes
) -> None:
    await start_worker(processes, worker_config(etcd, "prefill", "p1"))
    good = await start_worker(processes, worker_config(etcd, "decode", "d1"))
    odd = await start_worker(
        processes, worker_config(etcd, "decode", "odd", faults={"layout_mismatch": True})
    )
    async with (
        running_router(etcd) as router,
        httpx.AsyncClient(base_url=router.url, timeout=30) as http,
    ):
        await until(lambda: router.known() == {"p1", "d1", "odd"}, "all three registered")
        await until(lambda: router.routable() == {"p1", "d1", "odd"}, "all three are connected")
        health = (await http.get("/health")).json()
        assert [entry["instance"] for entry in health["ignored"]] == ["odd"], health
        assert "block_size" in health["ignored"][0]["reason"]
        for _ in range(6):
            response = await complete(http)
            assert response.status_code == 200, response.text
        assert (await stats(odd))["decode_requests"] == 0
        odd_stats, good_stats = await stats(odd), await stats(good)
        assert odd_stats["kv_blocks_in_use"] == 0 and good_stats["kv_leases"] == 0


async def test_advertised_addresses_are_used_end_to_end(
    etcd: EtcdServer, processes: Processes
) -> None:
    # both listen on every interface and advertise another loopback alias
    wildcard = {"host": "0.0.0.0", "advertise_host": "127.0.0.2", "kv_transport": "tcp"}
    prefill = await start_worker(processes, worker_config(etcd, "prefill", "p1", **wildcard))
    await start_worker(processes, worker_config(etcd, "decode", "d1", **wildcard))
    assert prefill.url.startswith("http://127.0.0.2:")
    async with EtcdClient([etcd.endpoint]) as client:
        await until_async_registered(client, {"p1", "d1"})
        kvs, _ = await client.get_prefix(PREFIX)
    registrations = {r.instance_id: r for r in map(decode_registration, (kv.value for kv in kvs))}
    assert registrations["p1"].url == prefill.url
    assert registrations["p1"].transfer_host == "127.0.0.2"
    async with (
        running_router(etcd) as router,
        httpx.AsyncClient(base_url=router.url, timeout=30) as http,
    ):
        await until(lambda: router.routable() == {"p1", "d1"}, "the pair is routable")
        assert {i.url.split(":")[1] for i in worker_backend(router.router).instances.values()} == {
            "//127.0.0.2"
        }
        response = await complete(http)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 16
    async with httpx.AsyncClient() as plain:
        info = (await plain.get(f"{prefill.url}/pd/info")).json()
    assert info["transfer_endpoint"][0] == "127.0.0.2"


def test_a_wildcard_bind_without_an_advertised_address_is_refused() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdtrio", "worker", "--engine", "synthetic", "--host", "0.0.0.0"],
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert b"advertise_host" in result.stderr and b"every interface" in result.stderr
