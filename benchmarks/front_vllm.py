"""pdtrio's router in front of a real vLLM PD pair: what it adds, and the KV it leaves.

One vLLM prefill and one vLLM decode (NixlConnector, KV in CPU memory, one core
each, ``pdtrio.testing.vllm``; PDTRIO_VLLM_PYTHON and PDTRIO_VLLM_MODEL as for
``nox -s vllm``), and pdtrio's router (hypercorn, trio, its own process) over
them, decode behind a ``pdtrio.faults`` proxy:

1. latency: ``--requests`` sequential streamed completions (a 64-token prompt,
   ``--tokens`` tokens, greedy), to decode alone (it prefills itself: the
   baseline) and through the router (prefill leg, KV by NIXL, decode leg):
   TTFT and ITL medians, and the router's CPU per request (its process's CPU
   time over the run);
2. stranded KV: ``--storm`` clients that leave between the legs (the decode
   proxy holds decode's connection until the client has gone): how long
   prefill's KV stays in use after each left, from prefill's ``/metrics``;
   against the same prefill leg left with no decode (what a proxy that does
   nothing on a disconnect leaves: held until vLLM's lease, 300 s here).

vllm-router is not run (it is not installed here).

``python -m benchmarks.front_vllm [--quick] [--json PATH]``
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks.kit import aligned_table, stream_completion, write_json
from pdtrio.faults.plan import Fault
from pdtrio.faults.proxy import FaultProxy
from pdtrio.protocol.vllm_pd import prefill_body
from pdtrio.testing.processes import LOOPBACK, cpu_seconds, free_port, router_command
from pdtrio.testing.vllm import NIXL_LEASED_KV_CONFIG, SERVED_MODEL, kv_usage, vllm_pd_pair

_LEFT_ALONE_WATCH_S = 10.0


def _body(tokens: int, words: int = 64) -> dict[str, Any]:
    return {
        "model": SERVED_MODEL,
        "prompt": "one two three four " * (words // 4),
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


async def _latency(url: str, requests: int, tokens: int) -> dict[str, float]:
    ttft: list[float] = []
    itl: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        for _ in range(requests):
            result = await stream_completion(http, _body(tokens))
            if result.status != 200 or not result.arrivals:
                raise RuntimeError(f"{url}: {result.status} {result.error}")
            ttft.append(result.arrivals[0] - result.started)
            itl += [b - a for a, b in zip(result.arrivals, result.arrivals[1:], strict=False)]
    return {"ttft_ms": statistics.median(ttft) * 1000, "itl_ms": statistics.median(itl) * 1000}


async def _kv(url: str) -> float:
    return await trio.to_thread.run_sync(kv_usage, url)


async def _kv_until(url: str, held: bool, within_s: float) -> float | None:
    """Seconds until prefill's KV usage is non-zero (``held``) or zero; None: not within."""
    started = trio.current_time()
    for _ in range(int(within_s / 0.1)):
        if (await _kv(url) > 0.0) == held:
            return trio.current_time() - started
        await trio.sleep(0.1)
    return None


async def _storm(router_url: str, prefill_url: str, proxy: FaultProxy, clients: int) -> list[float]:
    """Each client leaves once prefill holds its KV; how long prefill holds it after."""
    freed_after: list[float] = []
    async with httpx.AsyncClient(timeout=300) as http:
        for _ in range(clients):
            proxy.fault = Fault(stall=True)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    functools.partial(
                        http.post, f"{router_url}/v1/completions", json=_body(16, 120)
                    )
                )
                if await _kv_until(prefill_url, held=True, within_s=60) is None:
                    raise RuntimeError("prefill never held the request's KV")
                nursery.cancel_scope.cancel()  # the client leaves
            proxy.fault = Fault()
            freed = await _kv_until(prefill_url, held=False, within_s=60)
            if freed is None:
                raise RuntimeError("prefill's KV was not freed within 60 s")
            freed_after.append(freed)
    return freed_after


async def _left_alone(prefill_url: str) -> float | None:
    """A prefill leg nobody decodes: seconds until its KV is freed (None: not in the watch)."""
    async with httpx.AsyncClient(timeout=300) as http:
        leg = prefill_body({**_body(16, 120), "stream": False})
        response = await http.post(f"{prefill_url}/v1/completions", json=leg)
        response.raise_for_status()
    return await _kv_until(prefill_url, held=False, within_s=_LEFT_ALONE_WATCH_S)


async def _run(
    args: argparse.Namespace,
    prefill_url: str,
    decode_url: str,
    proxy_port: int,
    router: subprocess.Popen[bytes],
    router_url: str,
) -> dict[str, Any]:
    report: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        proxy = FaultProxy(LOOPBACK, proxy_port, LOOPBACK, int(decode_url.rsplit(":", 1)[1]))
        await nursery.start(proxy.run)
        async with httpx.AsyncClient(timeout=5) as http:
            for _ in range(300):
                try:
                    if (await http.get(f"{router_url}/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.2)
        await _latency(decode_url, 1, 4)  # warm-up: NIXL's handshake, first compiles
        await _latency(router_url, 1, 4)
        report["decode_alone"] = await _latency(decode_url, args.requests, args.tokens)
        cpu_before = cpu_seconds([router.pid])
        report["pdtrio"] = await _latency(router_url, args.requests, args.tokens)
        report["pdtrio"]["router_cpu_ms_per_request"] = (
            (cpu_seconds([router.pid]) - cpu_before) / args.requests * 1000
        )
        report["stranded_kv_freed_after_s"] = await _storm(
            router_url, prefill_url, proxy, args.storm
        )
        report["left_alone_freed_after_s"] = await _left_alone(prefill_url)
        nursery.cancel_scope.cancel()
    return report


def _measure(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    if args.prefill_url and args.decode_url:  # a pair already running (the tests')
        return _measure_on(args, logs, args.prefill_url, args.decode_url)
    with vllm_pd_pair(logs, kv_config=NIXL_LEASED_KV_CONFIG) as (prefill, decode):
        return _measure_on(args, logs, prefill.url, decode.url)


def _measure_on(
    args: argparse.Namespace, logs: Path, prefill_url: str, decode_url: str
) -> dict[str, Any]:
    proxy_port = free_port()
    config = logs / "front-vllm.toml"
    config.write_text(
        f'[[instances]]\nkind = "vllm"\nrole = "prefill"\nurl = "{prefill_url}"\n'
        f'[[instances]]\nkind = "vllm"\nrole = "decode"\n'
        f'url = "http://{LOOPBACK}:{proxy_port}"\n'
    )
    port = free_port()
    with (logs / "router.log").open("wb") as log:
        router = subprocess.Popen(
            router_command(f"{LOOPBACK}:{port}"),
            env={**os.environ, "PDTRIO_CONFIG": str(config)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        return trio.run(
            _run, args, prefill_url, decode_url, proxy_port, router, f"http://{LOOPBACK}:{port}"
        )
    finally:
        router.terminate()
        try:
            router.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # a router that does not stop on SIGTERM is a finding: its log says where it is
            router.kill()
            router.wait()
            tail = (logs / "router.log").read_bytes()[-6000:].decode("utf-8", "replace")
            print(
                f"the router did not stop within 30 s of SIGTERM; its log ends:\n{tail}",
                file=sys.stderr,
            )
            raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few requests: a smoke run")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--storm", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--prefill-url", default="", help="a running vLLM prefill (with --decode-url)"
    )
    parser.add_argument(
        "--decode-url", default="", help="a running vLLM decode (with --prefill-url)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.tokens, args.storm = 3, 8, 1
    with tempfile.TemporaryDirectory() as tmp:
        report = _measure(args, Path(tmp))
    alone, front = report["decode_alone"], report["pdtrio"]
    rows = [
        ["decode alone (no PD)", f"{alone['ttft_ms']:.0f}", f"{alone['itl_ms']:.1f}", "-"],
        [
            "pdtrio router, PD",
            f"{front['ttft_ms']:.0f}",
            f"{front['itl_ms']:.1f}",
            f"{front['router_cpu_ms_per_request']:.1f}",
        ],
    ]
    print(
        aligned_table(
            ["path", "TTFT p50 ms", "ITL p50 ms", "router CPU ms/req"], rows, align="lrrr"
        )
    )
    stranded = report["stranded_kv_freed_after_s"]
    left = report["left_alone_freed_after_s"]
    print(
        f"\nclients gone between the legs ({len(stranded)}): prefill's KV freed after "
        f"{statistics.median(stranded):.1f} s median, {max(stranded):.1f} s max (pdtrio); "
        + (
            f"a prefill leg left alone: still held after {_LEFT_ALONE_WATCH_S:g} s "
            "(vLLM's lease: 300 s here, 30 s by default)"
            if left is None
            else f"a prefill leg left alone: freed after {left:.1f} s"
        )
    )
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
