"""What the next engine step runs: the scheduling policy, apart from the engine loop.

As vLLM v1 keeps its ``Scheduler`` (``schedule()`` / ``update_from_output()``) apart
from its engine core and model runner, the engine loop here only carries out a
:class:`StepSchedule` and reports back what the step did; this module decides, and is
pure (no torch, no I/O, no clock), so the policy is tested on its own.

The policy, continuous batching with chunked prefill, as vLLM v1's:

- a step computes at most ``max_num_batched_tokens`` tokens, decode rows (one token
  each) and prompt chunks together, so a step's length is bounded whatever arrives;
- running decodes first, oldest first, up to ``max_batch_size``: they never wait for
  prompts;
- then waiting prompts in arrival order take what is left of the budget, each at most
  ``prefill_chunk_tokens`` of its prompt: a long prompt goes a chunk a step (its KV
  written chunk by chunk, its first token sampled at its last), and the prompts behind
  it take what budget its chunk leaves instead of waiting for it to finish.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar, final

import attrs

Prompt = TypeVar("Prompt", bound=Hashable)
Decode = TypeVar("Decode", bound=Hashable)


@final
@attrs.frozen
class SchedulerLimits:
    max_batch_size: int  # decode sequences a step
    # tokens a step, decode rows and prompt chunks together (vLLM's max_num_batched_tokens)
    max_num_batched_tokens: int
    # tokens of one prompt a step (vLLM's long_prefill_token_threshold)
    prefill_chunk_tokens: int

    def __attrs_post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_batched_tokens", "prefill_chunk_tokens"):
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

    @property
    def num_tokens(self) -> int:
        """The tokens this step computes: one per decode, every prompt chunk's."""
        return len(self.decodes) + sum(take for _, take in self.prefills)


@final
class Scheduler(Generic[Prompt, Decode]):
    """The waiting prompts and running decodes of one engine, and what each step runs.

    The engine adds what arrives (``add_prompt``, ``add_decode``), asks ``schedule()``
    for a step, runs it, and reports it with ``update_from_output`` (which prompts are
    computed whole now, which decodes finished); ``remove_prompt`` / ``remove_decode``
    take out an aborted or failed request.  A step that is not reported (abandoned, failed) changed nothing.
    """

    def __init__(self, limits: SchedulerLimits) -> None:
        self.limits = limits
        # prompts in arrival order, each with its tokens still to compute (> 0)
        self._waiting: dict[Prompt, int] = {}
        # decodes in the order they started (dicts keep insertion order)
        self._running: dict[Decode, None] = {}

    @property
    def num_waiting_prompts(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def add_prompt(self, prompt: Prompt, num_tokens: int) -> None:
        """A prompt with ``num_tokens`` (> 0) still to compute joins the queue, last."""
        if num_tokens <= 0:
            raise ValueError(f"a waiting prompt has {num_tokens} tokens left to prefill")
        if prompt in self._waiting:
            raise ValueError("the prompt is waiting already")
        self._waiting[prompt] = num_tokens

    def add_decode(self, decode: Decode) -> None:
        self._running[decode] = None

    def remaining(self, prompt: Prompt) -> int:
        """The prompt's tokens still to compute."""
        return self._waiting[prompt]

    def remove_prompt(self, prompt: Prompt) -> bool:
        """Take a waiting prompt out (aborted, failed); whether it was waiting."""
        return self._waiting.pop(prompt, None) is not None

    def remove_decode(self, decode: Decode) -> bool:
        """Take a running decode out (aborted, failed); whether it was running."""
        if decode not in self._running:
            return False
        del self._running[decode]
        return True

    def schedule(self) -> StepSchedule[Prompt, Decode]:
        """The next step: decodes first, then prompt chunks, within the limits."""
        limits = self.limits
        budget = limits.max_num_batched_tokens
        decodes = tuple(self._running)[: min(limits.max_batch_size, budget)]
        budget -= len(decodes)
        prefills: list[tuple[Prompt, int]] = []
        for prompt, remaining in self._waiting.items():
            if budget <= 0:
                break
            take = min(remaining, limits.prefill_chunk_tokens, budget)
            prefills.append((prompt, take))
            budget -= take
        left_out = len(self._waiting) - len(prefills) + len(self._running) - len(decodes)
        return StepSchedule(tuple(prefills), decodes, left_out)

    def update_from_output(
        self, step: StepSchedule[Prompt, Decode], finished: Iterable[Decode] = ()
    ) -> list[Prompt]:
        """``step`` ran: its prompt chunks are computed, and the ``finished`` decodes end.
        The prompts whose last chunk it computed (they leave the queue, in step order)."""
        completed: list[Prompt] = []
        for prompt, take in step.prefills:
            left = self._waiting.get(prompt)
            if left is None:
                continue  # removed while the step ran
            if left <= take:
                del self._waiting[prompt]
                completed.append(prompt)
            else:
                self._waiting[prompt] = left - take
        for decode in finished:
            self._running.pop(decode, None)
        return completed


__all__ = ["Scheduler", "SchedulerLimits", "StepSchedule"]
