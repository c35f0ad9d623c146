"""The errors a client sees: :class:`OpenAIError`, with its HTTP status and OpenAI body.

Every constructor here is :func:`error_for` with a fixed reason and message; the
status, ``type`` and ``code`` of each reason come from the one table,
:data:`pdtrio.protocol.errors.ERRORS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, final

from pdtrio.protocol.errors import ERRORS, Reason
from pdtrio.protocol.openai.json_pieces import CountedArray

JSON_MEDIA_TYPE: Final = "application/json"


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
        f"Method {show_client_text(method)} is not allowed on {path}; use {allow}.",
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
    shown = "none" if content_type is None else show_client_text(content_type)
    return error_for(
        Reason.UNSUPPORTED_MEDIA_TYPE,
        f"Unsupported Content-Type {shown}: the request body must be {JSON_MEDIA_TYPE}.",
    )


def not_found_model(model: str) -> OpenAIError:
    return error_for(
        Reason.MODEL_NOT_FOUND,
        f"The model {show_client_text(model)} does not exist.",
        param="model",
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


def show_client_text(value: str) -> str:
    """A client string quoted for an error message, cut short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def json_type_name(value: Any) -> str:
    """A JSON value's type as an error message names it ("an integer", "null")."""
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


def invalid_type(param: str, expected: str, value: Any) -> OpenAIError:
    """A 400 for a field of the wrong JSON type, in OpenAI's words."""
    return bad_request(
        f"Invalid type for '{param}': expected {expected}, but got {json_type_name(value)} instead.",
        param=param,
        code="invalid_type",
    )
