"""vLLM's disaggregated-prefill HTTP protocol (the KV connector's ``kv_transfer_params``).

A request is two legs with one ``X-Request-Id``.  The prefill leg is the
client's request with ``stream: false``, one token, no ``stream_options`` nor
``min_tokens``, and ``kv_transfer_params.do_remote_decode``: the prefill
instance computes the prompt's KV, holds it for a remote decode, and answers
where it lies (``kv_transfer_params``: engine id, block ids, host, port, ...;
newer versions add fields, so it is passed on whole).  The decode leg is the
client's request carrying that object: decode pulls the blocks (which frees
them on prefill) and generates the whole answer, streamed.  A null
``kv_transfer_params`` (prefill ended at its one token) makes decode's a plain
request.

Tools: the legs carry the client's ``tools`` and ``tool_choice``, so the engine renders
them with its chat template; an engine started with a tool parser answers calls as
``delta.tool_calls`` (read here, :class:`EngineToolCalls` gathers them into whole
calls), one without answers text (the router reads ``<tool_call>`` blocks out of it).

Logprobs, when the client asks for them, come on decode's stream in OpenAI's
shapes (decode computes every token again, the first included): read here as
:class:`TokenLogprob` items, shaped again for the client by the router's shaper.

Pure data (sans-IO): bodies built, answers and ``/metrics`` read; no I/O, no clock.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, final

import attrs

from pdtrio.protocol.link.wire import MAX_TOP_LOGPROBS, TokenLogprob, Usage
from pdtrio.protocol.openai.tools import ToolCall

REQUEST_ID_HEADER = "X-Request-Id"
# what the prefill leg asks for: keep the KV for a decode elsewhere to pull
PREFILL_KV_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# the client's fields that make no sense on a one-token, unstreamed prefill
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")
Endpoint = Literal["chat", "completion"]
PATHS: Mapping[Endpoint, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


class EngineAnswerError(ValueError):
    """An engine's answer is not what its protocol says it sends."""


def choice_body(client_body: Mapping[str, Any], choice: int) -> dict[str, Any]:
    """The client's request as choice ``choice`` of its ``n`` runs alone: one sample
    (``n``, and ``best_of``, which pdtrio serves only equal to it, left out), with
    ``seed + choice`` when it has a seed (what vLLM gives its own n samples, so each
    choice is what a single request with that seed would answer).

    Why each choice is a PD flow of its own, a prefill leg and a decode leg (vLLM's and
    SGLang's), rather than one flow with ``n``: vLLM 0.32 forks a request
    with ``n`` into n child requests in its front end, each carrying the same
    ``kv_transfer_params``: on prefill each child holds its own copy of the prompt's
    blocks and the answer names only one (the rest stranded until the lease ends); on
    decode each child pulls the same remote blocks, and the first pull's notification
    frees them on prefill while the others may still be reading (the NIXL connector
    then logs "potentially invalid KV blocks").  SGLang's bootstrap pairs one prefill
    with one decode per room; how it numbers the rooms of n samples is its own.  One
    sample per flow is the form both serve as designed.
    """
    body = {key: value for key, value in client_body.items() if key not in ("n", "best_of")}
    seed = body.get("seed")
    if choice and isinstance(seed, int) and not isinstance(seed, bool):
        body["seed"] = seed + choice
    return body


def prefill_body(client_body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg: one token, not streamed, the KV kept for a remote decode."""
    body = {key: value for key, value in client_body.items() if key not in _NOT_FOR_PREFILL}
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return body


def decode_body(
    client_body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The decode leg: the client's request with prefill's ``kv_transfer_params`` (None:
    a plain request), always streamed with a running token count (the router shapes
    the client's answer from it, streamed or not)."""
    body = dict(client_body)
    body.pop("kv_transfer_params", None)
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    body["stream"] = True
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def release_body(
    client_body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any]
) -> dict[str, Any]:
    """A decode leg whose only use is to pull prefill's blocks, which frees them there:
    for a request whose client left after prefill answered (vLLM would otherwise keep
    them until its abort timeout).  One token, not streamed."""
    body = {key: value for key, value in client_body.items() if key not in _NOT_FOR_PREFILL}
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["kv_transfer_params"] = dict(kv_transfer_params)
    return body


@final
@attrs.frozen
class PrefillAnswer:
    """What the router keeps of prefill's answer."""

    kv_transfer_params: Mapping[str, Any] | None  # whole, as prefill sent it
    prompt_tokens: int
    cached_tokens: int


def parse_prefill_answer(answer: Any) -> PrefillAnswer:
    """Prefill's JSON answer (a completion of one token)."""
    if not isinstance(answer, dict):
        raise EngineAnswerError(f"prefill answered {type(answer).__name__}, not an object")
    params = answer.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise EngineAnswerError("prefill's kv_transfer_params is not an object")
    usage = answer.get("usage")
    prompt_tokens, cached = _prompt_counts(usage)
    return PrefillAnswer(params, prompt_tokens, cached)


def _prompt_counts(usage: Any) -> tuple[int, int]:
    if not isinstance(usage, dict):
        return 0, 0
    prompt = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return (
        prompt if isinstance(prompt, int) else 0,
        cached if isinstance(cached, int) else 0,
    )


@final
@attrs.frozen
class DecodeChunk:
    """One event of decode's stream, as the router reads it."""

    text: str
    completion_tokens: int | None  # the running count, when the chunk carries usage
    finish_reason: str | None
    usage: Usage | None  # the final counts (the usage-only chunk)
    error: str | None = None  # an error event: the engine failed the stream
    # the chunk's tokens' logprobs, one item per token (None: none asked, or none sent)
    logprobs: tuple[TokenLogprob, ...] | None = None
    # chat: the pieces of tool calls the engine's tool parser read out of its answer
    tool_calls: tuple[ToolCallDelta, ...] = ()


@final
@attrs.frozen
class ToolCallDelta:
    """A piece of an engine's streamed tool call (OpenAI's ``delta.tool_calls[i]``): its
    first piece has the call's id and name, the next ones more of its arguments."""

    index: int
    id: str | None
    name: str | None
    arguments: str | None


@final
class EngineToolCalls:
    """An engine's streamed tool-call pieces gathered into whole calls.

    Engines stream calls one after the other (vLLM's and SGLang's tool parsers): a call
    is whole once a later one begins, or the answer ends.  A call is relayed whole, as
    pdtrio's own calls are (the client's stream has each call in one chunk).
    """

    __slots__ = ("_open", "_closed_below")

    def __init__(self) -> None:
        self._open: dict[int, _PartialCall] = {}
        self._closed_below = 0  # calls of a lower index are whole and relayed

    def feed(self, deltas: Sequence[ToolCallDelta]) -> list[ToolCall]:
        """The calls ``deltas`` complete (those before a call they begin)."""
        whole: list[ToolCall] = []
        for delta in deltas:
            if delta.index < self._closed_below:
                raise EngineAnswerError(
                    f"decode streamed more of tool call {delta.index} after a later one began"
                )
            partial = self._open.get(delta.index)
            if partial is None:
                whole += self._close(below=delta.index)
                partial = self._open[delta.index] = _PartialCall()
            if delta.id and not partial.id:
                partial.id = delta.id
            if delta.name and not partial.name:
                partial.name = delta.name
            if delta.arguments:
                partial.arguments.append(delta.arguments)
        return whole

    def finish(self) -> list[ToolCall]:
        """The calls still open when the answer ended."""
        return self._close(below=None)

    def _close(self, below: int | None) -> list[ToolCall]:
        whole = []
        for index in sorted(self._open):
            if below is not None and index >= below:
                break
            partial = self._open.pop(index)
            if not partial.name:
                raise EngineAnswerError(f"decode streamed tool call {index} without its name")
            # (a call of a function with no parameters may come with no arguments at all)
            arguments = "".join(partial.arguments) or "{}"
            whole.append(ToolCall(index, partial.id, partial.name, arguments))
            self._closed_below = index + 1
        return whole


@attrs.define
class _PartialCall:
    id: str = ""
    name: str = ""
    arguments: list[str] = attrs.Factory(list)


def parse_decode_event(
    data: str, endpoint: Endpoint, *, with_logprobs: bool = False
) -> DecodeChunk | None:
    """An SSE ``data:`` payload of decode's stream; None for ``[DONE]``.

    ``with_logprobs``: the request asked for logprobs, read from each chunk's choice
    (else not even looked at).
    """
    if data == "[DONE]":
        return None
    try:
        event = json.loads(data)
    except json.JSONDecodeError as exc:
        raise EngineAnswerError(f"decode sent an event that is not JSON: {exc}") from exc
    if not isinstance(event, dict):
        raise EngineAnswerError("decode sent an event that is not an object")
    if "error" in event:
        error = event["error"]
        message = error.get("message") if isinstance(error, dict) else error
        return DecodeChunk("", None, None, None, error=str(message))
    text = ""
    finish_reason = None
    logprobs = None
    tool_calls: tuple[ToolCallDelta, ...] = ()
    choices = event.get("choices") or []
    if choices:
        choice = choices[0]
        if not isinstance(choice, dict):
            raise EngineAnswerError("decode sent a choice that is not an object")
        if endpoint == "chat":
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                raise EngineAnswerError("decode sent a delta that is not an object")
            text = delta.get("content") or ""
            tool_calls = _tool_call_deltas(delta.get("tool_calls"))
        else:
            text = choice.get("text") or ""
        finish_reason = choice.get("finish_reason")
        shaped = choice.get("logprobs") if with_logprobs else None
        if shaped is not None:
            logprobs = (
                chat_token_logprobs(shaped)
                if endpoint == "chat"
                else completion_token_logprobs(shaped)
            )
    usage = event.get("usage")
    running = None
    final = None
    if isinstance(usage, dict):
        completion = usage.get("completion_tokens")
        running = completion if isinstance(completion, int) else None
        if not choices and running is not None:  # the usage-only chunk that ends the stream
            prompt, cached = _prompt_counts(usage)
            final = Usage(prompt, running, cached)
    return DecodeChunk(
        text, running, finish_reason, final, logprobs=logprobs, tool_calls=tool_calls
    )


def _tool_call_deltas(shaped: Any) -> tuple[ToolCallDelta, ...]:
    """A chat delta's ``tool_calls`` (``[{"index", "id", "type", "function": {"name",
    "arguments"}}]``, each field but the index present only when it has something)."""
    if not shaped:
        return ()
    if not isinstance(shaped, list):
        raise EngineAnswerError("decode sent tool_calls that are not a list")
    deltas = []
    for entry in shaped:
        if not isinstance(entry, dict):
            raise EngineAnswerError("decode sent a tool call that is not an object")
        index = entry.get("index", 0)
        function = entry.get("function") or {}
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise EngineAnswerError("decode sent a tool call whose index is not a number")
        if not isinstance(function, dict):
            raise EngineAnswerError("decode sent a tool call whose function is not an object")
        fields = (entry.get("id"), function.get("name"), function.get("arguments"))
        if not all(value is None or isinstance(value, str) for value in fields):
            raise EngineAnswerError(
                "decode sent a tool call whose id, name or arguments is not a string"
            )
        deltas.append(ToolCallDelta(index, *fields))
    return tuple(deltas)


def chat_token_logprobs(shaped: Any) -> tuple[TokenLogprob, ...]:
    """A chat choice's ``logprobs`` (``{"content": [{"token", "logprob", "bytes",
    "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}``) as items, the
    alternatives in the engine's order (``bytes`` is the token's UTF-8: not kept)."""
    if not isinstance(shaped, dict):
        raise EngineAnswerError("decode sent chat logprobs that are not an object")
    content = shaped.get("content")
    if content is None:  # (a chunk of no token)
        return ()
    if not isinstance(content, list):
        raise EngineAnswerError("decode sent chat logprobs whose content is not a list")
    items = []
    for entry in content:
        if not isinstance(entry, dict):
            raise EngineAnswerError("decode sent a chat logprob that is not an object")
        tops = entry.get("top_logprobs") or []
        if not isinstance(tops, list) or not all(isinstance(top, dict) for top in tops):
            raise EngineAnswerError("decode sent chat top_logprobs that are not a list of objects")
        tops = tops[:MAX_TOP_LOGPROBS]
        items.append(
            TokenLogprob(
                _token(entry.get("token")),
                _logprob(entry.get("logprob")),
                tuple(_token(top.get("token")) for top in tops),
                tuple(_logprob(top.get("logprob")) for top in tops),
            )
        )
    return tuple(items)


def completion_token_logprobs(shaped: Any) -> tuple[TokenLogprob, ...]:
    """A completion choice's ``logprobs`` (``{"tokens", "token_logprobs",
    "top_logprobs": [{token: logprob}, ...], "text_offset"}``) as items.

    Each ``top_logprobs`` map holds the likeliest and the sampled token (vLLM's:
    up to n + 1 keys): kept best first, so the shaper's first n are the likeliest
    and it adds the sampled token back as the engine did.  ``text_offset`` is the
    shaper's to count again for the client's text.
    """
    if not isinstance(shaped, dict):
        raise EngineAnswerError("decode sent completion logprobs that are not an object")
    tokens = shaped.get("tokens") or []
    values = shaped.get("token_logprobs") or []
    tops = shaped.get("top_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list) or len(tokens) != len(values):
        raise EngineAnswerError(
            "decode sent completion logprobs whose tokens and token_logprobs do not pair up"
        )
    if tops is None:
        tops = [None] * len(tokens)
    if not isinstance(tops, list) or len(tops) != len(tokens):
        raise EngineAnswerError("decode sent completion top_logprobs that are not one per token")
    items = []
    for token, value, top in zip(tokens, values, tops, strict=True):
        if top is not None and not isinstance(top, dict):
            raise EngineAnswerError("decode sent a completion top_logprobs that is not an object")
        ranked = sorted(
            ((_token(name), _logprob(logprob)) for name, logprob in (top or {}).items()),
            key=lambda pair: -pair[1],
        )[:MAX_TOP_LOGPROBS]
        items.append(
            TokenLogprob(
                _token(token),
                _logprob(value),
                tuple(name for name, _ in ranked),
                tuple(logprob for _, logprob in ranked),
            )
        )
    return tuple(items)


def _token(value: Any) -> str:
    if not isinstance(value, str):
        raise EngineAnswerError(
            f"decode sent a logprob's token that is not a string ({type(value).__name__})"
        )
    return value


def _logprob(value: Any) -> float:
    # (bool is an int; NaN and -inf, which JSON lacks, the shaper writes as -9999.0)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EngineAnswerError(
            f"decode sent a logprob that is not a number ({type(value).__name__})"
        )
    return float(value)


@final
@attrs.frozen
class EngineLoad:
    """What an engine's ``/metrics`` says of its load."""

    waiting: int
    running: int
    kv_usage: float  # 0..1 of its KV cache in use

    @property
    def idle(self) -> bool:
        """Nothing running or waiting (the KV a prefix cache keeps counts as in use)."""
        return self.waiting == 0 and self.running == 0


# vLLM's names, then SGLang's
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
# vLLM 0.32's name, the one before it, SGLang's
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")


def parse_engine_metrics(text: str) -> EngineLoad:
    """vLLM's (or SGLang's) Prometheus text: waiting and running requests, KV cache usage
    (summed over its engines; a figure it does not show counts as 0)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        name = line[:name_end]
        if name not in _WAITING and name not in _RUNNING and name not in _KV_USAGE:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            sums[name] = sums.get(name, 0.0) + value
    kv = next((sums[name] for name in _KV_USAGE if name in sums), 0.0)
    waiting = sum(sums.get(name, 0.0) for name in _WAITING)
    running = sum(sums.get(name, 0.0) for name in _RUNNING)
    return EngineLoad(int(waiting), int(running), kv)
