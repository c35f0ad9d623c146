"""The scheduling policy on its own (pdtrio.engine.scheduler): what a step runs."""

from __future__ import annotations

import pytest

from pdtrio.config import EngineConfig
from pdtrio.engine.scheduler import SchedulerLimits, schedule

# prompts are (name, tokens left to prefill); decodes are names
LIMITS = SchedulerLimits(max_batch_size=4, max_prefill_tokens=300, prefill_chunk_tokens=128)


def _left(prompt: tuple[str, int]) -> int:
    return prompt[1]


def _plan(
    waiting: list[tuple[str, int]], running: list[str], limits: SchedulerLimits = LIMITS
) -> tuple[list[tuple[str, int]], list[str], int]:
    step = schedule(waiting, running, limits, _left)
    return [(p[0], take) for p, take in step.prefills], list(step.decodes), step.waiting


def test_nothing_to_do_is_an_empty_step() -> None:
    step = schedule([], [], LIMITS, _left)
    assert step.empty and step.waiting == 0


def test_decodes_run_oldest_first_up_to_the_batch_limit() -> None:
    running = [f"d{i}" for i in range(6)]
    assert _plan([], running) == ([], ["d0", "d1", "d2", "d3"], 2)


def test_prompts_behind_a_long_one_share_the_step_budget() -> None:
    # a chunk of each, in arrival order, until the step's 300 prompt tokens are spent
    waiting = [("a", 256), ("b", 256), ("c", 10), ("d", 50)]
    assert _plan(waiting, []) == ([("a", 128), ("b", 128), ("c", 10), ("d", 34)], [], 0)


def test_a_short_budget_leaves_later_prompts_waiting() -> None:
    limits = SchedulerLimits(max_batch_size=4, max_prefill_tokens=100, prefill_chunk_tokens=128)
    # the first prompt takes the whole budget (less than a chunk); the second waits
    assert _plan([("a", 256), ("b", 20)], ["d0"], limits) == ([("a", 100)], ["d0"], 1)


def test_decodes_and_prompts_share_a_step() -> None:
    assert _plan([("a", 40)], ["d0", "d1"]) == ([("a", 40)], ["d0", "d1"], 0)


def test_a_long_prompt_goes_a_chunk_a_step_ahead_of_those_behind() -> None:
    # the engine keeps arrival order: a partly prefilled prompt stays first
    left = {"a": 300, "b": 300}
    chunks: list[list[tuple[str, int]]] = []
    while any(left.values()):
        waiting = [(name, n) for name, n in left.items() if n]
        plan, _, _ = _plan(waiting, [])
        chunks.append(plan)
        for name, take in plan:
            left[name] -= take
    assert chunks == [
        [("a", 128), ("b", 128)],
        [("a", 128), ("b", 128)],
        [("a", 44), ("b", 44)],
    ]


def test_the_default_limits_prefill_a_256_token_prompt_in_one_step() -> None:
    # a later chunk costs more than prefilling with the first (pdtrio.config's comment), so
    # by default the engine benchmark's 256-token prompts go whole, 8 of them a step, with
    # the running decodes; a longer prompt still goes a chunk a step
    config = EngineConfig()
    limits = SchedulerLimits(
        max_batch_size=config.max_batch_size,
        max_prefill_tokens=config.max_prefill_tokens,
        prefill_chunk_tokens=config.prefill_chunk_tokens,
    )
    waiting = [(f"p{i}", 256) for i in range(10)]
    plan, decodes, left_out = _plan(waiting, ["d0"], limits)
    assert plan == [(f"p{i}", 256) for i in range(8)] and decodes == ["d0"] and left_out == 2
    assert _plan([("long", 1000)], [], limits)[0] == [("long", 256)]


def test_limits_and_prompts_are_checked() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        SchedulerLimits(max_batch_size=0, max_prefill_tokens=1, prefill_chunk_tokens=1)
    with pytest.raises(ValueError, match="tokens left to prefill"):
        schedule([("a", 0)], [], LIMITS, _left)
