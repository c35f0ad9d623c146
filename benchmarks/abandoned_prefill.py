"""Abandoned prefills: clients that leave during prefill, and a prefill worker that hangs.

A real router (hypercorn, trio) over one prefill and one decode worker
process on the synthetic engine, whose prefill takes ``prefill_s_per_token``
per prompt token (``--prefill-ms``: a whole prompt's prefill), with
``kv_lease_s`` long (60 s), so a lease that nobody releases shows as a wait
for its expiry:

1. storm: ``--clients`` (200) clients each send a prompt of ``--prompt-tokens``
   (about 2,000) tokens and hang up during its prefill (at a random moment of
   it, so some leave just as prefill answers);
2. storm, link stalled: the same clients, but once their prefills run the
   router's link to prefill stalls (a ``pdtrio.faults`` proxy carries it
   throughout) for ``--stall-s`` (3 s, more than ``router.link_timeout_s``), as
   the link of a prefill worker swamped by a storm does, and the clients hang
   up early in the stall: their releases wait in it, prefill answers into it,
   and the router drops the link;
3. SIGSTOP: ``--stopped-clients`` (20) such requests are sent, their clients
   stay, and the prefill worker is stopped (SIGSTOP) for ``--stop-s`` (5 s,
   more than the link timeout) while it prefills them, then resumed.

4. the same storm on the README's default cluster (``--real-model``, on unless
   ``--quick``): the embedded SmolLM2 prefill and decode workers, prompts of
   ``--prompt-tokens`` random token ids, each client hanging up 0.2-3 s after
   sending (prefill of one such prompt takes tens of seconds on two cores).

Each reports the time from the last disconnect (or the end of the stall, or
the SIGCONT) until both workers are idle, as their ``/pd/stats`` say (no
lease, no KV block in use, no request running or prefilling), the most leases
seen meanwhile, and the leases that waited out their expiry.

``python -m benchmarks.abandoned_prefill [--quick] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from benchmarks.kit import aligned_table, stream_completion, write_json
from pdtrio.peer_auth import WorkerAuth
from pdtrio.security import WORKER_SECRET_ENV, PeerCredentials
from pdtrio.testing import (
    LOOPBACK,
    Processes,
    Service,
    start_fault_proxy,
    synthetic_worker_config,
    write_router_config,
)

KV_LEASE_S = 60.0
LINK_TIMEOUT_S = 1.5
# what /pd/stats says of an idle worker: all of these zero
_BUSY_KEYS = (
    "kv_leases",
    "kv_blocks_in_use",
    "running_requests",
    "prefills_in_progress",
    "decode_requests",
)
_POLL_S = 0.02


@attrs.frozen
class Plan:
    clients: int = 200
    prompt_tokens: int = 2000
    prefill_ms: float = 1000.0  # one prompt's prefill
    stopped_clients: int = 20
    stop_s: float = 5.0
    stall_s: float = 3.0
    # each client hangs up at a random moment between these fractions of its prefill
    hang_up_from: float = 0.1
    hang_up_to: float = 1.0
    seed: int = 0


QUICK = Plan(clients=40, stopped_clients=8, stop_s=3.0, stall_s=2.5)


@attrs.define
class Cluster:
    prefill: Service
    decode: Service
    router: Service
    proxy_control_port: int  # the fault proxy's, between the router and prefill

    @property
    def workers(self) -> tuple[Service, Service]:
        return (self.prefill, self.decode)


def start_cluster(procs: Processes, tmp: Path, plan: Plan) -> Cluster:
    """One prefill and one decode worker process, and a router over them."""
    # room for every client's prompt (and completion) at once: no call refused for KV room
    blocks = math.ceil((plan.prompt_tokens + 64) / 16) * max(plan.clients, plan.stopped_clients)
    configs = [
        synthetic_worker_config(role, num_kv_blocks=max(4096, blocks + blocks // 4))
        for role in ("prefill", "decode")
    ]
    configs[0]["engine"]["synthetic"]["prefill_s_per_token"] = (
        plan.prefill_ms / 1000 / plan.prompt_tokens
    )
    started = [procs.start_worker({**config, "kv_lease_s": KV_LEASE_S}) for config in configs]
    prefill, decode = (procs.wait_ready(process) for process in started)
    # the router reaches prefill through a fault proxy (a stall on demand)
    proxy = start_fault_proxy(procs, prefill.address)
    config = write_router_config(
        tmp / "router.toml",
        [("prefill", proxy.url), ("decode", decode.url)],
        router={
            "link_timeout_s": LINK_TIMEOUT_S,
            "link_heartbeat_s": 0.5,
            "admission_queue_limit": 4 * max(plan.clients, 64),
        },
    )
    return Cluster(prefill, decode, procs.router(config, output="capture"), proxy.control_port)


async def _proxy(cluster: Cluster, line: str) -> None:
    """One control line to the fault proxy (``stall on``), answered ``ok ...``."""
    stream = await trio.open_tcp_stream(LOOPBACK, cluster.proxy_control_port)
    async with stream:
        await stream.receive_some(4096)  # its greeting: the fault in force
        await stream.send_all(line.encode() + b"\n")
        answer = await stream.receive_some(4096)
    if not answer.startswith(b"ok"):
        raise RuntimeError(f"the fault proxy answered {line!r} with {answer!r}")


def _request(plan: Plan, router: Service, *, stream: bool = True) -> bytes:
    body = json.dumps(
        {
            "model": "synthetic",
            # token ids: exactly as many tokens (the synthetic vocabulary: 1000)
            "prompt": [10 + i % 900 for i in range(plan.prompt_tokens)],
            "max_tokens": 64,
            "stream": stream,
        }
    ).encode()
    return (
        f"POST /v1/completions HTTP/1.1\r\nhost: {router.address}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _stats(http: httpx.AsyncClient, worker: Service) -> dict[str, Any]:
    answer: dict[str, Any] = (await http.get(f"{worker.url}/pd/stats")).json()
    return answer


def busy(stats: dict[str, Any]) -> bool:
    return any(stats[key] for key in _BUSY_KEYS)


async def wait_idle(cluster: Cluster, since: float, limit_s: float) -> dict[str, Any]:
    """Poll both workers' /pd/stats until both are idle (or ``limit_s`` passes): how long
    after ``since`` (trio clock) they were (None: not within the limit), the most leases
    seen, the last statistics."""
    started = since
    most_leases = 0
    async with httpx.AsyncClient(timeout=10.0) as http:
        while True:
            stats = [await _stats(http, worker) for worker in cluster.workers]
            most_leases = max(most_leases, sum(s["kv_leases"] for s in stats))
            elapsed = trio.current_time() - started
            if not any(busy(s) for s in stats):
                return {"idle_after_s": elapsed, "most_leases": most_leases, "stats": stats}
            if elapsed > limit_s:
                return {"idle_after_s": None, "most_leases": most_leases, "stats": stats}
            await trio.sleep(_POLL_S)


async def _expired(cluster: Cluster) -> int:
    async with httpx.AsyncClient(timeout=10.0) as http:
        return sum([(await _stats(http, w))["kv_leases_expired"] for w in cluster.workers])


async def _hang_up_after(
    router: Service, request: bytes, delay_s: float, start: trio.Event | None = None
) -> float:
    """Send the request, hang up ``delay_s`` later (after ``start`` is set, if given); when
    it hung up (trio clock)."""
    host, port = router.address.rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    try:
        await stream.send_all(request)
        if start is not None:
            await start.wait()
        await trio.sleep(delay_s)
    finally:
        await stream.aclose()
    return trio.current_time()


async def _wait_prefilling(cluster: Cluster, count: int, limit_s: float) -> None:
    """Until prefill says ``count`` prefills are in progress (or ``limit_s`` passed)."""
    async with httpx.AsyncClient(timeout=10.0) as http:
        # another process's statistics: asked again and again (nothing to wait on here)
        with trio.move_on_after(limit_s):
            while True:
                if (await _stats(http, cluster.prefill))["prefills_in_progress"] >= count:
                    return
                await trio.sleep(_POLL_S)


async def storm(
    cluster: Cluster, plan: Plan, idle_limit_s: float = KV_LEASE_S + 10, *, stall: bool = False
) -> dict[str, Any]:
    """``plan.clients`` clients hang up during their prefill; the time until all is idle
    (waited for up to ``idle_limit_s``).

    ``stall``: once their prefills run, the prefill link stalls for ``plan.stall_s`` and the
    clients hang up early in the stall, their prefills still running: the releases wait in
    the stall, the replies go into it, and the router drops the link."""
    rng = random.Random(plan.seed)
    request = _request(plan, cluster.router)
    prefill_s = plan.prefill_ms / 1000
    # spread over the prefill, its end included (the reply crossing the release); with a
    # stall, over the first half of the prefill left once the stall begins
    low, high = (0.0, 0.5) if stall else (plan.hang_up_from, plan.hang_up_to)
    delays = [rng.uniform(low, high) * prefill_s for _ in range(plan.clients)]
    expired_before = await _expired(cluster)
    hung_up: list[float] = []
    stalled = trio.Event() if stall else None

    async def one(delay: float) -> None:
        hung_up.append(await _hang_up_after(cluster.router, request, delay, stalled))

    stall_ended = -math.inf
    async with trio.open_nursery() as nursery:
        for delay in delays:
            nursery.start_soon(one, delay)
        if stalled is not None:
            await _wait_prefilling(cluster, plan.clients, prefill_s)
            await _proxy(cluster, "stall on")
            stalled.set()
            await trio.sleep(plan.stall_s)
            await _proxy(cluster, "stall off")
            stall_ended = trio.current_time()
    idle = await wait_idle(cluster, max(*hung_up, stall_ended), idle_limit_s)
    return {
        "stall_s": plan.stall_s if stall else 0.0,
        "clients": plan.clients,
        "prompt_tokens": plan.prompt_tokens,
        "prefill_ms": plan.prefill_ms,
        **idle,
        "leases_expired": await _expired(cluster) - expired_before,
    }


async def _stream_status(router: Service, request: bytes) -> str:
    """Send the request and read its answer to the end: its status line and last line."""
    host, port = router.address.rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    received = b""
    try:
        await stream.send_all(request)
        with trio.move_on_after(KV_LEASE_S):
            while chunk := await stream.receive_some(65536):
                received += chunk
                if received.endswith(b"0\r\n\r\n") or b"content-length" in received.lower():
                    break
    finally:
        await stream.aclose()
    return received.split(b"\r\n", 1)[0].decode("latin-1", "replace")


async def sigstop(
    cluster: Cluster, plan: Plan, idle_limit_s: float = KV_LEASE_S + 10
) -> dict[str, Any]:
    """Prefill is stopped past the link timeout while it prefills; resumed, how soon all
    is idle again (waited for up to ``idle_limit_s``)."""
    request = _request(plan, cluster.router, stream=False)
    expired_before = await _expired(cluster)
    answers: list[str] = []

    async def one() -> None:
        answers.append(await _stream_status(cluster.router, request))

    async with trio.open_nursery() as nursery:
        for _ in range(plan.stopped_clients):
            nursery.start_soon(one)
        # stopped while they prefill
        await trio.sleep(plan.prefill_ms / 1000 * 0.5)
        os.kill(cluster.prefill.pid, signal.SIGSTOP)
        try:
            await trio.sleep(plan.stop_s)
        finally:
            os.kill(cluster.prefill.pid, signal.SIGCONT)
        resumed = trio.current_time()
    idle = await wait_idle(cluster, resumed, idle_limit_s)
    statuses: dict[str, int] = {}
    for answer in answers:
        statuses[answer] = statuses.get(answer, 0) + 1
    return {
        "clients": plan.stopped_clients,
        "stop_s": plan.stop_s,
        "answers": statuses,
        **idle,
        "leases_expired": await _expired(cluster) - expired_before,
    }


_READY_INSTANCES = re.compile(r"([\w-]+) \((?:prefill|decode)[^)]*\) at (https?://[\w.:\[\]-]+)")
REAL_MODEL_SECRET = "abandoned-prefill-benchmark-secret"


async def real_model_storm(
    router: Service, workers: dict[str, str], plan: Plan, idle_limit_s: float = 120.0
) -> dict[str, Any]:
    """``plan.clients`` streaming clients of the embedded SmolLM2 cluster, each hanging up
    0.2-3 s after it sent its prompt; how soon after the last hang-up both workers are idle
    (their /pd/stats, asked with the worker secret's proof)."""
    rng = random.Random(plan.seed)
    last_hang_up = [0.0]
    outcomes: dict[str, int] = {}

    async with httpx.AsyncClient(
        base_url=router.url, timeout=120, limits=httpx.Limits(max_connections=plan.clients)
    ) as http:

        async def client(prompt: list[int], hang_up_s: float) -> None:
            with trio.move_on_after(hang_up_s) as scope:
                body = {
                    "model": "smollm2-135m-instruct",
                    "prompt": prompt,
                    "max_tokens": 16,
                    "stream": True,
                    "temperature": 0,
                }
                outcome = str((await stream_completion(http, body)).status)
            if scope.cancelled_caught:
                outcome = "hung up"
                last_hang_up[0] = max(last_hang_up[0], trio.current_time())
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

        async with trio.open_nursery() as nursery:
            for _ in range(plan.clients):
                prompt = [rng.randrange(100, 40_000) for _ in range(plan.prompt_tokens)]
                nursery.start_soon(client, prompt, rng.uniform(0.2, 3.0))
    most_leases = 0
    auth = WorkerAuth(PeerCredentials(REAL_MODEL_SECRET))
    async with httpx.AsyncClient(timeout=10.0, auth=auth) as peer:
        while True:
            stats = [(await peer.get(f"{url}/pd/stats")).json() for url in workers.values()]
            most_leases = max(most_leases, sum(s["kv_leases"] for s in stats))
            elapsed = trio.current_time() - last_hang_up[0]
            if not any(busy(s) for s in stats) or elapsed > idle_limit_s:
                break
            await trio.sleep(_POLL_S)
    return {
        "clients": plan.clients,
        "prompt_tokens": plan.prompt_tokens,
        "answers": outcomes,
        "idle_after_s": None if any(busy(s) for s in stats) else elapsed,
        "most_leases": most_leases,
        "leases_expired": sum(s["kv_leases_expired"] for s in stats),
        "stats": stats,
    }


def run_real_model(plan: Plan) -> dict[str, Any]:
    before = os.environ.get(WORKER_SECRET_ENV)
    os.environ[WORKER_SECRET_ENV] = REAL_MODEL_SECRET  # the embedded workers get it too
    try:
        with Processes(stop_grace_s=30) as procs:
            router = procs.router(None, output="capture", timeout=300)
            printed = procs.output(router.process).decode(errors="replace")
            ready = [line for line in printed.splitlines() if "router ready" in line]
            workers = dict(_READY_INSTANCES.findall(ready[-1])) if ready else {}
            if len(workers) != 2:
                raise RuntimeError(f"cannot tell the embedded workers from: {ready}")
            return trio.run(real_model_storm, router, workers, plan)
    finally:
        if before is None:
            os.environ.pop(WORKER_SECRET_ENV, None)
        else:
            os.environ[WORKER_SECRET_ENV] = before


def run(plan: Plan, *, real_model: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, Processes(stop_grace_s=30) as procs:
        cluster = start_cluster(procs, Path(tmp), plan)
        report: dict[str, Any] = {"kv_lease_s": KV_LEASE_S, "link_timeout_s": LINK_TIMEOUT_S}
        report["storm"] = trio.run(storm, cluster, plan)
        report["storm_stalled"] = trio.run(partial(storm, cluster, plan, stall=True))
        report["sigstop"] = trio.run(sigstop, cluster, plan)
    if real_model:
        report["real_model_storm"] = run_real_model(plan)
    return report


def _seconds(value: float | None) -> str:
    return f"> {KV_LEASE_S + 10:g} s (not idle)" if value is None else f"{value:.2f} s"


def table(report: dict[str, Any]) -> str:
    storm_row = report["storm"]
    stalled_row = report["storm_stalled"]
    stop_row = report["sigstop"]
    rows = [
        ("case", "until both workers idle", "most leases held", "leases expired"),
        (
            f"storm: {storm_row['clients']} clients hang up during a "
            f"{storm_row['prefill_ms']:g} ms prefill of {storm_row['prompt_tokens']} tokens",
            "from the last hang-up " + _seconds(storm_row["idle_after_s"]),
            str(storm_row["most_leases"]),
            str(storm_row["leases_expired"]),
        ),
        (
            f"the same storm, its prefill link stalled {stalled_row['stall_s']:g} s "
            f"(link timeout {report['link_timeout_s']:g} s)",
            "from the last hang-up or the stall's end " + _seconds(stalled_row["idle_after_s"]),
            str(stalled_row["most_leases"]),
            str(stalled_row["leases_expired"]),
        ),
        (
            f"SIGSTOP of prefill for {stop_row['stop_s']:g} s under {stop_row['clients']} "
            f"prefills (link timeout {report['link_timeout_s']:g} s)",
            "from SIGCONT " + _seconds(stop_row["idle_after_s"]),
            str(stop_row["most_leases"]),
            str(stop_row["leases_expired"]),
        ),
    ]
    real = report.get("real_model_storm")
    if real is not None:
        rows.append(
            (
                f"storm on the default SmolLM2 cluster: {real['clients']} clients hang up "
                f"0.2-3 s into prompts of {real['prompt_tokens']} tokens (kv_lease_s 30)",
                "from the last hang-up "
                + (
                    "> 120 s (not idle)"
                    if real["idle_after_s"] is None
                    else f"{real['idle_after_s']:.2f} s"
                ),
                str(real["most_leases"]),
                str(real["leases_expired"]),
            )
        )
    lines = [aligned_table(rows[0], rows[1:])]
    lines.append(
        f"(kv_lease_s = {report['kv_lease_s']:g}; answers while stopped: {stop_row['answers']})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer clients (CI-sized)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--clients", type=int, default=None)
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--prefill-ms", type=float, default=None)
    parser.add_argument("--stopped-clients", type=int, default=None)
    parser.add_argument("--stop-s", type=float, default=None)
    parser.add_argument("--stall-s", type=float, default=None)
    parser.add_argument("--hang-up-from", type=float, default=None)
    parser.add_argument("--hang-up-to", type=float, default=None)
    parser.add_argument(
        "--real-model",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also the storm on the embedded SmolLM2 cluster (default: on, off with --quick)",
    )
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else Plan()
    names = ("clients", "prompt_tokens", "prefill_ms", "stopped_clients", "stop_s", "stall_s")
    for name in (*names, "hang_up_from", "hang_up_to"):
        value = getattr(args, name)
        if value is not None:
            plan = attrs.evolve(plan, **{name: value})
    started = time.perf_counter()
    real_model = not args.quick if args.real_model is None else args.real_model
    report = run(plan, real_model=real_model)
    report["plan"] = attrs.asdict(plan)
    report["wall_s"] = time.perf_counter() - started
    print(table(report))
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
