"""Discovery: what finding workers through etcd costs, and how routing behaves while they churn.

Real processes on loopback: one etcd, synthetic ``pdtrio worker`` processes that
register themselves in it (lease TTL 2 s), routers served by ``hypercorn -k trio``.
Load: N concurrent streaming clients (bare sockets, ``connection: close``, so
the load generator spends little CPU), each request ``max_tokens`` 32 on a
synthetic engine stepping every 5 ms.

1. Cost: the same load, in turns, against (a) a router with a static instance
   list and (b) a router watching etcd, both over the same two workers (one
   prefill, one decode): requests/s, TTFT p50/p99, router CPU (its process tree,
   from ``/proc``) per request; (b)/(a) ratios from the same run.
2. Churn under load (etcd router): a new prefill, then a new decode joins
   (registered in etcd -> routable in ``/health`` -> first request served, from
   its ``/pd/stats``); the older of each is stopped with SIGTERM (-> gone from
   ``/health`` -> process exit); a third decode joins and one decode with
   requests in flight is killed with SIGKILL (-> out of rotation -> its lease
   expired in etcd -> forgotten by the router: ``/health``'s revision reaches
   the deletion).  Every request is classified; a killed decode's in-flight
   streams end with a ``decode_failed`` error event: expected.  Any other
   failure is a bug.
3. etcd outages under load: etcd stopped for a few seconds, then started again
   on the same data: failures (expected: none), how soon the router notices,
   and, after the restart, how soon it says it is connected and how soon its
   watch is live again (a key put under the prefix shows in ``/health``).

``python -m benchmarks.discovery [--quick] [--clients N] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from benchmarks.kit import markdown_table, percentile, write_json
from pdtrio.discovery.etcd import EtcdClient
from pdtrio.testing import (
    LOOPBACK,
    Processes,
    Service,
    cpu_seconds,
    synthetic_worker_config,
    write_router_config,
)
from pdtrio.testing.etcd import EtcdServer, etcd_binary, running_etcd

PREFIX = "/bench/instances/"
LEASE_TTL_S = 2
DECODE_STEP_S = 0.005
WAIT_S = 30.0  # a bound on waiting for the system to act, not a performance threshold
POLL_S = 0.02  # other processes' state, seen from outside: polled
# what a worker holds while it has work (its /pd/stats): a draining one waits for all zero
_BUSY_FIELDS = ("prefills_in_progress", "kv_leases", "decode_requests", "running_requests")
_CODE = re.compile(rb'"code"\s*:\s*"([^"]+)"')


@attrs.frozen
class Settings:
    quick: bool
    clients: int
    max_tokens: int
    cost_rounds: int
    cost_window_s: float
    warmup_s: float
    churn_rounds: int
    outages_s: tuple[float, ...]


# --- load ---------------------------------------------------------------------------


@attrs.frozen
class Outcome:
    kind: str  # "ok", "error event <code>", "http <status> <code>", ...
    phase: str  # what was going on when it ended
    started: float  # trio clock
    ended: float
    ttft_s: float | None
    tail: str


def _request(max_tokens: int) -> bytes:
    body = json.dumps(
        {
            "model": "synthetic",
            "prompt": "how much does discovery cost",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {LOOPBACK}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def _classify(data: bytes) -> str:
    head, _, body = data.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return "closed before a response"
    code = _CODE.search(body)
    if status != 200:
        return f"http {status} {code.group(1).decode() if code else ''}".rstrip()
    if b'"error"' in body:
        return f"error event {code.group(1).decode() if code else '?'}"
    return "ok" if b"data: [DONE]" in body else "closed mid-stream"


@attrs.define(eq=False)
class Load:
    """Clients streaming requests back to back until stopped; every outcome is kept."""

    address: tuple[str, int]
    request: bytes
    phase: str = "warmup"
    outcomes: list[Outcome] = attrs.field(factory=list)

    async def run(self, clients: int, stop: trio.Event) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(clients):
                nursery.start_soon(self._client, stop)

    async def _client(self, stop: trio.Event) -> None:
        while not stop.is_set():
            outcome = await self._one()
            self.outcomes.append(outcome)
            if outcome.kind != "ok":
                await trio.sleep(0.01)  # failing fast must not spin

    async def _one(self) -> Outcome:
        started = trio.current_time()
        ttft: float | None = None
        received = bytearray()
        kind = ""
        with trio.move_on_after(WAIT_S) as scope:
            try:
                stream = await trio.open_tcp_stream(*self.address)
            except OSError:
                kind = "connect failed"
            else:
                async with stream:
                    try:
                        await stream.send_all(self.request)
                        while chunk := await stream.receive_some(65536):
                            received += chunk
                            if ttft is None and b'"text"' in received:
                                ttft = trio.current_time() - started
                    except (trio.BrokenResourceError, OSError):
                        pass
        if scope.cancelled_caught:
            kind = "hung"
        kind = kind or _classify(bytes(received))
        tail = "" if kind == "ok" else bytes(received[-300:]).decode(errors="replace")
        return Outcome(kind, self.phase, started, trio.current_time(), ttft, tail)


def _address(service: Service) -> tuple[str, int]:
    host, port = service.address.rsplit(":", 1)
    return host, int(port)


def _failures(outcomes: Sequence[Outcome]) -> dict[str, int]:
    return dict(Counter(o.kind for o in outcomes if o.kind != "ok"))


# --- the cluster, seen from outside ---------------------------------------------------


@attrs.define(eq=False)
class Cluster:
    """The processes of a run and the means to look at them."""

    procs: Processes
    etcd: EtcdServer
    http: httpx.AsyncClient
    etcd_client: EtcdClient
    tmp: Path
    serial: Counter[str] = attrs.field(factory=Counter)

    def worker_config(self, role: str, name: str) -> dict[str, Any]:
        config = synthetic_worker_config(role, decode_step_s=DECODE_STEP_S)
        config["instance_id"] = name
        config["drain_s"] = 10.0
        config["discovery"] = {
            "etcd_endpoints": [self.etcd.endpoint],
            "prefix": PREFIX,
            "lease_ttl_s": LEASE_TTL_S,
        }
        return config

    def name(self, role: str) -> str:
        self.serial[role] += 1
        return f"{role[0]}{self.serial[role]}"

    async def start_worker(self, role: str, name: str) -> Service:
        config = self.worker_config(role, name)
        return await trio.to_thread.run_sync(lambda: self.procs.worker(config, timeout=60))

    async def start_workers(self, roles: Sequence[str]) -> list[Service]:
        """Several at once: their start-ups overlap."""
        configs = [self.worker_config(role, self.name(role)) for role in roles]
        started = [self.procs.start_worker(config) for config in configs]
        ready = []
        for process in started:
            ready.append(
                await trio.to_thread.run_sync(partial(self.procs.wait_ready, process, timeout=60))
            )
        return ready

    async def static_router(self, workers: Sequence[Service]) -> Service:
        path = write_router_config(
            self.tmp / "static-router.toml", [(w.ready["role"], w.url) for w in workers]
        )
        return await trio.to_thread.run_sync(lambda: self.procs.router(path))

    async def health(self, router: Service) -> dict[str, Any]:
        try:
            answer: dict[str, Any] = (await self.http.get(f"{router.url}/health")).json()
        except (httpx.HTTPError, ValueError):
            return {}
        return answer

    async def count(self, router: Service, role: str) -> int:
        return int((await self.health(router)).get(f"{role}_instances", -1))

    async def stats(self, worker: Service) -> dict[str, Any]:
        try:
            answer: dict[str, Any] = (await self.http.get(f"{worker.url}/pd/stats")).json()
        except (httpx.HTTPError, ValueError):
            return {}
        return answer

    async def registered(self, name: str) -> tuple[bool, int]:
        """Whether ``name`` is registered in etcd now, and etcd's revision."""
        kvs, revision = await self.etcd_client.get_prefix(PREFIX + name)
        return any(kv.key == PREFIX + name for kv in kvs), revision


async def _until_or_none(condition: Callable[[], Awaitable[bool]]) -> float | None:
    """When (trio clock) ``condition()`` first came true; None if not within WAIT_S."""
    with trio.move_on_after(WAIT_S):
        # other processes' state, seen from outside: polled
        while not await condition():  # noqa: ASYNC110
            await trio.sleep(POLL_S)
        return trio.current_time()
    return None


async def _until(condition: Callable[[], Awaitable[bool]], what: str) -> float:
    at = await _until_or_none(condition)
    if at is None:
        raise RuntimeError(f"not within {WAIT_S:g} s: {what}")
    return at


def _ms(later: float | None, earlier: float) -> float | None:
    return None if later is None else (later - earlier) * 1000


# --- 1. cost --------------------------------------------------------------------------


async def _window(
    cluster: Cluster, router: Service, idle: Service, settings: Settings
) -> dict[str, Any]:
    """One measured window of load against ``router``; ``idle`` is the other router."""
    load = Load(_address(router), _request(settings.max_tokens))
    stop = trio.Event()
    busy_tree, idle_tree = router.tree(), idle.tree()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(load.run, settings.clients, stop)
        await trio.sleep(settings.warmup_s)
        load.phase = "measure"
        cpu_start, idle_start = cpu_seconds(busy_tree), cpu_seconds(idle_tree)
        started = trio.current_time()
        await trio.sleep(settings.cost_window_s)
        cpu_end, idle_end = cpu_seconds(busy_tree), cpu_seconds(idle_tree)
        window = trio.current_time() - started
        load.phase = "tail"
        stop.set()
    measured = [o for o in load.outcomes if o.phase == "measure"]
    ok = [o for o in measured if o.kind == "ok"]
    return {
        "window_s": window,
        "requests": len(measured),
        "ok": len(ok),
        "failures": _failures(load.outcomes),
        "ttft_ms": [o.ttft_s * 1000 for o in ok if o.ttft_s is not None],
        "router_cpu_s": cpu_end - cpu_start,
        "idle_router_cpu_s": idle_end - idle_start,
    }


def _cost_summary(windows: list[dict[str, Any]]) -> dict[str, Any]:
    window_s = sum(w["window_s"] for w in windows)
    requests = sum(w["requests"] for w in windows)
    ttfts = [t for w in windows for t in w["ttft_ms"]]
    failures: Counter[str] = Counter()
    for w in windows:
        failures.update(w["failures"])
    cpu = sum(w["router_cpu_s"] for w in windows)
    return {
        "window_s": window_s,
        "requests": requests,
        "ok": sum(w["ok"] for w in windows),
        "failures": dict(failures),
        "requests_per_s": sum(w["ok"] for w in windows) / window_s,
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "router_cpu_s": cpu,
        "router_cpu_ms_per_request": cpu / requests * 1000 if requests else float("nan"),
    }


async def _cost(
    cluster: Cluster, etcd_router: Service, settings: Settings
) -> tuple[dict[str, Any], list[Service]]:
    workers = await cluster.start_workers(["prefill", "decode"])
    await _until(lambda: _routable(cluster, etcd_router, 1, 1), "the etcd router sees the pair")
    static = await cluster.static_router(workers)
    windows: dict[str, list[dict[str, Any]]] = {"static": [], "etcd": []}
    idle_cpu: dict[str, float] = {"static": 0.0, "etcd": 0.0}
    for _ in range(settings.cost_rounds):  # in turns: drift on a shared machine hits both
        for kind, busy, idle in (("static", static, etcd_router), ("etcd", etcd_router, static)):
            window = await _window(cluster, busy, idle, settings)
            windows[kind].append(window)
            idle_cpu["etcd" if kind == "static" else "static"] += window["idle_router_cpu_s"]
    await trio.to_thread.run_sync(lambda: cluster.procs.stop(static.process))
    result = {kind: _cost_summary(w) for kind, w in windows.items()}
    for kind, summary in result.items():
        other = "etcd" if kind == "static" else "static"
        summary["idle_router_cpu_ms_per_s"] = idle_cpu[kind] / result[other]["window_s"] * 1000
    return result, workers


async def _routable(cluster: Cluster, router: Service, prefill: int, decode: int) -> bool:
    health = await cluster.health(router)
    return bool(
        health.get("prefill_instances") == prefill and health.get("decode_instances") == decode
    )


# --- 2. churn ---------------------------------------------------------------------------


@attrs.define(eq=False)
class Churn:
    cluster: Cluster
    router: Service
    load: Load
    prefills: list[Service]
    decodes: list[Service]
    events: list[dict[str, Any]] = attrs.field(factory=list)
    kills: list[tuple[float, int]] = attrs.field(factory=list)
    """(when, the killed decode's requests in flight just before)."""

    async def join(self, role: str) -> None:
        """Start a worker of ``role``; etcd and the router are watched from its start on."""
        self.load.phase = f"join {role}"
        before = await self.cluster.count(self.router, role)
        name = self.cluster.name(role)
        served_field = "served_prefills" if role == "prefill" else "decode_requests"
        times: dict[str, float | None] = {}

        async def registered() -> bool:
            return (await self.cluster.registered(name))[0]

        async def routable() -> bool:
            return await self.cluster.count(self.router, role) > before

        async def wait(key: str, condition: Callable[[], Awaitable[bool]]) -> None:
            times[key] = await _until_or_none(condition)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait, "registered", registered)
            nursery.start_soon(wait, "routable", routable)
            started = trio.current_time()
            worker = await self.cluster.start_worker(role, name)
            ready = trio.current_time()

            async def served() -> bool:
                return bool((await self.cluster.stats(worker)).get(served_field))

            nursery.start_soon(wait, "served", served)
        at = times["registered"]
        (self.prefills if role == "prefill" else self.decodes).append(worker)
        self.events.append(
            {
                "event": f"join {role}",
                "start_to_ready_ms": (ready - started) * 1000,
                "start_to_registered_ms": _ms(at, started),
                "registered_to_routable_ms": None if at is None else _ms(times["routable"], at),
                "registered_to_first_served_ms": None if at is None else _ms(times["served"], at),
            }
        )

    async def leave(self, role: str) -> None:
        """SIGTERM the oldest of ``role``."""
        self.load.phase = f"leave {role}"
        workers = self.prefills if role == "prefill" else self.decodes
        worker = workers.pop(0)
        before = await self.cluster.count(self.router, role)
        times: dict[str, Any] = {}

        async def exited() -> None:
            code = await trio.to_thread.run_sync(lambda: worker.process.wait(timeout=WAIT_S))
            times["exit"], times["code"] = trio.current_time(), code

        async def gone() -> bool:
            return await self.cluster.count(self.router, role) < before

        async def wait_gone() -> None:
            times["gone"] = await _until_or_none(gone)

        async def idle() -> bool:
            stats = await self.cluster.stats(worker)
            return not stats or not any(stats.get(field) for field in _BUSY_FIELDS)

        async def wait_idle() -> None:
            times["idle"] = await _until_or_none(idle)

        sent = trio.current_time()
        worker.process.send_signal(signal.SIGTERM)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(exited)
            nursery.start_soon(wait_gone)
            nursery.start_soon(wait_idle)
        self.events.append(
            {
                "event": f"leave {role}",
                "sigterm_to_gone_ms": _ms(times["gone"], sent),
                "sigterm_to_idle_ms": _ms(times["idle"], sent),
                "sigterm_to_exit_ms": _ms(times["exit"], sent),
                "exit_code": times["code"],
            }
        )

    async def kill_decode(self) -> None:
        """SIGKILL the oldest decode once it has requests in flight."""
        self.load.phase = "kill decode"
        worker = self.decodes.pop(0)
        name = worker.ready["instance_id"]
        before = await self.cluster.count(self.router, "decode")

        async def busy() -> bool:
            return bool((await self.cluster.stats(worker)).get("decode_requests"))

        await _until(busy, "the doomed decode has requests in flight")
        in_flight = int((await self.cluster.stats(worker)).get("decode_requests", 0))
        killed = trio.current_time()
        worker.process.kill()
        self.kills.append((killed, in_flight))
        await trio.to_thread.run_sync(worker.process.wait)

        async def out() -> bool:
            return await self.cluster.count(self.router, "decode") < before

        out_at = await _until_or_none(out)
        deleted_revision = 0

        async def expired() -> bool:
            nonlocal deleted_revision
            present, deleted_revision = await self.cluster.registered(name)
            return not present

        expired_at = await _until_or_none(expired)

        async def forgotten() -> bool:
            health = await self.cluster.health(self.router)
            return int(health.get("discovery", {}).get("revision", 0)) >= deleted_revision

        forgotten_at = await _until_or_none(forgotten) if expired_at is not None else None
        self.events.append(
            {
                "event": "kill decode",
                "in_flight": in_flight,
                "kill_to_out_of_rotation_ms": _ms(out_at, killed),
                "kill_to_lease_expired_ms": _ms(expired_at, killed),
                "kill_to_forgotten_ms": _ms(forgotten_at, killed),
            }
        )

    async def settle(self, seconds: float) -> None:
        self.load.phase = "steady"
        await trio.sleep(seconds)


async def _churn(
    cluster: Cluster, router: Service, workers: list[Service], settings: Settings
) -> dict[str, Any]:
    load = Load(_address(router), _request(settings.max_tokens), phase="steady")
    churn = Churn(
        cluster,
        router,
        load,
        [w for w in workers if w.ready["role"] == "prefill"],
        [w for w in workers if w.ready["role"] == "decode"],
    )
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(load.run, settings.clients, stop)
        await churn.settle(1.0)
        for _ in range(settings.churn_rounds):
            await churn.join("prefill")
            await churn.join("decode")
            await churn.settle(0.5)
            await churn.leave("prefill")
            await churn.leave("decode")
            await churn.join("decode")
            await churn.settle(0.5)
            await churn.kill_decode()
            await churn.settle(1.0)
        load.phase = "steady"
        stop.set()
    return {
        "events": churn.events,
        "kills": churn.kills,
        "outcomes": load.outcomes,
        "workers": churn.prefills + churn.decodes,
    }


def _kill_verdict(outcomes: Sequence[Outcome], kills: Sequence[tuple[float, int]]) -> bool:
    """Every failure is a ``decode_failed`` event of a request in flight at a kill, and no
    kill failed more requests than its decode had in flight just before it."""
    failed = [o for o in outcomes if o.kind != "ok"]
    per_kill: Counter[int] = Counter()
    for o in failed:
        at = [i for i, (when, _) in enumerate(kills) if o.started < when <= o.ended]
        if o.kind != "error event decode_failed" or not at:
            return False
        per_kill[at[0]] += 1
    return all(per_kill[i] <= in_flight for i, (_, in_flight) in enumerate(kills))


# --- 3. etcd outages ----------------------------------------------------------------------


async def _outage(
    cluster: Cluster, router: Service, load: Load, seconds: float, index: int
) -> dict[str, Any]:
    load.phase = f"outage {index}"
    stopping = trio.current_time()
    await cluster.etcd.stop()
    stopped = trio.current_time()
    noticed: float | None = None
    flickers = 0
    # how long ago /health says the router was last in touch with etcd, against the truth
    contact_behind_s = 0.0
    with trio.move_on_at(stopping + seconds):
        while True:  # /health through the outage: does it ever say connected?
            discovery = (await cluster.health(router)).get("discovery", {})
            said = discovery.get("connected")
            if said is False and noticed is None:
                noticed = trio.current_time()
            elif said and noticed is not None:
                flickers += 1
            if "last_contact_s_ago" in discovery:
                truth = trio.current_time() - stopping
                contact_behind_s = max(contact_behind_s, truth - discovery["last_contact_s_ago"])
            await trio.sleep(0.05)
    down_s = trio.current_time() - stopping
    load.phase = f"restart {index}"
    await cluster.etcd.start()
    restarted = trio.current_time()
    marker = f"{PREFIX}bench-marker-{index}"
    await cluster.etcd_client.put(marker, b"not a registration")

    async def connected() -> bool:
        return bool((await cluster.health(router)).get("discovery", {}).get("connected"))

    async def watching() -> bool:
        ignored = (await cluster.health(router)).get("ignored", [])
        return any(entry.get("key") == marker for entry in ignored)

    connected_at = await _until_or_none(connected)
    watching_at = await _until_or_none(watching)
    await cluster.etcd_client.delete(marker)
    kvs, _ = await cluster.etcd_client.get_prefix(PREFIX)
    load.phase = f"after outage {index}"
    await trio.sleep(1.0)
    return {
        "down_s": down_s,
        "stop_ms": (stopped - stopping) * 1000,
        "stop_to_noticed_ms": _ms(noticed, stopping),
        "connected_flickers": flickers,
        "last_contact_understated_s": contact_behind_s,
        "restart_to_connected_ms": _ms(connected_at, restarted),
        "restart_to_watch_live_ms": _ms(watching_at, restarted),
        "registrations_after": len(kvs),
    }


async def _outages(cluster: Cluster, router: Service, settings: Settings) -> dict[str, Any]:
    load = Load(_address(router), _request(settings.max_tokens), phase="before outage")
    stop = trio.Event()
    rows = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(load.run, settings.clients, stop)
        await trio.sleep(1.0)
        for index, seconds in enumerate(settings.outages_s, 1):
            row = await _outage(cluster, router, load, seconds, index)
            phases = {f"outage {index}", f"restart {index}", f"after outage {index}"}
            mine = [o for o in load.outcomes if o.phase in phases]
            row.update(ok=sum(o.kind == "ok" for o in mine), failures=_failures(mine))
            rows.append(row)
        stop.set()
    return {"outages": rows, "outcomes": load.outcomes}


# --- the run --------------------------------------------------------------------------------


async def _run(procs: Processes, settings: Settings, tmp: Path) -> dict[str, Any]:
    async with (
        running_etcd() as etcd,
        EtcdClient([etcd.endpoint]) as etcd_client,
        httpx.AsyncClient(timeout=5, trust_env=False) as http,
    ):
        cluster = Cluster(procs, etcd, http, etcd_client, tmp)
        try:
            # the etcd router first: /health is 503 until a pair registers
            router = await trio.to_thread.run_sync(
                lambda: _start_unhealthy_router(cluster.procs, tmp, etcd.endpoint)
            )
            started = time.monotonic()
            cost, workers = await _cost(cluster, router, settings)
            cost_s = time.monotonic() - started
            started = time.monotonic()
            churn = await _churn(cluster, router, workers, settings)
            churn_s = time.monotonic() - started
            started = time.monotonic()
            outages = await _outages(cluster, router, settings)
            outages_s = time.monotonic() - started
        finally:
            # workers deregister while etcd still runs; then etcd stops
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(procs.close)
    return {
        "cost": cost,
        "churn": churn,
        "outages": outages,
        "part_seconds": {"cost": cost_s, "churn": churn_s, "outages": outages_s},
    }


def _start_unhealthy_router(procs: Processes, tmp: Path, endpoint: str) -> Service:
    """The etcd router, started before any worker: waited for until it answers at all."""
    path = tmp / "etcd-router.toml"
    path.write_text(
        f"[discovery]\netcd_endpoints = [{json.dumps(endpoint)}]\nprefix = {json.dumps(PREFIX)}\n"
    )
    router = procs.start_router(path)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if router.process.poll() is not None:
            raise RuntimeError(f"the etcd router exited with status {router.process.returncode}")
        try:
            httpx.get(f"{router.url}/health", timeout=1)
            return router
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("the etcd router did not answer /health")


def run(settings: Settings) -> dict[str, Any]:
    if etcd_binary() is None:
        raise SystemExit("etcd is not installed (apt-get install -y etcd-server)")
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, Processes(stop_grace_s=15) as procs:
        result = trio.run(_run, procs, settings, Path(tmp))
    result["total_s"] = time.monotonic() - started
    result["settings"] = attrs.asdict(settings)
    result["goals"] = _goals(result)
    return result


# --- the report --------------------------------------------------------------------------


def _goals(r: dict[str, Any]) -> list[dict[str, Any]]:
    churn = r["churn"]
    graceful = [o for o in churn["outcomes"] if o.kind != "ok" and o.phase != "kill decode"]
    outage_failures = sum(sum(o["failures"].values()) for o in r["outages"]["outages"])
    ratio = (
        r["cost"]["etcd"]["router_cpu_ms_per_request"]
        / r["cost"]["static"]["router_cpu_ms_per_request"]
    )
    leaves = [e for e in churn["events"] if e["event"].startswith("leave")]
    return [
        {
            "goal": "0 failed requests from graceful joins/leaves",
            "value": len(graceful),
            "pass": not graceful and all(e["exit_code"] == 0 for e in leaves),
        },
        {
            "goal": "only the killed worker's in-flight requests fail",
            "value": sum(o.kind != "ok" for o in churn["outcomes"] if o.phase == "kill decode"),
            "pass": _kill_verdict(churn["outcomes"], churn["kills"]),
        },
        {
            "goal": "0 failed during the etcd outage",
            "value": outage_failures,
            "pass": outage_failures == 0,
        },
        {
            "goal": "discovery adds no CPU per request (ratio <= 1.1)",
            "value": round(ratio, 3),
            "pass": ratio <= 1.1,
        },
    ]


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or value != value else f"{value:.{digits}f}"


def _stats_ms(values: Sequence[float | None]) -> str:
    known = [v for v in values if v is not None]
    missing = len(values) - len(known)
    if not known:
        return "never"
    text = f"{_f(percentile(known, 50))} / {_f(max(known))}"
    return text + (f" ({missing} never)" if missing else "")


def render(r: dict[str, Any]) -> str:
    s = r["settings"]
    cost = r["cost"]
    a, b = cost["static"], cost["etcd"]
    lines = [
        f"## 1. cost: {s['clients']} streaming clients, max_tokens {s['max_tokens']}, "
        f"{s['cost_rounds']} x {s['cost_window_s']:g} s windows per router, in turns",
        "",
    ]
    cost_rows = []
    for label, key, digits in (
        ("requests/s", "requests_per_s", 1),
        ("TTFT p50 ms", "ttft_p50_ms", 1),
        ("TTFT p99 ms", "ttft_p99_ms", 1),
        ("router CPU ms/request", "router_cpu_ms_per_request", 2),
        ("router CPU while idle, ms/s", "idle_router_cpu_ms_per_s", 1),
    ):
        ratio = b[key] / a[key] if a[key] else float("nan")
        cost_rows.append([label, _f(a[key], digits), _f(b[key], digits), f"{ratio:.2f}"])
    cost_rows.append(
        [
            "requests ok / failed",
            f"{a['ok']} / {sum(a['failures'].values())}",
            f"{b['ok']} / {sum(b['failures'].values())}",
            "",
        ]
    )
    header = ["measure", "(a) static list", "(b) etcd", "(b)/(a)"]
    lines.append(markdown_table(header, cost_rows, align="lrrr"))

    churn = r["churn"]
    lines += [
        "",
        f"## 2. churn under load (etcd router, {s['churn_rounds']} round(s), lease TTL "
        f"{LEASE_TTL_S} s)",
        "",
    ]
    rows: list[tuple[str, str, str]] = [
        ("join prefill", "registered -> routable (/health)", "registered_to_routable_ms"),
        ("join prefill", "registered -> first prefill served", "registered_to_first_served_ms"),
        ("join decode", "registered -> routable (/health)", "registered_to_routable_ms"),
        ("join decode", "registered -> first decode served", "registered_to_first_served_ms"),
        ("join (all)", "process start -> registered in etcd", "start_to_registered_ms"),
        ("leave prefill", "SIGTERM -> gone from /health", "sigterm_to_gone_ms"),
        ("leave prefill", "SIGTERM -> nothing running (/pd/stats)", "sigterm_to_idle_ms"),
        ("leave prefill", "SIGTERM -> process exit", "sigterm_to_exit_ms"),
        ("leave decode", "SIGTERM -> gone from /health", "sigterm_to_gone_ms"),
        ("leave decode", "SIGTERM -> nothing running (/pd/stats)", "sigterm_to_idle_ms"),
        ("leave decode", "SIGTERM -> process exit", "sigterm_to_exit_ms"),
        ("kill decode", "SIGKILL -> out of rotation", "kill_to_out_of_rotation_ms"),
        ("kill decode", "SIGKILL -> lease expired in etcd", "kill_to_lease_expired_ms"),
        ("kill decode", "SIGKILL -> forgotten by the router", "kill_to_forgotten_ms"),
    ]
    event_rows = []
    for event, label, key in rows:
        values = [
            e[key]
            for e in churn["events"]
            if e["event"] == event or (event == "join (all)" and e["event"].startswith("join"))
        ]
        event_rows.append([event, str(len(values)), label, _stats_ms(values)])
    header = ["event", "n", "measure", "p50 / max ms"]
    lines.append(markdown_table(header, event_rows, align="lrlr"))
    leaves = [e for e in churn["events"] if e["event"].startswith("leave")]
    kills = [e for e in churn["events"] if e["event"] == "kill decode"]
    by_phase: dict[str, list[Outcome]] = {}
    for o in churn["outcomes"]:
        by_phase.setdefault(o.phase, []).append(o)
    phase_rows = []
    for phase, outcomes in sorted(by_phase.items()):
        failures = _failures(outcomes)
        phase_rows.append(
            [
                phase,
                str(sum(o.kind == "ok" for o in outcomes)),
                str(sum(failures.values())),
                str(failures or ""),
            ]
        )
    header = ["requests during", "ok", "failed", "failures"]
    lines += ["", markdown_table(header, phase_rows, align="lrrl")]
    lines.append(
        f"\nexit codes after SIGTERM: {dict(Counter(e['exit_code'] for e in leaves))}; "
        f"decode requests in flight just before each kill: {[e['in_flight'] for e in kills]}"
    )

    lines += [
        "",
        "## 3. etcd outages under load",
        "",
    ]
    header = [
        "etcd down s",
        "stop -> router notices ms",
        "restart -> connected ms",
        "restart -> watch live ms",
        "connected during outage (samples)",
        "last contact understated by s",
        "registrations after",
        "ok",
        "failed",
    ]
    outage_rows = [
        [
            f"{o['down_s']:.1f}",
            _f(o["stop_to_noticed_ms"]),
            _f(o["restart_to_connected_ms"]),
            _f(o["restart_to_watch_live_ms"]),
            str(o["connected_flickers"]),
            f"{o['last_contact_understated_s']:.1f}",
            str(o["registrations_after"]),
            str(o["ok"]),
            f"{sum(o['failures'].values())} {o['failures'] or ''}",
        ]
        for o in r["outages"]["outages"]
    ]
    lines.append(markdown_table(header, outage_rows, align="rrrrrrrrl"))

    lines += ["", "goals:"]
    for g in r["goals"]:
        lines.append(f"- {'PASS' if g['pass'] else 'FAIL'}  {g['goal']}  ({g['value']})")
    samples: dict[str, str] = {}
    for outcomes in (churn["outcomes"], r["outages"]["outcomes"]):
        for o in outcomes:
            if o.kind != "ok":
                samples.setdefault(o.kind, o.tail)
    for kind, tail in samples.items():
        lines.append(f"  e.g. {kind}: {tail[-200:]!r}")
    parts = r["part_seconds"]
    lines.append(
        f"\nwall: {r['total_s']:.0f} s (cost {parts['cost']:.0f} s, churn {parts['churn']:.0f} s, "
        f"outages {parts['outages']:.0f} s)"
    )
    return "\n".join(lines)


def _jsonable(r: dict[str, Any]) -> dict[str, Any]:
    def outcome(o: Outcome) -> dict[str, Any]:
        return attrs.asdict(o)

    out = dict(r)
    out["churn"] = {**r["churn"], "outcomes": [outcome(o) for o in r["churn"]["outcomes"]]}
    out["churn"].pop("workers", None)
    out["outages"] = {
        **r["outages"],
        "outcomes": [outcome(o) for o in r["outages"]["outcomes"] if o.kind != "ok"],
    }
    out["cost"] = {
        k: {kk: vv for kk, vv in v.items() if kk != "ttft_ms"} for k, v in r["cost"].items()
    }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="CI-sized: about a minute")
    parser.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    settings = Settings(
        quick=args.quick,
        clients=args.clients,
        max_tokens=32,
        cost_rounds=1 if args.quick else 2,
        cost_window_s=6.0 if args.quick else 20.0,
        warmup_s=1.0 if args.quick else 2.0,
        churn_rounds=1 if args.quick else 3,
        outages_s=(3.0,) if args.quick else (3.0, 3.0 * LEASE_TTL_S),
    )
    try:
        result = run(settings)
    except KeyboardInterrupt:
        print("interrupted: every process was stopped", file=sys.stderr)
        return 130
    print(render(result))
    write_json(args.json, _jsonable(result))
    correct = all(g["pass"] for g in result["goals"][:3])  # CPU, a timing, never fails a run
    return 0 if correct else 1


if __name__ == "__main__":
    raise SystemExit(main())
