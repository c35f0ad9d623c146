"""Soak: many clients, random disconnects and faults for a while; then nothing may be left over.

Real processes on loopback: a router (``hypercorn -k trio``, static config) over
2 prefill and 3 decode synthetic workers (the third with the ``kv_transfer_corrupt``
hook on, set at start as hooks are: it flips a byte of each block it pulls, so each of
its handoffs must be refused by decode's digest check and go on elsewhere), with a :class:`~pdtrio.faults.FaultProxy`
(run in this process) between the router and each worker's URL, so the router's
link and health probes to every worker go through it, and one in front of each
prefill's KV transfer port: prefill binds a port chosen here and advertises the
proxy's (``advertise_transfer_port``) in its ``/pd/info`` and every KV handle, so
each pull from decode goes through the proxy.  The workers run ``kv_transport =
"tcp"``: NIXL's control session would cross the proxy too, but its data moves by
UCX (shared memory, RDMA), past any TCP proxy, so a NIXL pull could not be faulted.

For ``--seconds``, concurrent clients (raw sockets, ``connection: close``) send
streamed and non-streamed completions of random ``max_tokens``; some close their
socket at a random point, some read slowly.  Meanwhile faults come at random
intervals, only ones the cluster must recover from by itself: a proxy that stalls
(past ``link_timeout_s`` or not), adds latency, resets every connection, resets
each connection after a few bytes, refuses new connections after resetting the
open ones, or a worker process SIGSTOPped for a while; on a KV transfer port, a
proxy that adds latency, caps the bandwidth, stalls (sometimes past the KV lease),
resets each connection after a few bytes or refuses.  A failed pull makes decode
reject the start (``TRANSFER_FAILED``); the router tries the other decode, and
when that fails too it goes again from the other prefill (``handoff_attempts``
rounds); only when those fail too does the client get a 503 (or, once streaming, an
error event):
the outcomes count them by error code, as they count a fault's other visible
effects; one whose code no fault explains is listed as unexplained (a bug to look
into, not a failed run).  What must hold whatever the faults did is checked once
every fault is cleared:

- a stream that has neither ended nor failed ``--hang-bound`` seconds later is hung;
- ~50 isolated disconnect probes, one at a time on the quiet cluster, measure
  the time from a client's close to its decode worker's ``kv_blocks_in_use``
  dropping back (``/pd/stats`` polled every millisecond);
- every worker's ``/pd/stats`` must come back to no blocks, no running requests,
  no leases (the router releases a failed transfer's lease; one may have to expire:
  ``kv_lease_s`` is short here, and how many did is reported) and the router's
  ``/health`` to no active requests;
- the router's memory (RSS of its process tree) at the start and the end;
- each process must exit on SIGINT, and nothing below it may outlive it.

Every completed answer is checked against the synthetic engine's (the clients ask for
greedy answers, one right text each: ``soak_goals.expected_text``); one that differs is
wrong.  Each request is attributed to the faults active in its life, and the soak prints
per fault: requests, completed, migrated (the router's access lines), failed, cut (failed
without a well-formed error) and wrong; then issue 53's goals, PASS or FAIL, and exits 1
when one is missed (``benchmarks.soak_goals``).

A request whose decode is lost goes on on another (decode migration); one that ends
``decode_failed`` all the same is split by whether every decode was under a fault at
one moment of its life (then there was nowhere to go on) or not (a recoverable fault:
the goal is none).

``--hosts`` runs the same clients and checks against a multi-host deployment on one
machine (root), one fault class at a time: :mod:`benchmarks.soak_hosts`.

``python -m benchmarks.soak [--seconds N] [--quick] [--json PATH] [--seed S] [--hosts]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from benchmarks import soak_goals
from benchmarks.kit import percentile
from benchmarks.soak_goals import FaultSpan, RequestRecord
from pdtrio.config import SyntheticEngineConfig
from pdtrio.faults import Fault, FaultProxy
from pdtrio.testing import (
    LOOPBACK,
    Processes,
    Service,
    alive,
    synthetic_worker_config,
    write_router_config,
)

LINK_TIMEOUT_S = 1.5
KV_LEASE_S = 5.0
DECODE_STEP_S = 0.005
LINK_FAULT_KINDS = (
    "stall",
    "latency",
    "reset",
    "reset_after_bytes",
    "refuse",
    "sigstop",
)
KV_FAULT_KINDS = (
    "latency",
    "bandwidth",
    "stall",
    "reset_after_bytes",
    "refuse",
)
VOCAB_SIZE = SyntheticEngineConfig().vocab_size
"""The workers' (their default): what the expected answers are computed with."""
KV_PULL_MAX_BYTES = 1500
"""About the most one pull moves here (a 200-token synthetic prompt's KV is 832 bytes)."""


@attrs.frozen
class FaultTarget:
    """A proxy the faults may hit, on the path ``name`` names, and the worker behind it."""

    name: str
    proxy: FaultProxy
    worker: Service
    kinds: tuple[str, ...]
    reset_after_bytes: tuple[int, int]
    stall_s: tuple[float, float]


@attrs.define
class Settings:
    seconds: float
    clients: int
    probes: int
    hang_bound_s: float
    max_tokens: int
    fault_gap_s: tuple[float, float]
    seed: int


@attrs.define
class Tally:
    outcomes: Counter[str] = attrs.field(factory=Counter)
    faults: Counter[str] = attrs.field(factory=Counter)
    hung: list[dict[str, Any]] = attrs.field(factory=list)
    longest_s: float = 0.0
    samples: dict[str, str] = attrs.field(factory=dict)
    """One example body per non-ok outcome."""
    causes: Counter[str] = attrs.field(factory=Counter)
    """Non-ok outcomes by the message they carry (instances and numbers elided)."""
    fault_windows: dict[int, list[tuple[float, float]]] = attrs.field(factory=dict)
    """Each target's faults, by index into the targets: from when each began to when
    it was cleared (trio clock)."""
    decode_failed_spans: list[tuple[float, float]] = attrs.field(factory=list)
    """When each request that ended ``decode_failed`` ran (trio clock)."""
    records: list[RequestRecord] = attrs.field(factory=list)
    """Every request that ended (not the hung): for the per-fault accounting."""
    spans: list[FaultSpan] = attrs.field(factory=list)
    """Every fault, labelled, from when it began to when it was cleared (trio clock)."""


def _prompt(prompt_tokens: int) -> list[int]:
    return [1 + (i * 7) % 900 for i in range(prompt_tokens)]


def _request(max_tokens: int, stream: bool, prompt_tokens: int) -> bytes:
    body = json.dumps(
        {
            "model": "synthetic",
            "prompt": _prompt(prompt_tokens),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": stream,
            "temperature": 0,  # greedy: each answer has one right text
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {LOOPBACK}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


_ERROR_CODE = re.compile(rb'"code": ?"([a-z_]+)"')
_ERROR_MESSAGE = re.compile(rb'"message": ?"((?:[^"\\]|\\.)*)"')
_INSTANCE = re.compile(r"[a-z]+@[0-9.]+:[0-9]+")
_REQUEST_ID = re.compile(r"\b(?:chat)?cmpl-[0-9a-f]+(?:-m[0-9]+)?")


def _cause(outcome: str, data: bytes) -> str:
    """``outcome`` and its error's message, with instance names and numbers elided: so
    outcomes of one cause count together."""
    found = _ERROR_MESSAGE.search(data)
    if found is None:
        return outcome
    message = _INSTANCE.sub("<instance>", found[1].decode(errors="replace"))
    message = _REQUEST_ID.sub("<request>", message)
    return f"{outcome}: {re.sub(r'[0-9]+', 'N', message)}"


EXPLAINED_CODES = frozenset(
    {
        # 503: no instance could take it (a KV pull failed on each decode, every round; no
        # prefill came within prefill_wait_s)
        "service_unavailable",
        "decode_failed",  # 502: decode failed or went silent on its link
        "timeout",  # 504: prefill did not answer in time
        "client_too_slow",  # a slow reader cut off
        "queue_full",
    }
)
"""Error codes a client may see when a worker, a link or a KV transfer is faulted."""


def _classify(data: bytes, stream: bool) -> str:
    """The outcome, and for an error the code it carries (``http 503 service_unavailable``)."""
    head, _, body = data.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return "closed before a response"
    code = _ERROR_CODE.search(body)
    suffix = f" {code[1].decode()}" if code else ""
    if status != 200:
        return f"http {status}{suffix}"
    if b'"error"' in body:
        return f"error event{suffix}"
    if stream:
        return "ok" if b"data: [DONE]" in body else "closed mid-stream"
    return "ok" if b'"choices"' in body else "closed mid-response"


# --- clients ------------------------------------------------------------------------


async def _one_request(
    address: tuple[str, int], rng: random.Random, settings: Settings, tally: Tally
) -> str:
    stream = rng.random() < 0.7
    max_tokens = rng.randint(1, settings.max_tokens)
    prompt_tokens = rng.randint(4, 200)
    request = _request(max_tokens, stream, prompt_tokens)
    roll = rng.random()
    disconnect_after = rng.uniform(0.0, 1.0) if roll < 0.25 else None
    slow = 0.25 <= roll < 0.35
    started = time.monotonic()
    began = trio.current_time()
    first_event_at: float | None = None
    received = bytearray()
    try:
        sock = await trio.open_tcp_stream(*address)
    except OSError:
        return "connect failed"
    try:
        with trio.CancelScope() as scope:
            if disconnect_after is not None:
                scope.deadline = trio.current_time() + disconnect_after
            try:
                await sock.send_all(request)
                while True:
                    if slow:
                        await trio.sleep(rng.uniform(0.02, 0.1))
                    chunk = await sock.receive_some(2048 if slow else 65536)
                    if not chunk:
                        break
                    if first_event_at is None and b"data: {" in chunk:
                        first_event_at = trio.current_time()
                    received += chunk
            except (trio.BrokenResourceError, OSError):
                pass
        if scope.cancelled_caught:
            tally.records.append(RequestRecord(began, trio.current_time(), "client disconnected"))
            return "client disconnected"
        outcome = _classify(bytes(received), stream)
        wrong, request_id = None, None
        if outcome == "ok":
            request_id, text = soak_goals.answer(bytes(received), stream)
            wrong = text != soak_goals.expected_text(_prompt(prompt_tokens), max_tokens, VOCAB_SIZE)
            if wrong:
                tally.samples.setdefault("wrong answer", text[-160:])
        ended = trio.current_time()
        ttft_s = tpot_s = None
        if outcome == "ok" and stream and not slow and first_event_at is not None:
            ttft_s = first_event_at - began
            if max_tokens > 1:  # ignore_eos: every stream is max_tokens long
                tpot_s = (ended - first_event_at) / (max_tokens - 1)
        tally.records.append(
            RequestRecord(began, ended, outcome, wrong, request_id, ttft_s, tpot_s)
        )
        if outcome != "ok":
            tally.samples.setdefault(outcome, bytes(received[-300:]).decode(errors="replace"))
            tally.causes[_cause(outcome, bytes(received))] += 1
            if outcome.endswith("decode_failed"):
                tally.decode_failed_spans.append((began, trio.current_time()))
        return outcome
    except trio.Cancelled:
        # the hang bound: a stream still under way well after every fault was cleared
        tally.hung.append(
            {
                "stream": stream,
                "max_tokens": max_tokens,
                "age_s": round(time.monotonic() - started, 2),
                "bytes": len(received),
                "tail": bytes(received[-200:]).decode(errors="replace"),
            }
        )
        raise
    finally:
        tally.longest_s = max(tally.longest_s, time.monotonic() - started)
        sock.socket.close()


async def _client(
    address: tuple[str, int], rng: random.Random, settings: Settings, until: float, tally: Tally
) -> None:
    await trio.sleep(rng.uniform(0.0, 1.0))
    while trio.current_time() < until:
        outcome = await _one_request(address, rng, settings, tally)
        tally.outcomes[outcome] += 1
        if outcome not in ("ok", "client disconnected"):
            await trio.sleep(rng.uniform(0.0, 0.05))  # failing fast must not spin


# --- faults -------------------------------------------------------------------------


async def _fault(
    kind: str,
    rng: random.Random,
    target: FaultTarget,
    on_stopped: Callable[[int, bool], None],
) -> None:
    proxy, worker = target.proxy, target.worker
    hold = rng.uniform(0.5, 3.0)
    if kind == "stall":
        proxy.update(stall=True)
        await trio.sleep(rng.uniform(*target.stall_s))
        proxy.update(stall=False)
    elif kind == "latency":
        proxy.update(latency_s=rng.uniform(0.01, 0.3))
        await trio.sleep(hold)
        proxy.update(latency_s=0.0)
    elif kind == "bandwidth":
        # 2-40 kbps: a pull of a few hundred bytes takes from a few ms to a few seconds
        proxy.update(bandwidth_bytes_per_s=rng.uniform(250.0, 5000.0))
        await trio.sleep(hold)
        proxy.update(bandwidth_bytes_per_s=None)
    elif kind == "reset":
        proxy.reset_all()
    elif kind == "reset_after_bytes":
        proxy.update(reset_after_bytes=rng.randint(*target.reset_after_bytes))
        await trio.sleep(hold)
        proxy.update(reset_after_bytes=None)
    elif kind == "refuse":
        proxy.update(refuse=True)
        proxy.reset_all()
        await trio.sleep(hold)
        proxy.update(refuse=False)
    elif kind == "sigstop":
        os.kill(worker.pid, signal.SIGSTOP)
        on_stopped(worker.pid, True)
        try:
            await trio.sleep(hold)
        finally:
            os.kill(worker.pid, signal.SIGCONT)
            on_stopped(worker.pid, False)


async def _faults(
    rng: random.Random,
    settings: Settings,
    targets: list[FaultTarget],
    until: float,
    tally: Tally,
    stopped: set[int],
) -> None:
    busy: set[int] = set()

    def on_stopped(pid: int, is_stopped: bool) -> None:
        (stopped.add if is_stopped else stopped.discard)(pid)

    async def apply(kind: str, index: int) -> None:
        began = trio.current_time()
        try:
            await _fault(kind, rng, targets[index], on_stopped)
        finally:
            busy.discard(index)
            tally.fault_windows.setdefault(index, []).append((began, trio.current_time()))
            _record_span(tally, targets[index].name, kind, began)

    async with trio.open_nursery() as nursery:
        while True:
            await trio.sleep(rng.uniform(*settings.fault_gap_s))
            if trio.current_time() >= until:
                break
            free = [i for i in range(len(targets)) if i not in busy]
            if not free:
                continue
            index = rng.choice(free)
            kind = rng.choice(targets[index].kinds)
            busy.add(index)
            tally.faults[f"{kind} {targets[index].name}"] += 1
            nursery.start_soon(apply, kind, index)


def _record_span(tally: Tally, target: str, kind: str, began: float) -> None:
    label = f"{target} {kind}"
    kind_class = soak_goals.fault_kind(target, kind)
    tally.spans.append(FaultSpan(label, kind_class, began, trio.current_time()))


# --- measuring ----------------------------------------------------------------------


def _rss_mb(service: Service) -> float:
    total = 0
    for pid in service.tree():
        try:
            with open(f"/proc/{pid}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


async def _stats(http: httpx.AsyncClient, worker: Service) -> dict[str, Any]:
    result: dict[str, Any] = (await http.get(f"{worker.url}/pd/stats")).json()
    return result


_LEAK_FIELDS = (
    "kv_blocks_in_use",
    "running_requests",
    "kv_leases",
    "decode_requests",
    "prefills_in_progress",
)


async def _wait_healthy(
    http: httpx.AsyncClient, router: Service, within_s: float, decodes: int = 2
) -> bool:
    with trio.move_on_after(within_s):
        while True:
            try:
                health = (await http.get(f"{router.url}/health")).json()
                if health["prefill_instances"] == 2 and health["decode_instances"] == decodes:
                    return True
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            await trio.sleep(0.1)
    return False


async def _leaks(
    http: httpx.AsyncClient, router: Service, workers: list[Service], within_s: float
) -> dict[str, Any]:
    """What is still held once it all should be free: {} when nothing (leases may expire first)."""
    deadline = trio.current_time() + within_s
    while True:
        leaks: dict[str, Any] = {}
        for worker in workers:
            stats = await _stats(http, worker)
            held = {field: stats[field] for field in _LEAK_FIELDS if stats.get(field)}
            if held:
                leaks[f"{worker.ready['role']} {worker.url}"] = held
        active = (await http.get(f"{router.url}/health")).json().get("active_requests", 0)
        if active:
            leaks["router active_requests"] = active
        if not leaks or trio.current_time() > deadline:
            return leaks
        await trio.sleep(0.2)


_DIGEST_MISMATCHES = re.compile(
    rb"^pdtrio_worker_kv_digest_mismatches_total(?:\{[^}]*\})? (\S+)$", re.M
)


async def _digest_figures(http: httpx.AsyncClient, decodes: list[Service]) -> dict[str, int]:
    """The pulls the corrupt-a-byte hook damaged and the handoffs decode refused for a
    digest mismatch, over every decode (the hook is on in one)."""
    corrupted = mismatches = 0
    for decode in decodes:
        info = (await http.get(f"{decode.url}/pd/info")).json()
        corrupted += info["kv_transport"].get("fault_hooks", {}).get("corrupted_pulls", 0)
        metrics = (await http.get(f"{decode.url}/metrics")).content
        mismatches += sum(int(float(v)) for v in _DIGEST_MISMATCHES.findall(metrics))
    return {"corrupted_pulls": corrupted, "digest_mismatches": mismatches}


async def _probe(
    http: httpx.AsyncClient, address: tuple[str, int], decodes: list[Service]
) -> float | None:
    """One isolated disconnect: seconds from the client's close to its decode blocks' release."""
    baselines = [(await _stats(http, d))["kv_blocks_in_use"] for d in decodes]
    sock = await trio.open_tcp_stream(*address)
    try:
        await sock.send_all(_request(4000, True, 16))
        received = b""
        while received.count(b" t") < 3:
            chunk = await sock.receive_some(65536)
            if not chunk:
                return None
            received += chunk
        holder = None
        with trio.move_on_after(2.0):
            while holder is None:
                for decode, baseline in zip(decodes, baselines, strict=True):
                    if (await _stats(http, decode))["kv_blocks_in_use"] > baseline:
                        holder = (decode, baseline)
                        break
        if holder is None:
            return None
    finally:
        sock.socket.close()
    closed_at = time.perf_counter()
    decode, baseline = holder
    with trio.move_on_after(10.0):
        while True:  # polled: the worker has nothing to wait on from outside
            if (await _stats(http, decode))["kv_blocks_in_use"] <= baseline:
                return time.perf_counter() - closed_at
            await trio.sleep(0.001)
    return None


# --- the run ------------------------------------------------------------------------


async def _soak(
    procs: Processes,
    workers: list[Service],
    kv_ports: list[tuple[int, int] | None],
    settings: Settings,
    tmp: Path,
    corrupting: int,
) -> dict[str, Any]:
    """``kv_ports``: each prefill's bound and advertised KV transfer port (None: not a prefill);
    ``corrupting``: the index of the decode whose every pull is damaged."""
    rng = random.Random(settings.seed)
    tally = Tally()
    stopped: set[int] = set()
    result: dict[str, Any] = {}
    async with trio.open_nursery() as proxies:
        targets: list[FaultTarget] = []
        for worker in workers:
            port = int(worker.url.rsplit(":", 1)[1])
            proxy = FaultProxy(LOOPBACK, 0, LOOPBACK, port)
            await proxies.start(proxy.run)
            role = worker.ready["role"]
            targets.append(
                FaultTarget(role, proxy, worker, LINK_FAULT_KINDS, (64, 65536), (0.5, 3.0))
            )
        links = list(targets)
        for worker, ports in zip(workers, kv_ports, strict=True):
            if ports is None:
                continue
            bound, advertised = ports
            # what prefill advertises: the proxy, in front of the port prefill bound
            assert worker.ready["transfer_port"] == advertised, worker.ready
            proxy = FaultProxy(LOOPBACK, advertised, LOOPBACK, bound)
            await proxies.start(proxy.run)
            # a stall past the KV lease: the pull it held finds the lease gone
            stall_s = (0.5, KV_LEASE_S + 2.0)
            targets.append(
                FaultTarget(
                    "prefill KV", proxy, worker, KV_FAULT_KINDS, (1, KV_PULL_MAX_BYTES), stall_s
                )
            )
        config = write_router_config(
            tmp / "router.toml",
            [(t.worker.ready["role"], f"http://{LOOPBACK}:{t.proxy.listen_port}") for t in links],
            router={
                "link_timeout_s": LINK_TIMEOUT_S,
                "link_heartbeat_s": 0.5,
                "request_timeout_s": 120.0,
            },
        )
        router = await trio.to_thread.run_sync(lambda: procs.router(config, output="capture"))
        host, port_text = router.address.rsplit(":", 1)
        address = (host, int(port_text))
        limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
        async with httpx.AsyncClient(timeout=30, limits=limits) as http:
            decode_count = sum(w.ready["role"] == "decode" for w in workers)
            if not await _wait_healthy(http, router, 30, decode_count):
                raise RuntimeError("the router never saw all its workers")
            # warm up the router before its memory is the baseline
            async with trio.open_nursery() as warmup:
                for i in range(16):
                    warmup.start_soon(_one_request, address, random.Random(i), settings, Tally())
            result["router_rss_start_mb"] = _rss_mb(router)

            started = trio.current_time()
            until = started + settings.seconds
            # the corrupting decode damages every pull it makes, all along
            tally.spans.append(FaultSpan("decode corrupt", soak_goals.KV_PATH, started, until))
            tally.fault_windows[corrupting] = [(started, until)]  # it can take no request
            try:
                with trio.CancelScope(deadline=until + settings.hang_bound_s):
                    async with trio.open_nursery() as load:
                        load.start_soon(_faults, rng, settings, targets, until, tally, stopped)
                        for _ in range(settings.clients):
                            seed = rng.randrange(2**32)
                            load.start_soon(
                                _client, address, random.Random(seed), settings, until, tally
                            )
            finally:
                for target in targets:  # every fault cleared, whatever happened
                    target.proxy.fault = Fault()
                for pid in stopped:
                    os.kill(pid, signal.SIGCONT)
            result["soak_s"] = trio.current_time() - started
            result["healthy_again"] = await _wait_healthy(http, router, 30, decode_count)

            decodes = [w for w in workers if w.ready["role"] == "decode"]
            times = []
            probe_failures = 0
            for _ in range(settings.probes):
                probe = None
                with trio.move_on_after(15.0):
                    probe = await _probe(http, address, decodes)
                if probe is None:
                    probe_failures += 1
                else:
                    times.append(probe)
            result["leaks"] = await _leaks(http, router, workers, KV_LEASE_S * 2 + 10)
            prefills = [w for w in workers if w.ready["role"] == "prefill"]
            result["kv_leases_expired"] = sum(
                [(await _stats(http, p)).get("kv_leases_expired", 0) for p in prefills]
            )
            result["kv_digest"] = await _digest_figures(http, decodes)
        result["kv_connections_proxied"] = sum(
            t.proxy.counters.connections_accepted for t in targets[len(links) :]
        )
        result["router_rss_end_mb"] = _rss_mb(router)
        result["processes"] = await trio.to_thread.run_sync(
            lambda: _stop_all(procs, [router, *workers])
        )
        proxies.cancel_scope.cancel()
    result.update(
        outcomes=dict(tally.outcomes),
        unexplained_outcomes=_unexplained(tally.outcomes),
        requests=sum(tally.outcomes.values()),
        faults=dict(sorted(tally.faults.items())),
        faults_total=sum(tally.faults.values()),
        hung=tally.hung,
        longest_request_s=tally.longest_s,
        samples=tally.samples,
        causes=dict(tally.causes.most_common()),
        decode_failed=_decode_failed_by_fault(tally, targets),
        **_accounting(tally, procs.output(router.process), result),
        probes=len(times),
        probe_failures=probe_failures,
        disconnect_to_free_p50_ms=percentile(times, 50) * 1000,
        disconnect_to_free_p99_ms=percentile(times, 99) * 1000,
        disconnect_to_free_max_ms=max(times, default=float("nan")) * 1000,
    )
    return result


def _stop_all(procs: Processes, services: list[Service]) -> dict[str, Any]:
    """Stop each as documented (the router first: SIGTERM; a worker: its stdin closes).

    Reports exit statuses and any process of a tree that outlived it.
    """
    statuses: dict[str, int | None] = {}
    left_behind: list[int] = []
    for service in services:
        tree = service.tree()
        process = service.process
        if process.stdin is not None:
            process.stdin.close()
        else:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass  # procs.stop below kills it; its status says so
        deadline = time.monotonic() + 5.0
        while any(alive(pid) for pid in tree[1:]) and time.monotonic() < deadline:
            time.sleep(0.05)
        left_behind += [pid for pid in tree if alive(pid)]
        procs.stop(process, grace_s=1.0)  # whatever is left: SIGINT, then SIGKILL
        statuses[f"{service.ready.get('role', 'router')} {service.url}"] = process.returncode
    return {"exit_statuses": statuses, "left_behind": left_behind}


# ports picked now and bound later: below Linux's ephemeral range (32768-60999), where the
# kernel hands out port 0 binds, so nothing started meanwhile can take them
_PICKED_PORTS = range(20000, 32000)


def _free_ports(count: int, taken: list[tuple[int, int] | None]) -> list[int]:
    """``count`` free ports, none of them one already ``taken`` (each pick is closed again)."""
    used = {port for ports in taken if ports is not None for port in ports}
    picked: list[int] = []
    rng = random.Random()
    while len(picked) < count:
        port = rng.choice(_PICKED_PORTS)
        if port in used:
            continue
        with socket.socket() as probe:
            try:
                probe.bind((LOOPBACK, port))
            except OSError:
                continue
        used.add(port)
        picked.append(port)
    return picked


def run(settings: Settings) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, Processes(stop_grace_s=30) as procs:
        started = []
        kv_ports: list[tuple[int, int] | None] = []
        for role, corrupt in (
            ("prefill", 0),
            ("prefill", 0),
            ("decode", 0),
            ("decode", 0),
            ("decode", 1),
        ):
            config = {
                **synthetic_worker_config(role, decode_step_s=DECODE_STEP_S),
                "kv_lease_s": KV_LEASE_S,
                # only TCP pulls can be faulted (NIXL's data bypasses the proxy)
                "kv_transport": "tcp",
            }
            if corrupt:  # the corrupt-a-byte fault: the hook is set at start only
                config["faults"] = {"kv_transfer_corrupt": True}
            ports: tuple[int, int] | None = None
            if role == "prefill":
                # bound and advertised; the soak's proxy listens on the second
                bound, advertised = _free_ports(2, taken=kv_ports)
                config["transfer_port"], config["advertise_transfer_port"] = bound, advertised
                ports = (bound, advertised)
            kv_ports.append(ports)
            started.append(procs.start_worker(config))
        workers = [procs.wait_ready(process) for process in started]
        corrupting = len(workers) - 1
        result = trio.run(_soak, procs, workers, kv_ports, settings, Path(tmp), corrupting)
    result["settings"] = attrs.asdict(settings)
    return result


MIGRATION_BOUND_S = 3 * LINK_TIMEOUT_S + 5.0
"""How long the router may go on trying to place a request whose decode or prefill was cut
off: ``migration_limit`` (3) link timeouts, then ``decode_reconnect_wait_s`` (5 s); the
defaults, which the soak's router runs with."""

RECONNECT_S = 1.0
"""How long a faulted link takes to come back once its fault is cleared: the router
retries a lost link every 0.5 s, then connects and gets decode's first report."""


def _every_decode_faulted(
    span: tuple[float, float], windows: list[list[tuple[float, float]]]
) -> bool:
    """Whether, at some moment of ``span``, each decode was under a fault (or coming back
    from one, ``RECONNECT_S``): nowhere to continue a request then."""
    start, end = span
    # the moments where that may begin: the span's start, or a fault's
    for moment in [start, *(began for w in windows for began, _ in w)]:
        if not start <= moment <= end:
            continue
        if all(
            any(began <= moment <= cleared + RECONNECT_S for began, cleared in w) for w in windows
        ):
            return True
    return False


def _decode_failed_by_fault(tally: Tally, targets: Sequence[FaultTarget]) -> dict[str, int]:
    """The requests that ended ``decode_failed``: while every decode was faulted at once
    (nowhere to continue them), or not (a recoverable fault: there must be none)."""
    windows = [
        tally.fault_windows.get(index, [])
        for index, target in enumerate(targets)
        if target.name == "decode"
    ]
    unrecoverable = sum(_every_decode_faulted(span, windows) for span in tally.decode_failed_spans)
    return {
        "every_decode_faulted": unrecoverable,
        "recoverable": len(tally.decode_failed_spans) - unrecoverable,
    }


def _accounting(
    tally: Tally,
    router_output: bytes,
    result: dict[str, Any],
    judged: Sequence[str] = (),
) -> dict[str, Any]:
    """The per-fault table and the goals, each met or not (``judged``: the goal classes
    that must have had requests)."""
    by_label, by_kind = soak_goals.account(
        tally.records,
        tally.spans,
        soak_goals.migrated_request_ids(router_output),
        settle_s=RECONNECT_S,
    )
    # every request, under faults of several classes too
    everything = soak_goals.Row(wrong=sum(bool(record.wrong) for record in tally.records))
    failed_s, every_s = soak_goals.after_partition_s(tally.records, tally.spans, RECONNECT_S)
    met = soak_goals.goals(
        by_kind,
        everything,
        result["leaks"],
        len(tally.hung),
        result.get("kv_digest"),
        (failed_s, LINK_TIMEOUT_S + MIGRATION_BOUND_S),
        judged=judged,
    )
    return {
        "after_partition_longest_s": {"failed": failed_s, "any": every_s},
        "per_fault": {label: attrs.asdict(row) for label, row in by_label.items()},
        "per_goal_class": {kind: attrs.asdict(row) for kind, row in by_kind.items()},
        "goals": [{"goal": goal, "met": ok} for goal, ok in met],
    }


def _unexplained(outcomes: dict[str, int]) -> dict[str, int]:
    """Outcomes no injected fault accounts for: a bug to look into, though no leak."""
    return {
        outcome: count
        for outcome, count in outcomes.items()
        if outcome not in ("ok", "client disconnected")
        and outcome.rsplit(" ", 1)[-1] not in EXPLAINED_CODES
    }


def render(r: dict[str, Any]) -> str:
    lines = [f"soak {r['soak_s']:.1f} s, {r['settings']['clients']} clients"]
    lines.append(f"  requests run         {r['requests']}")
    for outcome, count in sorted(r["outcomes"].items(), key=lambda item: -item[1]):
        lines.append(f"    {outcome:36} {count:6d}")
    lines.append(f"  unexplained outcomes {r['unexplained_outcomes'] or 0}")
    lines.append(f"  faults injected      {r['faults_total']}")
    for kind, count in r["faults"].items():
        lines.append(f"    {kind:36} {count:6d}")
    if "kv_pulls" in r:
        lines.append(f"  KV pulls             {r['kv_pulls']} (NIXL over UCX's TCP, across hosts)")
        lines.append(f"  namespaces left      {r['bed']['namespaces_left'] or 0}")
    else:
        lines.append(f"  KV pulls proxied     {r['kv_connections_proxied']} connections")
    if "kv_digest" in r:
        digest = r["kv_digest"]
        lines.append(
            f"  KV digest            {digest['corrupted_pulls']} pulls corrupted, "
            f"{digest['digest_mismatches']} mismatches detected"
        )
    lines.append(f"  healthy again        {r['healthy_again']}")
    lines.append(f"  leaks                {r['leaks'] or 0}")
    lines.append(f"  KV leases expired    {r['kv_leases_expired']}")
    lines.append(f"  hung streams         {len(r['hung'])}")
    lines.append(f"  longest request      {r['longest_request_s']:.1f} s")
    lines.append(
        f"  disconnect to free   p50 {r['disconnect_to_free_p50_ms']:.1f} ms, "
        f"p99 {r['disconnect_to_free_p99_ms']:.1f} ms ({r['probes']} probes, {r['probe_failures']} failed; goal < 50 ms)"
    )
    lines.append(
        f"  router RSS           {r['router_rss_start_mb']:.1f} -> {r['router_rss_end_mb']:.1f} MB"
    )
    processes = r["processes"]
    lines.append(f"  left behind          {processes['left_behind'] or 0}")
    lines.append(f"  exit statuses        {dict(Counter(processes['exit_statuses'].values()))}")
    if "decode_failed" in r:
        lines.append(
            "  decode_failed        "
            f"{r['decode_failed']['recoverable']} while another decode was up (goal 0), "
            f"{r['decode_failed']['every_decode_faulted']} while every decode was faulted at once"
        )
    if soak_goals.PARTITION in r["per_goal_class"]:
        after = r["after_partition_longest_s"]
        lines.append(
            f"  after a partition    a request ended at most {after['any']:.1f} s later "
            f"(a failed one {after['failed']:.1f} s)"
        )
    lines.append("  failures by cause")
    for cause, count in r["causes"].items():
        lines.append(f"    {count:6d}  {cause[:150]}")
    for outcome, sample in r["samples"].items():
        lines.append(f"  e.g. {outcome}: {sample[-160:]!r}")
    for hung in r["hung"][:5]:
        lines.append(f"  hung: {hung}")
    rows = {k: soak_goals.Row(**v) for k, v in r["per_fault"].items()}
    classes = {k: soak_goals.Row(**v) for k, v in r["per_goal_class"].items()}
    lines += soak_goals.render_table(rows, classes, r.get("per_fault_leaked"))
    if "per_phase" in r:
        from benchmarks.soak_hosts import render_phases

        lines += render_phases(r)
    lines.append("  goals")
    for goal in r["goals"]:
        lines.append(f"    {'PASS' if goal['met'] else 'FAIL'}  {goal['goal']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=None, help="how long faults come")
    parser.add_argument("--quick", action="store_true", help="CI-sized: ~10 s, fewer clients")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--seed", type=int, default=None, help="for the clients and the faults")
    parser.add_argument("--clients", type=int, default=None)
    parser.add_argument(
        "--hosts",
        action="store_true",
        help="each process on its own address in network namespaces (root), NIXL over TCP, "
        "with a network's faults: silent partitions, flaps, 2%% loss, 50 ms latency",
    )
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    settings = Settings(
        seconds=args.seconds if args.seconds is not None else (8.0 if args.quick else 60.0),
        clients=args.clients if args.clients is not None else (16 if args.quick else 64),
        probes=20 if args.quick else 50,
        hang_bound_s=30.0,
        max_tokens=128 if args.quick else 256,
        fault_gap_s=(0.2, 1.0) if args.quick else (0.3, 2.0),
        seed=seed,
    )
    print(f"seed {seed}", file=sys.stderr)
    if args.hosts:
        from benchmarks.soak_hosts import run_on_hosts

        result = run_on_hosts(settings)
    else:
        result = run(settings)
    print(render(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    ok = not result["leaks"] and not result["hung"] and not result["processes"]["left_behind"]
    ok = ok and all(goal["met"] for goal in result["goals"])
    ok = ok and not result.get("bed", {}).get("namespaces_left")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
