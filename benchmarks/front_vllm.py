"""pdtrio's router in front of a real vLLM PD pair: what it adds, and the KV it leaves.

One vLLM prefill and one vLLM decode (NixlConnector, KV in CPU memory, one core
each, ``pdtrio.testing.vllm``; PDTRIO_VLLM_PYTHON and PDTRIO_VLLM_MODEL as for
``nox -s vllm``), and pdtrio's router (hypercorn, trio, its own process) over
them, decode behind a ``pdtrio.faults`` proxy:

1. latency: ``--requests`` sequential streamed completions (a 64-word prompt,
   ``--tokens`` tokens, greedy) on each path, the paths taken in turn (the
   machine's noise falls on each alike): decode alone (it prefills itself: the
   baseline; through the same proxy as the routers' decode legs, so that the
   proxy's cost is not counted as a router's) and through each router (prefill
   leg, KV by NIXL, decode leg): TTFT and ITL medians, and each router's CPU
   per request (its process tree's CPU time over the whole run, its background
   work included).  Every prompt starts with its own words, so no request finds
   another's KV in a prefix cache;
2. stranded KV: a storm of ``--storm`` clients at once that leave between the
   legs: the proxy holds each decode leg (``POST /v1/completions``; health and
   metrics reads pass) and the clients leave once every decode leg is held and
   prefill has answered them all (nothing running or waiting there, their KV
   held: vllm-router 0.1.17 sends the decode leg along with the prefill leg,
   pdtrio once prefill has answered).  Then prefill's KV in use, above
   what it was before the storm, over ``--watch`` seconds (prefill's
   ``/metrics``), when it was back to before, and how many tokens decode
   generated for the clients that left (decode's ``/metrics``); against the
   same prefill legs sent straight to prefill and left alone (what a proxy that
   does nothing on a disconnect leaves: held until vLLM's lease, 300 s here);
3. vllm-router (PyPI ``vllm-router``, Rust; ``--vllm-pd-disaggregation``) over
   the same pair, decode behind the same proxy: in the same latency run and
   the same storm, after pdtrio's.  Found beside the vLLM interpreter
   (``nox -s vllm`` installs it there) or named by ``PDTRIO_VLLM_ROUTER``; the
   rows are left out, saying so, where it is not installed.

Each router is stopped with SIGTERM at the end; one that has not stopped 30 s
later is killed, its log's tail printed, and the table says so.

Every wait is bounded by time: on two cores each vLLM instance's NIXL thread
spins a core, a request takes seconds and a ``/metrics`` read can too.  The
defaults (10 requests of 32 tokens a path, a storm of 5, 30 s watched) take
about 15 minutes there, the pair's start included.

``python -m benchmarks.front_vllm [--quick] [--json PATH]``
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import httpx
import trio

from benchmarks.kit import aligned_table, stream_completion, write_json
from pdtrio.faults.plan import Fault
from pdtrio.faults.proxy import FaultProxy
from pdtrio.protocol.engines.vllm import parse_engine_metrics, prefill_body
from pdtrio.testing.processes import (
    LOOPBACK,
    cpu_seconds,
    descendants,
    free_port,
    router_command,
)
from pdtrio.testing.vllm import NIXL_LEASED_KV_CONFIG, SERVED_MODEL, vllm_pd_pair

COMPLETION_LEGS: Final = ("POST /v1/completions", "POST /v1/chat/completions")
"""What the decode proxy holds during the storm: the legs, not the health or metrics reads."""
STORM_TOKENS: Final = 16
STORM_WORDS: Final = 120
_REACH_DECODE_S: Final = 240.0
"""How long the storm's clients are given to reach decode (prefill's answers, on one core)."""
_STOP_S: Final = 30.0
_IDLE_S: Final = 15.0
_CHECKPOINTS_S: Final = (5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
_started = time.monotonic()
_tags = itertools.count(1)


def _progress(line: str) -> None:
    print(f"[front_vllm {time.monotonic() - _started:6.0f} s] {line}", file=sys.stderr, flush=True)


def _body(tokens: int, words: int = 64) -> dict[str, Any]:
    """A completion whose prompt starts with words of its own: no prefix cache hit."""
    return {
        "model": SERVED_MODEL,
        "prompt": f"request {next(_tags)} of {os.getpid()}: "
        + "one two three four " * (words // 4),
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
    clients = {name: httpx.AsyncClient(base_url=url, timeout=300) for name, url in urls.items()}
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
        _progress("latency: warmed up")
        trees = {name: [pid, *descendants(pid)] for name, pid in pids.items()}
        cpu_before = {name: cpu_seconds(tree) for name, tree in trees.items()}
        order = list(urls)
        for i in range(requests):
            for name in order[i % len(order) :] + order[: i % len(order)]:
                await one(name)
            _progress(f"latency: round {i + 1} of {requests}")
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


# --- an engine's figures ------------------------------------------------------------------


def _engine_figures(url: str) -> tuple[float, float, int]:
    """KV usage (0..1), generation tokens so far, requests running or waiting."""
    text = httpx.get(f"{url}/metrics", timeout=60).text
    load = parse_engine_metrics(text)
    generated = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:generation_tokens_total")
    )
    return load.kv_usage, generated, load.running + load.waiting


def _cache_blocks(url: str) -> tuple[int, int] | None:
    """The KV cache's blocks (those usage counts: the null block left out) and tokens
    a block, from vLLM's ``vllm:cache_config_info`` (None: not shown)."""
    text = httpx.get(f"{url}/metrics", timeout=60).text
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            blocks = re.search(r'num_gpu_blocks="(\d+)"', line)
            size = re.search(r'block_size="(\d+)"', line)
            if blocks and size:
                return int(blocks.group(1)) - 1, int(size.group(1))
    return None


async def _figures(url: str) -> tuple[float, float, int]:
    return await trio.to_thread.run_sync(_engine_figures, url)


async def _kv(url: str) -> float:
    return (await _figures(url))[0]


async def _decode_idle(url: str, within_s: float) -> None:
    with trio.move_on_after(within_s):
        while (await _figures(url))[2]:  # noqa: ASYNC110 - /metrics is all there is to watch
            await trio.sleep(0.5)


async def _kv_over_time(prefill_url: str, watch_s: float) -> list[list[float]]:
    """Prefill's KV usage, read over ``watch_s`` seconds: [seconds since the start, usage]
    (a read's time is when its answer came: a starved engine's can take seconds)."""
    samples: list[list[float]] = []
    started = trio.current_time()
    while trio.current_time() - started < watch_s:
        kv = await _kv(prefill_url)
        samples.append([trio.current_time() - started, kv])
        await trio.sleep(0.5)
    return samples


def _back_to(samples: list[list[float]], before: float) -> float | None:
    """When the KV in use was first back to ``before`` (None: not while watched)."""
    return next((t for t, kv in samples if kv <= before + 1e-9), None)


# --- the storm ----------------------------------------------------------------------------


async def _until(condition: Callable[[], bool], within_s: float) -> None:
    with trio.move_on_after(within_s):
        while not condition():  # noqa: ASYNC110 - counters to watch
            await trio.sleep(0.1)


async def _prefill_done(prefill_url: str, before: float, within_s: float) -> bool:
    """Whether prefill has nothing running or waiting and holds KV above ``before``."""
    with trio.move_on_after(within_s):
        while True:
            kv, _, busy = await _figures(prefill_url)
            if not busy and kv > before:
                return True
            await trio.sleep(0.5)
    return False


async def _storm(
    router_url: str,
    prefill_url: str,
    decode_url: str,
    proxy: FaultProxy,
    clients: int,
    watch_s: float,
) -> dict[str, Any]:
    """``clients`` at once, gone once each decode leg is held at the proxy and prefill has
    answered them all (it holds their KV); prefill's KV in use over ``watch_s`` after, and
    the tokens decode generated for them."""
    await _decode_idle(decode_url, 120)
    generated_before = (await _figures(decode_url))[1]
    before = await _kv(prefill_url)
    held_before = proxy.counters.requests_held
    answered: list[str] = []  # clients answered (or failed) before they could leave

    async def client(http: httpx.AsyncClient) -> None:
        try:
            response = await http.post(
                f"{router_url}/v1/completions", json=_body(STORM_TOKENS, STORM_WORDS)
            )
            answered.append(str(response.status_code))
        except httpx.HTTPError as exc:
            answered.append(type(exc).__name__)

    proxy.fault = Fault(hold_requests=COMPLETION_LEGS)
    try:
        async with httpx.AsyncClient(timeout=600) as http, trio.open_nursery() as nursery:
            for _ in range(clients):
                nursery.start_soon(client, http)
            await _until(
                lambda: proxy.counters.requests_held - held_before + len(answered) >= clients,
                _REACH_DECODE_S,
            )
            reached = proxy.counters.requests_held - held_before
            # a router may send the decode leg with the prefill leg (vllm-router 0.1.17
            # does): the clients leave once prefill has also answered every one
            prefill_done = await _prefill_done(prefill_url, before, _REACH_DECODE_S)
            at_leaving = await _kv(prefill_url)
            nursery.cancel_scope.cancel()  # the clients leave
    finally:
        proxy.fault = Fault()
    _progress(
        f"storm: {reached} of {clients} held at decode's door, prefill "
        + ("done" if prefill_done else "not done")
        + "; gone; watching prefill's KV"
    )
    samples = await _kv_over_time(prefill_url, watch_s)
    await _decode_idle(decode_url, 120)
    generated = (await _figures(decode_url))[1] - generated_before
    return {
        "clients": clients,
        "reached_decode": reached,
        "prefill_done_before_leaving": prefill_done,
        "answered_before_leaving": answered,
        "kv_before": before,
        "kv_at_leaving": at_leaving,
        "kv_over_time": samples,
        "kv_freed_after_s": _back_to(samples, before),
        "decode_tokens_for_gone_clients": generated,
    }


async def _left_alone(prefill_url: str, legs: int, watch_s: float) -> dict[str, Any]:
    """``legs`` prefill legs at once, straight to prefill, that nobody decodes."""
    before = await _kv(prefill_url)
    async with httpx.AsyncClient(timeout=600) as http:

        async def leg() -> None:
            body = prefill_body({**_body(STORM_TOKENS, STORM_WORDS), "stream": False})
            (await http.post(f"{prefill_url}/v1/completions", json=body)).raise_for_status()

        with trio.fail_after(_REACH_DECODE_S):
            async with trio.open_nursery() as nursery:
                for _ in range(legs):
                    nursery.start_soon(leg)
    at_leaving = await _kv(prefill_url)
    _progress(f"left alone: {legs} prefill legs answered; watching prefill's KV")
    samples = await _kv_over_time(prefill_url, watch_s)
    return {
        "clients": legs,
        "kv_before": before,
        "kv_at_leaving": at_leaving,
        "kv_over_time": samples,
        "kv_freed_after_s": _back_to(samples, before),
    }


async def _until_healthy(url: str, what: str) -> None:
    with trio.move_on_after(300):
        async with httpx.AsyncClient(timeout=30) as http:
            while True:
                try:
                    if (await http.get(f"{url}/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.5)
    raise RuntimeError(f"{what} at {url} was not healthy within 300 s")


async def _idle_cpu(pids: dict[str, int]) -> dict[str, float]:
    """Each router's process tree's CPU with no request, ms a second: its background work."""
    trees = {name: [pid, *descendants(pid)] for name, pid in pids.items()}
    before = {name: cpu_seconds(tree) for name, tree in trees.items()}
    await trio.sleep(_IDLE_S)
    return {
        name: (cpu_seconds(tree) - before[name]) / _IDLE_S * 1000 for name, tree in trees.items()
    }


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
        _progress(f"routers healthy: {', '.join(routers)}")
        blocks = await trio.to_thread.run_sync(_cache_blocks, prefill_url)
        idle = await _idle_cpu({name: process.pid for name, (process, _) in routers.items()})
        report: dict[str, Any] = await _interleaved_latency(
            {"decode_alone": f"http://{LOOPBACK}:{proxy_port}"}
            | {name: url for name, (_, url) in routers.items()},
            {name: process.pid for name, (process, _) in routers.items()},
            args.requests,
            args.tokens,
        )
        report["prefill_cache_blocks"] = blocks
        for name, ms_per_s in idle.items():
            report[name]["idle_cpu_ms_per_s"] = ms_per_s
        for name, (_, url) in routers.items():
            _progress(f"storm through {name}")
            report[name]["storm"] = await _storm(
                url, prefill_url, decode_url, proxy, args.storm, args.watch
            )
        report["left_alone"] = await _left_alone(prefill_url, args.storm, args.watch)
        nursery.cancel_scope.cancel()
    return report


def _measure(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    if args.prefill_url and args.decode_url:  # a pair already running (the tests')
        return _measure_on(args, logs, args.prefill_url, args.decode_url)
    _progress("starting the vLLM pair")
    with vllm_pd_pair(logs, kv_config=NIXL_LEASED_KV_CONFIG) as (prefill, decode):
        _progress("the vLLM pair is ready")
        return _measure_on(args, logs, prefill.url, decode.url)


def vllm_router_binary() -> Path | None:
    """vllm-router's launcher: PDTRIO_VLLM_ROUTER, or beside the vLLM interpreter."""
    named = os.environ.get("PDTRIO_VLLM_ROUTER", "")
    if named:
        return Path(named)
    python = os.environ.get("PDTRIO_VLLM_PYTHON", "")
    beside = Path(python).parent / "vllm-router" if python else None
    return beside if beside is not None and beside.exists() else None


def _stop(process: subprocess.Popen[bytes], name: str, log: Path) -> float | None:
    """SIGTERM; the seconds it took to stop, or None: not within :data:`_STOP_S` (then
    killed, its log's tail printed: a router that does not stop is a finding)."""
    started = time.monotonic()
    process.terminate()
    try:
        process.wait(timeout=_STOP_S)
        return time.monotonic() - started
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        tail = log.read_bytes()[-6000:].decode("utf-8", "replace")
        print(
            f"{name} did not stop within {_STOP_S:g} s of SIGTERM (killed); its log ends:\n{tail}",
            file=sys.stderr,
        )
        return None


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
    stopped: dict[str, float | None] = {}
    try:
        for name, (command, env, url) in commands.items():
            with (logs / f"{name}.log").open("wb") as log:
                process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            routers[name] = (process, url)
        report = trio.run(_run, args, prefill_url, decode_url, proxy_port, routers)
    finally:
        for name, (process, _) in routers.items():
            stopped[name] = _stop(process, name, logs / f"{name}.log")
    report["stopped_after_sigterm_s"] = stopped
    return report


# --- the report ---------------------------------------------------------------------------


def _held(kv: float, before: float, blocks: tuple[int, int] | None) -> str:
    """KV in use above ``before``: blocks where the cache's size is known, else percent."""
    if blocks is None:
        return f"{(kv - before) * 100:+.2f}%"
    return f"{round((kv - before) * blocks[0]):d}"


def _storm_row(
    label: str, storm: dict[str, Any], blocks: tuple[int, int] | None, watch_s: float
) -> list[str]:
    before = storm["kv_before"]
    samples = storm["kv_over_time"]
    cells = [label, f"{storm.get('reached_decode', storm['clients'])}/{storm['clients']}"]
    cells.append(_held(storm["kv_at_leaving"], before, blocks))
    for checkpoint in (c for c in _CHECKPOINTS_S if c <= watch_s):
        seen = [kv for t, kv in samples if t <= checkpoint] or [samples[0][1]]
        cells.append(_held(seen[-1], before, blocks))
    freed = storm["kv_freed_after_s"]
    cells.append(f"{freed:.1f} s" if freed is not None else f"not in {watch_s:g} s")
    spent = storm.get("decode_tokens_for_gone_clients")
    cells.append("-" if spent is None else f"{spent:.0f}")
    return cells


def _print_report(report: dict[str, Any], args: argparse.Namespace) -> None:
    names = {"pdtrio": "pdtrio router, PD", "vllm_router": "vllm-router, PD"}
    alone = report["decode_alone"]
    rows = [
        [
            "decode alone (no PD)",
            f"{alone['ttft_ms']:.0f}",
            "-",
            f"{alone['itl_ms']:.1f}",
            "-",
            "-",
            "-",
        ]
    ]
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
                    f"{front['idle_cpu_ms_per_s']:.1f}",
                ]
            )
    print(
        f"{args.requests} streamed completions a path ({args.tokens} tokens, greedy), "
        "the paths in turn; decode through the same proxy on every path\n"
        "(router CPU: its processes' over the whole run a request, background work included; "
        f"idle: the same with no request, over {_IDLE_S:g} s before):"
    )
    print(
        aligned_table(
            [
                "path",
                "TTFT p50 ms",
                "added",
                "ITL p50 ms",
                "added",
                "router CPU ms/req",
                "idle ms/s",
            ],
            rows,
            align="lrrrrrr",
        )
    )
    blocks = report["prefill_cache_blocks"]
    unit = (
        f"blocks of {blocks[1]} tokens, of prefill's {blocks[0]}"
        if blocks
        else "% of prefill's KV cache"
    )
    print(
        f"\n{args.storm} clients at once, gone between the legs (their decode legs held at "
        "decode's door, prefill done):\n"
        f"prefill's KV in use above before ({unit}), after they left:"
    )
    checkpoints = [f"+{c:g} s" for c in _CHECKPOINTS_S if c <= args.watch]
    storm_rows = [
        _storm_row(label, report[name]["storm"], blocks, args.watch)
        for name, label in names.items()
        if name in report
    ]
    storm_rows.append(
        _storm_row("left alone (no decode, no release)", report["left_alone"], blocks, args.watch)
    )
    print(
        aligned_table(
            ["path", "gone", "on leaving", *checkpoints, "back to before", "decode tokens"],
            storm_rows,
            align="l" + "r" * (len(checkpoints) + 4),
        )
    )
    print(
        f"(decode tokens: generated by decode for the gone clients; each asked {STORM_TOKENS}. "
        "vLLM's lease on unpulled KV: 300 s here, 30 s by default)"
    )
    for name, label in names.items():
        storm = report[name]["storm"] if name in report else {}
        if storm.get("answered_before_leaving"):
            answered = storm["answered_before_leaving"]
            print(f"{label}: clients answered (or failed) before they left: {answered}")
        if storm and not storm["prefill_done_before_leaving"]:
            print(f"{label}: prefill had not answered every client within {_REACH_DECODE_S:g} s")
    stops = ", ".join(
        f"{names[name]}: " + (f"not within {_STOP_S:g} s (killed)" if s is None else f"{s:.1f} s")
        for name, s in report["stopped_after_sigterm_s"].items()
    )
    print(f"stopped after SIGTERM: {stops}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few requests: a smoke run")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--storm", type=int, default=5, help="clients in the storm")
    parser.add_argument(
        "--watch", type=float, default=30.0, help="seconds prefill's KV is watched after a storm"
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
        args.requests, args.tokens, args.storm, args.watch = 2, 8, 2, 10.0
    with tempfile.TemporaryDirectory() as tmp:
        report = _measure(args, Path(tmp))
    _print_report(report, args)
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
