"""1. ingest: what one router core absorbs (see the package's docstring).

The driver (:func:`run_ingest`) starts a producer (``producer.py``) and a
router process (:func:`run_router`) per case.  The router process uses the
package's public pieces only: ``WorkerLink`` (``run``, ``start``), each
stream's ``StreamBuffer`` and ``wait_update``, ``StreamShaper``.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import trio

from benchmarks.token_path.measure import router_and_load_cpus, start_role
from pdtrio.asgi import Message
from pdtrio.config import RouterConfig
from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.link.wire import DecodeStart, KvHandle
from pdtrio.protocol.openai.sse import StreamShaper
from pdtrio.protocol.sampling import SamplingParams
from pdtrio.router.stream_outcome import StreamFailed, StreamRejected
from pdtrio.router.workers.link import WorkerLink
from pdtrio.router.workers.stream import DecodeStream
from pdtrio.testing import LOOPBACK, Processes

CASES = [(1, 1), (4, 1), (16, 1), (64, 1), (1, 16)]  # (entries per frame, tokens per entry)
_PROFILED_CASES = [(1, 1), (16, 1)]
_LAYOUT = KvLayout("synthetic", 1, 1, 1, 16, "synthetic")


def run_ingest(quick: bool, profile_dir: Path | None) -> list[dict[str, Any]]:
    router_cpu, load_cpu = router_and_load_cpus()
    warmup, duration = (0.5, 1.5) if quick else (1.0, 4.0)
    cases = [(e, t, False) for e, t in CASES]
    if profile_dir is not None:
        cases += [(e, t, True) for e, t in _PROFILED_CASES]
    rows = []
    for entries, tokens, profiled in cases:
        streams = max(64, entries)
        measure_s = max(duration, 3.0) if profiled else duration
        profile = None if profile_dir is None else profile_dir / f"ingest_{entries}x{tokens}.txt"
        result = _one_case(
            entries,
            tokens,
            streams,
            warmup,
            measure_s,
            profile if profiled else None,
            router_cpu=router_cpu,
            load_cpu=load_cpu,
        )
        cpu_s = result["cpu_s"] or 1e-9
        row: dict[str, Any] = {
            "entries_per_frame": entries,
            "tokens_per_entry": tokens,
            "tokens_per_frame": entries * tokens,
            "tokens_per_cpu_s": result["tokens"] / cpu_s,
            "frames_per_cpu_s": result["frames"] / cpu_s,
            "us_per_token": cpu_s / max(1, result["tokens"]) * 1e6,
            "router_util": result["cpu_s"] / result["wall_s"],
            "tokens_per_sse_chunk": result["tokens"] / max(1, result["sse_chunks"]),
            "overflows": result["streams_ended"],
            "profiled": profiled,
        }
        if profiled and profile is not None:
            row["profile"] = str(profile)
            row["profile_top"] = profile_top(profile)
        rows.append(row)
    return rows


def _one_case(
    entries: int,
    tokens: int,
    streams: int,
    warmup_s: float,
    measure_s: float,
    profile: Path | None,
    *,
    router_cpu: int,
    load_cpu: int,
) -> dict[str, Any]:
    with Processes(stop_grace_s=5) as procs:
        producer = start_role(
            procs,
            "producer",
            {
                "entries": entries,
                "tokens": tokens,
                "streams": streams,
                "max_s": warmup_s + measure_s + 30,
            },
            cpu=load_cpu,
        )
        port = int(procs.read_line(producer, b"PORT ", 30))
        router = start_role(
            procs,
            "ingest-router",
            {
                "url": f"ws://{LOOPBACK}:{port}/pd/link",
                "streams": streams,
                "warmup_s": warmup_s,
                "measure_s": measure_s,
            },
            cpu=router_cpu,
        )
        spy = None
        if profile is not None:
            procs.read_line(router, b"MEASURING", 60)
            spy = procs.start(
                [
                    str(Path(sys.executable).parent / "py-spy"),
                    "record",
                    "-f",
                    "raw",
                    "-r",
                    "500",
                    "--function",
                    "-d",
                    str(int(measure_s)),
                    "-o",
                    str(profile),
                    "--pid",
                    str(router.pid),
                ],
                cpus={load_cpu},
            )
        result: dict[str, Any] = json.loads(
            procs.read_line(router, b"RESULT ", warmup_s + measure_s + 60)
        )
        if spy is not None:
            spy.wait(timeout=30)
    return result


def profile_top(path: Path, n: int = 15) -> dict[str, list[tuple[str, float]]]:
    """Self and inclusive shares of the top functions in a py-spy raw (folded) profile."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    try:
        text = path.read_text()
    except OSError:
        return {}
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples = int(count)
        total += samples
        frames = stack.split(";")
        own[frames[-1]] += samples
        for frame in set(frames):
            incl[frame] += samples
    if not total:
        return {}
    return {
        "self": [(f, round(c / total * 100, 1)) for f, c in own.most_common(n)],
        # the frames every sample shares (module, trio.run) say nothing: left out
        "inclusive": [
            (f, round(c / total * 100, 1)) for f, c in incl.most_common() if c < 0.98 * total
        ][:n],
    }


# --- the router process -------------------------------------------------------------


@attrs.define
class _Tally:
    tokens: int = 0
    sse_chunks: int = 0
    streams_ended: int = 0


def run_router(spec: dict[str, Any]) -> None:
    """Print ``MEASURING`` when the window opens, then ``RESULT {json}``."""
    result = trio.run(_measure_router, spec)
    print("RESULT " + json.dumps(result), flush=True)


def _decode_start(request_id: str) -> DecodeStart:
    handle = KvHandle(
        request_id=request_id,
        instance_id="ingest-prefill",
        transfer_host=LOOPBACK,
        transfer_port=9,
        block_ids=(0,),
        num_tokens=16,
        layout=_LAYOUT,
        lease_ttl_s=3600.0,
    )
    return DecodeStart(
        request_id=request_id,
        prompt_token_ids=tuple(range(1, 17)),
        first_token_id=300,
        sampling=SamplingParams(temperature=0.0, ignore_eos=True),
        token_budget=RouterConfig().max_tokens_limit,
        tokens_generated=1,
        cached_tokens=0,
        kv_handle=handle,
    )


async def _drain(stream: DecodeStream, request_id: str, tally: _Tally) -> None:
    """Deliver one stream as a request's task does: merged deltas, shaped, into a null send."""
    shaper = StreamShaper(
        kind="completion",
        request_id=request_id,
        model="synthetic",
        created=int(time.time()),
        include_usage=False,
        continuous_usage_stats=False,
    )

    async def send(message: Message) -> None:
        tally.sse_chunks += 1

    buffer = stream.buffer
    while True:
        delta = buffer.take()
        if delta is not None:
            tally.tokens += delta.num_tokens
            chunk = shaper.delta(delta.text, delta.num_tokens, delta.finish_reason, delta.usage)
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if delta.finish_reason is not None:
                break
        if isinstance(stream.outcome, StreamFailed | StreamRejected):
            break  # cut off: it fell too far behind
        await stream.wait_update()
    tally.streams_ended += 1


async def _measure_router(spec: dict[str, Any]) -> dict[str, Any]:
    # the benchmark's producer sends no heartbeats: no liveness timeout here
    link = WorkerLink(
        "ingest",
        spec["url"],
        max_pending_tokens=RouterConfig().stream_buffer_tokens,
        link_timeout_s=3600.0,
    )
    tally = _Tally()

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    def sample() -> tuple[float, float, int, int, int]:
        return (
            time.perf_counter(),
            cpu(),
            tally.tokens,
            link.statistics().frames_received,
            tally.sse_chunks,
        )

    async with trio.open_nursery() as nursery:
        await nursery.start(link.run)
        for i in range(spec["streams"]):
            request_id = f"cmpl-{i:032x}"
            stream = await link.start(_decode_start(request_id))
            nursery.start_soon(_drain, stream, request_id, tally)
        await trio.sleep(spec["warmup_s"])
        before = sample()
        print("MEASURING", flush=True)
        await trio.sleep(spec["measure_s"])
        after = sample()
        nursery.cancel_scope.cancel()
    wall_s, cpu_s, tokens, frames, sse_chunks = (a - b for a, b in zip(after, before, strict=True))
    return {
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "tokens": tokens,
        "frames": frames,
        "sse_chunks": sse_chunks,
        "streams_ended": tally.streams_ended,
    }
