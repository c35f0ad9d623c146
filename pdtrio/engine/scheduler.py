"""What the next engine step runs: the scheduling policy, apart from the engine loop.

As vLLM v1 keeps ``Scheduler.schedule()`` apart from its engine core, the engine
loop here only carries out a :class:`StepSchedule`; this module decides it, and is
pure (no torch, no I/O, no clock), so the policy is tested on its own.

The policy, continuous batching with chunked prefill:

- running decodes first, oldest first, up to ``max_batch_size`` (one token each);
- then waiting prompts in arrival order share ``max_prefill_tokens`` a step, each
  at most ``prefill_chunk_tokens`` of its prompt: a long prompt goes a chunk a step
  (an abort, or the running decodes, wait one chunk at most), and the prompts behind
  it take what budget is left of the step instead of waiting for it to finish.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar, final

import attrs

Prompt = TypeVar("Prompt")
Decode = TypeVar("Decode")


@final
@attrs.frozen
class SchedulerLimits:
    max_batch_size: int  # decode sequences a step
    max_prefill_tokens: int  # prompt tokens a step, every prompt in it together
    prefill_chunk_tokens: int  # tokens of one prompt a step

    def __attrs_post_init__(self) -> None:
        for name in ("max_batch_size", "max_prefill_tokens", "prefill_chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@final
@attrs.frozen
class StepSchedule(Generic[Prompt, Decode]):
    prefills: tuple[tuple[Prompt, int], ...]  # (prompt, how many of its tokens this step)
    decodes: tuple[Decode, ...]
    waiting: int  # requests left out of this step (prompts and decodes)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


def schedule(
    waiting: Sequence[Prompt],
    running: Sequence[Decode],
    limits: SchedulerLimits,
    remaining_tokens: Callable[[Prompt], int],
) -> StepSchedule[Prompt, Decode]:
    """The next step: ``waiting`` prompts in arrival order (``remaining_tokens`` says how
    many of each prompt are still to prefill, > 0), ``running`` decodes oldest first."""
    decodes = tuple(running[: limits.max_batch_size])
    prefills: list[tuple[Prompt, int]] = []
    budget = limits.max_prefill_tokens
    for prompt in waiting:
        if budget <= 0:
            break
        remaining = remaining_tokens(prompt)
        if remaining <= 0:
            raise ValueError(f"a waiting prompt has {remaining} tokens left to prefill")
        take = min(remaining, limits.prefill_chunk_tokens, budget)
        prefills.append((prompt, take))
        budget -= take
    left_out = len(waiting) - len(prefills) + len(running) - len(decodes)
    return StepSchedule(tuple(prefills), decodes, left_out)


__all__ = ["SchedulerLimits", "StepSchedule", "schedule"]
