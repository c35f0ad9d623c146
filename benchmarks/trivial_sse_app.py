"""The least an SSE server can do: the router cost benchmark's baseline.

``hypercorn -k trio benchmarks.trivial_sse_app:app``, with ``TRIVIAL_SSE_STEP_S``
in the environment (seconds between tokens; 0 or unset: back to back).

``POST /v1/completions`` answers a streamed request with the bytes pdtrio's
router sends for the same request on the synthetic engine: the same headers,
one chunk per token shaped by pdtrio's own ``StreamShaper`` (so the same JSON,
the same ``finish_reason`` on the last token, the usage chunk only when
``stream_options.include_usage`` asks for it, then ``data: [DONE]`` in the
same write as the last token), and
``max_tokens`` tokens whose text is ``" t<id>"`` with a three-digit id, like a
synthetic token.  The first token goes out at once, as prefill's does; the
others are paced as the synthetic decode engine paces them: every stream on
one shared clock that ticks every ``TRIVIAL_SSE_STEP_S`` (the engine steps all
of its requests together): the second token on the clock's next tick, each
later one a step after the one before (at once if that moment has passed).

No prefill, no decode, no links, no disconnect watcher, no validation beyond
reading ``max_tokens``: what is left is hypercorn's own cost per request and
per SSE event, which is what pdtrio's router is compared with.  ``GET /health``
answers 200.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from typing import Any, Final

import trio

from pdtrio.protocol.sse import StreamShaper
from pdtrio.protocol.wire import Usage

STEP_S: Final = float(os.environ.get("TRIVIAL_SSE_STEP_S", "0") or 0)

# pdtrio.router.pipeline's SSE headers
_SSE_HEADERS: Final = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_JSON_HEADERS: Final = [(b"content-type", b"application/json")]
_FIRST_ID: Final = 300
_IDS: Final = 700  # ids 300..999: three digits, as the synthetic engine's (vocab 1000)


async def _lifespan(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _respond(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _JSON_HEADERS})
    await send({"type": "http.response.body", "body": body})


async def _completion(receive: Any, send: Any) -> None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    request = json.loads(b"".join(chunks))
    if not request.get("stream"):
        await _respond(send, 400, b'{"error":{"message":"only streamed requests"}}')
        return
    max_tokens = int(request.get("max_tokens") or 16)
    prompt = request.get("prompt")
    prompt_tokens = len(prompt) if isinstance(prompt, list) else 1 + len(str(prompt).encode())
    options = request.get("stream_options") or {}
    include_usage = bool(options.get("include_usage"))
    shaper = StreamShaper(
        kind="completion",
        request_id="cmpl-" + uuid.uuid4().hex,
        model=str(request.get("model", "synthetic")),
        created=int(time.time()),
        include_usage=include_usage,
        continuous_usage_stats=include_usage and bool(options.get("continuous_usage_stats")),
    )
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
    seed = uuid.uuid4().int
    tick = -math.inf
    for index in range(max_tokens):
        if index and STEP_S:
            now = trio.current_time()
            if tick == -math.inf:
                tick = (math.floor(now / STEP_S) + 1) * STEP_S  # the clock's next tick
            else:
                tick = max(tick + STEP_S, now)  # a late stream goes at once, as the engine does
            await trio.sleep_until(tick)
        last = index == max_tokens - 1
        text = f" t{_FIRST_ID + (seed + index * 7919) % _IDS}"
        usage = Usage(prompt_tokens, max_tokens, 0) if last else None
        body = shaper.delta(text, 1, "length" if last else None, usage)
        if last:  # the last event and [DONE] in one write, as pdtrio's router sends them
            body += shaper.done()
        await send({"type": "http.response.body", "body": body, "more_body": not last})
    if max_tokens < 1:
        await send({"type": "http.response.body", "body": shaper.done(), "more_body": False})


async def app(scope: Any, receive: Any, send: Any) -> None:
    kind = scope["type"]
    if kind == "lifespan":
        await _lifespan(receive, send)
        return
    if kind != "http":
        return
    path, method = scope["path"], scope["method"]
    if path == "/v1/completions" and method == "POST":
        await _completion(receive, send)
    elif path == "/health" and method == "GET":
        await _respond(send, 200, b'{"status":"ok"}')
    else:
        await _respond(send, 404, b'{"error":{"message":"not found"}}')
