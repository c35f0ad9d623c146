"""Why a request failed, and what the client sees for it: one table.

Every error a client gets is an OpenAI error body with an HTTP status. Where a
failure is found (the router's pipeline, its HTTP front, a worker's answer) it
names a :class:`Reason`; this table alone says which status, OpenAI ``type`` and
``code`` that reason is shown as, so two places never answer the same failure
differently. :func:`pdtrio.protocol.openai.errors.error_for` builds the error from a
reason and a message; the named constructors there (``queue_full``,
``service_unavailable``, ...) are that call with their fixed message.

Pure data (sans-IO): no I/O, no clock.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, final

import attrs


@final
class Reason(enum.Enum):
    """A failure as the server knows it, before it is an HTTP answer."""

    # the client's to fix (4xx)
    INVALID_REQUEST = "invalid_request"  # a field, the JSON, a value: the message says which
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_API_KEY = "invalid_api_key"
    PEER_UNAUTHENTICATED = "peer_unauthenticated"  # a worker endpoint without the secret's proof
    REQUEST_ID_IN_USE = "request_id_in_use"  # a worker already runs a request of that id
    NOT_FOUND = "not_found"  # no such route
    MODEL_NOT_FOUND = "model_not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    BODY_TIMEOUT = "body_timeout"  # the body did not arrive in time
    REQUEST_TOO_LARGE = "request_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    RATE_LIMITED = "rate_limited"  # a concurrency limit (per key or in all)
    # the service's (5xx, and the queue's 429)
    QUEUE_FULL = "queue_full"
    INTERNAL = "internal"  # the router itself cannot go on (an impossible pairing, ...)
    DECODE_FAILED = "decode_failed"  # a decode worker failed the request
    BAD_KV_HANDLE = "bad_kv_handle"  # prefill named a KV source it is not registered with
    SERVICE_UNAVAILABLE = "service_unavailable"  # no instance, no capacity within the lease
    SHUTTING_DOWN = "shutting_down"  # the router drains
    CLIENT_TOO_SLOW = "client_too_slow"  # the client read nothing for too long
    TIMEOUT = "timeout"  # the request's deadline passed


@final
@attrs.frozen
class ErrorKind:
    """How a reason is shown: status, OpenAI error type and code, extra headers."""

    status: int
    type: str
    code: str | None
    headers: tuple[tuple[str, str], ...] = ()


_INVALID: Final = "invalid_request_error"
_SERVER: Final = "server_error"
_RETRY_SOON: Final = (("retry-after", "1"),)

ERRORS: Final[Mapping[Reason, ErrorKind]] = MappingProxyType(
    {
        Reason.INVALID_REQUEST: ErrorKind(400, _INVALID, None),
        Reason.CONTEXT_LENGTH_EXCEEDED: ErrorKind(400, _INVALID, "context_length_exceeded"),
        Reason.INVALID_API_KEY: ErrorKind(
            401, _INVALID, "invalid_api_key", (("www-authenticate", "Bearer"),)
        ),
        Reason.PEER_UNAUTHENTICATED: ErrorKind(
            401, "authentication_error", "peer_authentication_required"
        ),
        Reason.REQUEST_ID_IN_USE: ErrorKind(409, _INVALID, "request_id_in_use"),
        Reason.NOT_FOUND: ErrorKind(404, _INVALID, "not_found"),
        Reason.MODEL_NOT_FOUND: ErrorKind(404, _INVALID, "model_not_found"),
        Reason.METHOD_NOT_ALLOWED: ErrorKind(405, _INVALID, "method_not_allowed"),
        Reason.BODY_TIMEOUT: ErrorKind(408, _INVALID, "request_timeout"),
        Reason.REQUEST_TOO_LARGE: ErrorKind(413, _INVALID, "request_too_large"),
        Reason.UNSUPPORTED_MEDIA_TYPE: ErrorKind(415, _INVALID, "unsupported_media_type"),
        Reason.RATE_LIMITED: ErrorKind(429, "rate_limit_error", "rate_limit_exceeded", _RETRY_SOON),
        Reason.QUEUE_FULL: ErrorKind(429, _SERVER, "queue_full", _RETRY_SOON),
        Reason.INTERNAL: ErrorKind(500, _SERVER, None),
        Reason.DECODE_FAILED: ErrorKind(502, _SERVER, "decode_failed"),
        Reason.BAD_KV_HANDLE: ErrorKind(502, _SERVER, "bad_kv_handle"),
        Reason.SERVICE_UNAVAILABLE: ErrorKind(503, _SERVER, "service_unavailable"),
        Reason.SHUTTING_DOWN: ErrorKind(503, _SERVER, "shutting_down"),
        Reason.CLIENT_TOO_SLOW: ErrorKind(503, _SERVER, "client_too_slow"),
        Reason.TIMEOUT: ErrorKind(504, _SERVER, "timeout"),
    }
)


def is_clients_fault(status: int) -> bool:
    """An instance's answer with ``status`` is the client's own (its prompt, say): passed
    on, never held against the instance nor retried on another."""
    return status < 500


def status_for_worker_failure(status: int) -> int:
    """The status the client sees for a worker's answer (``PrefillFailed.status``).

    A worker's 4xx is the client's own (its prompt, say) and passes as it is, and so
    does 503 (busy: no KV room, draining). Any other 5xx is a worker that failed,
    not the router: 502.
    """
    if not is_clients_fault(status) and status != 503:
        return 502
    return status
