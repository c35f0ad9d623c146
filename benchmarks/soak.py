"""Soak: many clients, random disconnects and faults for a while; then nothing may be left over.

Real processes on loopback: a router (``hypercorn -k trio``, static config) over
2 prefill and 2 decode synthetic workers, with a :class:`~pdtrio.faults.FaultProxy`
(run in this process) between the router and each worker's URL, so the router's
link and health probes to every worker go through it.  Decode pulls KV from the
port prefill advertises itself, which the router's configuration cannot point
at a proxy: that path is not faulted here.

For ``--seconds``, concurrent clients (raw sockets, ``connection: close``) send
streamed and non-streamed completions of random ``max_tokens``; some close their
socket at a random point, some read slowly.  Meanwhile faults come at random
intervals, only ones the cluster must recover from by itself: a proxy that stalls
(past ``link_timeout_s`` or not), adds latency, resets every connection, resets
each connection after a few bytes, refuses new connections after resetting the
open ones, or a worker process SIGSTOPped for a while.  Then every fault is
cleared and:

- a stream that has neither ended nor failed ``--hang-bound`` seconds later is hung;
- ~50 isolated disconnect probes, one at a time on the quiet cluster, measure
  the time from a client's close to its decode worker's ``kv_blocks_in_use``
  dropping back (``/pd/stats`` polled every millisecond);
- every worker's ``/pd/stats`` must come back to no blocks, no running requests,
  no leases (a lease may have to expire: ``kv_lease_s`` is short here) and the
  router's ``/health`` to no active requests;
- the router's memory (RSS of its process tree) at the start and the end;
- each process must exit on SIGINT, and nothing below it may outlive it.

``python -m benchmarks.soak [--seconds N] [--quick] [--json PATH] [--seed S]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from pdtrio.faults import FaultProxy
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
FAULT_KINDS = (
    "stall",
    "latency",
    "reset",
    "reset_after_bytes",
    "refuse",
    "sigstop",
)


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


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _request(max_tokens: int, stream: bool, prompt_tokens: int) -> bytes:
    body = json.dumps(
        {
            "model": "synthetic",
            "prompt": [1 + (i * 7) % 900 for i in range(prompt_tokens)],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {LOOPBACK}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def _classify(data: bytes, stream: bool) -> str:
    head, _, body = data.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return "closed before a response"
    if status != 200:
        return f"http {status}"
    if b'"error"' in body:
        return "error event"
    if stream:
        return "ok" if b"data: [DONE]" in body else "closed mid-stream"
    return "ok" if b'"choices"' in body else "closed mid-response"


# --- clients ------------------------------------------------------------------------


async def _one_request(
    address: tuple[str, int], rng: random.Random, settings: Settings, tally: Tally
) -> str:
    stream = rng.random() < 0.7
    max_tokens = rng.randint(1, settings.max_tokens)
    request = _request(max_tokens, stream, rng.randint(4, 200))
    roll = rng.random()
    disconnect_after = rng.uniform(0.0, 1.0) if roll < 0.25 else None
    slow = 0.25 <= roll < 0.35
    started = time.monotonic()
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
                    received += chunk
            except (trio.BrokenResourceError, OSError):
                pass
        if scope.cancelled_caught:
            return "client disconnected"
        outcome = _classify(bytes(received), stream)
        if outcome != "ok":
            tally.samples.setdefault(outcome, bytes(received[-300:]).decode(errors="replace"))
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
    proxy: FaultProxy,
    worker: Service,
    on_stopped: Callable[[int, bool], None],
) -> None:
    hold = rng.uniform(0.5, 3.0)
    if kind == "stall":
        proxy.update(stall=True)
        await trio.sleep(hold)
        proxy.update(stall=False)
    elif kind == "latency":
        proxy.update(latency_s=rng.uniform(0.01, 0.3))
        await trio.sleep(hold)
        proxy.update(latency_s=0.0)
    elif kind == "reset":
        proxy.reset_all()
    elif kind == "reset_after_bytes":
        proxy.update(reset_after_bytes=rng.randint(64, 65536))
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
    targets: list[tuple[FaultProxy, Service]],
    until: float,
    tally: Tally,
    stopped: set[int],
) -> None:
    busy: set[int] = set()

    def on_stopped(pid: int, is_stopped: bool) -> None:
        (stopped.add if is_stopped else stopped.discard)(pid)

    async def apply(kind: str, index: int) -> None:
        try:
            proxy, worker = targets[index]
            await _fault(kind, rng, proxy, worker, on_stopped)
        finally:
            busy.discard(index)

    async with trio.open_nursery() as nursery:
        while True:
            await trio.sleep(rng.uniform(*settings.fault_gap_s))
            if trio.current_time() >= until:
                break
            free = [i for i in range(len(targets)) if i not in busy]
            if not free:
                continue
            index = rng.choice(free)
            kind = rng.choice(FAULT_KINDS)
            busy.add(index)
            tally.faults[f"{kind} {targets[index][1].ready['role']}"] += 1
            nursery.start_soon(apply, kind, index)


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


async def _wait_healthy(http: httpx.AsyncClient, router: Service, within_s: float) -> bool:
    with trio.move_on_after(within_s):
        while True:
            try:
                health = (await http.get(f"{router.url}/health")).json()
                if health["prefill_instances"] == 2 and health["decode_instances"] == 2:
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
    procs: Processes, workers: list[Service], settings: Settings, tmp: Path
) -> dict[str, Any]:
    rng = random.Random(settings.seed)
    tally = Tally()
    stopped: set[int] = set()
    result: dict[str, Any] = {}
    async with trio.open_nursery() as proxies:
        targets: list[tuple[FaultProxy, Service]] = []
        for worker in workers:
            port = int(worker.url.rsplit(":", 1)[1])
            proxy = FaultProxy(LOOPBACK, 0, LOOPBACK, port)
            await proxies.start(proxy.run)
            targets.append((proxy, worker))
        config = write_router_config(
            tmp / "router.toml",
            [(w.ready["role"], f"http://{LOOPBACK}:{p.listen_port}") for p, w in targets],
            router={
                "link_timeout_s": LINK_TIMEOUT_S,
                "link_heartbeat_s": 0.5,
                "request_timeout_s": 120.0,
            },
        )
        router = await trio.to_thread.run_sync(lambda: procs.router(config))
        host, port_text = router.address.rsplit(":", 1)
        address = (host, int(port_text))
        limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
        async with httpx.AsyncClient(timeout=30, limits=limits) as http:
            if not await _wait_healthy(http, router, 30):
                raise RuntimeError("the router never saw all four workers")
            # warm up the router before its memory is the baseline
            async with trio.open_nursery() as warmup:
                for i in range(16):
                    warmup.start_soon(_one_request, address, random.Random(i), settings, Tally())
            result["router_rss_start_mb"] = _rss_mb(router)

            started = trio.current_time()
            until = started + settings.seconds
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
                for proxy, _ in targets:  # every fault cleared, whatever happened
                    proxy.update(stall=False, latency_s=0.0, reset_after_bytes=None, refuse=False)
                for pid in stopped:
                    os.kill(pid, signal.SIGCONT)
            result["soak_s"] = trio.current_time() - started
            result["healthy_again"] = await _wait_healthy(http, router, 30)

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
        result["router_rss_end_mb"] = _rss_mb(router)
        result["processes"] = await trio.to_thread.run_sync(
            lambda: _stop_all(procs, [router, *workers])
        )
        proxies.cancel_scope.cancel()
    result.update(
        outcomes=dict(tally.outcomes),
        requests=sum(tally.outcomes.values()),
        faults=dict(sorted(tally.faults.items())),
        faults_total=sum(tally.faults.values()),
        hung=tally.hung,
        longest_request_s=tally.longest_s,
        samples=tally.samples,
        probes=len(times),
        probe_failures=probe_failures,
        disconnect_to_free_p50_ms=_percentile(times, 0.5) * 1000,
        disconnect_to_free_p99_ms=_percentile(times, 0.99) * 1000,
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


def run(settings: Settings) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, Processes(stop_grace_s=30) as procs:
        started = [
            procs.start_worker(
                {
                    **synthetic_worker_config(role, decode_step_s=DECODE_STEP_S),
                    "kv_lease_s": KV_LEASE_S,
                }
            )
            for role in ("prefill", "prefill", "decode", "decode")
        ]
        workers = [procs.wait_ready(process) for process in started]
        result = trio.run(_soak, procs, workers, settings, Path(tmp))
    result["settings"] = attrs.asdict(settings)
    return result


def render(r: dict[str, Any]) -> str:
    lines = [f"soak {r['soak_s']:.1f} s, {r['settings']['clients']} clients"]
    lines.append(f"  requests run         {r['requests']}")
    for outcome, count in sorted(r["outcomes"].items(), key=lambda item: -item[1]):
        lines.append(f"    {outcome:30} {count:6d}")
    lines.append(f"  faults injected      {r['faults_total']}")
    for kind, count in r["faults"].items():
        lines.append(f"    {kind:30} {count:6d}")
    lines.append(f"  healthy again        {r['healthy_again']}")
    lines.append(f"  leaks                {r['leaks'] or 0}")
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
    for outcome, sample in r["samples"].items():
        lines.append(f"  e.g. {outcome}: {sample[-160:]!r}")
    for hung in r["hung"][:5]:
        lines.append(f"  hung: {hung}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=None, help="how long faults come")
    parser.add_argument("--quick", action="store_true", help="CI-sized: ~10 s, fewer clients")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--seed", type=int, default=None, help="for the clients and the faults")
    parser.add_argument("--clients", type=int, default=None)
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
    result = run(settings)
    print(render(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    ok = not result["leaks"] and not result["hung"] and not result["processes"]["left_behind"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
