from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdtrio.protocol.tokens.stream_buffer import (
    PendingDelta,
    PushResult,
    StreamBuffer,
    StreamBufferError,
)


def test_pending_deltas_merge_into_one() -> None:
    buffer = StreamBuffer(max_pending_tokens=10)
    assert buffer.take() is None
    assert buffer.push("Hel", 1, None, None) is PushResult.ACCEPTED
    assert buffer.push("", 1, None, [3, 2, 0]) is PushResult.ACCEPTED  # incomplete UTF-8
    assert buffer.push("lo", 2, "stop", None) is PushResult.ACCEPTED
    assert buffer.has_pending and buffer.pending_tokens == 4 and buffer.finished
    assert buffer.take() == PendingDelta("Hello", 4, "stop", [3, 2, 0])
    assert not buffer.has_pending and buffer.pending_tokens == 0
    assert buffer.take() is None


def test_usage_and_finish_come_from_the_last_push_that_had_them() -> None:
    buffer = StreamBuffer(max_pending_tokens=10)
    buffer.push("a", 1, None, [1, 1, 0])
    buffer.push("b", 1, None, [1, 2, 0])
    buffer.push("c", 1, None, None)
    assert buffer.take() == PendingDelta("abc", 3, None, [1, 2, 0])
    buffer.push("d", 1, None, None)
    assert buffer.take() == PendingDelta("d", 1, None, None)


def test_a_push_past_the_limit_overflows_and_fails_the_buffer() -> None:
    buffer = StreamBuffer(max_pending_tokens=4)
    assert buffer.push("ab", 2, None, None) is PushResult.ACCEPTED
    assert buffer.push("cd", 2, None, None) is PushResult.ACCEPTED  # exactly at the limit
    assert buffer.push("e", 1, None, None) is PushResult.OVERFLOW
    assert buffer.failed and buffer.pending_tokens == 4
    assert buffer.push("f", 1, "stop", None) is PushResult.DISCARDED
    assert buffer.take() == PendingDelta("abcd", 4, None, None)  # what came before
    assert buffer.push("g", 1, None, None) is PushResult.DISCARDED


def test_an_empty_buffer_takes_any_push() -> None:
    buffer = StreamBuffer(max_pending_tokens=2)
    assert buffer.push("abcdef", 6, None, None) is PushResult.ACCEPTED
    assert buffer.push("g", 1, None, None) is PushResult.OVERFLOW


def test_a_finish_or_usage_alone_never_overflows() -> None:
    buffer = StreamBuffer(max_pending_tokens=2)
    assert buffer.push("abc", 3, None, None) is PushResult.ACCEPTED
    assert buffer.push("", 0, None, [1, 3, 0]) is PushResult.ACCEPTED
    assert buffer.push("", 0, "stop", None) is PushResult.ACCEPTED
    assert buffer.take() == PendingDelta("abc", 3, "stop", [1, 3, 0])


def test_a_push_after_the_finish_is_an_error() -> None:
    buffer = StreamBuffer(max_pending_tokens=4)
    buffer.push("a", 1, "length", None)
    buffer.take()
    assert buffer.finished
    with pytest.raises(StreamBufferError):
        buffer.push("b", 1, None, None)


def test_close_drops_pending_and_discards_later_pushes() -> None:
    buffer = StreamBuffer(max_pending_tokens=4)
    buffer.push("a", 1, None, None)
    buffer.close()
    assert buffer.closed and not buffer.has_pending and buffer.take() is None
    assert buffer.push("b", 1, "stop", None) is PushResult.DISCARDED
    assert buffer.take() is None


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        StreamBuffer(max_pending_tokens=0)
    with pytest.raises(StreamBufferError):
        StreamBuffer(max_pending_tokens=4).push("a", -1, None, None)


pushes = st.lists(
    st.one_of(
        st.tuples(
            st.just("push"),
            st.text(max_size=5),
            st.integers(0, 4),
            st.none() | st.lists(st.integers(0, 9), min_size=3, max_size=3),
        ),
        st.tuples(st.just("take"), st.just(""), st.just(0), st.none()),
    ),
    max_size=40,
)


@given(
    limit=st.integers(1, 12),
    ops=pushes,
    finish=st.sampled_from([None, "stop", "length"]),
)
def test_taken_deltas_are_the_pushes_in_order_until_an_overflow(
    limit: int, ops: list[tuple[str, str, int, Any]], finish: str | None
) -> None:
    buffer = StreamBuffer(max_pending_tokens=limit)
    accepted_text, accepted_tokens = "", 0
    taken_text, taken_tokens = "", 0
    window_usage: Any = None  # the last usage pushed since the last take
    pending = 0
    pending_pushes = 0  # pushes with tokens since the last take
    overflowed = False
    for kind, text, num_tokens, usage in ops:
        if kind == "take":
            delta = buffer.take()
            if pending == 0 and delta is None:
                continue
            assert delta is not None
            assert delta.num_tokens == pending
            taken_text += delta.text
            taken_tokens += delta.num_tokens
            assert delta.usage == window_usage
            assert delta.finish_reason is None
            pending, pending_pushes, window_usage = 0, 0, None
            continue
        result = buffer.push(text, num_tokens, None, usage)
        if overflowed:
            assert result is PushResult.DISCARDED
        elif pending and num_tokens and pending + num_tokens > limit:
            # overflow exactly when the pending tokens would pass the limit
            assert result is PushResult.OVERFLOW
            assert buffer.failed
            overflowed = True
        else:
            assert result is PushResult.ACCEPTED
            accepted_text += text
            accepted_tokens += num_tokens
            pending += num_tokens
            pending_pushes += num_tokens > 0
            if usage is not None:
                window_usage = usage
        assert buffer.pending_tokens == pending
        assert pending <= limit or pending_pushes == 1  # one lone push may be larger
    if not overflowed:
        assert buffer.push("", 0, finish, None) is PushResult.ACCEPTED
        assert buffer.finished == (finish is not None)
    last = buffer.take()
    if last is not None:
        taken_text += last.text
        taken_tokens += last.num_tokens
        if not overflowed:
            assert last.finish_reason == finish
            assert last.usage == window_usage
    assert taken_text == accepted_text
    assert taken_tokens == accepted_tokens
    assert buffer.take() is None
