from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdtrio.protocol.link.wire import TokenEntry, Usage
from pdtrio.protocol.tokens.flush import (
    FlushConfig,
    FlushNow,
    FlushPolicy,
    Idle,
    WaitForWrite,
    WaitUntil,
)
from tests.examples import examples

Entry = TokenEntry
REQUESTS = [f"r{i}" for i in range(8)]
ticks = st.integers(0, 3) | st.integers(0, 40)  # mostly steps close together


def entry(
    rid: str,
    ids: list[int],
    text: str,
    finish: str | None = None,
    usage: Usage | None = None,
) -> Entry:
    return TokenEntry(rid, ids, text, finish, usage)


# --- examples ------------------------------------------------------------------


def test_lone_step_on_idle_link_flushes_at_once() -> None:
    policy = FlushPolicy(FlushConfig())
    assert policy.decide(0.0, in_flight=False) == Idle()
    policy.add([entry("a", [1], "hi")], 0.0)
    assert policy.decide(0.0, in_flight=False) == FlushNow()
    assert policy.take() == [entry("a", [1], "hi")]
    assert not policy.has_pending
    assert policy.decide(0.0, in_flight=False) == Idle()


def test_entries_wait_behind_the_in_flight_frame_then_hold_up_to_the_window() -> None:
    policy = FlushPolicy(FlushConfig(window_s=0.002))
    policy.add([entry("a", [1], "x")], 1.0)
    assert policy.decide(1.0, in_flight=False) == FlushNow()
    policy.take()
    policy.add([entry("a", [2], "y"), entry("b", [7], "p")], 1.0005)
    assert policy.decide(1.0005, in_flight=True) == WaitForWrite()
    # The write finished before the window: hold for more steps.
    assert policy.decide(1.001, in_flight=False) == WaitUntil(1.0025)
    policy.add([entry("a", [3], "z"), entry("b", [8], "q")], 1.002)
    assert policy.decide(1.002, in_flight=False) == WaitUntil(1.0025)
    assert policy.decide(1.0025, in_flight=False) == FlushNow()
    assert policy.take() == [entry("a", [2, 3], "yz"), entry("b", [7, 8], "pq")]
    # Drained: the next batch on a free link is not held.
    policy.add([entry("a", [4], "w")], 1.003)
    assert policy.decide(1.003, in_flight=False) == FlushNow()


def test_a_finishing_request_ends_the_hold() -> None:
    policy = FlushPolicy(FlushConfig(window_s=1.0))
    policy.add([entry("a", [1], "x")], 0.0)
    assert policy.decide(0.0, in_flight=True) == WaitForWrite()
    assert policy.decide(0.1, in_flight=False) == WaitUntil(1.0)
    policy.add([entry("b", [2], "y", "stop", Usage(3, 1, 0))], 0.2)
    assert policy.decide(0.2, in_flight=True) == WaitForWrite()
    assert policy.decide(0.2, in_flight=False) == FlushNow()


def test_a_full_frame_ends_the_hold() -> None:
    policy = FlushPolicy(FlushConfig(window_s=1.0, max_entries=2))
    policy.add([entry("a", [1], "x")], 0.0)
    policy.decide(0.0, in_flight=True)
    assert policy.decide(0.0, in_flight=False) == WaitUntil(1.0)
    policy.add([entry("b", [2], "y")], 0.1)
    assert policy.decide(0.1, in_flight=False) == FlushNow()

    by_text = FlushPolicy(FlushConfig(window_s=1.0, max_bytes_hint=4))
    by_text.add([entry("a", [1], "ab")], 0.0)
    by_text.decide(0.0, in_flight=True)
    assert by_text.decide(0.0, in_flight=False) == WaitUntil(1.0)
    by_text.add([entry("a", [2], "cd")], 0.1)
    assert by_text.decide(0.1, in_flight=False) == FlushNow()
    assert by_text.take() == [entry("a", [1, 2], "abcd")]


def test_merge_takes_finish_and_usage_from_the_later_step_and_keeps_inputs() -> None:
    policy = FlushPolicy(FlushConfig())
    first = [entry("a", [1, 2], "he", None, Usage(5, 2, 0)), entry("b", [9], "x")]
    second = [entry("a", [3], "llo", "stop", None), entry("c", [4], "new")]
    inputs = copy.deepcopy([first, second])
    policy.add(first, 0.0)
    policy.add(second, 0.0)
    assert policy.pending_entries == 3
    assert policy.take() == [
        entry("a", [1, 2, 3], "hello", "stop", Usage(5, 2, 0)),
        entry("b", [9], "x"),
        entry("c", [4], "new"),
    ]
    assert [first, second] == inputs
    stats = policy.statistics()
    assert (stats.frames_taken, stats.entries_taken, stats.entries_merged) == (1, 3, 1)


def test_an_unmerged_entry_goes_out_as_it_came_and_the_later_usage_wins() -> None:
    policy = FlushPolicy(FlushConfig())
    alone = entry("b", [9], "x")
    policy.add([entry("a", [1], "x", None, Usage(4, 1, 0)), alone], 0.0)
    policy.add([entry("a", [2], "y", "length", Usage(4, 2, 1))], 0.0)
    frame = policy.take()
    assert frame[1] is alone  # no copy on the hot path when nothing merged
    assert frame[0] == entry("a", [1, 2], "xy", "length", Usage(4, 2, 1))


def test_frames_split_at_the_caps_and_keep_request_order() -> None:
    policy = FlushPolicy(FlushConfig(max_entries=2, max_bytes_hint=100))
    policy.add([entry(r, [i], r) for i, r in enumerate(["a", "b", "c"])], 0.0)
    policy.add([entry("a", [9], "!")], 0.0)
    assert policy.take() == [entry("a", [0, 9], "a!"), entry("b", [1], "b")]
    policy.add([entry("a", [10], "?")], 0.0)
    assert policy.take() == [entry("c", [2], "c"), entry("a", [10], "?")]
    assert policy.take() == []

    oversized = FlushPolicy(FlushConfig(max_bytes_hint=3))
    oversized.add([entry("a", [1], "abcdef"), entry("b", [2], "g")], 0.0)
    assert oversized.take() == [entry("a", [1], "abcdef")]
    assert oversized.take() == [entry("b", [2], "g")]


def test_what_is_left_after_a_capped_frame_is_held_on_its_own_merits() -> None:
    policy = FlushPolicy(FlushConfig(window_s=1.0, max_bytes_hint=2))
    policy.add([entry("a", [1], "xx", "stop"), entry("b", [2], "y")], 0.0)
    assert policy.decide(0.0, in_flight=True) == WaitForWrite()
    assert policy.decide(0.1, in_flight=False) == FlushNow()
    assert policy.take() == [entry("a", [1], "xx", "stop")]
    assert policy.decide(0.1, in_flight=True) == WaitForWrite()
    # b neither finishes nor fills a frame: it waits out its own window.
    assert policy.decide(0.2, in_flight=False) == WaitUntil(1.0)
    assert policy.decide(1.0, in_flight=False) == FlushNow()


def test_without_coalescing_every_step_is_its_own_frame() -> None:
    policy = FlushPolicy(FlushConfig(coalesce=False, window_s=1.0))
    steps = [[entry("a", [1], "x"), entry("b", [2], "y")], [entry("a", [3], "z")]]
    for step in steps:
        policy.add(step, 0.0)
    assert policy.decide(0.0, in_flight=True) == WaitForWrite()
    assert policy.decide(0.0, in_flight=False) == FlushNow()
    assert policy.take() == steps[0]
    assert policy.decide(0.0, in_flight=False) == FlushNow()
    assert policy.take() == steps[1]


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        FlushConfig(window_s=-1.0)
    with pytest.raises(ValueError):
        FlushConfig(max_entries=0)
    with pytest.raises(ValueError):
        FlushConfig(max_bytes_hint=0)


# --- properties ------------------------------------------------------------------

configs = st.builds(
    FlushConfig,
    window_s=st.sampled_from([0.0, 0.0005, 0.002, 0.01]),
    max_entries=st.integers(1, 4) | st.just(64),
    max_bytes_hint=st.integers(1, 12) | st.just(1024),
    coalesce=st.booleans(),
)

step_items = st.lists(
    st.tuples(
        st.sampled_from(REQUESTS),
        st.lists(st.integers(0, 50_000), max_size=3),
        st.text(max_size=4),
        st.sampled_from([None] * 18 + ["stop", "length"]),
        st.none() | st.builds(Usage, st.integers(0, 99), st.integers(0, 99), st.integers(0, 99)),
    ),
    min_size=1,
    max_size=5,
)

operations = st.lists(
    st.one_of(
        st.tuples(st.just("step"), step_items, ticks),
        st.tuples(st.just("decide"), st.booleans(), ticks),
        st.tuples(st.just("take"), st.none(), ticks),
    ),
    max_size=40,
)


class Harness:
    """Drives a policy, records what goes in and out, and checks each decision."""

    def __init__(self, config: FlushConfig) -> None:
        self.config = config
        self.policy = FlushPolicy(config)
        self.now = 0.0
        self.finished: set[str] = set()
        self.inputs: list[list[Entry]] = []  # deep copies of what went in
        self.given: list[list[Entry]] = []  # the very lists handed to the policy
        self.frames: list[list[Entry]] = []
        self.first_pending: dict[str, float] = {}  # coalescing: one entry per request
        self.finishing_pending: set[str] = set()
        self.pending_steps: list[list[Entry]] = []  # not coalescing: whole steps
        self.told_in_flight = False

    def advance(self, ticks: int) -> None:
        self.now += ticks * 0.0001

    def add(self, items: list[tuple[Any, ...]]) -> bool:
        step = []
        for rid, ids, text, finish, usage in items:
            if rid in self.finished:
                continue  # the engine emits nothing for a finished request
            step.append(entry(rid, list(ids), text, finish, usage))
            if finish is not None:
                self.finished.add(rid)
        if not step:
            return False
        self.inputs.append(copy.deepcopy(step))
        self.given.append(step)
        self.policy.add(step, self.now)
        self.pending_steps.append(list(step))
        for e in step:
            self.first_pending.setdefault(e.request_id, self.now)
            if e.finish_reason is not None:
                self.finishing_pending.add(e.request_id)
        return True

    def decide(self, in_flight: bool) -> object:
        if in_flight and self.policy.has_pending:
            self.told_in_flight = True
        decision = self.policy.decide(self.now, in_flight=in_flight)
        if not self.policy.has_pending:
            assert decision == Idle()
            return decision
        assert decision != Idle()
        if in_flight:
            # (one frame at a time) nothing is sent while a frame is in flight
            assert decision == WaitForWrite()
            return decision
        if not self.config.coalesce or not self.told_in_flight:
            # (iii)/(v) a free link with nothing queued behind a frame sends at once
            assert decision == FlushNow()
        if self.finishing_pending:
            # (ii) a finishing request is never held once the link is free
            assert decision == FlushNow()
        stats = self.policy.statistics()
        if (
            stats.pending_entries >= self.config.max_entries
            or stats.pending_text_chars >= self.config.max_bytes_hint
        ):
            assert decision == FlushNow()  # a full frame is not held
        oldest = min(self.first_pending.values())
        if self.config.coalesce and self.now >= oldest + self.config.window_s:
            assert decision == FlushNow()
        if isinstance(decision, WaitUntil):
            # (iv) no entry waits past its window; and never a deadline already due
            assert self.now < decision.deadline <= oldest + self.config.window_s
        return decision

    def take(self) -> None:
        frame = self.policy.take()
        if not frame:
            assert not self.pending_steps
            return
        self.frames.append(frame)
        config = self.config
        # (vi) caps hold unless one entry alone is past the text cap
        assert len(frame) <= config.max_entries
        if len(frame) > 1:
            assert sum(len(e.text) for e in frame) <= config.max_bytes_hint
        if config.coalesce:
            rids = [e.request_id for e in frame]
            assert len(set(rids)) == len(rids)
            for rid in rids:
                del self.first_pending[rid]
                self.finishing_pending.discard(rid)
        else:
            # (v) a frame is (a prefix of) exactly one step
            head = self.pending_steps[0]
            assert frame == head[: len(frame)]
            del head[: len(frame)]
            if not head:
                self.pending_steps.pop(0)
        if not self.policy.has_pending:
            self.pending_steps.clear()
            self.first_pending.clear()
            self.finishing_pending.clear()
            self.told_in_flight = False

    def drain(self) -> None:
        while self.policy.has_pending:
            self.take()
        assert self.policy.take() == []

    def check_streams(self) -> None:
        """(i) every request's tokens, text, finish and usage come out intact."""
        expected = reassemble(self.inputs)
        assert reassemble(self.frames) == expected
        stats = self.policy.statistics()
        assert stats.pending_entries == 0 and stats.pending_text_chars == 0
        assert stats.entries_taken == sum(len(f) for f in self.frames)
        assert self.given == self.inputs  # the policy never mutates its inputs


def reassemble(frames: list[list[Entry]]) -> dict[str, tuple[list[int], str, Any, Any]]:
    streams: dict[str, tuple[list[int], str, Any, Any]] = {}
    for frame in frames:
        for e in frame:
            rid, ids, text, finish, usage = (
                e.request_id,
                e.token_ids,
                e.text,
                e.finish_reason,
                e.usage,
            )
            old_ids, old_text, old_finish, old_usage = streams.get(rid, ([], "", None, None))
            streams[rid] = (
                old_ids + list(ids),
                old_text + text,
                old_finish if finish is None else finish,
                old_usage if usage is None else usage,
            )
    return streams


@settings(max_examples=examples(400))
@given(config=configs, ops=operations)
def test_policy_preserves_streams_and_keeps_its_promises(
    config: FlushConfig, ops: list[tuple[str, Any, int]]
) -> None:
    harness = Harness(config)
    for kind, arg, ticks in ops:
        harness.advance(ticks)
        if kind == "step":
            if harness.add(arg):
                harness.decide(ticks % 2 == 0)
        elif kind == "decide":
            harness.decide(arg)
        else:
            harness.take()
    harness.drain()
    harness.check_streams()


class SimulatedSender:
    """A two-task sender: a collector feeds the policy while a writer writes."""

    def __init__(self, harness: Harness, write_s: float) -> None:
        self.harness = harness
        self.write_s = write_s  # how long every frame takes to write
        self.write_done_at: float | None = None

    def run_until(self, until: float) -> None:
        """Follow the policy's decisions until ``until``, when the next step arrives."""
        h = self.harness
        while True:
            if self.write_done_at is not None and self.write_done_at <= until:
                h.now = max(h.now, self.write_done_at)
                self.write_done_at = None
            decision = h.decide(self.write_done_at is not None)
            if isinstance(decision, FlushNow):
                h.take()
                self.write_done_at = h.now + self.write_s
            elif isinstance(decision, WaitUntil) and decision.deadline <= until:
                h.now = decision.deadline
            elif not (
                isinstance(decision, WaitForWrite)
                and self.write_done_at is not None
                and self.write_done_at <= until
            ):
                break
        h.now = max(h.now, until)


@settings(max_examples=examples(300))
@given(
    config=configs,
    write_ticks=st.integers(0, 30),
    steps=st.lists(st.tuples(step_items, ticks), max_size=30),
)
def test_a_simulated_sender_delivers_everything_by_itself(
    config: FlushConfig, write_ticks: int, steps: list[tuple[list[tuple[Any, ...]], int]]
) -> None:
    harness = Harness(config)
    sender = SimulatedSender(harness, write_ticks * 0.0001)
    for items, ticks in steps:
        sender.run_until(harness.now + ticks * 0.0001)
        harness.add(items)
    sender.run_until(harness.now + 1.0)
    assert not harness.policy.has_pending
    harness.check_streams()


@given(config=configs, steps=st.lists(step_items, min_size=1, max_size=10))
def test_on_a_link_that_is_always_free_nothing_ever_waits(
    config: FlushConfig, steps: list[list[tuple[Any, ...]]]
) -> None:
    harness = Harness(config)
    for items in steps:
        if harness.add(items):
            assert harness.decide(False) == FlushNow()
            while harness.policy.has_pending:
                assert harness.decide(False) == FlushNow()
                harness.take()
    harness.check_streams()
