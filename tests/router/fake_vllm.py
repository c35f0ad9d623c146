"""An in-process stand-in for a vLLM server in a PD pair, for the router's fast tests.

It speaks the HTTP contract the router relies on (what vLLM 0.32's OpenAI server
and its NixlConnector do): ``/v1/models``, ``/health``, ``/metrics``, and the
completion endpoints, where a request with ``kv_transfer_params.do_remote_decode``
is a prefill leg (one token, not streamed; the prompt's "blocks" held until a
decode pulls them) and one with ``do_remote_prefill`` a decode leg (it pulls the
blocks from its prefill, which frees them, then streams).  Faults on command.
The real engine is tested in tests/vllm/.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from tests.cluster import serve_app

MODEL = "fake-model"
CACHED_TOKENS = 3  # what every prefill says it found cached


@attrs.define(eq=False)
class FakeVllm:
    name: str
    peers: dict[str, FakeVllm]  # engine id -> engine: where a decode pulls from
    url: str = ""
    # the prefilled requests whose blocks wait for a decode: request id -> block count
    held: dict[str, int] = attrs.Factory(dict)
    received: list[tuple[dict[str, Any], dict[str, str]]] = attrs.Factory(list)
    # faults: the status its completions answer with (0: none), a decode stream that fails
    # after this many tokens, a prefill whose kv_transfer_params is null, an unhealthy /health
    fail_status: int = 0
    fail_after_tokens: int | None = None
    null_kv_params: bool = False
    health_status: int = 200
    token_padding: int = 0  # characters added to each streamed token's text (a big stream)
    # the streamed token (index) whose logprobs come malformed, for a request asking for them
    bad_logprobs_at: int | None = None
    # its streamed tokens come without the logprobs a request asked for (an engine's bug)
    drop_logprobs: bool = False
    # a decode leg waits for this before it answers (a slow decode), when set
    decode_gate: trio.Event | None = None
    decode_waiting: trio.Event = attrs.Factory(trio.Event)  # a decode leg is at the gate
    decode_aborted: trio.Event = attrs.Factory(trio.Event)  # one was aborted there
    _held_changed: trio.Event = attrs.Factory(trio.Event)

    def hold(self, request_id: str, blocks: int) -> None:
        self.held[request_id] = blocks
        self._touch()

    def free(self, request_id: str) -> None:
        self.held.pop(request_id, None)
        self._touch()

    def _touch(self) -> None:
        self._held_changed.set()
        self._held_changed = trio.Event()

    async def wait_until(self, holding: bool) -> None:
        """Until it holds prefilled blocks (``holding``), or holds none."""
        while bool(self.held) != holding:
            await self._held_changed.wait()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        if path == "/v1/models":
            await _json(send, 200, {"data": [{"id": MODEL, "max_model_len": 2048}]})
        elif path == "/health":
            await _json(send, self.health_status, {})
        elif path == "/metrics":
            text = (
                f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 0.0\n'
                f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 0.0\n'
                f'vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} '
                f"{sum(self.held.values()) / 100}\n"
            )
            await _send(send, 200, text.encode(), b"text/plain")
        else:
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
            request = json.loads(body)
            self.received.append((request, headers))
            await self._complete(path, request, headers, receive, send)

    async def _complete(
        self, path: str, request: dict[str, Any], headers: dict[str, str], receive: Any, send: Any
    ) -> None:
        if self.fail_status:
            await _json(
                send,
                self.fail_status,
                {
                    "error": {
                        "message": f"{self.name} says no",
                        "type": "BadRequestError"
                        if self.fail_status < 500
                        else "InternalServerError",
                    }
                },
            )
            return
        chat = path.endswith("/chat/completions")
        prompt = json.dumps(request.get("messages") if chat else request.get("prompt"))
        prompt_tokens = len(prompt.split())
        request_id = headers.get("x-request-id", "")
        params = request.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            self.hold(request_id, prompt_tokens)
            kv = None
            if not self.null_kv_params:
                kv = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_engine_id": self.name,
                    "remote_request_id": request_id,
                    "remote_block_ids": [[1, 2]],
                    "remote_host": "127.0.0.1",
                    "remote_port": 5600,
                    "tp_size": 1,
                    "a_field_of_a_newer_version": {"kept": True},
                }
            else:
                self.free(request_id)
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": 1,
                "total_tokens": prompt_tokens + 1,
                "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS},
            }
            choice = {"index": 0, "finish_reason": "length"}
            choice.update(
                {"message": {"role": "assistant", "content": "X"}} if chat else {"text": "X"}
            )
            choice["logprobs"] = logprobs_of(request, chat, ["X"], 0)  # (vLLM's, if asked)
            await _json(
                send,
                200,
                {"id": request_id, "choices": [choice], "usage": usage, "kv_transfer_params": kv},
            )
            return
        if self.decode_gate is not None:
            self.decode_waiting.set()
            # as vLLM does, a request whose client (the router) hung up is aborted: it
            # pulls nothing
            gone = False
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    nonlocal gone
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    gone = True
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch)
                await self.decode_gate.wait()
                nursery.cancel_scope.cancel()
            if gone:
                self.decode_aborted.set()
                return
        if params.get("do_remote_prefill"):
            source = self.peers[params["remote_engine_id"]]
            source.free(params["remote_request_id"])  # pulled: prefill frees them
        await self._stream(request, chat, prompt_tokens, send)

    async def _stream(
        self, request: dict[str, Any], chat: bool, prompt_tokens: int, send: Any
    ) -> None:
        max_tokens = int(request.get("max_completion_tokens") or request.get("max_tokens") or 16)
        if not request.get("stream"):
            text = "".join(f" t{i}" for i in range(max_tokens))
            choice = {"index": 0, "finish_reason": "length"}
            choice.update(
                {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            )
            await _json(
                send,
                200,
                {
                    "choices": [choice],
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens},
                },
            )
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )

        async def event(payload: Any) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await send(
                {
                    "type": "http.response.body",
                    "body": f"data: {data}\n\n".encode(),
                    "more_body": True,
                }
            )

        def usage(completion: int) -> dict[str, int]:
            return {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
            }

        if chat:
            await event(
                {
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None,
                        }
                    ],
                    "usage": usage(0),
                }
            )
        sent_chars = 0
        for i in range(max_tokens):
            if self.fail_after_tokens is not None and i == self.fail_after_tokens:
                await event(
                    {"error": {"message": "the engine broke", "type": "InternalServerError"}}
                )
                await send(
                    {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
                )
                return
            finish = "length" if i == max_tokens - 1 else None
            text = f" t{i}" + "." * self.token_padding
            choice = (
                {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            )
            logprobs = logprobs_of(request, chat, [text], sent_chars, first=i)
            if self.drop_logprobs:
                logprobs = None
            if logprobs is not None and i == self.bad_logprobs_at:
                logprobs = {"content": "not a list"} if chat else {"tokens": [text]}
            sent_chars += len(text)
            await event(
                {
                    "choices": [{**choice, "logprobs": logprobs, "finish_reason": finish}],
                    "usage": usage(i + 1),
                }
            )
        await event({"choices": [], "usage": usage(max_tokens)})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    def legs(self) -> list[dict[str, Any]]:
        return [body for body, _ in self.received]


def token_logprob(i: int) -> float:
    """The fake's log-probability of its ``i``-th token (exact in binary: compared as is)."""
    return -(i + 1) / 4


def logprobs_of(
    request: dict[str, Any], chat: bool, texts: list[str], text_offset: int, first: int = 0
) -> dict[str, Any] | None:
    """A choice's ``logprobs`` for tokens ``texts`` (the ``first``-th on), in vLLM's
    shapes, when the request asks for them (else None, as vLLM sends).  Each token is the
    likeliest; its k-th alternative is ``" alt{k}"``, k less likely."""
    asked = request.get("logprobs")
    if chat and asked is not True:
        return None
    if not chat and (not isinstance(asked, int) or isinstance(asked, bool)):
        return None
    top = int(request.get("top_logprobs") or 0) if chat else asked

    def alternatives(text: str, logprob: float) -> list[tuple[str, float]]:
        return [(text, logprob)] + [(f" alt{k}", logprob - k) for k in range(1, top)]

    if chat:
        return {
            "content": [
                {
                    "token": text,
                    "logprob": token_logprob(first + n),
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": token, "logprob": logprob, "bytes": list(token.encode())}
                        for token, logprob in alternatives(text, token_logprob(first + n))
                    ][:top],
                }
                for n, text in enumerate(texts)
            ]
        }
    offsets = []
    for text in texts:
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "text_offset": offsets,
        "token_logprobs": [token_logprob(first + n) for n in range(len(texts))],
        "tokens": texts,
        # (the sampled token's, always; with the likeliest: itself first)
        "top_logprobs": [
            dict(alternatives(text, token_logprob(first + n))[: max(top, 1)])
            for n, text in enumerate(texts)
        ],
    }


async def _json(send: Any, status: int, body: Any) -> None:
    await _send(send, status, json.dumps(body).encode(), b"application/json")


async def _send(send: Any, status: int, body: bytes, content_type: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type)],
        }
    )
    await send({"type": "http.response.body", "body": body})


@asynccontextmanager
async def fake_engines(nursery: trio.Nursery, *names: str) -> AsyncIterator[dict[str, FakeVllm]]:
    """Fake vLLM servers named ``names``, served on loopback, knowing each other."""
    peers: dict[str, FakeVllm] = {}
    for name in names:
        peers[name] = FakeVllm(name, peers)
        peers[name].url = await serve_app(peers[name], nursery)
    yield peers
