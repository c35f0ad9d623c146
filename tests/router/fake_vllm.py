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
from collections import Counter
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
    # how often its /health and its /metrics were read
    reads: Counter[str] = attrs.Factory(Counter)
    # faults: the status its completions answer with (0: none), a decode stream that fails
    # after this many tokens, a prefill whose kv_transfer_params is null, an unhealthy /health
    fail_status: int = 0
    fail_after_tokens: int | None = None
    # a streamed leg ends after this many tokens with finish_reason "abort" and its usage,
    # as vLLM ends a request it aborted itself (a KV load that failed, its shutdown)
    abort_after_tokens: int | None = None
    null_kv_params: bool = False
    health_status: int = 200
    health_gate: trio.Event | None = None  # /health answers once this is set (a slow engine)
    token_padding: int = 0  # characters added to each streamed token's text (a big stream)
    # the streamed token (index) whose logprobs come malformed, for a request asking for them
    bad_logprobs_at: int | None = None
    # its streamed tokens come without the logprobs a request asked for (an engine's bug)
    drop_logprobs: bool = False
    # the calls (function name, arguments) its model answers a chat request with tools
    # with, and whether it runs a tool parser (vLLM's --enable-auto-tool-choice
    # --tool-call-parser hermes: the calls as delta.tool_calls) or not (as text)
    tool_calls: list[tuple[str, dict[str, Any]]] = attrs.Factory(list)
    tool_parser: bool = True
    # its tool parser streams its last call with a name that is not a string (an engine's
    # bug, after the tokens of the calls before it)
    bad_tool_calls: bool = False
    # pulls of blocks it did not hold (vLLM: "Potentially invalid KV blocks for
    # unrecognized request"): a decode pulling one prefill twice
    unrecognized_pulls: list[str] = attrs.Factory(list)
    # a streamed leg stops after this many tokens and waits for its client to hang up
    stall_after_tokens: int | None = None
    stalled: int = 0  # legs stalled so far
    hung_up: int = 0  # stalled legs whose client (the router) hung up
    stalls_changed: trio.Event = attrs.Factory(trio.Event)
    # a decode leg waits for this before it answers (a slow decode), when set; only the
    # streamed legs of these choices (``choice_of``), when set
    decode_gate: trio.Event | None = None
    gated_choices: frozenset[int] | None = None
    # the prefill legs and the streamed decode legs of these choices answer 500 (a decode
    # leg pulling nothing)
    failed_choices: frozenset[int] = frozenset()
    # the streamed decode legs of these choices answer 200, then (once
    # ``early_failure_gate`` is set, when given) an error event before any token, pulling
    # nothing: a choice failing before its first token while the others stream
    early_failed_choices: frozenset[int] = frozenset()
    early_failure_gate: trio.Event | None = None
    decode_waiting: trio.Event = attrs.Factory(trio.Event)  # a decode leg is at the gate
    decode_aborted: trio.Event = attrs.Factory(trio.Event)  # one was aborted there
    _held_changed: trio.Event = attrs.Factory(trio.Event)

    def hold(self, request_id: str, blocks: int) -> None:
        self.held[request_id] = blocks
        self._touch()

    def free(self, request_id: str) -> None:
        self.held.pop(request_id, None)
        self._touch()

    def pulled(self, request_id: str) -> None:
        """A decode pulled the blocks of ``request_id``: they are freed."""
        if request_id not in self.held:
            self.unrecognized_pulls.append(request_id)
        self.free(request_id)

    def _touch(self) -> None:
        self._held_changed.set()
        self._held_changed = trio.Event()

    def _stall_count(self, stalled: int = 0, hung_up: int = 0) -> None:
        self.stalled += stalled
        self.hung_up += hung_up
        self.stalls_changed.set()
        self.stalls_changed = trio.Event()

    async def wait_for_stalls(self, stalled: int, hung_up: int = 0) -> None:
        """Until this many legs stalled, and their router hung up on this many."""
        while self.stalled < stalled or self.hung_up < hung_up:
            await self.stalls_changed.wait()

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
        self.reads[path] += 1
        if path == "/v1/models":
            await _json(send, 200, {"data": [{"id": MODEL, "max_model_len": 2048}]})
        elif path == "/health":
            if self.health_gate is not None:
                await self.health_gate.wait()
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
        # n > 1: vLLM's front end forks n child requests ("{i}_{id}"), each its own KV
        n = int(request.get("n") or 1)
        children = [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]
        if params.get("do_remote_decode"):
            if choice_of(request_id) in self.failed_choices:
                await _json(send, 500, {"error": {"message": f"{self.name} fails a choice"}})
                return
            for child in children:
                self.hold(child, prompt_tokens)
            request_id = children[-1]  # (the answer names one child's blocks: the rest wait)
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
        choice = choice_of(request_id) if request.get("stream") else None
        if choice in self.failed_choices:
            await _json(send, 500, {"error": {"message": f"{self.name} fails choice {choice}"}})
            return
        if choice in self.early_failed_choices:
            await self._fail_before_first_token(choice, receive, send)
            return
        if self.decode_gate is not None and (
            self.gated_choices is None or choice in self.gated_choices
        ):
            self.decode_waiting.set()
            # as vLLM does, a request whose client (the router) hung up is aborted: it
            # pulls nothing
            if not await wait_unless_hung_up(self.decode_gate, receive):
                self.decode_aborted.set()
                return
        if params.get("do_remote_prefill"):
            source = self.peers[params["remote_engine_id"]]
            for _ in children:  # (each child pulls the same blocks: prefill frees them)
                source.pulled(params["remote_request_id"])
        await self._stream(request, chat, prompt_tokens, receive, send)

    async def _fail_before_first_token(self, choice: int, receive: Any, send: Any) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        gate = self.early_failure_gate
        if gate is not None:
            if not await wait_unless_hung_up(gate, receive):  # the router hung up: nothing more
                return
        error = {"error": {"message": f"{self.name} broke choice {choice}", "type": "Internal"}}
        await send(
            {
                "type": "http.response.body",
                "body": f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode(),
                "more_body": False,
            }
        )

    async def _stream(
        self, request: dict[str, Any], chat: bool, prompt_tokens: int, receive: Any, send: Any
    ) -> None:
        """The answer: ``n`` choices (vLLM's front end forks a request into n samples, each
        with seed + its index), streamed interleaved, each chunk one choice's with its
        ``index`` (a role chunk each; continuous usage counts per choice, the final usage
        sums them), or whole."""
        n = int(request.get("n") or 1)
        answers = [self._answer(request, chat, choice) for choice in range(n)]
        if not request.get("stream"):
            choices = []
            for index, answer in enumerate(answers):
                text = "".join(piece.text for piece in answer.pieces)
                choice: dict[str, Any] = {"index": index, "finish_reason": answer.finish_reason}
                if not chat:
                    choice["text"] = text
                elif answer.calls and self.tool_parser:
                    choice["message"] = {
                        "role": "assistant",
                        "content": text or None,
                        "tool_calls": answer.calls,
                    }
                else:
                    choice["message"] = {"role": "assistant", "content": text}
                choices.append(choice)
            completion = sum(len(answer.pieces) for answer in answers)
            await _json(
                send,
                200,
                {
                    "choices": choices,
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion},
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
            for index in range(n):
                await event(
                    {
                        "choices": [
                            {
                                "index": index,
                                "delta": {"role": "assistant", "content": ""},
                                "finish_reason": None,
                            }
                        ],
                        "usage": usage(0),
                    }
                )
        sent_chars = [0] * n
        for i in range(max(len(answer.pieces) for answer in answers)):
            if self.stall_after_tokens is not None and i == self.stall_after_tokens:
                self._stall_count(stalled=1)
                while (await receive())["type"] != "http.disconnect":
                    pass
                self._stall_count(hung_up=1)
                return
            if self.fail_after_tokens is not None and i == self.fail_after_tokens:
                await event(
                    {"error": {"message": "the engine broke", "type": "InternalServerError"}}
                )
                await send(
                    {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
                )
                return
            if self.abort_after_tokens is not None and i == self.abort_after_tokens:
                for index in range(n):
                    choice = {"index": index, "delta": {}} if chat else {"index": index, "text": ""}
                    await event({"choices": [{**choice, "finish_reason": "abort"}]})
                await event({"choices": [], "usage": usage(i * n)})
                await send(
                    {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
                )
                return
            for index, answer in enumerate(answers):
                if i >= len(answer.pieces):
                    continue
                piece = answer.pieces[i]
                finish = answer.finish_reason if i == len(answer.pieces) - 1 else None
                if not chat:
                    choice = {"index": index, "text": piece.text}
                elif piece.tool_call is not None:
                    choice = {"index": index, "delta": {"tool_calls": [piece.tool_call]}}
                else:
                    choice = {"index": index, "delta": {"content": piece.text}}
                logprobs = logprobs_of(request, chat, [piece.text], sent_chars[index], first=i)
                if logprobs is not None and i == self.bad_logprobs_at:
                    logprobs = {"content": "not a list"} if chat else {"tokens": [piece.text]}
                if self.drop_logprobs:
                    logprobs = None
                sent_chars[index] += len(piece.text)
                await event(
                    {
                        "choices": [{**choice, "logprobs": logprobs, "finish_reason": finish}],
                        "usage": usage(i + 1),
                    }
                )
        await event({"choices": [], "usage": usage(sum(len(a.pieces) for a in answers))})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    def _answer(self, request: dict[str, Any], chat: bool, choice: int) -> FakeAnswer:
        """Choice ``choice``'s answer: its tokens " t0", " t1", ... (with a seed, each
        " s{seed + choice}t{i}": its sample is the seed's), or, to a chat request with
        tools, its calls (``tool_calls``) as this engine's tool parser streams them, or as
        text where it has none."""
        max_tokens = int(request.get("max_completion_tokens") or request.get("max_tokens") or 16)
        seed = request.get("seed")
        sample = "" if seed is None else f"s{seed + choice}"
        calls = self._calls_for(request) if chat else []
        if not calls:
            pieces = [Piece(f" {sample}t{i}" + "." * self.token_padding) for i in range(max_tokens)]
            return FakeAnswer(pieces, "length")
        named = isinstance(request.get("tool_choice"), dict)
        if self.tool_parser:
            pieces = []
            for call in calls:
                function, arguments = call["function"], call["function"]["arguments"]
                half = len(arguments) // 2
                head = {"index": call["index"], "id": call["id"], "type": "function"}
                bad = self.bad_tool_calls and call is calls[-1]
                name = 42 if bad else function["name"]
                pieces += [
                    Piece("", {**head, "function": {"name": name, "arguments": ""}}),
                    Piece(
                        "", {"index": call["index"], "function": {"arguments": arguments[:half]}}
                    ),
                    Piece(
                        "", {"index": call["index"], "function": {"arguments": arguments[half:]}}
                    ),
                ]
            # (vLLM: "stop" after a named function's call, as OpenAI says)
            finish = "stop" if named else "tool_calls"
        else:
            text = "\n".join(
                "<tool_call>\n"
                + json.dumps(
                    {
                        "name": call["function"]["name"],
                        "arguments": json.loads(call["function"]["arguments"]),
                    }
                )
                + "\n</tool_call>"
                for call in calls
            )
            pieces = [Piece(text[i : i + 7]) for i in range(0, len(text), 7)]
            finish = "stop"
        if len(pieces) > max_tokens:
            return FakeAnswer(pieces[:max_tokens], "length", calls)
        return FakeAnswer(pieces, finish, calls)

    def _calls_for(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        """The calls its model makes to a request with tools (a named function's alone, as
        vLLM's guided decoding forces; none with tool_choice "none", where its parser
        would read them: without one, the model may still write a call-like block, text)."""
        choice = request.get("tool_choice")
        if not request.get("tools") or not self.tool_calls:
            return []
        if choice == "none" and self.tool_parser:
            return []
        wanted = self.tool_calls
        if isinstance(choice, dict):
            wanted = [(choice["function"]["name"], self.tool_calls[0][1])]
        return [
            {
                "index": index,
                "id": f"chatcmpl-tool-{index}{len(self.received)}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
            for index, (name, arguments) in enumerate(wanted)
        ]

    def legs(self) -> list[dict[str, Any]]:
        return [body for body, _ in self.received]


async def wait_unless_hung_up(event: trio.Event, receive: Any) -> bool:
    """Wait for ``event`` unless the client (the router) hangs up first: whether it came."""
    gone = False
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        await event.wait()
        nursery.cancel_scope.cancel()
    return not gone


def choice_of(request_id: str) -> int:
    """The choice a leg's X-Request-Id names: the router's ``{id}-{choice}`` for choice > 0
    (an id of its own is ``{prefix}-{hex}``: one dash)."""
    head, _, tail = request_id.rpartition("-")
    return int(tail) if tail.isdigit() and "-" in head else 0


@attrs.frozen
class Piece:
    """One token of a fake answer: its text, or a piece of a tool call its parser streams."""

    text: str
    tool_call: dict[str, Any] | None = None


@attrs.frozen
class FakeAnswer:
    pieces: list[Piece]
    finish_reason: str
    calls: list[dict[str, Any]] = attrs.Factory(list)  # (the calls, whole)


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
