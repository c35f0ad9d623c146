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
of its requests together), a token per tick from the next one.  One ticker
task per process keeps the clock and wakes, at each tick, the streams waiting
for it: the cheapest pacing trio has (a ``sleep_until`` per stream would add a
cancel scope with a deadline, and a ``Cancelled`` raised and caught, to every
event, which is not hypercorn's cost).

``TRIVIAL_SSE_TOKENS_PER_EVENT`` (default 1) groups the paced tokens: a stream
sends every k ticks one event carrying the k tokens of those ticks, as
pdtrio's router does when its adaptive egress spaces a stream's sends (at its
cap, 50 ms over a 10 ms step: 5 tokens an event).  What that costs here is
what an SSE event costs hypercorn at the event rate pdtrio's router has then.

No prefill, no decode, no links, no disconnect watcher, no validation beyond
reading ``max_tokens``: what is left is hypercorn's own cost per request and
per SSE event, which is what pdtrio's router is compared with.  ``GET /health``
answers 200.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any, Final, NoReturn, final

import trio

from pdtrio.protocol.link.wire import Usage
from pdtrio.protocol.openai.sse import StreamShaper

STEP_S: Final = float(os.environ.get("TRIVIAL_SSE_STEP_S", "0") or 0)
TOKENS_PER_EVENT: Final = max(1, int(os.environ.get("TRIVIAL_SSE_TOKENS_PER_EVENT", "1") or 1))

# pdtrio.router.request.pipeline's SSE headers
_SSE_HEADERS: Final = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_JSON_HEADERS: Final = [(b"content-type", b"application/json")]
_FIRST_ID: Final = 300
_IDS: Final = 700  # ids 300..999: three digits, as the synthetic engine's (vocab 1000)


@final
class _SharedClock:
    """The process's pace: ``ticks`` counts the ticks so far, one every ``STEP_S``.

    Its ticker runs in the app's lifespan (hypercorn's default is to run it).
    """

    def __init__(self) -> None:
        self.ticks = 0
        self._waiting: dict[int, trio.Event] = {}  # tick number -> the streams waiting for it

    async def run(self, step_s: float) -> NoReturn:
        next_at = trio.current_time()
        while True:
            # a late tick comes at once and the next a step after it, as the engine steps
            next_at = max(next_at + step_s, trio.current_time())
            await trio.sleep_until(next_at)
            self.ticks += 1
            due = self._waiting.pop(self.ticks, None)
            if due is not None:
                due.set()

    async def wait_for(self, tick: int) -> None:
        """Until tick number ``tick`` (at once if it has passed)."""
        if tick <= self.ticks:
            return
        due = self._waiting.get(tick)
        if due is None:
            due = self._waiting[tick] = trio.Event()
        await due.wait()


_CLOCK: Final = _SharedClock()


async def _lifespan(receive: Any, send: Any) -> None:
    async with trio.open_nursery() as nursery:  # the clock's ticker runs here
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if STEP_S:
                    nursery.start_soon(_CLOCK.run, STEP_S)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                nursery.cancel_scope.cancel()
                break
    await send({"type": "lifespan.shutdown.complete"})


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
    index = 0  # tokens sent
    tick = _CLOCK.ticks  # the tick the last paced event went out on
    while index < max_tokens:
        # the first token alone and at once (prefill's); then groups, a token per tick
        count = 1 if index == 0 else min(TOKENS_PER_EVENT, max_tokens - index)
        if index and STEP_S:
            tick += count
            await _CLOCK.wait_for(tick)
        text = "".join(
            f" t{_FIRST_ID + (seed + token * 7919) % _IDS}" for token in range(index, index + count)
        )
        index += count
        last = index == max_tokens
        usage = Usage(prompt_tokens, max_tokens, 0) if last else None
        body = shaper.delta(text, count, "length" if last else None, usage)
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
