"""OpenAI request models, their validation, and the non-streamed response bodies.

Sans-IO: ``parse_*`` take the raw request body and return a frozen request or
raise :class:`OpenAIError`, never anything else, whatever the bytes are.  The
router turns the error into a JSON body with its status before the headers go
out, or into an SSE error event after.
"""

from __future__ import annotations

import codecs
import json
import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Final, final

import attrs

from pdtrio.protocol.errors import ERRORS, Reason
from pdtrio.protocol.sampling import SamplingParams
from pdtrio.protocol.wire import ChatPrompt, TextPrompt, TokenPrompt, Usage

CHAT_ROLES: Final = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STOP_SEQUENCES: Final = 4
_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1
# top_k larger than any vocabulary is "off" in effect; the bound keeps it packable.
_TOP_K_MAX: Final = 2**31 - 1
# Bodies above this are parsed piece by piece: json.loads holds the GIL for the whole body.
PIECEWISE_JSON_BYTES: Final = 256 * 1024
JSON_MEDIA_TYPE: Final = "application/json"


# --- errors ------------------------------------------------------------------


@final
class OpenAIError(Exception):
    """An error the client sees, with its HTTP status and OpenAI error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Sequence[tuple[str, str]] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = tuple(headers)  # extra response headers, e.g. a 405's Allow

    def to_body(self) -> dict[str, Any]:
        return error_body(self.message, type_=self.type, param=self.param, code=self.code)

    def __repr__(self) -> str:
        return (
            f"OpenAIError({self.message!r}, status={self.status}, type={self.type!r}, "
            f"param={self.param!r}, code={self.code!r})"
        )


def error_body(
    message: str, *, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The one error body, the router's and the workers' alike."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_for(
    reason: Reason,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: Sequence[tuple[str, str]] = (),
) -> OpenAIError:
    """The error the client sees for ``reason`` (its status, type and code: the one
    table, :data:`pdtrio.protocol.errors.ERRORS`); ``code`` only where the reason has
    none of its own (which of the request's fields is invalid, say), ``headers`` added
    to the reason's."""
    kind = ERRORS[reason]
    return OpenAIError(
        message,
        status=kind.status,
        type=kind.type,
        param=param,
        code=kind.code if kind.code is not None else code,
        headers=(*kind.headers, *headers),
    )


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> OpenAIError:
    return error_for(Reason.INVALID_REQUEST, message, param=param, code=code)


def not_found(message: str) -> OpenAIError:
    """An unknown route (OpenAI answers these with invalid_request_error too)."""
    return error_for(Reason.NOT_FOUND, message)


def method_not_allowed(method: str, path: str, allowed: Sequence[str]) -> OpenAIError:
    """A known route asked with the wrong method; ``Allow`` lists the right ones."""
    allow = ", ".join(allowed)
    return error_for(
        Reason.METHOD_NOT_ALLOWED,
        f"Method {_show(method)} is not allowed on {path}; use {allow}.",
        headers=(("allow", allow),),
    )


def is_json_content_type(content_type: str | None) -> bool:
    """Whether a Content-Type header says UTF-8 JSON (``application/json``, charset optional)."""
    if content_type is None:
        return False
    media_type, *parameters = content_type.split(";")
    if media_type.strip().lower() != JSON_MEDIA_TYPE:
        return False
    for parameter in parameters:
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in (
            "utf-8",
            "utf8",
        ):
            return False
    return True


def unsupported_media_type(content_type: str | None) -> OpenAIError:
    shown = "none" if content_type is None else _show(content_type)
    return error_for(
        Reason.UNSUPPORTED_MEDIA_TYPE,
        f"Unsupported Content-Type {shown}: the request body must be {JSON_MEDIA_TYPE}.",
    )


def not_found_model(model: str) -> OpenAIError:
    return error_for(
        Reason.MODEL_NOT_FOUND, f"The model {_show(model)} does not exist.", param="model"
    )


def context_length_exceeded(
    *, prompt_tokens: int, max_tokens: int | None, context_length: int, param: str = "messages"
) -> OpenAIError:
    asked = "" if max_tokens is None else f" and {max_tokens} in the completion"
    return error_for(
        Reason.CONTEXT_LENGTH_EXCEEDED,
        f"This model's maximum context length is {context_length} tokens. However, you "
        f"requested {prompt_tokens} tokens in the prompt{asked}. Please reduce the length "
        "of the prompt or the completion.",
        param=param,
    )


def request_too_large(limit_bytes: int) -> OpenAIError:
    return error_for(
        Reason.REQUEST_TOO_LARGE,
        f"The request body is larger than the limit of {limit_bytes} bytes.",
    )


def body_timeout(timeout_s: float) -> OpenAIError:
    return error_for(Reason.BODY_TIMEOUT, f"The request body did not arrive within {timeout_s:g}s.")


def server_error(message: str) -> OpenAIError:
    return error_for(Reason.INTERNAL, message)


def service_unavailable(message: str) -> OpenAIError:
    return error_for(Reason.SERVICE_UNAVAILABLE, message)


def queue_full() -> OpenAIError:
    """The admission queue is at its limit: 429, retry in a second."""
    return error_for(
        Reason.QUEUE_FULL, "the server is at capacity and its queue is full; retry shortly"
    )


def unauthorized(has_key: bool) -> OpenAIError:
    """No API key, or not one of the router's: 401 (OpenAI's shape and words)."""
    message = (
        "Incorrect API key provided."
        if has_key
        else "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
    )
    return error_for(Reason.INVALID_API_KEY, message)


def too_many_requests(message: str) -> OpenAIError:
    """A concurrency limit is reached: 429, retry in a second."""
    return error_for(Reason.RATE_LIMITED, message)


def gateway_timeout(message: str) -> OpenAIError:
    return error_for(Reason.TIMEOUT, message)


# --- requests ----------------------------------------------------------------


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
    prompt = ChatPrompt(_messages(obj, context_length))
    _reject_unsupported(obj)
    _reject_truthy_flag(obj, "logprobs", "logprobs are not supported.")
    _reject_tools(obj)
    _reject_response_format(obj)
    sampling, max_tokens = _sampling(obj, max_tokens_limit, allow_completion_alias=True)
    stream, include_usage, continuous = _streaming(obj)
    return ChatCompletionRequest(
        model=model,
        prompt=prompt,
        sampling=sampling,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        continuous_usage_stats=continuous,
        user=_opt_str(obj, "user"),
    )


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
    _reject_unsupported(obj)
    # Legacy completions take logprobs as a count; any count asks for logprobs.
    logprobs = obj.get("logprobs")
    if logprobs is not None and logprobs is not False:
        if isinstance(logprobs, bool) or not isinstance(logprobs, int):
            raise _type_error("logprobs", "an integer", logprobs)
        raise bad_request("logprobs are not supported.", param="logprobs")
    _reject_truthy_flag(obj, "echo", "echo is not supported.")
    best_of = _opt_int(obj, "best_of")
    if best_of is not None and best_of != 1:
        raise bad_request("best_of other than 1 is not supported.", param="best_of")
    suffix = obj.get("suffix")
    if suffix is not None and suffix != "":
        if not isinstance(suffix, str):
            raise _type_error("suffix", "a string", suffix)
        raise bad_request("suffix is not supported.", param="suffix")
    sampling, max_tokens = _sampling(obj, max_tokens_limit, allow_completion_alias=False)
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


# --- response bodies -----------------------------------------------------------


def models_list_body(
    models: Sequence[str], *, created: int, owned_by: str = "pdtrio"
) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": m, "object": "model", "created": created, "owned_by": owned_by} for m in models
        ],
    }


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def chat_completion_body(
    *,
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    usage: Usage,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage_body(usage),
    }


def completion_body(
    *,
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    usage: Usage,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage_body(usage),
    }


# --- validation helpers ----------------------------------------------------------


def _show(value: str) -> str:
    """A client string quoted for an error message, cut short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | CountedArray):
        return "an array"
    return "an object"


def _type_error(param: str, expected: str, value: Any) -> OpenAIError:
    return bad_request(
        f"Invalid type for '{param}': expected {expected}, but got {_json_type(value)} instead.",
        param=param,
        code="invalid_type",
    )


def _missing(param: str) -> OpenAIError:
    return bad_request(
        f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
    )


def _load_object(
    body: bytes | bytearray, count_past: tuple[str, int] | None = None
) -> dict[str, Any]:
    try:
        if len(body) > PIECEWISE_JSON_BYTES:
            obj = _load_piecewise(body, count_past)
        else:
            obj = json.loads(body)
    except (ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError, bad UTF-8 and over-long integers.
        raise bad_request(
            f"The request body is not valid JSON: {exc}"[:200], code="invalid_json"
        ) from None
    if not isinstance(obj, dict):
        raise bad_request(
            f"The request body must be a JSON object, but got {_json_type(obj)}.",
            code="invalid_json",
        )
    return obj


# The C scanners json.loads is built on (untyped in typeshed): one value, one string.
_scan_value: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
_scan_string: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_WHITESPACE_CHARS: Final = frozenset(" \t\n\r")
# At most this many characters go to one C call (a fraction of a millisecond).
_CHUNK_CHARS: Final = 64 * 1024
# A run of plain numbers, each followed by a comma: loaded as one chunk, at C speed.
_NUMBER_RUN = re.compile(r"(?:-?[0-9][-+0-9.eE]*[ \t\n\r]*,[ \t\n\r]*)+")
_NUMBER_HEADS: Final = frozenset("-0123456789")
_PIECEWISE_DEPTH: Final = 3  # body > prompt > [token ids]: the deepest arrays always split
# An object or array deeper than that is one scanner call if it ends this soon,
# else split too (a message whose content is megabytes).
_SMALL_VALUE_CHARS: Final = 4096
# Of a string's content, what can be cut off and decoded on its own: plain runs,
# escapes, and a high surrogate escape only with its low one or with enough after it
# to see that none follows (a pair cut in two would decode as two lone surrogates).
# It stops at the closing quote, a control character, a bad escape, or the window's end.
_STRING_RUN = re.compile(
    r"""(?:[^"\\\x00-\x1f]+"""
    r"""|\\["\\/bfnrt]"""
    r"""|\\u(?![dD][89abAB])[0-9a-fA-F]{4}"""
    r"""|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"""
    r"""|\\u[dD][89abAB][0-9a-fA-F]{2}(?=[^\\]|\\[^u]|\\u[^dD]|\\u[dD][^c-fC-F])"""
    r""")*"""
)
# The most characters _STRING_RUN needs past a cut to decide on an escape (a pair).
_LONGEST_ESCAPE: Final = 12
# Bytes decoded to text per C call (a megabyte of UTF-8 is about a millisecond).
_DECODE_CHUNK_BYTES: Final = 1024 * 1024


@final
@attrs.frozen
class CountedArray:
    """A JSON array of which only the length was kept: it was longer than any use of it."""

    length: int


def _load_piecewise(body: bytes | bytearray, count_past: tuple[str, int] | None = None) -> Any:
    """``json.loads`` for big bodies, one small C call at a time.

    A single json.loads of megabytes holds the GIL for tens of milliseconds, so
    even on a worker thread it stalls the event loop; between these pieces the
    interpreter can hand the GIL back.  The body is decoded a megabyte at a
    time; arrays (token ids, messages) are split into elements, runs of numbers
    into 64 KiB chunks, long strings into 64 KiB windows, and an object that
    does not end within 4 KiB into its members.  Raises ValueError
    (JSONDecodeError, bad UTF-8) like json.loads.

    ``count_past=(key, limit)``: an array under the top-level ``key`` (or an
    array in it) longer than ``limit`` becomes a :class:`CountedArray`; the
    numbers past the limit are counted, not built (nor checked one by one), and
    other elements (messages) are dropped as soon as they are parsed.
    """
    text = _decode_piecewise(body)
    pos = _skip_whitespace(text, 0)
    if text.startswith("\ufeff", pos):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM", text, pos)
    value, pos = _piece(text, pos, 1, count_past)
    pos = _skip_whitespace(text, pos)
    if pos != len(text):
        raise json.JSONDecodeError("Extra data", text, pos)
    return value


def _decode_piecewise(body: bytes | bytearray) -> str:
    """``body.decode`` as json.loads does it, a megabyte per call; joining is a copy."""
    decoder = codecs.getincrementaldecoder(json.detect_encoding(body))("surrogatepass")
    view = memoryview(body)
    parts = [
        decoder.decode(view[start : start + _DECODE_CHUNK_BYTES])
        for start in range(0, len(view), _DECODE_CHUNK_BYTES)
    ]
    parts.append(decoder.decode(b"", final=True))
    return "".join(parts)


def _skip_whitespace(text: str, pos: int) -> int:
    if pos < len(text) and text[pos] in _WHITESPACE_CHARS:
        match = _WHITESPACE.match(text, pos)
        assert match is not None  # the pattern matches the empty string
        return match.end()
    return pos


def _piece(
    text: str, pos: int, depth: int, count_past: tuple[str, int] | None = None
) -> tuple[Any, int]:
    """The value at ``pos``; ``count_past``: at depth 1, what to count (see _load_piecewise)."""
    head = text[pos : pos + 1]
    if head == '"':
        return _string_piecewise(text, pos)
    if head == "{":
        if depth > 1 and (small := _scan_small(text, pos)) is not None:
            return small
        return _object_piecewise(text, pos, depth, count_past if depth == 1 else None)
    if head == "[":
        if depth > _PIECEWISE_DEPTH and (small := _scan_small(text, pos)) is not None:
            return small
        return _array_piecewise(text, pos, depth)
    try:
        value, end = _scan_value(text, pos)
    except StopIteration as stop:
        # (the scanner's "no value starts here": json.loads's own words, nothing lost)
        raise json.JSONDecodeError("Expecting value", text, stop.value) from None
    return value, end


def _scan_small(text: str, pos: int) -> tuple[Any, int] | None:
    """The object or array at ``pos`` in one scanner call, if it ends within a few KiB.

    None if it does not, or if it is malformed: the piecewise parse then finds
    where.  Scanning a copy of the window bounds the call whatever follows; an
    object or array is whole once its closing bracket is in.
    """
    window = text[pos : pos + _SMALL_VALUE_CHARS]
    try:
        value, end = _scan_value(window, 0)
    except (ValueError, StopIteration, RecursionError):
        return None
    return value, pos + end


def _string_piecewise(text: str, pos: int) -> tuple[str, int]:
    """The string whose opening quote is at ``pos``, one window of its content at a time."""
    pieces: list[str] = []
    start = pos + 1
    size = len(text)
    while True:
        window_end = min(size, start + _CHUNK_CHARS)
        run = _STRING_RUN.match(text, start, window_end)
        assert run is not None  # the pattern matches the empty string
        stop = run.end()
        if stop > start:
            piece = text[start:stop]
            if "\\" in piece:
                piece = _scan_string(piece + '"', 0)[0]
            pieces.append(piece)
        if stop < size and text[stop] == '"':
            return "".join(pieces), stop + 1
        if window_end < size and (
            stop == window_end or (text[stop] == "\\" and stop + _LONGEST_ESCAPE > window_end)
        ):
            start = stop  # the window cut the content, perhaps mid-escape: go on from there
            continue
        raise _string_error(text, pos, stop)


def _string_error(text: str, quote: int, stop: int) -> json.JSONDecodeError:
    """Why the string opened at ``quote`` cannot go on at ``stop``, as json.loads says it."""
    if stop >= len(text):
        return json.JSONDecodeError("Unterminated string starting at", text, quote)
    if text[stop] == "\\":
        if text[stop + 1 : stop + 2] == "u":
            return json.JSONDecodeError("Invalid \\uXXXX escape", text, stop + 1)
        return json.JSONDecodeError("Invalid \\escape", text, stop)
    return json.JSONDecodeError("Invalid control character at", text, stop)


def _object_piecewise(
    text: str, pos: int, depth: int, count_past: tuple[str, int] | None = None
) -> tuple[dict[str, Any], int]:
    obj: dict[str, Any] = {}
    pos = _skip_whitespace(text, pos + 1)
    if text[pos : pos + 1] == "}":
        return obj, pos + 1
    while True:
        if text[pos : pos + 1] != '"':
            raise json.JSONDecodeError(
                "Expecting property name enclosed in double quotes", text, pos
            )
        key, pos = _string_piecewise(text, pos)
        pos = _skip_whitespace(text, pos)
        if text[pos : pos + 1] != ":":
            raise json.JSONDecodeError("Expecting ':' delimiter", text, pos)
        pos = _skip_whitespace(text, pos + 1)
        if count_past is not None and key == count_past[0] and text[pos : pos + 1] == "[":
            value, pos = _array_piecewise(text, pos, depth + 1, count_past[1])
        else:
            value, pos = _piece(text, pos, depth + 1)
        obj[key] = value
        pos = _skip_whitespace(text, pos)
        delimiter = text[pos : pos + 1]
        if delimiter == "}":
            return obj, pos + 1
        if delimiter != ",":
            raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
        pos = _skip_whitespace(text, pos + 1)


def _array_piecewise(
    text: str, pos: int, depth: int, limit: int | None = None
) -> tuple[list[Any] | CountedArray, int]:
    """The array at ``pos``; past ``limit`` elements, only counted (then a CountedArray)."""
    items: list[Any] = []
    counted = 0  # elements past the limit, not kept
    pos = _skip_whitespace(text, pos + 1)
    if text[pos : pos + 1] == "]":
        return items, pos + 1
    while True:
        counting = limit is not None and len(items) > limit
        run = (
            _NUMBER_RUN.match(text[pos : pos + _CHUNK_CHARS])
            if text[pos : pos + 1] in _NUMBER_HEADS
            else None
        )
        if run is not None:
            # the run ends just after a comma: the array goes on past it
            chunk = run.group().rstrip().removesuffix(",")
            if counting:
                counted += chunk.count(",") + 1
            else:
                try:
                    items.extend(json.loads(f"[{chunk}]"))
                except json.JSONDecodeError as exc:
                    # the same error, placed in the whole body instead of the chunk
                    raise json.JSONDecodeError(exc.msg, text, pos + max(0, exc.pos - 1)) from None
            pos = _skip_whitespace(text, pos + run.end())  # the window may cut the spaces
        if limit is not None and text[pos : pos + 1] == "[":
            value, pos = _array_piecewise(text, pos, depth + 1, limit)  # [[ids]]: one prompt
        else:
            value, pos = _piece(text, pos, depth + 1)
        if counting:
            counted += 1
        else:
            items.append(value)
        pos = _skip_whitespace(text, pos)
        delimiter = text[pos : pos + 1]
        if delimiter == "]":
            if counted:
                return CountedArray(len(items) + counted), pos + 1
            return items, pos + 1
        if delimiter != ",":
            raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
        pos = _skip_whitespace(text, pos + 1)


# Characters of a string encoded per C call when checking it for lone surrogates.
_CHECK_CHUNK_CHARS: Final = 1024 * 1024


def _check_text(value: str, param: str) -> str:
    # JSON may carry lone surrogates ("\ud800"); they cannot be tokenized or packed.
    try:
        # a piece at a time: a megabyte is a fraction of a millisecond (a str holds code
        # points, so no cut splits a pair)
        for start in range(0, len(value), _CHECK_CHUNK_CHARS):
            value[start : start + _CHECK_CHUNK_CHARS].encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            f"Invalid value for '{param}': the string contains an unpaired surrogate.",
            param=param,
        ) from None
    return value


def _opt_str(obj: dict[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _type_error(key, "a string", value)
    return _check_text(value, key)


def _opt_bool(obj: dict[str, Any], key: str, param: str | None = None) -> bool | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise _type_error(param or key, "a boolean", value)
    return value


def _opt_int(obj: dict[str, Any], key: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(key, "an integer", value)
    return value


def _opt_number(obj: dict[str, Any], key: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _type_error(key, "a number", value)
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise bad_request(f"Invalid value for '{key}': must be a finite number.", param=key)
    return number


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


def _messages(obj: dict[str, Any], context_length: int | None) -> tuple[tuple[str, str], ...]:
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


def _message(message: Any, where: str) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise _type_error(where, "an object", message)
    role = message.get("role")
    if role is None:
        raise _missing(f"{where}.role")
    if not isinstance(role, str):
        raise _type_error(f"{where}.role", "a string", role)
    if role not in CHAT_ROLES:
        supported = ", ".join(f"'{r}'" for r in sorted(CHAT_ROLES))
        raise bad_request(
            f"Invalid value: {_show(role)}. Supported values are: {supported}.",
            param=f"{where}.role",
            code="invalid_value",
        )
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and tool_calls != []:
        raise bad_request("Tool calls are not supported.", param=f"{where}.tool_calls")
    if message.get("function_call") is not None:
        raise bad_request("Function calls are not supported.", param=f"{where}.function_call")
    content = message.get("content")
    where_content = f"{where}.content"
    if content is None:
        if role == "assistant":
            return role, ""
        raise _missing(where_content)
    if isinstance(content, str):
        return role, _check_text(content, where_content)
    if not isinstance(content, list):
        raise _type_error(where_content, "a string or an array of content parts", content)
    return role, "".join(_text_part(p, f"{where_content}.[{j}]") for j, p in enumerate(content))


def _text_part(part: Any, where: str) -> str:
    if not isinstance(part, dict):
        raise _type_error(where, "an object", part)
    kind = part.get("type")
    if kind is None:
        raise _missing(f"{where}.type")
    if not isinstance(kind, str):
        raise _type_error(f"{where}.type", "a string", kind)
    if kind != "text":
        raise bad_request(
            f"Content parts of type {_show(kind)} are not supported; only 'text' parts are.",
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
    for i, token in enumerate(raw):
        if isinstance(token, bool) or not isinstance(token, int):
            raise _type_error(f"{where}.[{i}]", "an integer token id", token)
        if not 0 <= token <= _INT64_MAX:
            raise bad_request(
                f"Invalid value for '{where}.[{i}]': {token} is not a valid token id.",
                param=f"{where}.[{i}]",
            )
    return TokenPrompt(tuple(raw))


def _reject_truthy_flag(obj: dict[str, Any], key: str, message: str) -> None:
    if _opt_bool(obj, key):
        raise bad_request(message, param=key)


def _reject_unsupported(obj: dict[str, Any]) -> None:
    """Fields both endpoints share that are accepted only at their no-op value."""
    n = _opt_int(obj, "n")
    if n is not None:
        if n > 1:
            raise bad_request("n > 1 is not supported.", param="n")
        if n < 1:
            raise bad_request(f"Invalid value for 'n': {n} is less than 1.", param="n")
    for key in ("frequency_penalty", "presence_penalty"):
        penalty = _opt_number(obj, key)
        if penalty is not None and penalty != 0.0:
            raise bad_request(f"{key} is not supported (only 0 or null).", param=key)
    logit_bias = obj.get("logit_bias")
    if logit_bias is not None and logit_bias != {}:
        if not isinstance(logit_bias, dict):
            raise _type_error("logit_bias", "an object", logit_bias)
        raise bad_request("logit_bias is not supported.", param="logit_bias")
    top_logprobs = _opt_int(obj, "top_logprobs")
    if top_logprobs is not None and top_logprobs != 0:
        raise bad_request("top_logprobs is not supported.", param="top_logprobs")


def _reject_tools(obj: dict[str, Any]) -> None:
    for key in ("tools", "functions"):
        value = obj.get(key)
        if value is not None and value != []:
            if not isinstance(value, list):
                raise _type_error(key, "an array", value)
            raise bad_request(f"{key} are not supported.", param=key)
    for key in ("tool_choice", "function_call"):
        value = obj.get(key)
        if value is not None and value != "none":
            raise bad_request(f"{key} is not supported (only 'none' or null).", param=key)


def _reject_response_format(obj: dict[str, Any]) -> None:
    value = obj.get("response_format")
    if value is None:
        return
    if not isinstance(value, dict):
        raise _type_error("response_format", "an object", value)
    if value.get("type") != "text":
        raise bad_request(
            'response_format other than {"type": "text"} is not supported.',
            param="response_format",
        )


def _token_limit(obj: dict[str, Any], key: str, max_tokens_limit: int) -> int | None:
    value = _opt_int(obj, key)
    if value is None:
        return None
    if value < 1:
        raise bad_request(f"Invalid value for '{key}': {value} is less than 1.", param=key)
    if value > max_tokens_limit:
        raise bad_request(
            f"Invalid value for '{key}': {value} is greater than the maximum of {max_tokens_limit}.",
            param=key,
        )
    return value


def _stop(obj: dict[str, Any]) -> tuple[str, ...]:
    raw = obj.get("stop")
    if raw is None:
        return ()
    if isinstance(raw, str):
        items: list[Any] = [raw]
        wheres = ["stop"]
    elif isinstance(raw, list):
        if len(raw) > MAX_STOP_SEQUENCES:
            raise bad_request(
                f"Invalid 'stop': at most {MAX_STOP_SEQUENCES} stop sequences are allowed.",
                param="stop",
            )
        items = raw
        wheres = [f"stop.[{i}]" for i in range(len(raw))]
    else:
        raise _type_error("stop", "a string or an array of strings", raw)
    for item, where in zip(items, wheres, strict=True):
        if not isinstance(item, str):
            raise _type_error(where, "a string", item)
        if not item:
            raise bad_request("Stop sequences must not be empty strings.", param="stop")
        _check_text(item, "stop")
    return tuple(items)


def _sampling(
    obj: dict[str, Any], max_tokens_limit: int, *, allow_completion_alias: bool
) -> tuple[SamplingParams, int | None]:
    """The sampling parameters and the client's max_tokens (None: not set)."""
    max_tokens = _token_limit(obj, "max_tokens", max_tokens_limit)
    limit_param = "max_tokens"
    if allow_completion_alias:
        newer = _token_limit(obj, "max_completion_tokens", max_tokens_limit)
        if newer is not None:
            max_tokens, limit_param = newer, "max_completion_tokens"
    min_tokens = _opt_int(obj, "min_tokens") or 0
    if min_tokens < 0:
        raise bad_request(
            f"Invalid value for 'min_tokens': {min_tokens} is less than 0.", param="min_tokens"
        )
    upper = max_tokens if max_tokens is not None else max_tokens_limit
    if min_tokens > upper:
        raise bad_request(
            f"Invalid value for 'min_tokens': {min_tokens} is greater than "
            f"'{limit_param}' ({upper}).",
            param="min_tokens",
        )

    temperature = _opt_number(obj, "temperature")
    if temperature is None:
        temperature = 1.0
    elif not 0.0 <= temperature <= 2.0:
        raise bad_request(
            f"Invalid value for 'temperature': {temperature} is not between 0 and 2.",
            param="temperature",
        )
    top_p = _opt_number(obj, "top_p")
    if top_p is None:
        top_p = 1.0
    elif not 0.0 < top_p <= 1.0:
        raise bad_request(
            f"Invalid value for 'top_p': {top_p} must be greater than 0 and at most 1.",
            param="top_p",
        )
    top_k = _opt_int(obj, "top_k")
    if top_k is None or top_k == -1:
        top_k = 0
    elif not 0 <= top_k <= _TOP_K_MAX:
        raise bad_request(
            f"Invalid value for 'top_k': {top_k}; use -1 or 0 to disable, or a positive count.",
            param="top_k",
        )
    seed = _opt_int(obj, "seed")
    if seed is not None and not _INT64_MIN <= seed <= _INT64_MAX:
        raise bad_request(
            "Invalid value for 'seed': must fit in a signed 64-bit integer.", param="seed"
        )

    sampling = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        min_tokens=min_tokens,
        stop=_stop(obj),
        ignore_eos=bool(_opt_bool(obj, "ignore_eos")),
    )
    return sampling, max_tokens


def _streaming(obj: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats)."""
    stream = bool(_opt_bool(obj, "stream"))
    options = obj.get("stream_options")
    if options is None:
        return stream, False, False
    if not stream:
        raise bad_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )
    if not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    include_usage = bool(_opt_bool(options, "include_usage", "stream_options.include_usage"))
    continuous = bool(
        _opt_bool(options, "continuous_usage_stats", "stream_options.continuous_usage_stats")
    )
    return stream, include_usage, include_usage and continuous
