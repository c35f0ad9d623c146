"""The Responses API's streaming shape: text deltas in, typed server-sent events out.

Sans-IO, with :class:`~pdtrio.protocol.openai.sse.StreamShaper`'s interface (the
pipeline feeds either alike, the model's tool calls through ``tool_calls`` too:
each a ``function_call`` output item, its arguments in one delta).  Each event is ``event: <type>\\ndata: {...}\\n\\n``
with a ``sequence_number``; the stream ends with ``response.completed`` (or
``response.incomplete``, or ``error`` and ``response.failed``), never with
``data: [DONE]``, as OpenAI's does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final, final

from pdtrio.protocol.link.wire import TokenLogprob, Usage
from pdtrio.protocol.openai.errors import OpenAIError
from pdtrio.protocol.openai.responses import (
    MessageStatus,
    ResponsesRequest,
    ResponseStatus,
    function_call_item,
    message_item,
    response_object,
)
from pdtrio.protocol.openai.sse import BaseShaper
from pdtrio.protocol.openai.tools import ToolCall

_dumps: Final = json.dumps
_compact: Final = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def message_id_for(response_id: str, output_index: int = 0) -> str:
    """The id of a response's output message at ``output_index`` (the first's, at 0,
    is the response's own id as a message's)."""
    base = "msg_" + response_id.removeprefix("resp_")
    return base if output_index == 0 else f"{base}_{output_index}"


def function_call_id_for(response_id: str, output_index: int) -> str:
    """The id of a response's function_call output item at ``output_index``."""
    return f"fc_{response_id.removeprefix('resp_')}_{output_index}"


@final
class ResponsesStreamShaper(BaseShaper):
    """Shapes one streamed response of ``request`` (id ``response_id``).

    Feed every text delta to :meth:`delta` (empty ones too: their tokens count)
    and each completed call of the model's to :meth:`tool_calls`, then end with
    :meth:`done` or :meth:`error`; each returns the bytes to write now.  The
    response's opening events go out with the first call; without tools the
    message's too (its text may be empty), with tools a message opens at its
    first text (an answer that only calls has none) and closes before a call.
    """

    __slots__ = (
        "_created_at",
        "_delta_prefix",
        "_eager_message",
        "_finish_reason",
        "_message_id",
        "_message_index",
        "_opened",
        "_output",
        "_request",
        "_response_id",
        "_sequence",
        "_text_parts",
    )

    def __init__(self, *, request: ResponsesRequest, response_id: str, created_at: int) -> None:
        super().__init__()
        self._request = request
        self._response_id = response_id
        self._created_at = created_at
        self._sequence = 0
        self._opened = False
        self._finish_reason: str | None = None
        self._eager_message = request.chat.tools is None
        self._output: list[dict[str, Any]] = []  # the items done
        # the message open now (None: none), its text so far
        self._message_index: int | None = None
        self._message_id = ""
        self._text_parts: list[str] = []
        self._delta_prefix = ""

    # --- events -------------------------------------------------------------------

    def delta(
        self,
        text: str,
        num_tokens: int,
        finish_reason: str | None,
        usage: Usage | None = None,
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> bytes:
        """The bytes for ``num_tokens`` more tokens decoding to ``text`` (``logprobs``
        are not asked on this endpoint: ignored)."""
        self._check_delta(num_tokens)
        self._count(num_tokens, usage)
        out = self._open()
        if text:
            if self._message_index is None:
                out += self._open_message()
            self._text_parts.append(text)
            out += self._delta_prefix + _dumps(text) + self._sequence_end()
        if finish_reason is not None:
            self._finished = True
            self._finish_reason = finish_reason
            out += self._close_message()
        return out.encode()

    def tool_calls(self, calls: Sequence[ToolCall]) -> bytes:
        """The events of ``calls``, each a function_call item, whole (a call is sent
        once its block is complete); the message before them is closed first."""
        if self._closed or self._finished:
            raise ValueError("tool_calls() after the stream ended")
        out = self._open() + self._close_message()
        for call in calls:
            index = len(self._output)
            item_id = function_call_id_for(self._response_id, index)
            out += (
                self._event(
                    "response.output_item.added",
                    output_index=index,
                    item=function_call_item(item_id, call, arguments=""),
                )
                + self._event(
                    "response.function_call_arguments.delta",
                    item_id=item_id,
                    output_index=index,
                    delta=call.arguments,
                )
                + self._event(
                    "response.function_call_arguments.done",
                    item_id=item_id,
                    output_index=index,
                    name=call.name,
                    arguments=call.arguments,
                )
            )
            item = function_call_item(item_id, call)
            self._output.append(item)
            out += self._event("response.output_item.done", output_index=index, item=item)
        return out.encode()

    def done(self) -> bytes:
        """End the stream normally: ``response.completed`` (``response.incomplete`` when
        the output ran out of tokens), the whole response with its usage."""
        self._close()
        out = self._open()
        if not self._output and self._message_index is None:
            out += self._open_message()  # (an answer of nothing is an empty message)
        out += self._close_message()
        # (response_object makes it incomplete after a length finish)
        response = self._response("completed", list(self._output))
        return (out + self._event(f"response.{response['status']}", response=response)).encode()

    def error(self, error: OpenAIError) -> bytes:
        """End the stream with an ``error`` event, then ``response.failed``."""
        self._close()
        out = self._open()
        out += self._event("error", code=error.code, message=error.message, param=error.param)
        output = list(self._output)
        if self._text_parts:  # the message cut short
            output.append(message_item(self._message_id, "".join(self._text_parts), "incomplete"))
        response = self._response("failed", output, error=error)
        return (out + self._event("response.failed", response=response)).encode()

    # --- internals -------------------------------------------------------------------

    def _open(self) -> str:
        """The opening events, once: the response (and, without tools, its message)."""
        if self._opened:
            return ""
        self._opened = True
        response = self._response("in_progress", [])
        out = self._event("response.created", response=response) + self._event(
            "response.in_progress", response=response
        )
        return out + self._open_message() if self._eager_message else out

    def _open_message(self) -> str:
        """A message item and its text part, at the next output index."""
        index = self._message_index = len(self._output)
        message_id = self._message_id = message_id_for(self._response_id, index)
        self._text_parts = []
        # the hot event's JSON before its delta (its sequence_number goes last)
        self._delta_prefix = (
            'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
            f'"item_id":{_dumps(message_id)},"output_index":{index},"content_index":0,'
            '"logprobs":[],"delta":'
        )
        return self._event(
            "response.output_item.added",
            output_index=index,
            item=message_item(message_id, None, "in_progress"),
        ) + self._event(
            "response.content_part.added",
            item_id=message_id,
            output_index=index,
            content_index=0,
            part=_text_part(""),
        )

    def _close_message(self) -> str:
        """The open message's closing events ("" when none is open)."""
        index = self._message_index
        if index is None:
            return ""
        self._message_index = None
        text = "".join(self._text_parts)
        self._text_parts = []
        item = message_item(self._message_id, text, self._item_status())
        self._output.append(item)
        return (
            self._event(
                "response.output_text.done",
                item_id=self._message_id,
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            )
            + self._event(
                "response.content_part.done",
                item_id=self._message_id,
                output_index=index,
                content_index=0,
                part=_text_part(text),
            )
            + self._event("response.output_item.done", output_index=index, item=item)
        )

    def _item_status(self) -> MessageStatus:
        return "incomplete" if self._finish_reason == "length" else "completed"

    def _response(
        self,
        status: ResponseStatus,
        output: list[dict[str, Any]],
        error: OpenAIError | None = None,
    ) -> dict[str, Any]:
        usage = None
        if status != "in_progress":
            usage = Usage(self._prompt_tokens, self._completion_tokens, self._cached_tokens)
        return response_object(
            self._request,
            response_id=self._response_id,
            created_at=self._created_at,
            status=status,
            output=output,
            usage=usage,
            finish_reason=self._finish_reason,
            error=error,
        )

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, **fields, "sequence_number": self._sequence}
        self._sequence += 1
        return f"event: {kind}\ndata: {_compact(data)}\n\n"

    def _sequence_end(self) -> str:
        end = f',"sequence_number":{self._sequence}}}\n\n'
        self._sequence += 1
        return end


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}
