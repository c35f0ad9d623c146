"""2. e2e: the router as users run it, under 64 and 256 streaming clients.

See the package's docstring.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.kit import percentile
from benchmarks.token_path.measure import core_busy_ticks, router_and_load_cpus, start_role
from pdtrio.testing import Processes, cpu_seconds, synthetic_worker_config, write_router_config

CLIENTS = (64, 256)
MAX_TOKENS = 256
# quick: short enough that requests end inside its 3 s window even on a starved machine
# (256 tokens at 10 ms a step is 2.6 s each: a CI run has had a row end none)
QUICK_MAX_TOKENS = 32


def run_e2e(
    quick: bool, step_s: float
) -> tuple[list[dict[str, Any]], dict[int, dict[str, list[float]]]]:
    """The rows, and per client count the raw TTFTs and gaps in ms (for ``--plot``)."""
    router_cpu, load_cpu = router_and_load_cpus()
    warmup, measure = (2.0, 3.0) if quick else (3.0, 10.0)
    rows = []
    latencies: dict[int, dict[str, list[float]]] = {}
    with Processes() as procs, tempfile.TemporaryDirectory() as tmp:
        starting = {
            role: procs.start_worker(
                synthetic_worker_config(role, decode_step_s=step_s, num_kv_blocks=16384),
                cpus={load_cpu},
            )
            for role in ("prefill", "decode")
        }
        prefill, decode = (procs.wait_ready(p, timeout=120) for p in starting.values())
        config = write_router_config(
            Path(tmp) / "router.toml", [("prefill", prefill.url), ("decode", decode.url)]
        )
        router = procs.router(config, cpus={router_cpu})
        router_pids = router.tree()
        for clients in CLIENTS:
            spec = {
                "address": router.address,
                "clients": clients,
                "max_tokens": QUICK_MAX_TOKENS if quick else MAX_TOKENS,
                "warmup_s": warmup,
                "measure_s": measure,
            }
            load = start_role(procs, "sse-clients", spec, cpu=load_cpu)

            def sample(load_pid: int = load.pid) -> tuple[float, ...]:
                return (
                    cpu_seconds(router_pids),
                    cpu_seconds([decode.pid]),
                    cpu_seconds([prefill.pid]),
                    cpu_seconds([load_pid]),
                    *core_busy_ticks(router_cpu),
                )

            procs.read_line(load, b"MARK start", warmup + 60)
            before, wall0 = sample(), time.perf_counter()
            procs.read_line(load, b"MARK end", measure + 60)
            after, wall = sample(), time.perf_counter() - wall0
            result = json.loads(procs.read_line(load, b"RESULT ", 60))
            load.wait(timeout=30)
            latencies[clients] = {
                "ttft": [t / 1e3 for t in result.pop("ttfts_us")],
                "itl": [g / 1e3 for g in result.pop("gaps_us")],
            }
            router_s, decode_s, prefill_s, clients_s, core_busy, core_total = (
                a - b for a, b in zip(after, before, strict=True)
            )
            rows.append(
                _row(
                    clients,
                    step_s,
                    result,
                    wall,
                    router_s,
                    decode_s,
                    prefill_s + clients_s,
                    core_busy / max(1, core_total),
                )
            )
    return rows, latencies


def _row(
    clients: int,
    step_s: float,
    result: dict[str, Any],
    wall: float,
    router_s: float,
    decode_s: float,
    other_load_s: float,
    router_core_busy: float,
) -> dict[str, Any]:
    tokens = max(1, result["tokens"])
    p50s, p99s = result["client_p50s"], result["client_p99s"]
    return {
        "clients": clients,
        "decode_step_ms": step_s * 1e3,
        "offered_tokens_per_s": clients / step_s,
        "tokens": result["tokens"],
        "requests_done": result["requests_done"],
        "tokens_per_s": result["tokens"] / result["measure_s"],
        "tokens_per_event": result["tokens"] / max(1, result["events"]),
        "router_us_per_token": router_s / tokens * 1e6,
        "router_util": router_s / wall,
        "router_core_busy": router_core_busy,
        "decode_us_per_token": decode_s / tokens * 1e6,
        "router_over_decode": router_s / max(decode_s, 1e-9),
        "load_core_util": (decode_s + other_load_s) / wall,
        "itl_p50_ms": percentile(p50s, 50) * 1e3 if p50s else None,
        "itl_p99_ms": percentile(p99s, 50) * 1e3 if p99s else None,
        "itl_p99_worst_ms": max(p99s) * 1e3 if p99s else None,
        "ttft_p50_ms": result["ttft_p50"] * 1e3,
        "ttft_p99_ms": result["ttft_p99"] * 1e3,
        "connect_p99_ms": result["connect_p99"] * 1e3,
        "connect_max_ms": result["connect_max"] * 1e3,
        "failures": result["failures"],
    }
