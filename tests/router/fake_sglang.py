"""An in-process emulator of SGLang's PD HTTP contract (its bootstrap protocol), for the
router's tests: no CPU build of SGLang installs here.

Written from what SGLang's own router (sgl-router, mini_lb) sends and what its servers
do: both legs carry ``bootstrap_host``/``bootstrap_port``/``bootstrap_room``; prefill
computes the KV and waits for the decode of that room to fetch it through its
bootstrap server; decode waits for the room's KV, then generates and streams.  A decode
whose prefill never comes waits (what SGLang does; the router must close it).
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from tests.router.fake_vllm import (
    CACHED_TOKENS,
    FakeVllm,
    _json,
    choice_of,
    logprobs_of,
    wait_unless_hung_up,
)


@attrs.define(eq=False)
class Room:
    prefilled: trio.Event = attrs.Factory(trio.Event)
    fetched: trio.Event = attrs.Factory(trio.Event)


@attrs.define(eq=False)
class FakeSglang(FakeVllm):
    # (host, bootstrap port, room) -> the transfer; shared by every fake of a test
    rooms: dict[tuple[str, int, int], Room] = attrs.Factory(dict)
    bootstrap_port: int = 0
    decode_waiting_for_kv: trio.Event = attrs.Factory(trio.Event)
    prefill_gate: trio.Event | None = None  # a prefill computes once it is set (slow prefill)

    def room(self, request: dict[str, Any]) -> Room:
        key = (request["bootstrap_host"], request["bootstrap_port"], request["bootstrap_room"])
        return self.rooms.setdefault(key, Room())

    async def _complete(
        self, path: str, request: dict[str, Any], headers: dict[str, str], receive: Any, send: Any
    ) -> None:
        if self.fail_status:
            await _json(send, self.fail_status, {"error": {"message": f"{self.name} says no"}})
            return
        chat = path.endswith("/chat/completions")
        prompt_tokens = len(str(request.get("messages") or request.get("prompt")).split())
        room = self.room(request)
        if self.name.startswith("p"):  # a prefill: compute, then wait for the fetch
            assert request["bootstrap_port"] == self.bootstrap_port
            if self.prefill_gate is not None:
                await self.prefill_gate.wait()
            room.prefilled.set()
            with trio.move_on_after(10):
                await room.fetched.wait()
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": 1,
                "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS},
            }
            # (with the first token's logprobs when asked: they also go to decode with the KV,
            # in SGLang's metadata buffers, only if prefill computed them)
            choice = {
                "index": 0,
                "text": "",
                "logprobs": logprobs_of(request, chat, [" t0"], 0),
                "finish_reason": "length",
            }
            await _json(send, 200, {"choices": [choice], "usage": usage})
            return
        choice = choice_of(headers.get("x-request-id", "")) if request.get("stream") else None
        if choice in self.early_failed_choices:
            await self._fail_before_first_token(choice, receive, send)
            return
        # a decode: wait for the room's KV (forever, as SGLang would), unless the router hangs up
        self.decode_waiting_for_kv.set()
        if not await wait_unless_hung_up(room.prefilled, receive):
            self.decode_aborted.set()
            return
        room.fetched.set()
        await self._stream(request, chat, prompt_tokens, receive, send)
