"""The OpenAI shapes of token logprobs, as vLLM's OpenAI server writes them.

Chat (``logprobs: true``, ``top_logprobs: n``): ``{"content": [{"token",
"logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}``,
``top_logprobs`` the ``n`` likeliest, best first.

Completions (``logprobs: n``): ``{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}``, each ``top_logprobs`` item a ``{token: logprob}`` of the ``n``
likeliest and the sampled token (so up to n + 1 keys, as OpenAI's and vLLM's);
``text_offset`` is where each token starts in the completion's text: the text
sent before the part (a streamed chunk, or 0 for the whole answer) plus the
lengths of the token strings before it in the part, as vLLM counts it.

``bytes`` is the token string's UTF-8 (a token that is part of a character
decodes on its own to U+FFFD, as in vLLM).  A log-probability below -9999 (or
-inf, a token the model rules out) is written as -9999.0, as vLLM does: JSON
has no infinity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdtrio.protocol.link.wire import TokenLogprob

_FLOOR = -9999.0


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def _finite(logprob: float) -> float:
    return logprob if logprob > _FLOOR else _FLOOR  # (NaN too: not > the floor)


def chat_logprobs(items: Sequence[TokenLogprob], top_logprobs: int) -> dict[str, Any]:
    """A chat choice's ``logprobs`` for these tokens."""
    return {
        "content": [
            {
                "token": item.token,
                "logprob": _finite(item.logprob),
                "bytes": _utf8(item.token),
                "top_logprobs": [
                    {"token": token, "logprob": _finite(logprob), "bytes": _utf8(token)}
                    for token, logprob in zip(
                        item.top_tokens[:top_logprobs],
                        item.top_logprobs[:top_logprobs],
                        strict=True,
                    )
                ],
            }
            for item in items
        ]
    }


def completion_logprobs(
    items: Sequence[TokenLogprob], top_logprobs: int, text_offset: int = 0
) -> dict[str, Any]:
    """A completion choice's ``logprobs`` for these tokens, the first at ``text_offset``."""
    offsets: list[int] = []
    tops: list[dict[str, float]] = []
    at = text_offset
    for item in items:
        offsets.append(at)
        at += len(item.token)
        top = {
            token: _finite(logprob)
            for token, logprob in zip(
                item.top_tokens[:top_logprobs], item.top_logprobs[:top_logprobs], strict=True
            )
        }
        top.setdefault(item.token, _finite(item.logprob))  # the sampled token is always there
        tops.append(top)
    return {
        "tokens": [item.token for item in items],
        "token_logprobs": [_finite(item.logprob) for item in items],
        "top_logprobs": tops,
        "text_offset": offsets,
    }
