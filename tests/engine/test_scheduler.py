"""The scheduling policy on its own (pdtrio.engine.scheduler): what a step runs."""

from __future__ import annotations

import pytest

from pdtrio.config import EngineConfig
from pdtrio.engine.scheduler import Scheduler, SchedulerLimits

# prompts are names added with their tokens to compute; decodes are names
LIMITS = SchedulerLimits(max_batch_size=4, max_num_batched_tokens=300, prefill_chunk_tokens=128)


def _scheduler(
    waiting: list[tuple[str, int]], running: list[str], limits: SchedulerLimits = LIMITS
) -> Scheduler[str, str]:
    scheduler: Scheduler[str, str] = Scheduler(limits)
    for name, tokens in waiting:
        scheduler.add_prompt(name, tokens)
    for name in running:
        scheduler.add_decode(name)
    return scheduler


def _plan(
    waiting: list[tuple[str, int]], running: list[str], limits: SchedulerLimits = LIMITS
) -> tuple[list[tuple[str, int]], list[str], int]:
    step = _scheduler(waiting, running, limits).schedule()
    return list(step.prefills), list(step.decodes), step.waiting


def _run_to_the_end(
    scheduler: Scheduler[str, str],
) -> list[tuple[list[tuple[str, int]], list[str]]]:
    """Every step until the prompts are computed (no decode finishes)."""
    steps = []
    while scheduler.num_waiting_prompts:
        step = scheduler.schedule()
        assert step.num_tokens <= scheduler.limits.max_num_batched_tokens
        steps.append((list(step.prefills), list(step.decodes)))
        scheduler.update_from_output(step)
    return steps


def test_nothing_to_do_is_an_empty_step() -> None:
    step = _scheduler([], []).schedule()
    assert step.empty and step.waiting == 0 and step.num_tokens == 0


def test_decodes_run_oldest_first_up_to_the_batch_limit() -> None:
    running = [f"d{i}" for i in range(6)]
    assert _plan([], running) == ([], ["d0", "d1", "d2", "d3"], 2)


def test_prompts_behind_a_long_one_share_the_step_budget() -> None:
    # a chunk of each, in arrival order, until the step's 300 tokens are spent
    waiting = [("a", 256), ("b", 256), ("c", 10), ("d", 50)]
    assert _plan(waiting, []) == ([("a", 128), ("b", 128), ("c", 10), ("d", 34)], [], 0)


def test_decodes_go_first_and_prompts_take_what_they_leave_of_the_budget() -> None:
    # 4 decode rows of the 300 tokens: 296 for prompts
    waiting = [("a", 256), ("b", 256), ("c", 100)]
    running = ["d0", "d1", "d2", "d3"]
    assert _plan(waiting, running) == ([("a", 128), ("b", 128), ("c", 40)], running, 0)


def test_no_step_grows_past_the_budget_while_decodes_wait() -> None:
    # eight whole prompts of 256 with the running decodes: vLLM's budget cuts them
    limits = SchedulerLimits(
        max_batch_size=32, max_num_batched_tokens=512, prefill_chunk_tokens=256
    )
    running = [f"d{i}" for i in range(8)]
    scheduler = _scheduler([(f"p{i}", 256) for i in range(8)], running, limits)
    steps = _run_to_the_end(scheduler)
    # every step decodes all 8 and prefills 504 prompt tokens, the last what is left
    assert all(decodes == running for _, decodes in steps)
    assert [sum(take for _, take in prefills) for prefills, _ in steps] == [504] * 4 + [32]
    assert steps[0][0] == [("p0", 256), ("p1", 248)]
    assert steps[1][0] == [("p1", 8), ("p2", 256), ("p3", 240)]


def test_a_budget_smaller_than_the_decodes_caps_them_too() -> None:
    limits = SchedulerLimits(max_batch_size=8, max_num_batched_tokens=3, prefill_chunk_tokens=8)
    assert _plan([("a", 5)], ["d0", "d1", "d2", "d3"], limits) == ([], ["d0", "d1", "d2"], 2)


def test_a_short_budget_leaves_later_prompts_waiting() -> None:
    limits = SchedulerLimits(max_batch_size=4, max_num_batched_tokens=101, prefill_chunk_tokens=128)
    # the decode's row, then the first prompt takes the rest (less than a chunk); b waits
    assert _plan([("a", 256), ("b", 20)], ["d0"], limits) == ([("a", 100)], ["d0"], 1)


def test_a_long_prompt_goes_a_chunk_a_step_ahead_of_those_behind() -> None:
    steps = _run_to_the_end(_scheduler([("a", 300), ("b", 300)], []))
    assert [prefills for prefills, _ in steps] == [
        [("a", 128), ("b", 128)],
        [("a", 128), ("b", 128)],
        [("a", 44), ("b", 44)],
    ]


def test_update_from_output_says_which_prompts_are_computed_and_drops_finished_decodes() -> None:
    scheduler = _scheduler([("a", 100), ("b", 200)], ["d0", "d1"])
    step = scheduler.schedule()
    assert scheduler.update_from_output(step, finished=["d0"]) == ["a"]
    assert scheduler.remaining("b") == 72
    step = scheduler.schedule()
    assert list(step.decodes) == ["d1"] and list(step.prefills) == [("b", 72)]
    assert scheduler.update_from_output(step) == ["b"]
    assert scheduler.num_waiting_prompts == 0 and scheduler.num_running == 1


def test_a_step_not_reported_changes_nothing_and_removed_requests_leave() -> None:
    scheduler = _scheduler([("a", 200), ("b", 50)], ["d0"])
    abandoned = scheduler.schedule()
    assert scheduler.schedule() == abandoned  # (an abandoned step is planned again)
    assert scheduler.remove_prompt("a") and not scheduler.remove_prompt("a")
    assert scheduler.remove_decode("d0") and not scheduler.remove_decode("d0")
    # a prompt removed while its step ran is not reported as computed
    assert scheduler.update_from_output(abandoned) == ["b"]
    assert not scheduler.has_work


def test_the_default_limits_share_512_tokens_a_step() -> None:
    config = EngineConfig()
    limits = SchedulerLimits(
        max_batch_size=config.max_batch_size,
        max_num_batched_tokens=config.max_num_batched_tokens,
        prefill_chunk_tokens=config.prefill_chunk_tokens,
    )
    waiting = [(f"p{i}", 256) for i in range(10)]
    plan, decodes, left_out = _plan(waiting, ["d0"], limits)
    # the decode, a whole 256-token prompt (the engine benchmark's), and the next one's start
    assert plan == [("p0", 256), ("p1", 255)] and decodes == ["d0"] and left_out == 8
    assert _plan([("long", 1000)], [], limits)[0] == [("long", 256)]


def test_limits_and_prompts_are_checked() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        SchedulerLimits(max_batch_size=0, max_num_batched_tokens=1, prefill_chunk_tokens=1)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerLimits(max_batch_size=1, max_num_batched_tokens=0, prefill_chunk_tokens=1)
    with pytest.raises(ValueError, match="tokens left to prefill"):
        _scheduler([("a", 0)], [])
    with pytest.raises(ValueError, match="waiting already"):
        _scheduler([("a", 1), ("a", 2)], [])
