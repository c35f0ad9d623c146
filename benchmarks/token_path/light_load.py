"""3. latency at light load: what the router adds to each token (see the package's docstring).

The direct reader speaks to the workers as the router does, through their
public wire (``pdtrio.protocol.link.wire``): a ``PrefillRequest`` posted to the
prefill worker, then a ``DecodeStart`` on the decode worker's websocket, whose
``TokenFrame`` messages it reads itself.
"""

from __future__ import annotations

import bisect
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import trio
import trio_websocket

from benchmarks.kit import percentile
from benchmarks.token_path.measure import router_and_load_cpus
from benchmarks.token_path.sse_clients import completion_request
from pdtrio.protocol.link import wire
from pdtrio.protocol.sampling import SamplingParams
from pdtrio.testing import Processes, Service, synthetic_worker_config, write_router_config

_PROMPT = tuple(range(1, 17))
_MODES = ("on", "off")  # the decode worker's coalescing
_MSGPACK_HEADERS = {"content-type": wire.MSGPACK_CONTENT_TYPE, "accept": wire.MSGPACK_CONTENT_TYPE}


async def _direct_reader(
    prefill_url: str, decode_url: str, tokens: int, started: trio.Event, times: list[float]
) -> None:
    """One request straight through the workers; the arrival time of each of its tokens."""
    request_id = f"direct-{os.getpid()}-{time.monotonic_ns()}"
    sampling = SamplingParams(temperature=0.0, ignore_eos=True)
    request = wire.PrefillRequest(
        request_id, wire.TokenPrompt(_PROMPT), sampling, max_tokens=tokens
    )
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{prefill_url}/pd/prefill", content=wire.encode(request), headers=_MSGPACK_HEADERS
        )
        response.raise_for_status()
    reply: wire.PrefillReply = wire.Decoder(wire.PrefillReply).decode(response.content)
    if reply.kv_handle is None:
        raise RuntimeError(f"prefill finished the request at once ({reply.finish_reason})")
    start = wire.DecodeStart(
        request_id=request_id,
        prompt_token_ids=reply.prompt_token_ids,
        first_token_id=reply.first_token_id,
        sampling=sampling,
        token_budget=reply.token_budget,
        tokens_generated=1,
        cached_tokens=reply.cached_tokens,
        kv_handle=reply.kv_handle,
    )
    ws_url = decode_url.replace("http://", "ws://", 1) + "/pd/link"
    async with trio_websocket.open_websocket_url(ws_url) as ws:
        await ws.send_message(wire.encode(start))
        while True:
            data = await ws.get_message()
            now = time.perf_counter()
            message = wire.from_worker_decoder.decode(
                data.encode() if isinstance(data, str) else data
            )
            if isinstance(message, wire.DecodeRejected | wire.DecodeFailed):
                raise RuntimeError(f"decode refused the direct request: {message}")
            if not isinstance(message, wire.TokenFrame):
                continue
            for entry in message.entries:
                if entry.request_id == request_id:
                    times.extend([now] * len(entry.token_ids))
                    started.set()
                    if entry.finish_reason is not None:
                        return


async def _router_reader(address: str, tokens: int, times: list[float]) -> None:
    """One streamed completion through the router; the arrival time of each token."""
    host, port = address.rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(completion_request(host, tokens))
        tail = b""
        while b"data: [DONE]" not in tail:
            data = await stream.receive_some(65536)
            if not data:
                raise RuntimeError("router closed the stream early")
            now = time.perf_counter()
            window = tail + data
            # one time per token: each synthetic token's text is " t<id>"
            times.extend([now] * (window.count(b" t") - tail.count(b" t")))
            tail = window[-64:]


async def _latency_pair(
    prefill_url: str, decode_url: str, address: str, tokens: int
) -> tuple[list[float], list[float]]:
    """(direct, routed) token arrival times of one pair of requests on the same decode worker."""
    direct: list[float] = []
    routed: list[float] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            started = trio.Event()
            # the direct request runs longer: it spans the whole routed one
            nursery.start_soon(
                _direct_reader, prefill_url, decode_url, tokens + 200, started, direct
            )
            await started.wait()
            await _router_reader(address, tokens, routed)
    return direct, routed


def run_latency(
    quick: bool, rate: float
) -> tuple[list[dict[str, Any]], dict[str, dict[str, list[float]]]]:
    """The rows, and per coalescing mode the raw samples in seconds ("itl_routed",
    "itl_direct", "added"; for ``--plot``)."""
    router_cpu, load_cpu = router_and_load_cpus()
    step = 1.0 / rate
    tokens = int(rate * 1.0)  # one second per stream
    rounds = 2 if quick else 6
    samples: dict[str, dict[str, list[float]]] = {
        mode: {"itl_routed": [], "itl_direct": [], "added": []} for mode in _MODES
    }
    mismatched = Counter[str]()
    with Processes() as procs, tempfile.TemporaryDirectory() as tmp:
        prefill_p = procs.start_worker(
            synthetic_worker_config("prefill", decode_step_s=step), cpus={load_cpu}
        )
        decode_ps = {
            mode: procs.start_worker(
                synthetic_worker_config("decode", decode_step_s=step, coalesce=mode == "on"),
                cpus={load_cpu},
            )
            for mode in _MODES
        }
        prefill = procs.wait_ready(prefill_p, timeout=120)
        decodes: dict[str, Service] = {
            m: procs.wait_ready(p, timeout=120) for m, p in decode_ps.items()
        }
        routers = {
            mode: procs.router(
                write_router_config(
                    Path(tmp) / f"router-{mode}.toml",
                    [("prefill", prefill.url), ("decode", decodes[mode].url)],
                ),
                cpus={router_cpu},
            )
            for mode in _MODES
        }
        for round_ in range(rounds + 1):  # round 0 warms up
            for mode in _MODES if round_ % 2 == 0 else tuple(reversed(_MODES)):
                direct, routed = trio.run(
                    _latency_pair, prefill.url, decodes[mode].url, routers[mode].address, tokens
                )
                if round_ > 0:
                    mismatched[mode] += _pair_steps(direct, routed, samples[mode])
    rows = []
    for mode in _MODES:
        s = samples[mode]
        rows.append(
            {
                "coalesce": mode == "on",
                "tokens_per_s": rate,
                "samples": len(s["added"]),
                "itl_router_p50_ms": percentile(s["itl_routed"], 50) * 1e3,
                "itl_router_p99_ms": percentile(s["itl_routed"], 99) * 1e3,
                "itl_direct_p50_ms": percentile(s["itl_direct"], 50) * 1e3,
                "itl_direct_p99_ms": percentile(s["itl_direct"], 99) * 1e3,
                "added_p50_us": percentile(s["added"], 50) * 1e6,
                "added_p99_us": percentile(s["added"], 99) * 1e6,
                "added_mean_us": statistics.fmean(s["added"]) * 1e6 if s["added"] else float("nan"),
                "mismatched_steps": mismatched[mode],
            }
        )
    return rows, samples


def _pair_steps(direct: list[float], routed: list[float], samples: dict[str, list[float]]) -> int:
    """Pair each routed decode step with the direct reader's, add the gaps; returns the unpaired."""
    # the router's first token is prefill's, the rest are decode steps
    decode_tokens = routed[1:]
    samples["itl_routed"] += [b - a for a, b in zip(decode_tokens, decode_tokens[1:], strict=False)]
    # both requests advance one token per engine step: find the step offset
    # between the two lists, then compare each step's two arrival times
    shifts: Counter[int] = Counter()
    for i, t in enumerate(decode_tokens):
        j = bisect.bisect_left(direct, t)
        if j == len(direct) or (j > 0 and t - direct[j - 1] < direct[j] - t):
            j -= 1
        shifts[j - i] += 1
    if not shifts:
        return 0
    shift, agreeing = shifts.most_common(1)[0]
    pairs = [
        (t, direct[i + shift]) for i, t in enumerate(decode_tokens) if 0 <= i + shift < len(direct)
    ]
    samples["added"] += [t - d for t, d in pairs]
    same_steps = [d for _, d in pairs]
    samples["itl_direct"] += [b - a for a, b in zip(same_steps, same_steps[1:], strict=False)]
    return len(decode_tokens) - agreeing
