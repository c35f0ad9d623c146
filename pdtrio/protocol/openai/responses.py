"""OpenAI's Responses API (``POST /v1/responses``), stateless: the request and its body.

Sans-IO.  :func:`parse_responses_request` validates a body into a
:class:`ResponsesRequest`: the chat request the pipeline runs (its ``input``
and ``instructions`` as chat messages, ``max_output_tokens`` as max_tokens,
``text.format`` through the chat path's ``response_format`` parser) and what
the ``Response`` object echoes.  Nothing is stored: ``store`` is accepted and
ignored, and what needs a stored response or conversation
(``previous_response_id``, ``conversation``, ``background``, ``prompt``) is
refused with a 400 naming it.

Function tools are chat's: the flat ``tools`` and ``tool_choice`` go through
:func:`~pdtrio.protocol.openai.tools.parse_chat_tools` (``flat=True``), so the
model is shown them by the same template and a forced call gets the same
grammar; ``function_call`` and ``function_call_output`` input items become the
assistant's ``tool_calls`` and ``tool`` messages of chat's history
(:func:`~pdtrio.protocol.openai.tools.message_extras`).  The router reads the
calls back out of the text as it does a chat answer's, and they go out as
``function_call`` output items (:func:`function_call_item`).

:func:`response_object` is the ``Response`` object, the non-streamed body and
what the stream's ``response.*`` events carry (``pdtrio.protocol.openai.responses_sse``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Final, Literal, final

import attrs
import msgspec

from pdtrio.protocol.link.wire import Usage
from pdtrio.protocol.openai.errors import OpenAIError, bad_request, invalid_type, show_client_text
from pdtrio.protocol.openai.fields import (
    _check_text,
    _load_object,
    _missing,
    _opt_bool,
    _opt_int,
    _opt_str,
    _sampling,
    _token_limit,
)
from pdtrio.protocol.openai.requests import (
    ChatCompletionRequest,
    _chat_prompt,
    _model,
    _too_many_messages,
    message_role,
    message_text,
)
from pdtrio.protocol.openai.structured import response_format_output
from pdtrio.protocol.openai.tools import ChatTools, ToolCall, message_extras, parse_chat_tools

__all__ = [
    "INPUT_ROLES",
    "MessageStatus",
    "ResponsesRequest",
    "engine_chat_body",
    "function_call_item",
    "message_item",
    "parse_responses_request",
    "response_object",
    "response_usage",
]

INPUT_ROLES: Final = frozenset({"user", "system", "developer", "assistant"})
_TEXT_PART_TYPES: Final = frozenset({"input_text", "output_text"})
_OUTPUT_PART_TYPES: Final = frozenset({"input_text"})  # a function_call_output's parts
# OpenAI's metadata limits
_METADATA_KEYS: Final = 16
_METADATA_KEY_CHARS: Final = 64
_METADATA_VALUE_CHARS: Final = 512
# what only a stored response, conversation or prompt could serve
_STATEFUL: Final = {
    "previous_response_id": "previous_response_id is not supported: no response is stored "
    "(send the whole conversation in 'input').",
    "conversation": "conversation is not supported: no conversation is stored "
    "(send the whole conversation in 'input').",
    "prompt": "prompt (a stored prompt template) is not supported.",
}


@final
@attrs.frozen
class ResponsesRequest:
    """A ``/v1/responses`` request: ``chat`` is what runs, the rest what is echoed."""

    chat: ChatCompletionRequest
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    # the client's text.format as given (echoed), {"type": "text"} when none
    text_format: Mapping[str, Any]
    metadata: Mapping[str, str]
    store: bool
    parallel_tool_calls: bool
    # the client's tool_choice ("auto" when none) and function tools, as OpenAI echoes them
    tool_choice: str | Mapping[str, Any]
    tools: tuple[Mapping[str, Any], ...] = ()


def parse_responses_request(
    body: bytes | bytearray,
    *,
    served_models: Collection[str],
    max_tokens_limit: int,
    context_lengths: Mapping[str, int] | None = None,
) -> ResponsesRequest:
    """Validate a ``POST /v1/responses`` body; raises :class:`OpenAIError` (400 naming
    the ``param``) for anything not served."""
    obj = _load_object(body)
    model = _model(obj, served_models)
    for key, message in _STATEFUL.items():
        if obj.get(key) is not None:
            raise bad_request(message, param=key)
    if _opt_bool(obj, "background"):
        raise bad_request("background is not supported: no response is stored.", param="background")
    tools = parse_chat_tools(obj, flat=True)
    instructions = _opt_str(obj, "instructions")
    messages = _input_messages(obj)
    if instructions is not None:
        messages = (("system", instructions, ""), *messages)
    context_length = None if context_lengths is None else context_lengths.get(model)
    if context_length is not None and len(messages) >= context_length:
        raise _too_many_messages(len(messages), context_length)
    _reject_unserved(obj)
    max_output_tokens = _token_limit(obj, "max_output_tokens", max_tokens_limit)
    # the chat path's sampling checks, on the fields both APIs name alike
    shared: dict[str, Any] = {
        key: obj[key] for key in ("temperature", "top_p", "seed") if key in obj
    }
    sampling, _ = _sampling(shared, max_tokens_limit, allow_completion_alias=False, logprobs=-1)
    text_format, structured = _text_format(obj)
    forced = None if tools is None else tools.structured()
    if forced is not None:
        if structured is not None:
            raise bad_request(
                "tool_choice 'required' or a named function cannot be combined with "
                "text.format json_schema or json_object.",
                param="tool_choice",
            )
        structured = forced
    stream = bool(_opt_bool(obj, "stream"))
    options = obj.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid_type("stream_options", "an object", options)
    if options is not None and not stream:
        raise bad_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )
    store = _opt_bool(obj, "store")
    parallel = _opt_bool(obj, "parallel_tool_calls")
    chat = ChatCompletionRequest(
        model=model,
        prompt=_chat_prompt(messages, tools),
        sampling=msgspec.structs.replace(sampling, structured=structured),
        max_tokens=max_output_tokens,
        stream=stream,
        # the stream's last event carries the usage (response.completed's response)
        include_usage=False,
        continuous_usage_stats=False,
        user=_opt_str(obj, "user"),
        tools=tools if tools is not None and tools.shown else None,
    )
    return ResponsesRequest(
        chat=chat,
        instructions=instructions,
        max_output_tokens=max_output_tokens,
        # what sampled, sent or not (OpenAI's Response echoes 1.0 for either left out)
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        text_format=text_format,
        metadata=_metadata(obj),
        store=True if store is None else store,
        parallel_tool_calls=True if parallel is None else parallel,
        tool_choice=_echoed_choice(obj.get("tool_choice")),
        tools=_echoed_tools(obj, tools),
    )


# --- input ----------------------------------------------------------------------


def _input_messages(obj: dict[str, Any]) -> tuple[tuple[str, str, str], ...]:
    """The input as chat messages: (role, text, extras), extras as the chat path's
    :func:`~pdtrio.protocol.openai.tools.message_extras` writes them."""
    raw = obj.get("input")
    if raw is None:
        raise _missing("input")
    if isinstance(raw, str):
        return (("user", _check_text(raw, "input"), ""),)
    if not isinstance(raw, list):
        raise invalid_type("input", "a string or an array of input items", raw)
    if not raw:
        raise bad_request(
            "Invalid 'input': empty array. Expected an array with minimum length 1.",
            param="input",
            code="empty_array",
        )
    return _ChatHistory().of(raw)


@final
class _ChatHistory:
    """Input items as the chat messages they stand for: a ``function_call`` is an
    assistant's ``tool_calls`` entry (calls in a row, and the assistant text before
    them, are one message, as chat has them), a ``function_call_output`` a ``tool``
    message answering one of those calls."""

    def __init__(self) -> None:
        # each message as chat has it, with where it began (for message_extras' errors)
        self._messages: list[tuple[dict[str, Any], str]] = []
        self._call_names: dict[str, str] = {}  # call_id -> the function it called

    def of(self, items: list[Any]) -> tuple[tuple[str, str, str], ...]:
        for i, item in enumerate(items):
            self._item(item, f"input.[{i}]")
        return tuple(
            (message["role"], message["content"], message_extras(message, message["role"], where))
            for message, where in self._messages
        )

    def chat_messages(self, items: list[Any]) -> list[dict[str, Any]]:
        """The items as chat-completions messages (OpenAI's shapes: a ``tool`` message
        answers its ``tool_call_id``)."""
        for i, item in enumerate(items):
            self._item(item, f"input.[{i}]")
        messages = [message for message, _ in self._messages]
        for message in messages:
            message.pop("name", None)  # (the function's name: chat's tool message has none)
        return messages

    def _item(self, item: Any, where: str) -> None:
        if not isinstance(item, dict):
            raise invalid_type(where, "an object", item)
        kind = item.get("type")
        if kind == "function_call":
            self._call(item, where)
        elif kind == "function_call_output":
            self._output(item, where)
        elif kind is None or kind == "message":
            role = message_role(item, where, INPUT_ROLES)
            content = item.get("content")
            where_content = f"{where}.content"
            if content is None:
                raise _missing(where_content)
            text = message_text(content, where_content, _TEXT_PART_TYPES)
            self._messages.append(({"role": role, "content": text}, where))
        elif not isinstance(kind, str):
            raise invalid_type(f"{where}.type", "a string", kind)
        else:
            # reasoning, item_reference, a hosted tool's call, ...
            raise bad_request(
                f"Input items of type {show_client_text(kind)} are not supported; only "
                "'message', 'function_call' and 'function_call_output' items are.",
                param=f"{where}.type",
                code="unsupported_input",
            )

    def _call(self, item: dict[str, Any], where: str) -> None:
        call_id = _item_str(item, "call_id", where)
        name = _item_str(item, "name", where)
        arguments = _item_str(item, "arguments", where)
        self._call_names[call_id] = name
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        last = self._messages[-1][0] if self._messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            self._messages.append(
                ({"role": "assistant", "content": "", "tool_calls": [call]}, where)
            )

    def _output(self, item: dict[str, Any], where: str) -> None:
        call_id = _item_str(item, "call_id", where)
        name = self._call_names.get(call_id)
        if name is None:
            raise bad_request(
                f"No function_call found in 'input' for the function_call_output's call_id "
                f"{show_client_text(call_id)}.",
                param=f"{where}.call_id",
            )
        output = item.get("output")
        if output is None:
            raise _missing(f"{where}.output")
        text = message_text(output, f"{where}.output", _OUTPUT_PART_TYPES)
        message = {"role": "tool", "content": text, "tool_call_id": call_id, "name": name}
        self._messages.append((message, where))


def _item_str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if value is None:
        raise _missing(f"{where}.{key}")
    if not isinstance(value, str):
        raise invalid_type(f"{where}.{key}", "a string", value)
    return _check_text(value, f"{where}.{key}")


# --- in front of engines ---------------------------------------------------------

# what a chat body carries as the Responses body has it (validated by the parse)
_SAME_IN_CHAT: Final = ("temperature", "top_p", "seed", "parallel_tool_calls", "user")


def engine_chat_body(obj: Mapping[str, Any], request: ResponsesRequest) -> dict[str, Any]:
    """The chat-completions body a vLLM or SGLang engine is sent for the ``/v1/responses``
    body ``obj``, which :func:`parse_responses_request` validated into ``request``.

    ``instructions`` is a leading system message and ``input`` chat's messages (as
    pdtrio's own path runs them), ``max_output_tokens`` is ``max_tokens``,
    ``text.format`` is ``response_format``, and flat function ``tools`` and a named
    ``tool_choice`` take chat's nested shape.  What only the ``Response`` echoes
    (``metadata``, ``store``) stays with the router.
    """
    raw_input = obj["input"]
    history = (
        [{"role": "user", "content": raw_input}]
        if isinstance(raw_input, str)
        else _ChatHistory().chat_messages(raw_input)
    )
    if request.instructions is not None:
        history.insert(0, {"role": "system", "content": request.instructions})
    body: dict[str, Any] = {
        "model": request.chat.model,
        "messages": history,
        "stream": request.chat.stream,
    }
    if request.max_output_tokens is not None:
        body["max_tokens"] = request.max_output_tokens
    body.update({key: obj[key] for key in _SAME_IN_CHAT if obj.get(key) is not None})
    if request.text_format.get("type") != "text":
        body["response_format"] = _chat_response_format(request.text_format)
    if request.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    key: tool[key]
                    for key in ("name", "description", "parameters", "strict")
                    if tool.get(key) is not None
                },
            }
            for tool in obj["tools"]
        ]
        # (none without tools: vLLM refuses an explicit "auto" where it runs no tool parser)
        choice = obj.get("tool_choice")
        if isinstance(choice, dict):
            body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif choice is not None:
            body["tool_choice"] = choice
    return body


# --- the other fields --------------------------------------------------------------


def _echoed_choice(choice: Any) -> str | Mapping[str, Any]:
    """tool_choice as the Response echoes it (parse_chat_tools has checked it)."""
    if choice is None:
        return "auto"
    if isinstance(choice, dict):
        return {"type": "function", "name": choice["name"]}
    return str(choice)


def _echoed_tools(obj: dict[str, Any], tools: ChatTools | None) -> tuple[dict[str, Any], ...]:
    """The request's function tools as the Response echoes them (OpenAI's FunctionTool)."""
    if tools is None:
        return ()
    return tuple(
        {
            "type": "function",
            "name": function.name,
            "description": function.description,
            "parameters": raw.get("parameters"),
            "strict": raw.get("strict"),
        }
        for function, raw in zip(tools.functions, obj["tools"], strict=True)
    )


def _reject_unserved(obj: dict[str, Any]) -> None:
    """Fields accepted only at the value that asks nothing this router does not do."""
    include = obj.get("include")
    if include is not None and include != []:
        if not isinstance(include, list):
            raise invalid_type("include", "an array", include)
        raise bad_request("include is not supported.", param="include")
    top_logprobs = _opt_int(obj, "top_logprobs")
    if top_logprobs is not None and top_logprobs != 0:
        raise bad_request("top_logprobs is not supported on /v1/responses.", param="top_logprobs")
    truncation = obj.get("truncation")
    if truncation is not None and truncation != "disabled":
        raise bad_request(
            "truncation is not supported (only 'disabled': a prompt too long is refused).",
            param="truncation",
        )


def _text_format(obj: dict[str, Any]) -> tuple[Mapping[str, Any], Any]:
    """(text.format to echo, the constraint): the flat Responses format translated into
    the chat ``response_format`` shape and parsed by the chat path's parser."""
    text = obj.get("text")
    if text is None:
        return {"type": "text"}, None
    if not isinstance(text, dict):
        raise invalid_type("text", "an object", text)
    fmt = text.get("format")
    if fmt is None:
        return {"type": "text"}, None
    if not isinstance(fmt, dict):
        raise invalid_type("text.format", "an object", fmt)
    structured = response_format_output(
        _chat_response_format(fmt), where="text.format", json_schema_where="text.format"
    )
    return fmt, structured


def _chat_response_format(fmt: Mapping[str, Any]) -> dict[str, Any]:
    """A flat Responses ``text.format`` in chat's ``response_format`` shape."""
    translated: dict[str, Any] = {"type": fmt.get("type")}
    if fmt.get("type") == "json_schema":
        translated["json_schema"] = {
            key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt
        }
    return translated


def _metadata(obj: dict[str, Any]) -> Mapping[str, str]:
    raw = obj.get("metadata")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise invalid_type("metadata", "an object", raw)
    if len(raw) > _METADATA_KEYS:
        raise bad_request(
            f"Invalid 'metadata': at most {_METADATA_KEYS} keys are allowed.", param="metadata"
        )
    for key, value in raw.items():
        if len(key) > _METADATA_KEY_CHARS:
            raise bad_request(
                f"Invalid 'metadata': a key is longer than {_METADATA_KEY_CHARS} characters.",
                param="metadata",
            )
        if not isinstance(value, str):
            raise invalid_type(f"metadata.{key}", "a string", value)
        if len(value) > _METADATA_VALUE_CHARS:
            raise bad_request(
                f"Invalid 'metadata.{key}': longer than {_METADATA_VALUE_CHARS} characters.",
                param="metadata",
            )
        _check_text(key, "metadata")
        _check_text(value, f"metadata.{key}")
    return dict(raw)


# --- the Response object ------------------------------------------------------------


def response_usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


MessageStatus = Literal["in_progress", "completed", "incomplete"]


def message_item(message_id: str, text: str | None, status: MessageStatus) -> dict[str, Any]:
    """The output message (``text`` None: its content not begun)."""
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {
        "type": "message",
        "id": message_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def function_call_item(
    item_id: str, call: ToolCall, *, arguments: str | None = None
) -> dict[str, Any]:
    """A call of the model's as an output item (``arguments``: what to say of them
    instead of the whole, "" while they stream)."""
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if arguments is None else arguments,
        "status": "completed" if arguments is None else "in_progress",
    }


ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


def response_object(
    request: ResponsesRequest,
    *,
    response_id: str,
    created_at: int,
    status: ResponseStatus,
    output: list[dict[str, Any]],
    usage: Usage | None,
    finish_reason: str | None = None,
    error: OpenAIError | None = None,
) -> dict[str, Any]:
    """The ``Response`` object; a ``length`` finish makes it ``incomplete``."""
    if status == "completed" and finish_reason == "length":
        status = "incomplete"
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": None if error is None else _response_error(error),
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete" else None),
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": None,
        "metadata": dict(request.metadata),
        "model": request.chat.model,
        "output": output,
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": None,
        "reasoning": None,
        "service_tier": "default",
        "store": request.store,
        "temperature": request.temperature,
        "text": {"format": dict(request.text_format)},
        "tool_choice": (
            request.tool_choice
            if isinstance(request.tool_choice, str)
            else dict(request.tool_choice)
        ),
        "tools": [dict(tool) for tool in request.tools],
        "top_logprobs": 0,
        "top_p": request.top_p,
        "truncation": "disabled",
        "usage": None if usage is None else response_usage(usage),
        "user": request.chat.user,
    }


def _response_error(error: OpenAIError) -> dict[str, Any]:
    # ResponseError's code is one of OpenAI's own (server_error, rate_limit_exceeded, ...)
    code = "rate_limit_exceeded" if error.status == 429 else "server_error"
    return {"code": code, "message": error.message}
