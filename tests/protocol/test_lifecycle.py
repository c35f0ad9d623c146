"""The request lifecycle: what cleanup owes, checked against an independent model on every path."""

from __future__ import annotations

import itertools

import pytest

from pdtrio.protocol.request.lifecycle import (
    Cleanup,
    Event,
    LifecycleError,
    RequestLifecycle,
    State,
)


def _model_step(held: tuple[bool, bool], event: Event) -> tuple[bool, bool]:
    """(prefill may hold blocks, decode may run it) after ``event``, said from what each event means."""
    prefill, decode = held
    if event in (Event.PREFILL_SENT, Event.PREFILLED):
        return True, decode
    if event in (
        Event.PREFILL_NOT_SENT,
        Event.PREFILL_FAILED,
        Event.PREFILL_LOST,
        Event.FINISHED_AT_PREFILL,
    ):
        return False, decode
    if event is Event.DECODE_START_SENT:
        return prefill, True
    if event is Event.DECODE_NOT_STARTED:
        return prefill, False
    if event is Event.DECODE_ACCEPTED:
        return prefill, True  # decode pulled the blocks; prefill keeps them until a token
    if event is Event.FIRST_DECODE_TOKEN:
        return False, True  # decode is alive: prefill is told to free them
    if event is Event.DECODE_ENDED:
        return prefill, False
    if event is Event.DECODE_LOST:
        return prefill, False  # decode's request ended there; prefill released at its token
    if event is Event.KV_GIVEN_UP:
        return False, decode  # the caller released the blocks on prefill
    assert event is Event.CLEANED
    return False, False


def _expected(held: tuple[bool, bool]) -> Cleanup:
    owed = Cleanup.NOTHING
    if held[0]:
        owed |= Cleanup.RELEASE_ON_PREFILL
    if held[1]:
        owed |= Cleanup.ABORT_ON_DECODE
    return owed


def _paths(depth: int) -> list[list[Event]]:
    """Every sequence of valid events up to ``depth`` long (retries included)."""
    paths: list[list[Event]] = [[]]
    frontier: list[list[Event]] = [[]]
    for _ in range(depth):
        grown = []
        for path in frontier:
            lifecycle = RequestLifecycle()
            for event in path:
                lifecycle.handle(event)
            if lifecycle.state is State.DONE:
                continue
            for event in Event:
                probe = RequestLifecycle()
                for earlier in path:
                    probe.handle(earlier)
                try:
                    probe.handle(event)
                except LifecycleError:
                    continue
                grown.append([*path, event])
        paths.extend(grown)
        frontier = grown
    return paths


ALL_PATHS = _paths(9)


def test_there_are_many_paths_and_all_end_states_are_reached() -> None:
    ends = set()
    for path in ALL_PATHS:
        lifecycle = RequestLifecycle()
        for event in path:
            lifecycle.handle(event)
        ends.add(lifecycle.state)
    assert len(ALL_PATHS) > 100
    assert ends == set(State)


@pytest.mark.parametrize("path", ALL_PATHS, ids=lambda p: ">".join(e.name for e in p) or "start")
def test_cleanup_owes_exactly_what_is_held_on_every_path(path: list[Event]) -> None:
    lifecycle = RequestLifecycle()
    held = (False, False)
    for event in path:
        lifecycle.handle(event)
        held = _model_step(held, event)
        assert lifecycle.owed() == _expected(held), (path, lifecycle.state)
    # cleanup at this point leaves nothing owed, and may be repeated
    lifecycle.handle(Event.CLEANED)
    assert lifecycle.owed() is Cleanup.NOTHING
    lifecycle.handle(Event.CLEANED)
    assert lifecycle.state is State.DONE


def test_the_happy_path() -> None:
    lifecycle = RequestLifecycle()
    owed = []
    for event in (
        Event.PREFILL_SENT,
        Event.PREFILLED,
        Event.DECODE_START_SENT,
        Event.DECODE_ACCEPTED,
        Event.FIRST_DECODE_TOKEN,
        Event.DECODE_ENDED,
    ):
        lifecycle.handle(event)
        owed.append(lifecycle.owed())
    assert owed == [
        Cleanup.RELEASE_ON_PREFILL,
        Cleanup.RELEASE_ON_PREFILL,
        Cleanup.RELEASE_ON_PREFILL | Cleanup.ABORT_ON_DECODE,
        Cleanup.RELEASE_ON_PREFILL | Cleanup.ABORT_ON_DECODE,
        Cleanup.ABORT_ON_DECODE,
        Cleanup.NOTHING,
    ]


def test_a_decode_that_fails_before_its_first_token_can_be_replaced() -> None:
    lifecycle = RequestLifecycle()
    for event in (
        Event.PREFILL_SENT,
        Event.PREFILLED,
        Event.DECODE_START_SENT,
        Event.DECODE_ACCEPTED,
        Event.DECODE_ENDED,
    ):
        lifecycle.handle(event)
    # prefill still holds the blocks: another decode may pull them
    assert lifecycle.state is State.PREFILLED
    assert lifecycle.owed() is Cleanup.RELEASE_ON_PREFILL
    lifecycle.handle(Event.DECODE_START_SENT)
    assert lifecycle.state is State.DECODE_STARTING


def test_a_decode_lost_mid_stream_owes_nothing_and_the_request_may_start_over() -> None:
    lifecycle = RequestLifecycle()
    for event in (
        Event.PREFILL_SENT,
        Event.PREFILLED,
        Event.DECODE_START_SENT,
        Event.DECODE_ACCEPTED,
        Event.FIRST_DECODE_TOKEN,
        Event.DECODE_LOST,
    ):
        lifecycle.handle(event)
    # decode holds nothing, prefill was told to release at the first token
    assert lifecycle.owed() is Cleanup.NOTHING
    # a migration: a new prefill, of the prompt and the tokens delivered
    lifecycle.handle(Event.PREFILL_SENT)
    assert lifecycle.owed() is Cleanup.RELEASE_ON_PREFILL


def test_kv_no_decode_could_pull_is_released_and_the_request_may_start_over() -> None:
    lifecycle = RequestLifecycle()
    for event in (
        Event.PREFILL_SENT,
        Event.PREFILLED,
        Event.DECODE_START_SENT,
        Event.DECODE_ACCEPTED,
        Event.DECODE_ENDED,  # failed before its first token: prefill still holds
    ):
        lifecycle.handle(event)
    assert lifecycle.owed() is Cleanup.RELEASE_ON_PREFILL
    lifecycle.handle(Event.KV_GIVEN_UP)
    assert lifecycle.owed() is Cleanup.NOTHING
    lifecycle.handle(Event.PREFILL_SENT)
    assert lifecycle.state is State.PREFILLING


def test_a_rejected_start_can_be_retried_on_another_decode() -> None:
    lifecycle = RequestLifecycle()
    for event in (
        Event.PREFILL_SENT,
        Event.PREFILLED,
        Event.DECODE_START_SENT,
        Event.DECODE_NOT_STARTED,
    ):
        lifecycle.handle(event)
    assert lifecycle.owed() is Cleanup.RELEASE_ON_PREFILL
    lifecycle.handle(Event.DECODE_START_SENT)
    assert lifecycle.state is State.DECODE_STARTING


@pytest.mark.parametrize(
    ("state_path", "event"),
    [
        ([], Event.PREFILLED),
        ([], Event.DECODE_START_SENT),
        ([Event.PREFILL_SENT], Event.DECODE_ACCEPTED),
        ([Event.PREFILL_SENT, Event.PREFILLED], Event.DECODE_ENDED),
        ([Event.PREFILL_SENT, Event.FINISHED_AT_PREFILL], Event.DECODE_START_SENT),
        ([Event.CLEANED], Event.PREFILL_SENT),
    ],
)
def test_impossible_events_are_refused(state_path: list[Event], event: Event) -> None:
    lifecycle = RequestLifecycle()
    for earlier in state_path:
        lifecycle.handle(earlier)
    before = lifecycle.state
    with pytest.raises(LifecycleError, match=event.name):
        lifecycle.handle(event)
    assert lifecycle.state is before


def test_every_state_and_event_pair_is_either_a_transition_or_refused() -> None:
    for state, event in itertools.product(State, Event):
        assert isinstance(state, State) and isinstance(event, Event)
    # DONE accepts only CLEANED: nothing else can happen to a finished request
    done = RequestLifecycle()
    done.handle(Event.CLEANED)
    for event in Event:
        if event is not Event.CLEANED:
            with pytest.raises(LifecycleError):
                done.handle(event)
