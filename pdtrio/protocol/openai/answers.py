"""What each endpoint's answer looks like: its id, its stream shaper, its whole body.

Sans-IO.  The pipeline runs every endpoint's request the same way (a chat or a
completion request on the instances); :func:`answer_shape` says, by endpoint
kind, how its answer is named and shaped, so that no other code asks which
endpoint it serves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final, Literal, final

import attrs

from pdtrio.protocol.link.wire import TokenLogprob, Usage
from pdtrio.protocol.openai.requests import ChatCompletionRequest, CompletionRequest
from pdtrio.protocol.openai.responses import (
    MessageStatus,
    ResponsesRequest,
    function_call_item,
    message_item,
    response_object,
)
from pdtrio.protocol.openai.responses_sse import (
    ResponsesStreamShaper,
    function_call_id_for,
    message_id_for,
)
from pdtrio.protocol.openai.sse import BaseShaper, ChoiceShapers, StreamShaper
from pdtrio.protocol.openai.tools import ToolCall, parse_tool_calls

AnswerKind = Literal["chat", "completion", "responses"]


@final
@attrs.frozen
class AnswerDelta:
    """A piece of one choice's answer on its way to the client.

    ``final``: the response ends with it; ``logprobs``: its tokens', when the request
    asked for them; ``tool_calls``: calls an engine read out of its answer itself, sent
    after the text.
    """

    text: str
    num_tokens: int
    finish_reason: str | None = None
    usage: Usage | None = None
    final: bool = False
    logprobs: Sequence[TokenLogprob] | None = None
    choice: int = 0
    tool_calls: Sequence[ToolCall] = ()


AnyRequest = ChatCompletionRequest | CompletionRequest | ResponsesRequest

ENDPOINTS: Final[dict[AnswerKind, str]] = {
    "chat": "/v1/chat/completions",
    "completion": "/v1/completions",
    "responses": "/v1/responses",
}


# a streamed answer's shaper: chat's and completions' StreamShaper, or the Responses one
Shaper = BaseShaper


@final
@attrs.frozen
class AnswerShape:
    """One request's answer: ``run`` is the request the instances serve."""

    kind: AnswerKind
    request: AnyRequest
    run: ChatCompletionRequest | CompletionRequest
    id_prefix: str

    @property
    def endpoint(self) -> str:
        return ENDPOINTS[self.kind]

    def client_param(self, param: str | None) -> str | None:
        """A worker's error names the chat field it refused: the client is told its own
        request's name for it (``text.format`` for ``response_format`` on /v1/responses)."""
        if param is None:
            return None
        return _CLIENT_PARAMS[self.kind].get(param, param)

    def stream_shaper(self, request_id: str, created: int, top_logprobs: int | None) -> Shaper:
        request = self.request
        if isinstance(request, ResponsesRequest):
            return ResponsesStreamShaper(
                request=request, response_id=request_id, created_at=created
            )
        assert self.kind != "responses"
        shapers = [
            StreamShaper(
                kind=self.kind,
                request_id=request_id,
                model=request.model,
                created=created,
                include_usage=request.include_usage,
                continuous_usage_stats=request.continuous_usage_stats,
                top_logprobs=top_logprobs,
                index=index,
            )
            for index in range(request.sampling.n)
        ]
        if len(shapers) == 1:
            return shapers[0]
        return ChoiceShapers(shapers, include_usage=request.include_usage)

    @property
    def own_body(self) -> Callable[..., dict[str, Any]] | None:
        """The endpoint's own non-streamed body builder; None for chat and completions,
        whose bodies the client response builds (reading a chat answer's tool calls)."""
        return self.responses_body if isinstance(self.request, ResponsesRequest) else None

    def responses_body(
        self,
        *,
        request_id: str,
        created: int,
        text: str,
        finish_reason: str | None,
        usage: Usage,
        logprobs: Sequence[TokenLogprob] | None,
        top_logprobs: int,
        tool_calls: Sequence[ToolCall] | None = None,
    ) -> dict[str, Any]:
        """The whole, non-streamed ``Response`` (logprobs are not asked on this endpoint):
        its text as a message (none when the model only called), then its calls, read
        out of the text as chat's are (``tool_calls``: read already, ``text`` their
        content, the calls an engine read out itself among them)."""
        request = self.request
        assert isinstance(request, ResponsesRequest)
        item_status: MessageStatus = "incomplete" if finish_reason == "length" else "completed"
        calls = [] if tool_calls is None else list(tool_calls)
        tools = request.chat.tools
        if tool_calls is None and tools is not None and tools.shown:
            # ("none": a call-like block stays text)
            text, calls = parse_tool_calls(text, [function.name for function in tools.functions])
        output = (
            []
            if calls and not text
            else [message_item(message_id_for(request_id), text, item_status)]
        )
        for call in calls:
            output.append(function_call_item(function_call_id_for(request_id, len(output)), call))
        return response_object(
            request,
            response_id=request_id,
            created_at=created,
            status="completed",  # (incomplete after a length finish)
            output=output,
            usage=usage,
            finish_reason=finish_reason,
        )


_ID_PREFIXES: Final[dict[AnswerKind, str]] = {
    "chat": "chatcmpl-",
    "completion": "cmpl-",
    "responses": "resp_",
}

# what the instances' errors name, as each endpoint's request calls it
_CLIENT_PARAMS: Final[dict[AnswerKind, dict[str, str]]] = {
    "chat": {},
    "completion": {},
    "responses": {
        "response_format": "text.format",
        "max_tokens": "max_output_tokens",
        "messages": "input",
    },
}


def answer_shape(kind: AnswerKind, request: AnyRequest) -> AnswerShape:
    """The answer of ``request`` at endpoint ``kind``."""
    run = request.chat if isinstance(request, ResponsesRequest) else request
    if (kind == "responses") != isinstance(request, ResponsesRequest):
        raise ValueError(f"a {type(request).__name__} is not a {kind} request")
    return AnswerShape(kind=kind, request=request, run=run, id_prefix=_ID_PREFIXES[kind])
