"""The token path every backend's decode leg shares: from a decode run to the client.

A run's tokens are merged in its :class:`~pdtrio.protocol.tokens.stream_buffer.StreamBuffer`
by whoever reads the instance (a worker link, an engine's HTTP stream);
:func:`stream_tokens` (and :func:`stream_choices` for ``n`` > 1) hands them to the
shell's ``deliver``, spaced under load by the egress policy, whose holds the router's
one :class:`HoldTimer` ends.  The machine hears of the first batch and of the end.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

import trio

from pdtrio.protocol import request as rm
from pdtrio.protocol.errors import Reason
from pdtrio.protocol.link.wire import TokenLogprob
from pdtrio.protocol.openai.answers import AnswerDelta
from pdtrio.protocol.openai.tools import ToolCall
from pdtrio.protocol.tokens.egress import send_deadline
from pdtrio.protocol.tokens.stream_buffer import PendingDelta
from pdtrio.router.backend import ChoiceRuns, DecodeRun, LegHost, ShellFailure, Wait
from pdtrio.router.stream_outcome import StreamFailed

log = logging.getLogger("pdtrio.router.pipeline")

NO_COUNTS = rm.Failure(Reason.INTERNAL, "the engine finished the request without its token counts")


async def stream_tokens(
    host: LegHost,
    stream: DecodeRun,
    served: Callable[[], None],
    failed: Callable[[DecodeRun, StreamFailed], Awaitable[Wait | None]],
) -> Wait | None:
    """Deliver decode's tokens as they come; under load, spaced (adaptive egress).

    The spacing (``router.egress``, fed by the loop's load) holds a stream's
    next send until its last send plus the spacing, so the tokens that come
    meanwhile go out in one event.  A finish or a failure is never held.  The
    machine hears of the first batch and of the end, not of each token.
    ``served``: the stream finished well (its instance served it); ``failed``:
    it failed (what to report), every token pushed before the failure out first.
    """
    router = host.router
    buffer = stream.buffer
    egress = router.egress
    last_sent_at: float | None = None
    while True:
        spacing = egress.spacing_s
        held_until: float | None = None
        if spacing and not buffer.finished and not isinstance(stream.outcome, StreamFailed):
            deadline = send_deadline(last_sent_at, spacing, router.now())
            if deadline is not None:
                await stream.hold_until(deadline, router.hold_timer)
                held_until = deadline
        # read before the take: every token pushed before a failure goes out first
        outcome = stream.outcome
        delta = buffer.take()
        if delta is not None:
            final = delta.finish_reason is not None
            await _deliver(host, stream, delta, final=final)
            if final:
                served()
                return await host.report(rm.DecodeTokens(final=True))
            if spacing:
                # spaced from the schedule, not from when the send returned: the
                # send's own time and a late wake-up would add to every gap
                last_sent_at = held_until if held_until is not None else router.now()
        if isinstance(outcome, StreamFailed):
            return await failed(stream, outcome)
        await stream.wait_update()


async def stream_choices(
    host: LegHost,
    stream: ChoiceRuns,
    served: Callable[[], None],
    failed: Callable[[DecodeRun, StreamFailed], Awaitable[Wait | None]],
    *,
    retry_alone: Callable[[int, StreamFailed], bool] | None = None,
) -> Wait | None:
    """:func:`stream_tokens` for a request with ``n`` > 1: each choice's deltas as they
    come, with its index; the response ends with the last choice's finish.  No egress
    spacing (a choice's stream is not a client's): every wake-up sends what came.
    A failure of any choice is the request's (``failed``: the machine aborts the rest),
    but for one of a choice none of whose tokens went out, once other choices' had (the
    request cannot go again whole), that ``retry_alone`` started again (True).
    """
    assert stream.choices is not None
    running = dict(sorted(stream.choices.items()))
    machine = host.machine
    started: set[int] = set()  # the choices some delta of went out
    while True:
        for choice, run in list(running.items()):
            # read before the take: every token pushed before a failure goes out first
            outcome = run.outcome
            delta = run.buffer.take()
            if delta is not None:
                started.add(choice)
                finished = delta.finish_reason is not None
                if finished:
                    del running[choice]
                await _deliver(host, run, delta, final=finished and not running, choice=choice)
                if finished and not running:
                    served()
                    return await host.report(rm.DecodeTokens(final=True))
            if isinstance(outcome, StreamFailed) and choice in running:
                if (
                    retry_alone is not None
                    and choice not in started
                    and machine.decode_confirmed
                    and retry_alone(choice, outcome)
                ):
                    continue
                return await failed(run, outcome)
        await stream.wait_choices_update()


async def _deliver(
    host: LegHost, run: DecodeRun, taken: PendingDelta, *, final: bool, choice: int = 0
) -> None:
    """Hand ``taken`` (from ``run``'s buffer) to the client, with its tokens' logprobs
    and the calls the engine read out of it; the machine hears of decode's first tokens."""
    if taken.finish_reason is not None and taken.usage is None:
        raise ShellFailure(NO_COUNTS)
    if taken.num_tokens and host.machine.decode_unconfirmed:
        await host.report(rm.DecodeTokens())  # prefill may free the KV now
    logprobs = None
    if run.logprobs is not None:
        logprobs = _logprobs_of(run.logprobs, taken.num_tokens, host)
    await host.deliver(
        AnswerDelta(
            taken.text,
            taken.num_tokens,
            taken.finish_reason,
            taken.usage,
            final=final,
            logprobs=logprobs,
            choice=choice,
            tool_calls=_tool_calls_of(run),
        )
    )


def _tool_calls_of(run: DecodeRun) -> list[ToolCall]:
    """The calls an engine sent with (or before) the delta just taken from ``run``."""
    pending = run.tool_calls
    if not pending:
        return []
    taken = pending[:]
    pending.clear()
    return taken


def _logprobs_of(pending: list[TokenLogprob], num_tokens: int, host: LegHost) -> list[TokenLogprob]:
    """The logprobs of a delta's ``num_tokens`` tokens, taken from those decode sent
    ahead of them (a worker from before logprobs, or an engine, may send none: the delta
    has fewer; logged once per request, not per delta)."""
    taken = pending[:num_tokens]
    del pending[:num_tokens]
    if len(taken) < num_tokens and not host.logprobs_shortfall_logged:
        host.logprobs_shortfall_logged = True
        log.warning(
            "request %s: decode sent logprobs for %d of %d tokens (said once per request)",
            host.request_id,
            len(taken),
            num_tokens,
        )
    return taken


class Updated(Protocol):
    """A stream its reader marks when something new arrived."""

    updated: bool


async def wait_any_update(streams: Iterable[Updated], lot: trio.lowlevel.ParkingLot) -> None:
    """Until any of ``streams`` (a request's choices, sharing ``lot``) got something new;
    marks them all seen."""
    streams = tuple(streams)
    if any(stream.updated for stream in streams):
        await trio.lowlevel.checkpoint()
    else:
        await lot.park()
    for stream in streams:
        stream.updated = False
