"""How many tokens a request may generate, or why it cannot run at all.

The budget is computed once, by prefill, and covers every generated token,
the first one (sampled by prefill) included; decode is told how much of it
is spent and asks :func:`tokens_left`.
"""

from __future__ import annotations

from pdtrio.engine.api import EngineError, PromptRejected
from pdtrio.protocol.sampling import MAX_CHOICES, SamplingParams


def checked_token_ids(token_ids: tuple[int, ...], vocab_size: int) -> list[int]:
    """A prompt given as token ids, refused (a 400) if any id is outside the vocabulary."""
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise PromptRejected(
                f"token id {token_id} is out of range for a vocabulary of {vocab_size}",
                param="prompt",
            )
    return list(token_ids)


def check_logit_bias(sampling: SamplingParams, vocab_size: int) -> None:
    """PromptRejected (a 400) when ``logit_bias`` names a token outside the vocabulary
    (vLLM's rule; the ids are checked where the vocabulary is known)."""
    for token_id, _ in sampling.logit_bias:
        if not 0 <= token_id < vocab_size:
            raise PromptRejected(
                f"token id {token_id} in logit_bias is out of range for a vocabulary of "
                f"{vocab_size}",
                param="logit_bias",
            )


def check_prompt_length(prompt_tokens: int, max_model_len: int) -> None:
    """PromptRejected (a 400) when the prompt alone fills the context."""
    if prompt_tokens >= max_model_len:
        raise PromptRejected(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {prompt_tokens} tokens.",
            param="messages",
        )


def token_budget(
    prompt_tokens: int,
    max_tokens: int | None,
    *,
    max_model_len: int,
    kv_capacity_tokens: int,
    default_max_tokens: int = 2048,
) -> int:
    """The whole completion budget; PromptRejected (a 400) if the request can never fit.

    An unset ``max_tokens`` means ``default_max_tokens``, capped by the context:
    decode reserves the whole budget up front, so the context length would cost
    every default request the KV of the longest possible one.
    """
    if max_tokens is not None and max_tokens < 1:
        raise PromptRejected(f"max_tokens must be at least 1, not {max_tokens}", param="max_tokens")
    if prompt_tokens == 0:
        raise PromptRejected("the prompt is empty", param="prompt")
    check_prompt_length(prompt_tokens, max_model_len)
    if max_tokens is None:
        budget = min(default_max_tokens, max_model_len - prompt_tokens)
    else:
        budget = max_tokens
    if prompt_tokens + budget > max_model_len:
        raise PromptRejected(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + budget} tokens ({prompt_tokens} in the prompt, {budget} "
            f"for the completion).",
            param="max_tokens",
        )
    if prompt_tokens + budget > kv_capacity_tokens:
        raise PromptRejected(
            f"the request needs {prompt_tokens + budget} tokens of KV cache, more than this "
            f"instance can ever hold ({kv_capacity_tokens})",
            param="max_tokens",
        )
    return budget


def tokens_left(token_budget: int, tokens_generated: int) -> int:
    """How many more tokens a request may generate (<= 0: none)."""
    return token_budget - tokens_generated


def check_continuation(prompt_tokens: int, generated_tokens: int) -> int:
    """The prompt's own length when its last ``generated_tokens`` ids are earlier output.

    PromptRejected (a 400) unless at least one id of the prompt proper is left (an empty
    prompt is :func:`token_budget`'s to refuse).
    """
    if generated_tokens < 0 or (generated_tokens and generated_tokens >= prompt_tokens):
        raise PromptRejected(
            f"{generated_tokens} generated tokens in a prompt of {prompt_tokens}", param="prompt"
        )
    return prompt_tokens - generated_tokens


def check_choices(n: int, generated_tokens: int) -> None:
    """PromptRejected (a 400 naming ``n``) for a number of choices outside 1..MAX_CHOICES,
    or for several choices of a continuation (a migrated stream is one sequence)."""
    if not 1 <= n <= MAX_CHOICES:
        raise PromptRejected(f"n must be within 1..{MAX_CHOICES}, not {n}", param="n")
    if n > 1 and generated_tokens:
        raise PromptRejected("a continuation runs one choice, not n > 1", param="n")


def check_start_choices(
    request_id: str,
    sampling: SamplingParams,
    generated_tokens: int,
    choices: tuple[tuple[int, int], ...],
) -> None:
    """EngineError unless ``choices`` (a decode start's (choice, first token) pairs) are
    distinct choices of the request's ``n`` > 1, of a request that is no continuation."""
    if sampling.n <= 1 or generated_tokens:
        raise EngineError(
            f"request {request_id}: choices need n > 1 and no continuation "
            f"(n = {sampling.n}, {generated_tokens} generated tokens)"
        )
    indexes = [choice for choice, _ in choices]
    if not indexes or len(set(indexes)) != len(indexes):
        raise EngineError(f"request {request_id}: choices {indexes} are empty or repeat")
    if not all(0 <= choice < sampling.n for choice in indexes):
        raise EngineError(
            f"request {request_id}: choices {indexes} are not within 0..{sampling.n - 1}"
        )
