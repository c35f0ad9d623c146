"""The non-streamed response bodies: the model list, a whole completion, its usage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdtrio.protocol.link.wire import TokenLogprob, Usage
from pdtrio.protocol.openai.logprobs import chat_logprobs, completion_logprobs
from pdtrio.protocol.openai.tools import ToolCall


def models_list_body(
    models: Sequence[str], *, created: int, owned_by: str = "pdtrio"
) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": m, "object": "model", "created": created, "owned_by": owned_by} for m in models
        ],
    }


def listed_models(payload: Any) -> list[tuple[str, int]]:
    """What another server's ``/v1/models`` body lists: (id, max_model_len; 0 when not
    said) per model, in its order.  ValueError: not a models list."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        raise ValueError("not a models list: no 'data' array")
    models = []
    for entry in data:
        model_id = entry.get("id") if isinstance(entry, dict) else None
        if not isinstance(model_id, str) or not model_id:
            raise ValueError(f"a listed model has no id: {str(entry)[:100]!r}")
        length = entry.get("max_model_len") or 0
        if not isinstance(length, int) or isinstance(length, bool) or length < 0:
            raise ValueError(f"model {model_id!r}: max_model_len {length!r} is not a count")
        models.append((model_id, length))
    return models


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
    logprobs: Sequence[TokenLogprob] | None = None,
    top_logprobs: int = 0,
    tool_calls: Sequence[ToolCall] | None = None,
) -> dict[str, Any]:
    """``logprobs``: every token's, when the request asked (``top_logprobs`` alternatives).
    ``tool_calls``: the calls read from the answer (then ``text`` is what is left, and
    the content is null when nothing is, as OpenAI's)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message = {
            "role": "assistant",
            "content": text or None,
            "tool_calls": [call.to_body() for call in tool_calls],
        }
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason,
                "logprobs": None if logprobs is None else chat_logprobs(logprobs, top_logprobs),
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
    logprobs: Sequence[TokenLogprob] | None = None,
    top_logprobs: int = 0,
) -> dict[str, Any]:
    """``logprobs``: every token's, when the request asked (``top_logprobs`` alternatives)."""
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
                "logprobs": (
                    None if logprobs is None else completion_logprobs(logprobs, top_logprobs)
                ),
            }
        ],
        "usage": usage_body(usage),
    }
