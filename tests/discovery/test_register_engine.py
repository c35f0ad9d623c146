"""``pdtrio register``: vLLM engines that do not speak etcd, found by a router through etcd.

``pdtrio register`` runs as a real process beside each engine, against a real etcd;
the engines are the in-process fakes of vLLM's HTTP contract (tests/router/fake_vllm.py)
and the router runs in this process, asked as a load balancer would (``/health``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import msgspec
import pytest
import trio

from pdtrio.config import (
    DiscoveryConfig,
    InstanceKind,
    PdtrioConfig,
    RouterConfig,
    SecurityConfig,
)
from pdtrio.discovery.etcd import EtcdClient
from pdtrio.discovery.register_engine import main as register_main
from pdtrio.discovery.registry import DiscoveryState, EtcdRegistry
from pdtrio.protocol.link.registration import (
    REJECTED_KIND,
    EngineRegistration,
    Registration,
    RegistrationError,
    decode_entry,
    decode_registration,
    encode_registration,
    registration_key,
)
from pdtrio.router.app import RouterApp
from pdtrio.testing.etcd import EtcdServer
from tests.cluster import serve_app, wait_for_answer
from tests.discovery.test_registry import Recorder, registration
from tests.router.fake_sglang import FakeSglang
from tests.router.fake_vllm import MODEL, FakeVllm, fake_engines

PREFIX = "/pdtrio-engines/instances/"
WAIT_S = 20.0  # a bound on waiting for the system to act, never a performance threshold
SECRET = "the deployment's worker secret"
ENGINE_KEY = "the engines' own api key"


def engine(
    name: str, kind: str = "vllm", role: str = "decode", **fields: Any
) -> EngineRegistration:
    return EngineRegistration(
        instance_id=name,
        kind=kind,  # type: ignore[arg-type]
        role=role,  # type: ignore[arg-type]
        url=f"http://127.0.0.1:8{len(name)}00",
        model=MODEL,
        **fields,
    )


# --- the entry (pure) ---------------------------------------------------------------------


def test_an_engine_entry_round_trips_and_a_workers_entry_without_kind_is_a_workers() -> None:
    value = engine("d0")
    assert decode_entry(encode_registration(value)) == value
    assert b'"kind":"vllm"' in encode_registration(value)
    worker = registration("w0")
    assert b"kind" not in encode_registration(worker)  # as every worker writes it
    assert decode_entry(encode_registration(worker)) == worker
    said_pdtrio = msgspec.json.encode({**msgspec.to_builtins(worker), "kind": "pdtrio"})
    assert decode_entry(said_pdtrio) == worker
    with pytest.raises(RegistrationError, match="vLLM engine, not a pdtrio worker"):
        decode_registration(encode_registration(value))


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"kind": "tgi"}, "kind 'tgi'"),
        ({"kind": "sglang", "role": "prefill"}, "without its bootstrap port"),
        ({"bootstrap_port": 8998}, "bootstrap port is SGLang's"),
        ({"url": "ftp://x"}, "not an http"),
        ({"model": ""}, "not a usable registration"),
        ({"version": 1}, "version 1"),
    ],
)
def test_an_engine_entry_that_cannot_be_right_is_refused(
    fields: dict[str, Any], words: str
) -> None:
    data = msgspec.json.encode({**msgspec.to_builtins(engine("d0")), **fields})
    with pytest.raises(RegistrationError, match=words):
        decode_entry(data)


def test_sglang_prefill_with_its_bootstrap_port_is_taken() -> None:
    value = engine("p0", kind="sglang", role="prefill", bootstrap_port=8998)
    assert decode_entry(encode_registration(value)) == value


# --- the command line -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--url", "http://127.0.0.1:8100"], "no etcd to register at"),
        (["--url", "ftp://h:1", "--etcd", "http://127.0.0.1:2379"], "--url: url 'ftp://h:1'"),
        (["--url", "http://h:1", "--etcd", "127.0.0.1:2379"], "not an http:// or https:// URL"),
        (
            ["--url", "http://h:1", "--etcd", "http://e:2379", "--bootstrap-port", "8998"],
            "--bootstrap-port is SGLang's",
        ),
        (
            ["--url", "http://h:1", "--etcd", "http://e:2379", "--worker-secret-file", "/no/file"],
            "cannot read the worker secret file /no/file",
        ),
    ],
)
def test_a_bad_argument_exits_2_saying_what(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert register_main(["--kind", "vllm", "--role", "prefill", *argv], environ={}) == 2
    assert words in capsys.readouterr().err


def test_an_sglang_prefill_needs_its_bootstrap_port(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--kind", "sglang", "--role", "both", "--url", "http://h:1", "--etcd", "http://e:1"]
    assert register_main(argv, environ={}) == 2
    assert "an SGLang prefill needs --bootstrap-port" in capsys.readouterr().err


def test_a_missing_or_unknown_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        register_main(["--kind", "vllm", "--url", "http://h:1"], environ={})
    assert exited.value.code == 2
    assert "--role" in capsys.readouterr().err


# --- kinds that cannot pair ---------------------------------------------------------------


async def test_a_router_uses_only_the_kind_it_fronts(etcd: EtcdServer) -> None:
    """A pdtrio router ignores engines, an engine router ignores pdtrio workers (and
    engines of another kind): a prefill's KV is read only by a decode of its kind."""
    recorder = Recorder()
    engines = EngineRecorder()
    config = DiscoveryConfig(etcd_endpoints=(etcd.endpoint,), prefix=PREFIX, kind="vllm")
    async with EtcdClient([etcd.endpoint]) as client, trio.open_nursery() as nursery:
        for value in (engine("v"), engine("s", kind="sglang"), registration("w")):
            await client.put(
                registration_key(PREFIX, value.instance_id), encode_registration(value)
            )
        await nursery.start(
            EtcdRegistry(config, recorder, DiscoveryState("etcd"), engines=engines).run
        )
        assert set(engines.registered) == {"v"} and recorder.registered == {}
        assert sorted(recorder.rejected) == [
            (registration_key(PREFIX, "s"), REJECTED_KIND),
            (registration_key(PREFIX, "w"), REJECTED_KIND),
        ]
        assert (
            "the registration of a pdtrio worker; this router fronts vLLM engines"
            in (recorder.ignored[registration_key(PREFIX, "w")])
        )
        await client.delete(registration_key(PREFIX, "v"))
        with trio.fail_after(WAIT_S):
            await engines.gone.wait()
        assert engines.registered == {}

        pdtrio_router = Recorder()
        pdtrio_config = attrs.evolve(config, kind="pdtrio")
        await nursery.start(EtcdRegistry(pdtrio_config, pdtrio_router, DiscoveryState("etcd")).run)
        assert set(pdtrio_router.registered) == {"w"}
        assert (
            "the registration of a SGLang engine; this router fronts pdtrio workers"
            in (pdtrio_router.ignored[registration_key(PREFIX, "s")])
        )
        nursery.cancel_scope.cancel()


class EngineRecorder:
    def __init__(self) -> None:
        self.registered: dict[str, EngineRegistration] = {}
        self.gone = trio.Event()

    def engine_registered(self, registration: EngineRegistration) -> None:
        self.registered[registration.instance_id] = registration

    def engine_deregistered(self, instance_id: str) -> None:
        self.registered.pop(instance_id, None)
        self.gone.set()


# --- pdtrio register beside engines, end to end ------------------------------------------


@attrs.define
class Registrar:
    """One ``pdtrio register`` process."""

    process: trio.Process
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@asynccontextmanager
async def registered(
    etcd: EtcdServer,
    fake: FakeVllm,
    role: str,
    tmp_path: Path,
    *extra: str,
    kind: str = "vllm",
    environ: dict[str, str] | None = None,
) -> AsyncIterator[Registrar]:
    log_path = tmp_path / f"register-{fake.name}.log"
    with log_path.open("wb") as log:
        process = await trio.lowlevel.open_process(
            [
                sys.executable,
                "-m",
                "pdtrio",
                "register",
                "--kind",
                kind,
                "--role",
                role,
                "--url",
                fake.url,
                "--etcd",
                etcd.endpoint,
                "--prefix",
                PREFIX,
                "--instance-id",
                fake.name,
                "--lease-ttl-s",
                "2",
                "--health-interval-s",
                "0.1",
                "--health-failures",
                "2",
                *extra,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(environ or {})},
        )
    try:
        yield Registrar(process, log_path)
    finally:
        if process.returncode is None:
            process.kill()  # (this test's own process, by its handle)
        with trio.CancelScope(shield=True):
            await process.wait()


@asynccontextmanager
async def engine_router(
    etcd: EtcdServer, kind: InstanceKind = "vllm", **security: Any
) -> AsyncIterator[str]:
    config = PdtrioConfig(
        router=RouterConfig(drain_s=1.0, connect_timeout_s=2.0),
        discovery=DiscoveryConfig(
            etcd_endpoints=(etcd.endpoint,), prefix=PREFIX, lease_ttl_s=2, kind=kind
        ),
        security=SecurityConfig(**security),
    )
    app = RouterApp(config)
    async with trio.open_nursery() as nursery:
        yield await serve_app(app, nursery)
        nursery.cancel_scope.cancel()


async def health(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as http:
        answer: dict[str, Any] = (await http.get(f"{url}/health")).json()
        return answer


def engines_up(answer: dict[str, Any]) -> dict[str, str]:
    """Which registered engines the router routes to: name -> role."""
    return {e["instance"]: e["role"] for e in answer.get("engines", []) if e["healthy"]}


async def until_engines(url: str, expected: dict[str, str], what: str) -> dict[str, Any]:
    return await wait_for_answer(
        lambda: health(url), lambda a: engines_up(a) == expected, WAIT_S, what=what
    )


async def in_etcd(etcd: EtcdServer) -> dict[str, bytes]:
    async with EtcdClient([etcd.endpoint]) as client:
        kvs, _ = await client.get_prefix(PREFIX)
    return {kv.key.removeprefix(PREFIX): kv.value for kv in kvs}


async def until_in_etcd(etcd: EtcdServer, names: set[str]) -> dict[str, bytes]:
    return await wait_for_answer(
        lambda: in_etcd(etcd), lambda seen: set(seen) == names, WAIT_S, what=f"{names} in etcd"
    )


@pytest.mark.slow
async def test_registered_engines_serve_and_leave_while_unhealthy_and_on_sigterm(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    async with trio.open_nursery() as nursery, fake_engines(nursery, "p0", "d0") as fakes:
        p0, d0 = fakes["p0"], fakes["d0"]
        async with (
            engine_router(etcd, engine_api_key=ENGINE_KEY) as url,
            registered(
                etcd, p0, "prefill", tmp_path, environ={"PDTRIO_ENGINE_API_KEY": ENGINE_KEY}
            ) as prefill,
            registered(etcd, d0, "decode", tmp_path) as decode,
        ):
            answer = await until_engines(url, {"p0": "prefill", "d0": "decode"}, "both up")
            assert answer["status"] == "ok" and answer["discovery"]["source"] == "etcd"
            entries = await until_in_etcd(etcd, {"p0", "d0"})
            p0_entry = decode_entry(entries["p0"])
            assert isinstance(p0_entry, EngineRegistration)
            assert (p0_entry.kind, p0_entry.role, p0_entry.url) == ("vllm", "prefill", p0.url)
            assert p0_entry.model == MODEL  # learnt from its /v1/models
            assert ENGINE_KEY.encode() not in entries["p0"]  # never in etcd

            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                response = await http.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "one two", "max_tokens": 3}
                )
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == " t0 t1 t2"
            assert len(p0.legs()) == 1 and len(d0.legs()) == 1
            # the router's own key for registered engines, on every leg
            assert p0.received[0][1]["authorization"] == f"Bearer {ENGINE_KEY}"

            d0.health_status = 503  # decode's engine stops answering /health
            # gone from the list, not only down: the router's own probe of d0's /health
            # may mark it down before `pdtrio register` deregisters it
            answer = await wait_for_answer(
                lambda: health(url),
                lambda a: (
                    engines_up(a) == {"p0": "prefill"}
                    and "d0" not in {e.get("instance") for e in a.get("engines", [])}
                ),
                WAIT_S,
                what="d0 deregistered",
            )
            assert answer["status"] == "unavailable" and answer["decode_instances"] == 0
            assert set(await in_etcd(etcd)) == {"p0"}
            assert "deregistering it until it answers again" in decode.log()

            d0.health_status = 200
            await until_engines(url, {"p0": "prefill", "d0": "decode"}, "d0 back")

            prefill.process.send_signal(signal.SIGTERM)
            with trio.fail_after(WAIT_S):
                assert await prefill.process.wait() == 0, prefill.log()
            # revoked at once, not at the lease's end
            assert set(await in_etcd(etcd)) == {"d0"}
            await until_engines(url, {"d0": "decode"}, "p0 deregistered")
            assert "SIGTERM received: deregistering and exiting" in prefill.log()
            assert ENGINE_KEY not in prefill.log()
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_with_a_worker_secret_only_signed_engines_are_used(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    async with trio.open_nursery() as nursery, fake_engines(nursery, "p0", "d0") as fakes:
        async with (
            engine_router(etcd, worker_secret=SECRET) as url,
            registered(
                etcd, fakes["p0"], "prefill", tmp_path, "--worker-secret-file", str(secret_file)
            ),
            registered(etcd, fakes["d0"], "decode", tmp_path),  # no secret: unsigned
        ):
            await until_in_etcd(etcd, {"p0", "d0"})
            answer = await wait_for_answer(
                lambda: health(url),
                lambda a: engines_up(a) == {"p0": "prefill"} and bool(a.get("ignored")),
                WAIT_S,
                what="p0 up, d0 ignored",
            )
            [ignored] = answer["ignored"]
            assert ignored["key"] == registration_key(PREFIX, "d0")
            assert "not signed" in ignored["reason"]
            assert answer["status"] == "unavailable"  # no decode it may use
            entry = decode_entry((await in_etcd(etcd))["p0"])
            assert entry.signature and not isinstance(entry, Registration)
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_an_sglang_pair_found_in_etcd_takes_the_registered_bootstrap_port(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    rooms: dict[Any, Any] = {}
    prefill = FakeSglang("p0", {}, rooms=rooms, bootstrap_port=8998)
    decode = FakeSglang("d0", {}, rooms=rooms)
    async with trio.open_nursery() as nursery:
        for fake in (prefill, decode):
            fake.url = await serve_app(fake, nursery)
        async with (
            engine_router(etcd, kind="sglang") as url,
            registered(
                etcd, prefill, "prefill", tmp_path, "--bootstrap-port", "8998", kind="sglang"
            ),
            registered(etcd, decode, "decode", tmp_path, kind="sglang"),
        ):
            await until_engines(url, {"p0": "prefill", "d0": "decode"}, "both up")
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                response = await http.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "one two", "max_tokens": 2}
                )
            assert response.status_code == 200, response.text
            [prefill_leg] = prefill.legs()
            [decode_leg] = decode.legs()
            assert prefill_leg["bootstrap_port"] == decode_leg["bootstrap_port"] == 8998
        nursery.cancel_scope.cancel()
