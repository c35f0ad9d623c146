"""How many tokens a request may generate, or why it cannot run at all."""

from __future__ import annotations

from pdtrio.engine.api import PromptRejected


def token_budget(
    prompt_tokens: int, max_tokens: int | None, *, max_model_len: int, kv_capacity_tokens: int
) -> int:
    """The completion budget; PromptRejected (a 400) if the request can never fit."""
    if prompt_tokens == 0:
        raise PromptRejected("the prompt is empty", param="prompt")
    if prompt_tokens >= max_model_len:
        raise PromptRejected(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {prompt_tokens} tokens.",
            param="messages",
        )
    budget = max_model_len - prompt_tokens if max_tokens is None else max_tokens
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
