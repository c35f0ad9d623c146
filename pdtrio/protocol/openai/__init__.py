"""The OpenAI surface, sans-IO: request validation, the errors a client sees, the bodies.

- :mod:`.requests` — the request models and ``parse_*``, which take the raw body and
  return a frozen request or raise :class:`OpenAIError`, never anything else;
- :mod:`.errors` — :class:`OpenAIError` and its named constructors (each a reason of
  :data:`pdtrio.protocol.errors.ERRORS` with its message);
- :mod:`.bodies` — the non-streamed response bodies;
- :mod:`.logprobs` — the chat and completions shapes of token logprobs;
- :mod:`.json_pieces` — the piecewise JSON parser big bodies go through.

The names below are the surface the router and the workers use.
"""

from pdtrio.protocol.openai.bodies import (
    chat_completion_body,
    completion_body,
    listed_models,
    models_list_body,
    usage_body,
)
from pdtrio.protocol.openai.errors import (
    JSON_MEDIA_TYPE,
    OpenAIError,
    bad_request,
    body_timeout,
    context_length_exceeded,
    error_body,
    error_for,
    gateway_timeout,
    is_json_content_type,
    method_not_allowed,
    not_found,
    not_found_model,
    queue_full,
    request_too_large,
    server_error,
    service_unavailable,
    too_many_requests,
    unauthorized,
    unsupported_media_type,
)
from pdtrio.protocol.openai.fields import CHAT_ROLES, MAX_STOP_SEQUENCES
from pdtrio.protocol.openai.logprobs import chat_logprobs, completion_logprobs
from pdtrio.protocol.openai.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_chat_completion_request,
    parse_completion_request,
)

__all__ = [
    "CHAT_ROLES",
    "JSON_MEDIA_TYPE",
    "MAX_STOP_SEQUENCES",
    "ChatCompletionRequest",
    "CompletionRequest",
    "OpenAIError",
    "bad_request",
    "body_timeout",
    "chat_completion_body",
    "chat_logprobs",
    "completion_body",
    "completion_logprobs",
    "context_length_exceeded",
    "error_body",
    "error_for",
    "gateway_timeout",
    "is_json_content_type",
    "method_not_allowed",
    "listed_models",
    "models_list_body",
    "not_found",
    "not_found_model",
    "parse_chat_completion_request",
    "parse_completion_request",
    "queue_full",
    "request_too_large",
    "server_error",
    "service_unavailable",
    "too_many_requests",
    "unauthorized",
    "unsupported_media_type",
    "usage_body",
]
