"""A hostile etcd writer, and etcd's own authentication, against a real etcd and a real router.

What an operator sees: ``/health`` (which instances are known, which registry entries are
ignored and why, whether discovery is live), ``/metrics`` and the log.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import msgspec
import pytest
import trio

from pdtrio.config import DiscoveryConfig, PdtrioConfig, RouterConfig, SecurityConfig
from pdtrio.discovery.etcd import EtcdClient
from pdtrio.discovery.registry import DiscoveryState, EtcdRegistry
from pdtrio.discovery.worker_registration import keep_registered
from pdtrio.peer_auth import WorkerAuth
from pdtrio.protocol.link.registration import (
    encode_registration,
    registration_key,
    sign_registration,
)
from pdtrio.router.app import RouterApp
from pdtrio.router.core import Router
from pdtrio.security import PeerCredentials, derive_key
from pdtrio.testing.etcd import EtcdServer, require_etcd, running_etcd
from pdtrio.testing.processes import Processes, synthetic_worker_config
from tests.cluster import serve_app, wait_for_stats, worker_backend
from tests.discovery.test_registry import Recorder, registration

PREFIX = "/pdtrio-security/instances/"
WAIT_S = 20.0
SECRET = "the deployment's worker secret"
SIGNING_KEY = derive_key(SECRET, "registration")
ROOT_PASSWORD = "etcd-root-password"


@attrs.define
class RunningRouter:
    url: str
    app: RouterApp

    @property
    def router(self) -> Router:
        router = self.app.router
        assert router is not None
        return router

    def known(self) -> set[str]:
        return {name for name, i in worker_backend(self.router).instances.items() if i.registered}

    async def health(self) -> dict[str, Any]:
        async with httpx.AsyncClient() as http:
            answer: dict[str, Any] = (await http.get(f"{self.url}/health")).json()
            return answer

    async def metrics(self) -> str:
        async with httpx.AsyncClient() as http:
            return (await http.get(f"{self.url}/metrics")).text


def discovery_config(etcd: EtcdServer, **overrides: Any) -> DiscoveryConfig:
    return DiscoveryConfig(
        etcd_endpoints=(etcd.endpoint,), prefix=PREFIX, lease_ttl_s=2, **overrides
    )


@asynccontextmanager
async def running_router(
    discovery: DiscoveryConfig, *, secret: str = ""
) -> AsyncIterator[RunningRouter]:
    config = PdtrioConfig(
        router=RouterConfig(drain_s=1.0, connect_timeout_s=2.0),
        discovery=discovery,
        security=SecurityConfig(worker_secret=secret),
    )
    app = RouterApp(config)
    async with trio.open_nursery() as nursery:
        url = await serve_app(app, nursery)
        yield RunningRouter(f"http://{url.removeprefix('http://')}", app)
        nursery.cancel_scope.cancel()


async def until(condition: Any, what: str) -> None:
    await wait_for_stats(condition, WAIT_S, what=what)


def key_of(name: str) -> str:
    return registration_key(PREFIX, name)


def entry(name: str, **changes: Any) -> bytes:
    fields = msgspec.to_builtins(registration(name))
    fields.update(changes)
    return msgspec.json.encode(fields)


def ignored(health: dict[str, Any]) -> dict[str, str]:
    return {e["key"]: e["reason"] for e in health.get("ignored", []) if "key" in e}


def ignored_names(router: RunningRouter) -> list[str]:
    return [
        key.removeprefix(PREFIX)
        for key in worker_backend(router.router).links.ignored_registrations
    ]


def rejected_count(metrics: str, reason: str) -> float:
    prefix = f'pdtrio_registry_rejected_entries_total{{reason="{reason}"}} '
    for line in metrics.splitlines():
        if line.startswith(prefix):
            return float(line.removeprefix(prefix))
    raise AssertionError(f"no {prefix!r} in /metrics")


# --- hostile entries never stop discovery ----------------------------------------------------


async def test_a_deeply_nested_entry_is_ignored_and_discovery_goes_on(etcd: EtcdServer) -> None:
    async with (
        running_router(discovery_config(etcd)) as router,
        EtcdClient([etcd.endpoint]) as client,
    ):
        await client.put(key_of("nested"), b'{"a":' * 5000)
        await client.put(key_of("good"), encode_registration(registration("good")))
        await until(lambda: router.known() == {"good"}, "the entry after it is seen")
        health = await router.health()
        assert health["discovery"]["connected"] is True, health
        assert "arrays and objects" in ignored(health)[key_of("nested")]
        # deleting it takes it off the report; later entries are still seen
        await client.delete(key_of("nested"))
        await client.put(key_of("later"), encode_registration(registration("later")))
        await until(lambda: router.known() == {"good", "later"}, "a later entry is seen")
        assert key_of("nested") not in ignored(await router.health())
        assert rejected_count(await router.metrics(), "malformed") == 1


async def test_impossible_values_are_ignored_and_reported(etcd: EtcdServer) -> None:
    async with (
        running_router(discovery_config(etcd)) as router,
        EtcdClient([etcd.endpoint]) as client,
    ):
        await client.put(key_of("negative"), entry("negative", max_model_len=-5))
        await client.put(key_of("port"), entry("port", url="http://127.0.0.1:99999"))
        await client.put(key_of("good"), encode_registration(registration("good")))
        await until(lambda: router.known() == {"good"}, "the good entry is seen")
        reasons = ignored(await router.health())
        assert "max_model_len" in reasons[key_of("negative")], reasons
        assert "99999" in reasons[key_of("port")] or "port" in reasons[key_of("port")], reasons
        assert rejected_count(await router.metrics(), "invalid") == 2


async def test_a_registration_pointing_at_the_router_itself_is_refused(etcd: EtcdServer) -> None:
    async with (
        running_router(discovery_config(etcd)) as router,
        EtcdClient([etcd.endpoint]) as client,
    ):
        # before anyone asked the router anything: found out by dialing it
        await client.put(key_of("self"), encode_registration(registration("self", url=router.url)))
        await until(
            lambda: key_of("self") in worker_backend(router.router).links.ignored_registrations,
            "refused",
        )
        assert "router" in worker_backend(router.router).links.ignored_registrations[key_of("self")]
        assert router.known() == set()
        # once it was reached at its address: known at once
        await router.health()
        alias = registration("alias", url=router.url + "/")
        await client.put(key_of("alias"), encode_registration(alias))
        await client.put(key_of("good"), encode_registration(registration("good")))
        await until(lambda: router.known() == {"good"}, "the good entry is seen")
        await until(
            lambda: key_of("alias") in worker_backend(router.router).links.ignored_registrations,
            "refused",
        )
        assert router.known() == {"good"}
        assert rejected_count(await router.metrics(), "router_url") == 2


async def test_a_registry_that_stops_says_so(etcd: EtcdServer) -> None:
    state = DiscoveryState("etcd")
    config = discovery_config(etcd)
    async with trio.open_nursery() as nursery:
        await nursery.start(EtcdRegistry(config, Recorder(), state).run)
        assert state.report()["connected"] is True
        nursery.cancel_scope.cancel()
    report = state.report()
    assert report["connected"] is False and report["stopped"] is True
    assert "discovery stopped" in report["problem"]


# --- signed registrations --------------------------------------------------------------------


async def test_only_correctly_signed_registrations_are_used_when_the_router_has_a_secret(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "pdtrio.router.discovery")
    signed = sign_registration(registration("signed"), key_of("signed"), SIGNING_KEY)
    wrong = sign_registration(
        registration("wrong"), key_of("wrong"), derive_key("a guess", "registration")
    )
    # a real signature, copied under another key
    copied = sign_registration(registration("copy"), key_of("elsewhere"), SIGNING_KEY)
    async with (
        running_router(discovery_config(etcd), secret=SECRET) as router,
        EtcdClient([etcd.endpoint]) as client,
    ):
        await client.put(key_of("unsigned"), encode_registration(registration("unsigned")))
        await client.put(key_of("wrong"), encode_registration(wrong))
        await client.put(key_of("copy"), encode_registration(copied))
        await client.put(key_of("signed"), encode_registration(signed))
        await until(lambda: router.known() == {"signed"}, "the signed one is used")
        reasons = ignored(await router.health())
        assert "not signed" in reasons[key_of("unsigned")], reasons
        assert "signature" in reasons[key_of("wrong")], reasons
        assert "signature" in reasons[key_of("copy")], reasons
        metrics = await router.metrics()
        assert rejected_count(metrics, "unsigned") == 1
        assert rejected_count(metrics, "bad_signature") == 2
        # an unchanged entry listed again (etcd restarted) is not warned about again
        await etcd.stop()
        await until(lambda: not router.router.discovery.connected, "the outage is seen")
        await etcd.start()
        await until(lambda: router.router.discovery.connected, "watching again")
        await client.put(
            key_of("signed2"),
            encode_registration(
                sign_registration(registration("signed2"), key_of("signed2"), SIGNING_KEY)
            ),
        )
        await until(lambda: router.known() == {"signed", "signed2"}, "a later signed one")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for name in ("unsigned", "wrong", "copy"):
        about = [w for w in warnings if key_of(name) in w]
        assert len(about) == 1, (name, warnings)
    assert rejected_count(metrics, "unsigned") == 1


async def test_without_a_secret_unsigned_registrations_are_used_and_that_is_logged(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "pdtrio.router")
    async with (
        running_router(discovery_config(etcd)) as router,
        EtcdClient([etcd.endpoint]) as client,
    ):
        await client.put(key_of("plain"), encode_registration(registration("plain")))
        await until(lambda: router.known() == {"plain"}, "the unsigned one is used")
    assert any("not authenticated" in r.getMessage() for r in caplog.records)


# --- etcd's own authentication ---------------------------------------------------------------


async def test_etcd_user_and_password_a_worker_registers_and_the_router_sees_it(
    etcd: EtcdServer, tmp_path: Any
) -> None:
    await etcd.enable_auth(ROOT_PASSWORD)
    password_file = tmp_path / "etcd-password"
    password_file.write_text(ROOT_PASSWORD + "\n")
    worker = synthetic_worker_config("both")
    worker.update(
        instance_id="w1",
        secret=SECRET,
        discovery={
            "etcd_endpoints": [etcd.endpoint],
            "prefix": PREFIX,
            "lease_ttl_s": 2,
            "etcd_username": "root",
            "etcd_password_file": str(password_file),
        },
    )
    with Processes(stop_grace_s=5.0) as processes:
        await trio.to_thread.run_sync(lambda: processes.worker(worker, timeout=60))
        authed = discovery_config(etcd, etcd_username="root", etcd_password=ROOT_PASSWORD)
        async with running_router(authed, secret=SECRET) as router:
            await until(lambda: router.known() == {"w1"}, "the worker is seen")
            health = await router.health()
            assert health["discovery"]["connected"] is True
            assert ignored(health) == {}
            async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
                await until(
                    lambda: worker_backend(router.router).instances["w1"].usable, "routable"
                )
                response = await http.post(
                    "/v1/completions", json={"model": "synthetic", "prompt": "hi", "max_tokens": 4}
                )
                assert response.status_code == 200, response.text
            # a restarted etcd forgets its tokens: both sides authenticate again
            await etcd.stop()
            await until(lambda: not router.router.discovery.connected, "the outage is seen")
            await etcd.start()
            await until(lambda: router.router.discovery.connected, "watching again")
            async with EtcdClient(
                [etcd.endpoint], username="root", password=ROOT_PASSWORD
            ) as client:
                later = sign_registration(registration("later"), key_of("later"), SIGNING_KEY)
                await client.put(key_of("later"), encode_registration(later))
            await until(lambda: router.known() == {"w1", "later"}, "a later entry is seen")
        # a wrong password: no crash; /health says why discovery is not live
        wrong = discovery_config(etcd, etcd_username="root", etcd_password="not it")
        async with running_router(wrong, secret=SECRET) as router:
            health = await router.health()
            assert health["discovery"]["connected"] is False, health
            assert "authentication failed" in health["discovery"]["problem"], health
            assert ROOT_PASSWORD not in str(health) and "not it" not in str(health)
        # no credentials at all against an etcd that asks for them: said as much
        async with running_router(discovery_config(etcd), secret=SECRET) as router:
            problem = (await router.health())["discovery"]["problem"]
            assert "etcd_username" in problem, problem


async def test_a_worker_with_a_wrong_etcd_password_keeps_serving_and_says_why(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    await etcd.enable_auth(ROOT_PASSWORD)
    caplog.set_level(logging.WARNING, "pdtrio.worker.registration")
    config = discovery_config(etcd, etcd_username="root", etcd_password="hunter2-not-it")
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(keep_registered, config, registration("w"), stop)
        await until(lambda: bool(caplog.records), "a log line")
        stop.set()
    (line,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "credentials" in line.getMessage() and "authentication failed" in line.getMessage()
    assert "hunter2-not-it" not in line.getMessage()


async def test_etcd_client_tls_a_worker_registers_and_the_router_sees_it() -> None:
    require_etcd()
    async with running_etcd(tls=True) as etcd:
        assert etcd.tls is not None and etcd.endpoint.startswith("https://")
        tls = {
            "etcd_ca_file": etcd.tls.ca_file,
            "etcd_cert_file": etcd.tls.client_cert_file,
            "etcd_key_file": etcd.tls.client_key_file,
        }
        config = discovery_config(etcd, **tls)
        stop = trio.Event()
        async with running_router(config, secret=SECRET) as router, trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: keep_registered(config, registration("w"), stop, signing_key=SIGNING_KEY)
            )
            await until(lambda: router.known() == {"w"}, "the worker is seen over TLS")
            assert (await router.health())["discovery"]["connected"] is True
            stop.set()
            await until(lambda: router.known() == set(), "it deregistered")
        # without the client certificate etcd refuses the connection: said, not a crash
        no_cert = discovery_config(etcd, etcd_ca_file=etcd.tls.ca_file)
        async with running_router(no_cert, secret=SECRET) as router:
            discovery = (await router.health())["discovery"]
            assert discovery["connected"] is False and discovery["problem"], discovery


# --- the whole attack: an etcd writer without the credential ----------------------------------


async def test_an_etcd_writer_without_the_secret_gets_no_traffic_and_learns_nothing(
    etcd: EtcdServer,
) -> None:
    """The probe that found the hole, replayed: a listener registered as ``decode-evil``
    and a worker the attacker runs with a secret of its own, registered (and signed, by
    its own key) as ``prefill-evil``, beside a real pair.  Neither is dialed with anything
    usable or linked; every real request goes to the real pair."""
    seen: list[bytes] = []

    async def listener(stream: trio.SocketStream) -> None:
        async with stream:
            with trio.move_on_after(5):
                while chunk := await stream.receive_some(65536):
                    seen.append(chunk)

    def worker(role: str, name: str, secret: str) -> dict[str, Any]:
        config = synthetic_worker_config(role)
        config.update(
            instance_id=name,
            secret=secret,
            discovery={"etcd_endpoints": [etcd.endpoint], "prefix": PREFIX, "lease_ttl_s": 2},
        )
        return config

    attackers_secret = "the attacker's own secret"
    with Processes(stop_grace_s=5.0) as processes:
        for role, name, secret in (
            ("prefill", "prefill-0", SECRET),
            ("decode", "decode-0", SECRET),
            ("prefill", "prefill-evil", attackers_secret),
        ):
            start = functools.partial(processes.worker, worker(role, name, secret), timeout=60)
            service = await trio.to_thread.run_sync(start)
        attackers_worker = service
        async with (
            trio.open_nursery() as nursery,
            running_router(discovery_config(etcd), secret=SECRET) as router,
            EtcdClient([etcd.endpoint]) as client,
        ):
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, host="127.0.0.1"), listener, 0
            )
            port = listeners[0].socket.getsockname()[1]
            evil = entry("decode-evil", role="decode", url=f"http://127.0.0.1:{port}")
            await client.put(key_of("decode-evil"), evil)
            await until(
                lambda: {"prefill-evil", "decode-evil"} <= set(ignored_names(router)),
                "both hostile entries are ignored",
            )
            await until(
                lambda: (
                    router.known() == {"prefill-0", "decode-0"}
                    and all(i.usable for i in worker_backend(router.router).instances.values())
                ),
                "the real pair is routable",
            )
            reasons = ignored(await router.health())
            assert "not signed" in reasons[key_of("decode-evil")], reasons
            assert "signature" in reasons[key_of("prefill-evil")], reasons
            async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
                for index in range(10):
                    answer = await http.post(
                        "/v1/completions",
                        json={"model": "synthetic", "prompt": f"secret {index}", "max_tokens": 2},
                    )
                    assert answer.status_code == 200, answer.text
                # the attacker's worker: never linked, never asked for a prefill
                stats = await http.get(
                    f"{attackers_worker.url}/pd/stats",
                    auth=WorkerAuth(PeerCredentials(attackers_secret)),
                )
            assert stats.json()["router_links"] == 0, stats.json()
            assert stats.json()["served_prefills"] == 0, stats.json()
            nursery.cancel_scope.cancel()
    assert seen == []  # the listener was never even dialed
