"""``python -m benchmarks.big_inputs [--quick] [--json PATH]``: huge requests vs. the event loop.

Starts a subprocess cluster on the synthetic engine (prefill, decode, and
``hypercorn -k trio`` router), sends a few huge requests one after the other
while probing ``GET /health`` every 5 ms, and reports per request: its status,
how long it took, the /health latency p50/p99 while it ran, and the RSS of
the router and of the prefill worker before and after (from /proc/PID/statm).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import trio

from pdtrio.testing import Processes, Service, synthetic_worker_config, write_router_config

PROBE_INTERVAL_S = 5e-3
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


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def probe_health(url: str, latencies: list[float], stop: trio.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while not stop.is_set():
            started = time.perf_counter()
            response = await http.get("/health")
            latencies.append(time.perf_counter() - started)
            assert response.status_code == 200, response.text
            await trio.sleep(PROBE_INTERVAL_S)


async def measure_one(router: Service, path: str, body: bytes) -> dict[str, Any]:
    latencies: list[float] = []
    stop = trio.Event()
    async with httpx.AsyncClient(base_url=router.url, timeout=120) as http:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe_health, router.url, latencies, stop)
            await trio.sleep(0.1)  # a few probes of the quiet router first
            started = time.perf_counter()
            response = await http.post(
                path, content=body, headers={"content-type": "application/json"}
            )
            elapsed = time.perf_counter() - started
            await trio.sleep(0.05)
            stop.set()
    error = response.json().get("error") or {}
    return {
        "status": response.status_code,
        "code": error.get("code"),
        "seconds": elapsed,
        "health_p50_ms": percentile(latencies, 0.5) * 1e3,
        "health_p99_ms": percentile(latencies, 0.99) * 1e3,
        "health_max_ms": max(latencies) * 1e3,
        "probes": len(latencies),
    }


def run(quick: bool) -> list[dict[str, Any]]:
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
        for kind, path, body in bodies:
            router_before, prefill_before = rss_mb(router_pids), rss_mb([prefill.pid])
            result = trio.run(measure_one, router, path, body)
            time.sleep(0.2)  # let both processes finish freeing what the request held
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
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    header = [
        "request",
        "body MB",
        "status",
        "answer s",
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
            f"{r['health_p50_ms']:.2f}",
            f"{r['health_p99_ms']:.2f}",
            f"{r['health_max_ms']:.2f}",
            f"{r['router_rss_before_mb']:.0f} -> {r['router_rss_after_mb']:.0f}",
            f"{r['prefill_rss_before_mb']:.0f} -> {r['prefill_rss_after_mb']:.0f}",
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    out = [" | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    out.append("-+-".join("-" * w for w in widths))
    out += [" | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a tenth of each size")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = run(args.quick)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
