"""The tests' waits fail saying what they waited for, and return as soon as it holds."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tests.cluster import wait_for_answer, wait_for_stats


async def test_a_wait_in_vain_names_its_condition(autojump_clock: trio.testing.MockClock) -> None:
    never: list[int] = []
    with pytest.raises(AssertionError, match=r"waited 5\.0 s, in vain, for .*len\(never\) == 1"):
        await wait_for_stats(lambda: len(never) == 1)
    with pytest.raises(AssertionError, match="waited 2 s, in vain, for the queue: empty"):
        await wait_for_stats(lambda: bool(never), 2, what=lambda: "the queue: empty")


async def test_a_wait_returns_once_the_state_holds(autojump_clock: trio.testing.MockClock) -> None:
    state = {"done": False}

    async def finish_later() -> None:
        await trio.sleep(1.0)  # (the mock clock's time)
        state["done"] = True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(finish_later)
        started = trio.current_time()
        await wait_for_stats(lambda: state["done"], 5)
        assert 1.0 <= trio.current_time() - started < 1.1


async def test_an_answer_waited_for_in_vain_is_shown(
    autojump_clock: trio.testing.MockClock,
) -> None:
    answers = iter(range(1000))

    async def ask() -> int:
        return next(answers)

    assert await wait_for_answer(ask, lambda n: n == 3) == 3
    with pytest.raises(AssertionError, match=r"for a negative number; the last answer: \d+"):
        await wait_for_answer(ask, lambda n: n < 0, 1, what="a negative number")
