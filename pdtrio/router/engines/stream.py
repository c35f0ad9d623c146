"""An engine leg's stream as the shared token path reads it (``DecodeRun``), and a
request's choices' streams woken together (``n`` > 1).

Tools: the legs carry the client's ``tools`` and ``tool_choice``, and the engine
renders them with its chat template.  The calls its tool parser read out of the answer
(``delta.tool_calls``: vLLM's ``--enable-auto-tool-choice --tool-call-parser ...``,
SGLang's ``--tool-call-parser``) reach the client as whole OpenAI calls; an engine with
no parser answers text, whose ``<tool_call>`` blocks the router reads out as it does
on its own workers (``pdtrio.protocol.openai.tools``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, final

import attrs
import trio

from pdtrio.protocol import request as rm
from pdtrio.protocol.link.wire import TokenLogprob, Usage
from pdtrio.protocol.openai.tools import ToolCall
from pdtrio.protocol.tokens.stream_buffer import PushResult, StreamBuffer
from pdtrio.router.engines.pool import EngineInstance
from pdtrio.router.request.token_path import wait_any_update
from pdtrio.router.stream_outcome import (
    ACCEPTED,
    CUT_OFF_MESSAGE,
    DecodeLoss,
    StreamFailed,
    StreamOutcome,
)

if TYPE_CHECKING:
    from pdtrio.router.request.hold_timer import HoldTimer

log = logging.getLogger("pdtrio.router.engines")


@final
class EngineStream:
    """A leg's stream as the shared token path reads it (:class:`DecodeRun`).

    The reader waits for each push to be taken while the client keeps up, so
    every engine event goes out as its own; while the consumer holds its sends
    (adaptive egress) pushes merge, up to ``max_pending_tokens``, past which the
    client is too far behind and the stream is cut off, as a worker link does.
    """

    def __init__(self, max_pending_tokens: int, *, with_logprobs: bool = False) -> None:
        self.buffer = StreamBuffer(max_pending_tokens=max_pending_tokens)
        self.outcome: StreamOutcome = ACCEPTED  # (it exists once decode answered 200)
        self.token_ids: list[int] | None = None  # (an engine's request never migrates)
        # the request asked for logprobs: those of tokens pushed and not yet delivered
        self.logprobs: list[TokenLogprob] | None = [] if with_logprobs else None
        # the calls the engine read out of its answer, pushed and not yet delivered
        self.tool_calls: list[ToolCall] | None = []
        self.holding = False
        self.updated = False
        self._lot = trio.lowlevel.ParkingLot()  # (shared by a request's choices)
        self._taken = trio.Event()  # the consumer came back for more

    def _notify(self) -> None:
        self.updated = True
        self._lot.unpark_all()

    def fail(self, message: str, loss: DecodeLoss = DecodeLoss.DECODE_FAILED) -> None:
        """End the stream with ``message`` (a later failure's replaces an earlier one's,
        but a cut-off stays one)."""
        before = self.outcome
        if isinstance(before, StreamFailed):
            if before.cut_off:
                # its consumer ends it as cut off, whatever came after
                loss, message = before.loss, before.message
            elif before.loss is DecodeLoss.NOT_DECODES_FAULT and loss is DecodeLoss.DECODE_FAILED:
                # decode's failure after another part failed its choice (it waited for KV
                # that never came) follows from that one: decode is not blamed
                loss = before.loss
        self.outcome = StreamFailed(message, loss)
        self._notify()

    def restart(self) -> None:
        """Its choice starts again alone (nothing of it went out): no failure now."""
        self.outcome = ACCEPTED

    async def push(
        self,
        text: str,
        num_tokens: int,
        finish_reason: str | None,
        usage: Usage | None,
        logprobs: Sequence[TokenLogprob] | None = None,
        *,
        tool_calls: Sequence[ToolCall] = (),
    ) -> bool:
        """Hand a delta to the consumer (``logprobs``: its tokens', when asked for;
        ``tool_calls``: the calls it completed); False once the stream is cut off."""
        # (before the tokens: the consumer takes them together)
        if logprobs and self.logprobs is not None:
            self.logprobs += logprobs
        if tool_calls and self.tool_calls is not None:
            self.tool_calls += tool_calls
        if self.buffer.push(text, num_tokens, finish_reason, usage) is PushResult.OVERFLOW:
            self.fail(CUT_OFF_MESSAGE, DecodeLoss.CUT_OFF)
            return False
        self._notify()
        while self.buffer.has_pending and not self.holding and finish_reason is None:
            self._taken = trio.Event()
            await self._taken.wait()
        return True

    async def wait_update(self) -> None:
        self._taken.set()
        if self.updated:
            await trio.lowlevel.checkpoint()
        else:
            await self._lot.park()
        self.updated = False

    async def hold_until(self, deadline: float, timer: HoldTimer) -> None:
        """Until ``deadline`` (a cancel scope's: the router's hold timer is the worker
        links'), or a finish or a failure."""
        self.holding = True
        self._taken.set()
        try:
            with trio.move_on_at(deadline):
                while not self.buffer.finished and not isinstance(self.outcome, StreamFailed):
                    await self._lot.park()
        finally:
            self.holding = False


@final
class EngineChoices:
    """A request's choices on decode (``n`` > 1) as :func:`stream_choices` reads them:
    each choice's stream, all woken through one waiter."""

    def __init__(self, streams: Sequence[EngineStream]) -> None:
        self.choices: dict[int, EngineStream] = dict(enumerate(streams))
        self._lot = trio.lowlevel.ParkingLot()
        for stream in streams:
            stream._lot = self._lot

    async def wait_choices_update(self) -> None:
        streams = self.choices.values()
        for stream in streams:
            stream._taken.set()  # the consumer came back for more: every reader goes on
        await wait_any_update(streams, self._lot)


@final
@attrs.define(eq=False)
class ChoiceLeg:
    """One choice of the request on decode: its stream, the decode it runs on, and (SGLang)
    its prefill call's body (its room's) and instance."""

    choice: int
    body: dict[str, Any]
    stream: EngineStream
    decode: EngineInstance
    request_id: str
    prefill_body: dict[str, Any] | None = None
    prefill: EngineInstance | None = None
    decoded: bool = False  # decode produced a token of it (it has its KV)
    # its decode leg and (SGLang) its prefill call: closed when it is started again alone
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    prefill_scope: trio.CancelScope = attrs.Factory(trio.CancelScope)


@final
class LegAnswers:
    """A decode run's legs' answers: all in once every leg answered 200, or once one did
    not (``refusal``: what the machine hears)."""

    __slots__ = ("_waiting", "all_in", "refusal")

    def __init__(self, legs: int) -> None:
        self._waiting = legs
        self.all_in = trio.Event()
        self.refusal: rm.DecodeRejected | rm.DecodeFailed | None = None

    def accepted(self) -> None:
        self._waiting -= 1
        if not self._waiting:
            self.all_in.set()

    def refused(self, event: rm.DecodeRejected | rm.DecodeFailed) -> None:
        if self.refusal is None and not self.all_in.is_set():
            self.refusal = event
            self.all_in.set()
