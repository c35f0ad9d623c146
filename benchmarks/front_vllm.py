"""pdtrio's router in front of a real vLLM PD pair: what it adds, and the KV it leaves.

One vLLM prefill and one vLLM decode (NixlConnector, KV in CPU memory, one core
each, ``pdtrio.testing.vllm``; PDTRIO_VLLM_PYTHON and PDTRIO_VLLM_MODEL as for
``nox -s vllm``), and pdtrio's router (hypercorn, trio, its own process) over
them, decode behind a ``pdtrio.faults`` proxy:

1. latency: ``--requests`` sequential streamed completions (a 64-token prompt,
   ``--tokens`` tokens, greedy) on each path, the paths taken in turn (the
   machine's noise falls on each alike): decode alone (it prefills itself: the
   baseline) and through each router (prefill leg, KV by NIXL, decode leg):
   TTFT and ITL medians, and each router's CPU per request (its process
   tree's CPU time over the whole run, its background work included);
2. stranded KV: ``--storm`` clients that leave between the legs (the decode
   proxy holds decode's connection until the client has gone): how long
   prefill's KV stays in use after each left, from prefill's ``/metrics``, and
   how many tokens decode generated for it (decode's ``/metrics``); against the
   same prefill leg left with no decode (what a proxy that does
   nothing on a disconnect leaves: held until vLLM's lease, 300 s here);
3. vllm-router (PyPI ``vllm-router``, Rust; ``--vllm-pd-disaggregation``) over
   the same pair, decode behind the same proxy: in the same latency run and
   the same storm, after pdtrio's.  Found beside the vLLM interpreter
   (``nox -s vllm`` installs it there) or named by ``PDTRIO_VLLM_ROUTER``; the
   rows are left out, saying so, where it is not installed.  A proxy that does
   not free the KV leaves it for vLLM's lease: each such client is watched for
   ``--watch`` seconds, and the KV still held then is reported.

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
from pdtrio.protocol.vllm_pd import parse_engine_metrics, prefill_body
from pdtrio.testing.processes import (
    LOOPBACK,
    cpu_seconds,
    descendants,
    free_port,
    router_command,
)
from pdtrio.testing.vllm import NIXL_LEASED_KV_CONFIG, SERVED_MODEL, vllm_pd_pair

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


async def _interleaved_latency(
    urls: dict[str, str], pids: dict[str, int], requests: int, tokens: int
) -> dict[str, dict[str, float]]:
    """``requests`` sequential streams per path, the paths taken in turn (this machine's
    noise then falls on each alike): TTFT and ITL medians; for a router, its process
    tree's CPU over the whole run (its background work included) per request."""
    ttft: dict[str, list[float]] = {name: [] for name in urls}
    itl: dict[str, list[float]] = {name: [] for name in urls}
    clients = {name: httpx.AsyncClient(base_url=url, timeout=600) for name, url in urls.items()}
    try:

        async def one(name: str) -> None:
            result = await stream_completion(clients[name], _body(tokens))
            if result.status != 200 or not result.arrivals:
                raise RuntimeError(f"{name}: {result.status} {result.error}")
            ttft[name].append(result.arrivals[0] - result.started)
            itl[name] += [b - a for a, b in zip(result.arrivals, result.arrivals[1:], strict=False)]

        for name in urls:  # warm-up: NIXL's handshake, first compiles
            await one(name)
            ttft[name].clear()
            itl[name].clear()
        trees = {name: [pid, *descendants(pid)] for name, pid in pids.items()}
        cpu_before = {name: cpu_seconds(tree) for name, tree in trees.items()}
        order = list(urls)
        for i in range(requests):
            for name in order[i % len(order) :] + order[: i % len(order)]:
                await one(name)
        cpu = {name: cpu_seconds(tree) - cpu_before[name] for name, tree in trees.items()}
    finally:
        for client in clients.values():
            await client.aclose()
    report = {
        name: {
            "ttft_ms": statistics.median(ttft[name]) * 1000,
            "itl_ms": statistics.median(itl[name]) * 1000,
        }
        for name in urls
    }
    for name, seconds in cpu.items():
        report[name]["router_cpu_ms_per_request"] = seconds / requests * 1000
    return report


def _engine_figures(url: str) -> tuple[float, float, int]:
    """KV usage (0..1), generation tokens so far, requests running or waiting."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    load = parse_engine_metrics(text)
    generated = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:generation_tokens_total")
    )
    return load.kv_usage, generated, load.running + load.waiting


async def _figures(url: str) -> tuple[float, float, int]:
    return await trio.to_thread.run_sync(_engine_figures, url)


async def _kv(url: str) -> float:
    return (await _figures(url))[0]


async def _kv_above(url: str, level: float, within_s: float) -> bool:
    """Whether prefill's KV usage rises above ``level`` within the time."""
    with trio.move_on_after(within_s):
        while await _kv(url) <= level:  # noqa: ASYNC110 - /metrics is all there is to watch
            await trio.sleep(0.1)
        return True
    return False


async def _kv_back_to(url: str, level: float, within_s: float) -> float | None:
    """Seconds until prefill's KV usage is back to ``level`` (None: not within)."""
    started = trio.current_time()
    with trio.move_on_after(within_s):
        while await _kv(url) > level:  # noqa: ASYNC110 - as above
            await trio.sleep(0.1)
        return trio.current_time() - started
    return None


async def _decode_idle(url: str, within_s: float) -> None:
    with trio.move_on_after(within_s):
        while (await _figures(url))[2]:  # noqa: ASYNC110 - as above
            await trio.sleep(0.2)


async def _storm(
    router_url: str,
    prefill_url: str,
    decode_url: str,
    proxy: FaultProxy,
    clients: int,
    watch_s: float,
) -> dict[str, list[Any]]:
    """Each client leaves once prefill holds its KV (decode's connection held by the
    proxy until then): how long prefill holds the KV after (None: still held after
    ``watch_s``; the next client starts from what is held), and how many tokens decode
    generated for the client that left."""
    freed_after: list[float | None] = []
    spent: list[float] = []
    async with httpx.AsyncClient(timeout=600) as http:
        for _ in range(clients):
            await _decode_idle(decode_url, watch_s)
            before = await _kv(prefill_url)
            generated_before = (await _figures(decode_url))[1]
            proxy.fault = Fault(stall=True)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    functools.partial(
                        http.post, f"{router_url}/v1/completions", json=_body(16, 120)
                    )
                )
                if not await _kv_above(prefill_url, before, within_s=120):
                    raise RuntimeError("prefill never held the request's KV")
                nursery.cancel_scope.cancel()  # the client leaves
            proxy.fault = Fault()
            freed_after.append(await _kv_back_to(prefill_url, before, within_s=watch_s))
            await _decode_idle(decode_url, watch_s)
            spent.append((await _figures(decode_url))[1] - generated_before)
    return {"kv_freed_after_s": freed_after, "decode_tokens_for_gone_clients": spent}


async def _left_alone(prefill_url: str) -> float | None:
    """A prefill leg nobody decodes: seconds until its KV is freed (None: not in the watch)."""
    before = await _kv(prefill_url)
    async with httpx.AsyncClient(timeout=600) as http:
        leg = prefill_body({**_body(16, 120), "stream": False})
        response = await http.post(f"{prefill_url}/v1/completions", json=leg)
        response.raise_for_status()
    return await _kv_back_to(prefill_url, before, within_s=_LEFT_ALONE_WATCH_S)


async def _until_healthy(url: str, what: str) -> None:
    with trio.move_on_after(300):
        async with httpx.AsyncClient(timeout=30) as http:
            while True:
                try:
                    if (await http.get(f"{url}/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.2)
    raise RuntimeError(f"{what} at {url} was not healthy within 300 s")


async def _run(
    args: argparse.Namespace,
    prefill_url: str,
    decode_url: str,
    proxy_port: int,
    routers: dict[str, tuple[subprocess.Popen[bytes], str]],
) -> dict[str, Any]:
    async with trio.open_nursery() as nursery:
        proxy = FaultProxy(LOOPBACK, proxy_port, LOOPBACK, int(decode_url.rsplit(":", 1)[1]))
        await nursery.start(proxy.run)
        for name, (_, url) in routers.items():
            await _until_healthy(url, name)
        report: dict[str, Any] = await _interleaved_latency(
            {"decode_alone": decode_url} | {name: url for name, (_, url) in routers.items()},
            {name: process.pid for name, (process, _) in routers.items()},
            args.requests,
            args.tokens,
        )
        for name, (_, url) in routers.items():
            report[name]["storm"] = await _storm(
                url, prefill_url, decode_url, proxy, args.storm, args.watch
            )
        report["left_alone_freed_after_s"] = await _left_alone(prefill_url)
        nursery.cancel_scope.cancel()
    return report


def _measure(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    if args.prefill_url and args.decode_url:  # a pair already running (the tests')
        return _measure_on(args, logs, args.prefill_url, args.decode_url)
    with vllm_pd_pair(logs, kv_config=NIXL_LEASED_KV_CONFIG) as (prefill, decode):
        return _measure_on(args, logs, prefill.url, decode.url)


def vllm_router_binary() -> Path | None:
    """vllm-router's launcher: PDTRIO_VLLM_ROUTER, or beside the vLLM interpreter."""
    named = os.environ.get("PDTRIO_VLLM_ROUTER", "")
    if named:
        return Path(named)
    python = os.environ.get("PDTRIO_VLLM_PYTHON", "")
    beside = Path(python).parent / "vllm-router" if python else None
    return beside if beside is not None and beside.exists() else None


def _stopped(process: subprocess.Popen[bytes], name: str, log: Path) -> bool:
    """SIGTERM, then whether it stopped within 30 s (if not: killed, its log's tail printed)."""
    process.terminate()
    try:
        process.wait(timeout=30)
        return True
    except subprocess.TimeoutExpired:
        # a router that does not stop on SIGTERM is a finding: its log says where it is
        process.kill()
        process.wait()
        tail = log.read_bytes()[-6000:].decode("utf-8", "replace")
        print(f"{name} did not stop within 30 s of SIGTERM; its log ends:\n{tail}", file=sys.stderr)
        return False


def _measure_on(
    args: argparse.Namespace, logs: Path, prefill_url: str, decode_url: str
) -> dict[str, Any]:
    proxy_port = free_port()
    proxied_decode = f"http://{LOOPBACK}:{proxy_port}"
    config = logs / "front-vllm.toml"
    config.write_text(
        f'[[instances]]\nkind = "vllm"\nrole = "prefill"\nurl = "{prefill_url}"\n'
        f'[[instances]]\nkind = "vllm"\nrole = "decode"\nurl = "{proxied_decode}"\n'
    )
    # name -> (command, environment, URL)
    commands: dict[str, tuple[list[str], dict[str, str], str]] = {}
    port = free_port()
    commands["pdtrio"] = (
        router_command(f"{LOOPBACK}:{port}"),
        {**os.environ, "PDTRIO_CONFIG": str(config)},
        f"http://{LOOPBACK}:{port}",
    )
    binary = vllm_router_binary()
    if binary is None or args.no_vllm_router:
        print("vllm-router: not installed here (or --no-vllm-router): its rows are left out")
    else:
        port = free_port()
        commands["vllm_router"] = (
            [str(binary), "--host", LOOPBACK, "--port", str(port)]
            + ["--vllm-pd-disaggregation", "--prefill", prefill_url, "--decode", proxied_decode]
            # at start it checks the workers every 30 s by default
            + ["--worker-startup-check-interval", "1", "--log-level", "warning"],
            dict(os.environ),
            f"http://{LOOPBACK}:{port}",
        )
    routers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    try:
        for name, (command, env, url) in commands.items():
            with (logs / f"{name}.log").open("wb") as log:
                process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            routers[name] = (process, url)
        return trio.run(_run, args, prefill_url, decode_url, proxy_port, routers)
    finally:
        stuck: list[str] = []
        for name, (process, _) in routers.items():
            if not _stopped(process, name, logs / f"{name}.log"):
                stuck.append(name)
        if stuck:
            raise RuntimeError(f"did not stop within 30 s of SIGTERM: {', '.join(stuck)}")


def _freed(seconds: list[float | None], watch_s: float) -> str:
    freed = [s for s in seconds if s is not None]
    held = len(seconds) - len(freed)
    text = (
        f"freed after {statistics.median(freed):.1f} s median, {max(freed):.1f} s max"
        if freed
        else ""
    )
    if held:
        text += ("; " if text else "") + f"{held} still held after {watch_s:g} s"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few requests: a smoke run")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--storm", type=int, default=5)
    parser.add_argument(
        "--watch", type=float, default=20.0, help="seconds a left client's KV is watched"
    )
    parser.add_argument("--no-vllm-router", action="store_true", help="pdtrio's router only")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--prefill-url", default="", help="a running vLLM prefill (with --decode-url)"
    )
    parser.add_argument(
        "--decode-url", default="", help="a running vLLM decode (with --prefill-url)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.tokens, args.storm, args.watch = 3, 8, 1, 10.0
    with tempfile.TemporaryDirectory() as tmp:
        report = _measure(args, Path(tmp))
    alone = report["decode_alone"]
    rows = [
        ["decode alone (no PD)", f"{alone['ttft_ms']:.0f}", "-", f"{alone['itl_ms']:.1f}", "-", "-"]
    ]
    names = {"pdtrio": "pdtrio router, PD", "vllm_router": "vllm-router, PD"}
    for name, label in names.items():
        if name in report:
            front = report[name]
            rows.append(
                [
                    label,
                    f"{front['ttft_ms']:.0f}",
                    f"{front['ttft_ms'] - alone['ttft_ms']:+.0f}",
                    f"{front['itl_ms']:.1f}",
                    f"{front['itl_ms'] - alone['itl_ms']:+.1f}",
                    f"{front['router_cpu_ms_per_request']:.1f}",
                ]
            )
    print(
        aligned_table(
            ["path", "TTFT p50 ms", "added", "ITL p50 ms", "added", "router CPU ms/req"],
            rows,
            align="lrrrrr",
        )
    )
    print("\nclients gone between the legs, prefill's KV after each left:")
    for name, label in names.items():
        if name in report:
            storm = report[name]["storm"]
            stranded = storm["kv_freed_after_s"]
            spent = storm["decode_tokens_for_gone_clients"]
            print(
                f"  {label} ({len(stranded)}): {_freed(stranded, args.watch)}; decode generated "
                f"{statistics.median(spent):.0f} tokens (median) for each gone client "
                f"(its request: 16)"
            )
    left = report["left_alone_freed_after_s"]
    print(
        "  a prefill leg left alone (no decode, no release): "
        + (
            f"still held after {_LEFT_ALONE_WATCH_S:g} s (vLLM's lease: 300 s here, 30 s by default)"
            if left is None
            else f"freed after {left:.1f} s"
        )
    )
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
