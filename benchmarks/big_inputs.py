"""``python -m benchmarks.big_inputs [--quick] [--repeat N] [--json PATH]``: huge requests vs. the loop.

Starts a subprocess cluster on the synthetic engine (prefill, decode, and
``hypercorn -k trio`` router), sends a few huge requests one after the other
(each ``--repeat`` times) while probing ``GET /health`` every 5 ms (from a process of
its own, so that the sending client's own stalls are not counted), and
reports per kind of request: its status, how long it took, the /health
latency p50/p99/max from just before it until a while after its answer (the
router's heap trim runs then), and the RSS of the router and of the prefill
worker before and after (from /proc/PID/statm).  The last line compares each
process's RSS at the end with its RSS at the start (after one small request):
the goal is within 20 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks.kit import aligned_table, percentile, write_json
from pdtrio.testing import Processes, Service, synthetic_worker_config, write_router_config

PROBE_INTERVAL_S = 5e-3
# probing goes on this long after the answer: the router frees and trims then
AFTER_ANSWER_S = 0.25
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb(pids: Iterable[int]) -> float:
    """Resident memory of the processes together, in MB."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as statm:
                total += int(statm.read().split()[1]) * _PAGE
        except FileNotFoundError:
            pass  # a process that exited holds nothing
    return total / 1e6


def big_bodies(quick: bool) -> list[tuple[str, str, bytes]]:
    """(kind, path, body): built before any probe runs, so the client does not stall it."""
    scale = 10 if quick else 1
    token_ids = [(i * 7919) % 30000 for i in range(1_000_000 // scale)]
    messages = [{"role": "user", "content": f"message {i}"} for i in range(100_000 // scale)]
    prompt = "a" * (15_000_000 // scale)
    return [
        (
            f"{len(token_ids)} token ids",
            "/v1/completions",
            json.dumps({"model": "synthetic", "prompt": token_ids}).encode(),
        ),
        (
            f"{len(messages)} messages",
            "/v1/chat/completions",
            json.dumps({"model": "synthetic", "messages": messages}).encode(),
        ),
        (
            f"{len(prompt) / 1e6:g} MB prompt",
            "/v1/completions",
            json.dumps({"model": "synthetic", "prompt": prompt}).encode(),
        ),
    ]


async def probe_health(url: str) -> None:
    """``--probe URL``: GET /health every PROBE_INTERVAL_S until stdin closes, then print
    the latencies (s) as JSON.  A process of its own: the client that sends the huge
    bodies stalls its own event loop for tens of ms (httpx copying 15 MB), and a probe
    sharing that loop would count the client's stall as the router's."""
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        async with trio.open_nursery() as nursery:

            async def until_stdin_closes() -> None:
                await trio.to_thread.run_sync(sys.stdin.read)
                nursery.cancel_scope.cancel()

            nursery.start_soon(until_stdin_closes)
            print("probing", flush=True)
            while True:
                started = time.perf_counter()
                response = await http.get("/health")
                latencies.append(time.perf_counter() - started)
                assert response.status_code == 200, response.text
                await trio.sleep(PROBE_INTERVAL_S)
    print(json.dumps(latencies), flush=True)


async def send_all_of(router: Service, path: str, body: bytes, repeat: int) -> dict[str, Any]:
    """``repeat`` sends of ``body``, one after the other: the answer and its time."""
    answers: list[float] = []
    async with httpx.AsyncClient(base_url=router.url, timeout=120) as http:
        await trio.sleep(0.1)  # a few probes of the quiet router first
        for _ in range(repeat):
            started = time.perf_counter()
            response = await http.post(
                path, content=body, headers={"content-type": "application/json"}
            )
            answers.append(time.perf_counter() - started)
            await trio.sleep(AFTER_ANSWER_S)
    error = response.json().get("error") or {}
    return {
        "status": response.status_code,
        "code": error.get("code"),
        "seconds": percentile(answers, 50),
    }


def measure_one(router: Service, path: str, body: bytes, repeat: int) -> dict[str, Any]:
    """``repeat`` sends of ``body`` with /health probed all along, from another process."""
    probe = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.big_inputs", "--probe", router.url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert probe.stdin is not None and probe.stdout is not None
    try:
        assert probe.stdout.readline().strip() == "probing"
        result = trio.run(send_all_of, router, path, body, repeat)
        probe.stdin.close()  # the probe stops when its stdin closes
        latencies: list[float] = json.loads(probe.stdout.readline())
    finally:
        if not probe.stdin.closed:
            probe.stdin.close()
        probe.wait(timeout=30)
    return {
        **result,
        "health_p50_ms": percentile(latencies, 50) * 1e3,
        "health_p99_ms": percentile(latencies, 99) * 1e3,
        "health_max_ms": max(latencies) * 1e3,
        "probes": len(latencies),
    }


def run(quick: bool, repeat: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
    bodies = big_bodies(quick)
    rows: list[dict[str, Any]] = []
    with Processes(stop_grace_s=10) as procs, tempfile.TemporaryDirectory() as tmp:
        prefill_process = procs.start_worker(synthetic_worker_config("prefill"))
        decode_process = procs.start_worker(synthetic_worker_config("decode"))
        prefill = procs.wait_ready(prefill_process)
        decode = procs.wait_ready(decode_process)
        config = write_router_config(
            Path(tmp) / "router.toml", [("prefill", prefill.url), ("decode", decode.url)]
        )
        router = procs.router(config)
        router_pids = router.tree()
        # the start: after one small request (what the first one loads is not the huge ones')
        small = {"model": "synthetic", "prompt": "hi", "max_tokens": 2}
        httpx.post(f"{router.url}/v1/completions", json=small, timeout=30).raise_for_status()
        time.sleep(0.2)
        start = {"router": rss_mb(router_pids), "prefill": rss_mb([prefill.pid])}
        for kind, path, body in bodies:
            router_before, prefill_before = rss_mb(router_pids), rss_mb([prefill.pid])
            result = measure_one(router, path, body, repeat)
            rows.append(
                {
                    "kind": kind,
                    "body_mb": len(body) / 1e6,
                    **result,
                    "router_rss_before_mb": router_before,
                    "router_rss_after_mb": rss_mb(router_pids),
                    "prefill_rss_before_mb": prefill_before,
                    "prefill_rss_after_mb": rss_mb([prefill.pid]),
                }
            )
        time.sleep(1.0)
        memory = {
            "router_rss_start_mb": start["router"],
            "router_rss_end_mb": rss_mb(router_pids),
            "prefill_rss_start_mb": start["prefill"],
            "prefill_rss_end_mb": rss_mb([prefill.pid]),
        }
    return rows, memory


def memory_line(memory: dict[str, float]) -> str:
    router = memory["router_rss_end_mb"] - memory["router_rss_start_mb"]
    prefill = memory["prefill_rss_end_mb"] - memory["prefill_rss_start_mb"]
    return (
        f"RSS at the end vs. the start (goal: within 20 MB): router "
        f"{memory['router_rss_start_mb']:.0f} -> {memory['router_rss_end_mb']:.0f} MB "
        f"({router:+.0f}), prefill {memory['prefill_rss_start_mb']:.0f} -> "
        f"{memory['prefill_rss_end_mb']:.0f} MB ({prefill:+.0f})"
    )


def table(rows: list[dict[str, Any]]) -> str:
    header = [
        "request",
        "body MB",
        "status",
        "answer s",
        "probes",
        "/health p50 ms",
        "p99 ms",
        "max ms",
        "router RSS MB",
        "prefill RSS MB",
    ]
    lines = [
        [
            r["kind"],
            f"{r['body_mb']:.1f}",
            f"{r['status']} {r['code'] or ''}".strip(),
            f"{r['seconds']:.3f}",
            str(r["probes"]),
            f"{r['health_p50_ms']:.2f}",
            f"{r['health_p99_ms']:.2f}",
            f"{r['health_max_ms']:.2f}",
            f"{r['router_rss_before_mb']:.0f} -> {r['router_rss_after_mb']:.0f}",
            f"{r['prefill_rss_before_mb']:.0f} -> {r['prefill_rss_after_mb']:.0f}",
        ]
        for r in rows
    ]
    return aligned_table(header, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a tenth of each size")
    parser.add_argument("--repeat", type=int, default=3, help="sends of each huge request")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--probe", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        trio.run(probe_health, args.probe)
        return
    rows, memory = run(args.quick, args.repeat)
    print(table(rows))
    print(memory_line(memory))
    write_json(args.json, {"rows": rows, "memory": memory})


if __name__ == "__main__":
    main()
