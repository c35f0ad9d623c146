"""OpenAI request models and their validation.

Sans-IO: ``parse_*`` take the raw request body and return a frozen request or
raise :class:`~pdtrio.protocol.openai.errors.OpenAIError`, never anything else,
whatever the bytes are.  The router turns the error into a JSON body with its
status before the headers go out, or into an SSE error event after.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, final

import attrs
import msgspec

from pdtrio.protocol.link.wire import (
    ChatPrompt,
    ChatPromptWithTools,
    TextPrompt,
    TokenPrompt,
)
from pdtrio.protocol.openai.errors import (
    OpenAIError,
    bad_request,
    context_length_exceeded,
    not_found_model,
    show_client_text,
)
from pdtrio.protocol.openai.fields import (
    _CHAT_PART_TYPES,
    _INT64_MAX,
    _JUST_INT,
    CHAT_ROLES,
    _chat_logprobs,
    _check_text,
    _choices,
    _completion_logprobs,
    _load_object,
    _missing,
    _opt_int,
    _opt_str,
    _reject_truthy_flag,
    _sampling,
    _streaming,
    _type_error,
)
from pdtrio.protocol.openai.json_pieces import CountedArray
from pdtrio.protocol.openai.tools import ChatTools, message_extras, parse_chat_tools
from pdtrio.protocol.sampling import SamplingParams


@final
@attrs.frozen
class ChatCompletionRequest:
    model: str
    prompt: ChatPrompt
    sampling: SamplingParams
    max_tokens: int | None  # the client's completion limit; prefill turns it into the budget
    stream: bool
    include_usage: bool
    # Already ANDed with include_usage: True only when usage goes on every chunk.
    continuous_usage_stats: bool
    user: str | None
    # None: no tools; else what the answer is read for (and forced to, with a grammar)
    tools: ChatTools | None = None


@final
@attrs.frozen
class CompletionRequest:
    model: str
    prompt: TextPrompt | TokenPrompt
    sampling: SamplingParams
    max_tokens: int | None  # the client's completion limit; prefill turns it into the budget
    stream: bool
    include_usage: bool
    continuous_usage_stats: bool
    user: str | None


def parse_chat_completion_request(
    body: bytes | bytearray,
    *,
    served_models: Collection[str],
    max_tokens_limit: int,
    context_lengths: Mapping[str, int] | None = None,
) -> ChatCompletionRequest:
    """Validate a ``POST /v1/chat/completions`` body; raises :class:`OpenAIError`.

    ``context_lengths`` (model -> tokens) lets a request with more messages than
    its model's context has tokens be refused here: every chat template wraps
    each message in role markers, so each message is at least one token.
    """
    # messages past the longest context are only counted, never kept (as token ids are)
    longest = max(context_lengths.values(), default=None) if context_lengths else None
    obj = _load_object(body, None if longest is None else ("messages", longest))
    model = _model(obj, served_models)
    context_length = None if context_lengths is None else context_lengths.get(model)
    messages = _messages(obj, context_length)
    logprobs = _chat_logprobs(obj)
    tools = parse_chat_tools(obj)
    sampling, max_tokens = _sampling(
        obj, max_tokens_limit, allow_completion_alias=True, logprobs=logprobs
    )
    sampling = _choices(obj, sampling)
    forced = None if tools is None else tools.structured()
    if forced is not None:
        if sampling.structured is not None:
            raise bad_request(
                "tool_choice 'required' or a named function cannot be combined with "
                "response_format or another output constraint.",
                param="tool_choice",
            )
        sampling = msgspec.structs.replace(sampling, structured=forced)
    stream, include_usage, continuous = _streaming(obj)
    return ChatCompletionRequest(
        model=model,
        prompt=_chat_prompt(messages, tools),
        sampling=sampling,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        continuous_usage_stats=continuous,
        user=_opt_str(obj, "user"),
        tools=tools if tools is not None and tools.shown else None,
    )


def _chat_prompt(messages: tuple[tuple[str, str, str], ...], tools: ChatTools | None) -> ChatPrompt:
    """A plain ChatPrompt unless there are tools to show or a tool-call history."""
    pairs = tuple((role, text) for role, text, _ in messages)
    tools_json = "" if tools is None else tools.tools_json()
    if not tools_json and not any(extras for _, _, extras in messages):
        return ChatPrompt(pairs)
    return ChatPromptWithTools(pairs, tools_json, tuple(extras for _, _, extras in messages))


def parse_completion_request(
    body: bytes | bytearray,
    *,
    served_models: Collection[str],
    max_tokens_limit: int,
    context_lengths: Mapping[str, int] | None = None,
) -> CompletionRequest:
    """Validate a ``POST /v1/completions`` body; raises :class:`OpenAIError`.

    ``context_lengths`` (model -> tokens) lets a token-id prompt that can never
    fit be refused here, before its ids are even checked one by one.
    """
    # a token-id prompt longer than any context is only counted, never built: a million
    # ids would be a million int objects, made and freed for nothing
    longest = max(context_lengths.values(), default=None) if context_lengths else None
    obj = _load_object(body, None if longest is None else ("prompt", longest))
    model = _model(obj, served_models)
    context_length = None if context_lengths is None else context_lengths.get(model)
    prompt = _completion_prompt(obj, context_length)
    top_logprobs = _opt_int(obj, "top_logprobs")
    if top_logprobs is not None and top_logprobs != 0:
        raise bad_request(
            "top_logprobs is a chat completions parameter; completions take the count as "
            "'logprobs'.",
            param="top_logprobs",
        )
    logprobs = _completion_logprobs(obj)
    # echo returns the prompt (and with logprobs, the prompt's logprobs): not served
    _reject_truthy_flag(obj, "echo", "echo is not supported.")
    suffix = obj.get("suffix")
    if suffix is not None and suffix != "":
        if not isinstance(suffix, str):
            raise _type_error("suffix", "a string", suffix)
        raise bad_request("suffix is not supported.", param="suffix")
    sampling, max_tokens = _sampling(
        obj, max_tokens_limit, allow_completion_alias=False, logprobs=logprobs
    )
    sampling = _choices(obj, sampling)
    # best_of (rank best_of samples by their cumulative logprob, answer the n best): vLLM
    # dropped it with its V1 engine; served only where it asks for nothing more than n
    best_of = _opt_int(obj, "best_of")
    if best_of is not None and best_of not in (1, sampling.n):
        raise bad_request(
            "best_of other than n is not supported (vLLM's V1 engine dropped it too): ask for "
            "n choices with logprobs and rank them.",
            param="best_of",
        )
    if (
        isinstance(prompt, TokenPrompt)
        and context_length is not None
        and max_tokens is not None
        and len(prompt.token_ids) + max_tokens > context_length
    ):
        raise context_length_exceeded(
            prompt_tokens=len(prompt.token_ids),
            max_tokens=max_tokens,
            context_length=context_length,
            param="max_tokens",
        )
    stream, include_usage, continuous = _streaming(obj)
    return CompletionRequest(
        model=model,
        prompt=prompt,
        sampling=sampling,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        continuous_usage_stats=continuous,
        user=_opt_str(obj, "user"),
    )


def _model(obj: dict[str, Any], served_models: Collection[str]) -> str:
    model = obj.get("model")
    if model is None:
        raise bad_request(
            "You must provide a model parameter.", param="model", code="missing_required_parameter"
        )
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)
    if model not in served_models:
        raise not_found_model(model)
    return model


def _messages(obj: dict[str, Any], context_length: int | None) -> tuple[tuple[str, str, str], ...]:
    """Each message's role, text and extras (JSON text, "" for none)."""
    raw = obj.get("messages")
    if raw is None:
        raise _missing("messages")
    if isinstance(raw, CountedArray) or (
        isinstance(raw, list) and context_length is not None and len(raw) >= context_length
    ):
        # each message is at least one token, and the engine needs room for one more
        raise _too_many_messages(
            raw.length if isinstance(raw, CountedArray) else len(raw), context_length
        )
    if not isinstance(raw, list):
        raise _type_error("messages", "an array", raw)
    if not raw:
        raise bad_request(
            "Invalid 'messages': empty array. Expected an array with minimum length 1.",
            param="messages",
            code="empty_array",
        )
    return tuple(_message(m, f"messages.[{i}]") for i, m in enumerate(raw))


def _too_many_messages(count: int, context_length: int | None) -> OpenAIError:
    limit = (
        "any served model's maximum context length"
        if context_length is None
        else f"this model's maximum context length of {context_length} tokens"
    )
    return bad_request(
        f"The request has {count} messages, more than {limit} (every message takes at "
        "least one token). Please reduce the number of messages.",
        param="messages",
        code="context_length_exceeded",
    )


def _message(message: Any, where: str) -> tuple[str, str, str]:
    if not isinstance(message, dict):
        raise _type_error(where, "an object", message)
    role = message_role(message, where, CHAT_ROLES)
    if message.get("function_call") is not None:
        raise bad_request(
            "'function_call' (the deprecated form) is not supported; use 'tool_calls'.",
            param=f"{where}.function_call",
        )
    extras = message_extras(message, role, where)
    content = message.get("content")
    where_content = f"{where}.content"
    if content is None:
        if role == "assistant":
            return role, "", extras
        raise _missing(where_content)
    return role, message_text(content, where_content, _CHAT_PART_TYPES), extras


def message_role(message: dict[str, Any], where: str, roles: Collection[str]) -> str:
    """A message's ``role``, one of ``roles``."""
    role = message.get("role")
    if role is None:
        raise _missing(f"{where}.role")
    if not isinstance(role, str):
        raise _type_error(f"{where}.role", "a string", role)
    if role not in roles:
        supported = ", ".join(f"'{r}'" for r in sorted(roles))
        raise bad_request(
            f"Invalid value: {show_client_text(role)}. Supported values are: {supported}.",
            param=f"{where}.role",
            code="invalid_value",
        )
    return role


def message_text(content: Any, where: str, part_types: Collection[str]) -> str:
    """A message's text: its ``content`` string, or its text parts (of ``part_types``)
    joined."""
    if isinstance(content, str):
        return _check_text(content, where)
    if not isinstance(content, list):
        raise _type_error(where, "a string or an array of content parts", content)
    return "".join(_text_part(p, f"{where}.[{j}]", part_types) for j, p in enumerate(content))


def _text_part(part: Any, where: str, part_types: Collection[str]) -> str:
    if not isinstance(part, dict):
        raise _type_error(where, "an object", part)
    kind = part.get("type")
    if kind is None:
        raise _missing(f"{where}.type")
    if not isinstance(kind, str):
        raise _type_error(f"{where}.type", "a string", kind)
    if kind not in part_types:
        served = " and ".join(f"'{t}'" for t in sorted(part_types))
        raise bad_request(
            f"Content parts of type {show_client_text(kind)} are not supported; only "
            f"{served} parts are.",
            param=f"{where}.type",
            code="unsupported_content",
        )
    text = part.get("text")
    if text is None:
        raise _missing(f"{where}.text")
    if not isinstance(text, str):
        raise _type_error(f"{where}.text", "a string", text)
    return _check_text(text, f"{where}.text")


def _completion_prompt(obj: dict[str, Any], context_length: int | None) -> TextPrompt | TokenPrompt:
    raw = obj.get("prompt")
    if raw is None:
        raise _missing("prompt")
    if isinstance(raw, str):
        return _text_prompt(raw, "prompt")
    if isinstance(raw, CountedArray):
        return _token_prompt(raw, "prompt", context_length)
    if not isinstance(raw, list):
        raise _type_error(
            "prompt", "a string, an array of one string or an array of token ids", raw
        )
    if not raw:
        raise bad_request("The prompt must not be empty.", param="prompt", code="empty_array")
    first = raw[0]
    if isinstance(first, str | list | CountedArray):
        # A list of prompts: only a batch of one is served.
        if len(raw) > 1:
            raise bad_request(
                "Batched prompts (more than one prompt per request) are not supported.",
                param="prompt",
            )
        if isinstance(first, str):
            return _text_prompt(first, "prompt.[0]")
        return _token_prompt(first, "prompt.[0]", context_length)
    return _token_prompt(raw, "prompt", context_length)


def _text_prompt(text: str, where: str) -> TextPrompt:
    if not text:
        raise bad_request("The prompt must not be empty.", param=where)
    return TextPrompt(_check_text(text, where))


def _token_prompt(
    raw: list[Any] | CountedArray, where: str, context_length: int | None
) -> TokenPrompt:
    length = raw.length if isinstance(raw, CountedArray) else len(raw)
    if not length:
        raise bad_request("The prompt must not be empty.", param=where)
    # the engine needs room for one completion token: a prompt filling the context never runs
    if context_length is not None and length >= context_length:
        raise context_length_exceeded(
            prompt_tokens=length, max_tokens=None, context_length=context_length, param=where
        )
    if isinstance(raw, CountedArray):  # counted only past the longest context there is
        raise bad_request(
            f"The prompt has {length} tokens, more than any served model's context length.",
            param=where,
            code="context_length_exceeded",
        )
    # every id a plain int in range (the usual prompt): checked in C, not two calls an id
    if set(map(type, raw)) == _JUST_INT and 0 <= min(raw) and max(raw) <= _INT64_MAX:
        return TokenPrompt(tuple(raw))
    for i, token in enumerate(raw):  # (which id is wrong, for the error)
        if isinstance(token, bool) or not isinstance(token, int):
            raise _type_error(f"{where}.[{i}]", "an integer token id", token)
        if not 0 <= token <= _INT64_MAX:
            raise bad_request(
                f"Invalid value for '{where}.[{i}]': {token} is not a valid token id.",
                param=f"{where}.[{i}]",
            )
    return TokenPrompt(tuple(raw))
