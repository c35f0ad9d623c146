"""The non-streamed response bodies: the model list, a whole completion, its usage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdtrio.protocol.wire import Usage


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
