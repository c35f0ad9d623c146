"""One request's view of its worker link: decode's answer, then merged token deltas.

The link's reader pushes into each request's :class:`DecodeStream` without waiting and
wakes its one waiter (the request's decode leg); n > 1 choices' streams share a waiter.
"""

from __future__ import annotations

from typing import final

import trio

from pdtrio.protocol.link.wire import DecodeRejected, TokenLogprob
from pdtrio.protocol.openai.tools import ToolCall
from pdtrio.protocol.tokens.stream_buffer import StreamBuffer
from pdtrio.router.request.hold_timer import HoldTimer
from pdtrio.router.request.token_path import wait_any_update
from pdtrio.router.stream_outcome import (
    ACCEPTED,
    UNANSWERED,
    DecodeLoss,
    StreamAccepted,
    StreamFailed,
    StreamOutcome,
    StreamRejected,
)


@final
class DecodeStream:
    """One request's view of the link: decode's answer, then merged token deltas.

    One task at a time waits on it (the request's pipeline); the link's
    reader calls :meth:`notify` after each change.
    """

    __slots__ = (
        "request_id",
        "buffer",
        "outcome",
        "token_ids",
        "logprobs",
        "tool_calls",
        "holding",
        "choices",
        "_holds",
        "updated",
        "_lot",
    )

    def __init__(self, request_id: str, max_pending_tokens: int) -> None:
        self.request_id = request_id
        self.buffer = StreamBuffer(max_pending_tokens=max_pending_tokens)
        self.outcome: StreamOutcome = UNANSWERED
        # every token id pushed, in order, when the router may migrate the request
        self.token_ids: list[int] | None = None
        # the request asked for logprobs: those decode sent ahead of their tokens, until the
        # consumer takes the tokens (the hot path never looks at them)
        self.logprobs: list[TokenLogprob] | None = None
        # (a worker's calls are in its text: the router reads them out of it)
        self.tool_calls: list[ToolCall] | None = None
        # its consumer is spacing its sends (adaptive egress): only a finish wakes it
        self.holding = False
        # n > 1: the stream of each choice decode runs (choice 0's, when it runs, is this
        # one); they share this one's waiter, and are the link's from decode's accept
        self.choices: dict[int, DecodeStream] | None = None
        self._holds = 0  # holds so far: tells the timer's stale wake-ups from the current one
        self.updated = False
        self._lot = trio.lowlevel.ParkingLot()

    def accept(self) -> None:
        """Decode accepted the start (no wake-up: the waiter learns it with the first
        tokens, one wake-up per request fewer)."""
        self.outcome = ACCEPTED

    def reject(self, rejection: DecodeRejected) -> None:
        self.outcome = StreamRejected(rejection)
        self.notify()

    def fail(self, message: str, loss: DecodeLoss) -> None:
        """End it (the first failure stands: what comes after it follows from it)."""
        outcome = self.outcome
        if not isinstance(outcome, StreamFailed):
            accepted = isinstance(outcome, StreamAccepted)
            self.outcome = StreamFailed(message, loss, accepted=accepted)
        self.notify()

    def notify(self) -> None:
        """Something new arrived: wake the waiter (never blocks)."""
        self.updated = True
        if self._lot:
            self._lot.unpark_all()

    async def wait_update(self) -> None:
        """Wait until something new arrived (tokens, an answer, a failure) since the last wait."""
        if self.updated:
            await trio.lowlevel.checkpoint()
        else:
            await self._lot.park()
        self.updated = False

    async def wait_choices_update(self) -> None:
        """:meth:`wait_update` for every choice's stream (n > 1): until any got something."""
        assert self.choices is not None
        await wait_any_update((self, *self.choices.values()), self._lot)

    def add_choice(self, choice: int, stream: DecodeStream) -> None:
        """Make ``stream`` choice ``choice``'s, woken as this one's waiter."""
        assert self.choices is not None
        stream._lot = self._lot
        self.choices[choice] = stream

    async def hold_until(self, deadline: float, timer: HoldTimer) -> None:
        """Wait until about ``deadline`` (``timer`` wakes it); a finish or failure ends it early.

        The caller checked that neither is in already.  Tokens do not wake a
        holding stream, so spacing its sends also spares the wake-ups.
        """
        self.holding = True
        self.updated = False
        self._holds += 1
        timer.add(deadline, self, self._holds)
        try:
            await self._lot.park()
        finally:
            self.holding = False

    def end_hold(self, hold: int) -> None:
        """The timer's wake-up for hold number ``hold`` (a stale one does nothing)."""
        if self.holding and hold == self._holds and self._lot:
            self._lot.unpark_all()
