"""The router cost benchmark's baseline app: its events, its pacing, its grouping.

Driven in-process as hypercorn drives it (lifespan, then an HTTP request), on
trio's mock clock: the pacing is checked by the clock, not by sleeping.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from benchmarks import trivial_sse_app

STEP_S = 0.01


async def _stream(
    monkeypatch: pytest.MonkeyPatch, max_tokens: int, tokens_per_event: int
) -> list[tuple[float, bytes]]:
    """The body events of one streamed completion, with the clock's time at each."""
    monkeypatch.setattr(trivial_sse_app, "STEP_S", STEP_S)
    monkeypatch.setattr(trivial_sse_app, "TOKENS_PER_EVENT", tokens_per_event)
    monkeypatch.setattr(trivial_sse_app, "_CLOCK", trivial_sse_app._SharedClock())
    lifespan_in, lifespan_inbox = trio.open_memory_channel[dict[str, Any]](4)
    lifespan_out, lifespan_outbox = trio.open_memory_channel[dict[str, Any]](4)
    events: list[tuple[float, bytes]] = []
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": max_tokens, "stream": True})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body.encode(), "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            events.append((trio.current_time(), message["body"]))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            trivial_sse_app.app, {"type": "lifespan"}, lifespan_inbox.receive, lifespan_out.send
        )
        await lifespan_in.send({"type": "lifespan.startup"})
        assert (await lifespan_outbox.receive())["type"] == "lifespan.startup.complete"
        await trio.sleep(STEP_S * 0.25)  # the request comes between two ticks
        scope = {"type": "http", "path": "/v1/completions", "method": "POST"}
        await trivial_sse_app.app(scope, receive, send)
        await lifespan_in.send({"type": "lifespan.shutdown"})
        assert (await lifespan_outbox.receive())["type"] == "lifespan.shutdown.complete"
    return events


def _tokens(body: bytes) -> int:
    return body.count(b" t")


@pytest.mark.parametrize(("max_tokens", "tokens_per_event"), [(7, 1), (12, 5), (6, 5), (1, 5)])
async def test_paced_tokens_come_a_tick_each_in_groups(
    monkeypatch: pytest.MonkeyPatch,
    autojump_clock: trio.testing.MockClock,
    max_tokens: int,
    tokens_per_event: int,
) -> None:
    events = await _stream(monkeypatch, max_tokens, tokens_per_event)
    counts = [_tokens(body) for _, body in events]
    assert sum(counts) == max_tokens
    # prefill's token alone, at once; then groups of k, the last one what is left
    assert counts[0] == 1
    rest = max_tokens - 1
    expected = [tokens_per_event] * (rest // tokens_per_event)
    if rest % tokens_per_event:
        expected.append(rest % tokens_per_event)
    assert counts[1:] == expected
    # a group goes out on the tick of its last token: k ticks after the group before
    start = events[0][0]
    sent = 0
    for (at, _), count in zip(events[1:], counts[1:], strict=True):
        sent += count
        assert at - start == pytest.approx(sent * STEP_S - STEP_S * 0.25, abs=1e-6)
    # the last event carries the finish and [DONE]; no other does
    assert events[-1][1].endswith(b"data: [DONE]\n\n")
    assert b'"finish_reason":"length"' in events[-1][1]
    assert all(b"[DONE]" not in body for _, body in events[:-1])


async def test_streams_share_one_clock(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """Two streams that start between the same two ticks send on the same ticks."""
    monkeypatch.setattr(trivial_sse_app, "STEP_S", STEP_S)
    clock = trivial_sse_app._SharedClock()
    woke: list[tuple[int, float]] = []

    async def stream(name: int, delay: float) -> None:
        await trio.sleep(delay)  # starts between two ticks (the mock clock's time)
        tick = clock.ticks
        for _ in range(3):
            tick += 1
            await clock.wait_for(tick)
            woke.append((name, trio.current_time()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(clock.run, STEP_S)
        async with trio.open_nursery() as streams:
            streams.start_soon(stream, 0, STEP_S * 0.1)
            streams.start_soon(stream, 1, STEP_S * 0.7)
        nursery.cancel_scope.cancel()
    times = {name: [at for who, at in woke if who == name] for name in (0, 1)}
    assert times[0] == pytest.approx(times[1])
    assert times[0] == pytest.approx([STEP_S, 2 * STEP_S, 3 * STEP_S], abs=1e-9)
