"""Capacity: a busy server makes requests wait, or refuses them at once, never 200-then-error.

Two runs against a real router (hypercorn, trio) over the embedded synthetic cluster:

1. ``configs/synthetic.toml``: 64 concurrent streaming requests without
   ``max_tokens`` (each reserves the default budget, so only some fit at once):
   how many complete, TTFT p50/p99.
2. A small decode KV (``--blocks``) and 1,000 requests offered at once against a
   queue limit of 256: how many complete, how many get an immediate 429 (and
   how soon: p50/p99), and how many get a 200 followed by an error event (the
   goal: none).  These go over bare sockets: through httpx, the load generator
   spent 3.5 times the CPU of the router and its workers, and the 429s measured
   its queue (p99 7-10 s), not the router's (about 1 s on 2 cores).

``python -m benchmarks.capacity [--quick] [--json PATH] [--plot PATH]``

``--plot`` draws the TTFT CDF of the first run and the burst's answer times
(200 and 429) as a PNG.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks import plotting
from benchmarks.kit import aligned_table, percentile, stream_completion, write_json
from pdtrio.testing import LOOPBACK, Processes, Service, free_port, router_command

ROOT = Path(__file__).resolve().parents[1]


def _embedded_toml(*, num_kv_blocks: int, decode_step_s: float, queue_limit: int) -> str:
    return (
        f"[router]\nadmission_queue_limit = {queue_limit}\n"
        "[embedded]\nprefill = 1\ndecode = 1\n"
        f'[embedded.worker.engine]\nkind = "synthetic"\nnum_kv_blocks = {num_kv_blocks}\n'
        f"[embedded.worker.engine.synthetic]\ndecode_step_s = {decode_step_s}\n"
    )


async def _one(
    http: httpx.AsyncClient, body: dict[str, Any], results: list[dict[str, Any]]
) -> None:
    try:
        answer = await stream_completion(http, body)
    except httpx.HTTPError as exc:
        results.append({"kind": f"transport error {type(exc).__name__}"})
        return
    message = None
    if answer.status == 200:
        kind = "ok" if answer.ok else "200 then error"
    elif answer.status == 429:
        kind = "429"
    else:
        error = answer.error or {}
        code, message = error.get("code"), error.get("message", answer.body[:200])
        kind = f"{answer.status} {code}" if code else str(answer.status)
    assert answer.finished is not None
    results.append(
        {
            "kind": kind,
            "ttft_s": answer.ttft,
            "answered_s": answer.finished - answer.started,
            "message": message,
        }
    )


async def _offer(url: str, count: int, body: dict[str, Any]) -> tuple[list[dict[str, Any]], float]:
    limits = httpx.Limits(max_connections=count + 8, max_keepalive_connections=count + 8)
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(_one, http, body, results)
    return results, time.perf_counter() - started


async def _raw_one(host: str, port: int, request: bytes, results: list[dict[str, Any]]) -> None:
    """One non-streamed request over a bare socket: httpx would cost the client more
    CPU than the router spends (1,000 requests: 7.7 s against 2.2 s), and the 429s
    would wait on the load generator, not on the router."""
    started = time.perf_counter()
    received = bytearray()
    try:
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            await stream.send_all(request)
            while chunk := await stream.receive_some(65536):  # connection: close
                received += chunk
    except OSError as exc:
        results.append({"kind": f"transport error {type(exc).__name__}"})
        return
    answered = time.perf_counter() - started
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        results.append({"kind": "no response", "answered_s": answered})
        return
    message = None
    if status == 200:
        kind = "ok" if b'"choices"' in body and b'"error"' not in body else "200 then error"
    elif status == 429:
        kind = "429"
    else:
        try:
            error = json.loads(body)["error"]
            kind, message = f"{status} {error['code']}", error["message"]
        except (ValueError, KeyError, TypeError):
            kind, message = str(status), body[:200].decode(errors="replace")
    ttft = answered if status == 200 else None  # not streamed: the whole answer is the first
    results.append({"kind": kind, "ttft_s": ttft, "answered_s": answered, "message": message})


async def _offer_raw(
    url: str, count: int, body: dict[str, Any]
) -> tuple[list[dict[str, Any]], float]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n"
        "connection: close\r\n\r\n"
    ).encode() + payload
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(_raw_one, host, int(port), request, results)
    return results, time.perf_counter() - started


def _summary(name: str, results: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    kinds = Counter(r["kind"] for r in results)
    ttfts = [r["ttft_s"] * 1000 for r in results if r.get("ttft_s") is not None]
    refusals = [r["answered_s"] * 1000 for r in results if r["kind"] == "429"]
    answered = [r["answered_s"] * 1000 for r in results if "answered_s" in r]
    return {
        "run": name,
        "requests": len(results),
        "ok": kinds.get("ok", 0),
        "429": kinds.get("429", 0),
        "200_then_error": kinds.get("200 then error", 0),
        "other": {k: v for k, v in kinds.items() if k not in ("ok", "429", "200 then error")},
        # one message of each other kind: what went wrong
        "other_messages": {
            r["kind"]: r["message"]
            for r in reversed(results)
            if r["kind"] not in ("ok", "429", "200 then error") and r.get("message")
        },
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "429_answer_p50_ms": percentile(refusals, 50),
        "429_answer_p99_ms": percentile(refusals, 99),
        "last_answer_ms": max(answered, default=float("nan")),
        "wall_s": wall_s,
    }


def _router(procs: Processes, config: Path) -> Service:
    """The router under hypercorn with a listen backlog that takes a burst of connections.

    hypercorn's default backlog (100) makes the kernel reset connections that
    arrive faster than they are accepted: a burst test would measure that instead.
    """
    port = free_port()
    command = router_command(f"{LOOPBACK}:{port}")
    command[-1:-1] = ["--backlog", "4096"]
    process = procs.start(command, env={"PDTRIO_CONFIG": str(config)})
    service = Service(process, f"http://{LOOPBACK}:{port}")
    procs.wait_healthy(service)
    return service


def _ms_of(results: list[dict[str, Any]], key: str, kind: str | None = None) -> list[float]:
    return [
        r[key] * 1000
        for r in results
        if r.get(key) is not None and (kind is None or r["kind"] == kind)
    ]


def run(quick: bool, blocks: int) -> tuple[list[dict[str, Any]], list[dict[str, list[float]]]]:
    """The rows, and for each run its raw latencies in ms (for ``--plot``)."""
    rows = []
    latencies: list[dict[str, list[float]]] = []
    with tempfile.TemporaryDirectory() as tmp, Processes() as procs:
        # 1. the shipped synthetic config, default budget (no max_tokens)
        router = _router(procs, ROOT / "configs" / "synthetic.toml")
        concurrent = 16 if quick else 64
        body = {"model": "synthetic", "prompt": "count to a lot", "stream": True}
        if quick:
            body["max_tokens"] = 2048  # the default, said: same reservation, same wait
        results, wall = trio.run(_offer, router.url, concurrent, body)
        rows.append(_summary(f"{concurrent} concurrent, no max_tokens", results, wall))
        latencies.append({"ttft": _ms_of(results, "ttft_s")})
        procs.stop(router.process)

        # 2. a small decode KV and a burst against the queue limit
        config = Path(tmp) / "burst.toml"
        config.write_text(
            _embedded_toml(num_kv_blocks=blocks, decode_step_s=0.005, queue_limit=256)
        )
        router = _router(procs, config)
        offered = 400 if quick else 1000
        # not streamed, over bare sockets: the one-process load generator must not be the
        # bottleneck it measures
        burst = {"model": "synthetic", "prompt": "burst", "max_tokens": 128, "stream": False}
        results, wall = trio.run(_offer_raw, router.url, offered, burst)
        rows.append(_summary(f"{offered} at once, queue 256, {blocks} blocks", results, wall))
        latencies.append(
            {
                "200 (whole answer)": _ms_of(results, "answered_s", "ok"),
                "429": _ms_of(results, "answered_s", "429"),
            }
        )
    return rows, latencies


def plot(
    path: Path, rows: list[dict[str, Any]], latencies: list[dict[str, list[float]]], quick: bool
) -> None:
    streamed, burst = rows
    plotting.save_figure(
        path,
        partial(
            plotting.latency_cdfs,
            series={"streamed, synthetic.toml": latencies[0]["ttft"]},
            xlabel="TTFT (ms)",
            title=f"1. {streamed['run']}: TTFT ({streamed['ok']} ok)",
        ),
        partial(
            plotting.latency_cdfs,
            series=latencies[1],
            xlabel="time to the answer (ms)",
            title=f"2. {burst['run']}: answers",
        ),
        title=f"capacity ({'quick' if quick else 'full'}): waits and refusals under load",
        columns=2,
    )


def render(rows: list[dict[str, Any]]) -> str:
    header = [
        "run",
        "requests",
        "ok",
        "429",
        "200+err",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "429 p50 ms",
        "429 p99 ms",
        "wall s",
        "other",
    ]
    cells = [
        [
            r["run"],
            str(r["requests"]),
            str(r["ok"]),
            str(r["429"]),
            str(r["200_then_error"]),
            f"{r['ttft_p50_ms']:.1f}",
            f"{r['ttft_p99_ms']:.1f}",
            f"{r['429_answer_p50_ms']:.1f}",
            f"{r['429_answer_p99_ms']:.1f}",
            f"{r['wall_s']:.1f}",
            str(r["other"] or ""),
        ]
        for r in rows
    ]
    lines = [aligned_table(header, cells, align="l" + "r" * 9 + "l", separator=" ", rule=None)]
    lines += [
        f"    {r['run']}: {kind}: {message}"
        for r in rows
        for kind, message in r["other_messages"].items()
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer requests (CI-sized)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--blocks", type=int, default=512, help="decode KV blocks for the burst run"
    )
    parser.add_argument(
        "--plot", type=Path, default=None, help="draw the latency CDFs into this PNG (matplotlib)"
    )
    args = parser.parse_args(argv)
    if args.plot is not None:
        plotting.require_matplotlib()
    rows, latencies = run(args.quick, args.blocks)
    print(render(rows))
    write_json(args.json, rows)
    if args.plot is not None:
        plot(args.plot, rows, latencies, args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
