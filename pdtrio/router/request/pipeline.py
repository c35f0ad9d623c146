"""One request, one nursery: the trio shell that carries out the request machine's commands.

Every decision of the request path (admission, prefill attempts and retries,
decode placement and its retries before the first token, migration, which
deadline applies, what cleanup owes, how the response ends) is the machine's:
``pdtrio.protocol.request.machine``, one (phase, event) table.  This shell
owns the nursery, the disconnect watcher and the I/O: it reports what happened
as events, does what the machine answers, and holds no request logic.

The commands that reach an instance are carried out by the request's legs, which
the router's one backend makes (``pdtrio.router.backend.Backend.legs_for``: pdtrio's
workers, ``pdtrio.router.workers``; vLLM or SGLang, ``pdtrio.router.engines``); the
shell knows them only as :class:`~pdtrio.router.backend.PrefillSide` and
:class:`~pdtrio.router.backend.DecodeSide`.  A failure's status is the one table's
(``pdtrio.protocol.errors``).

Deadlines: each wait (a prefill call, a decode placement and its stream, a wait
for a decode to connect) runs under the machine's earliest armed deadline; when
it passes, the shell reports which (``DeadlinePassed``).  A client that leaves,
one that stops reading, and the drain's cut cancel the nursery (its path, and
every task it started), and are reported once it has unwound.  The watch for a
client leaving is a task in the request's nursery, started once the request has
run ``CLIENT_WATCH_AFTER_S`` (the router's watch sweep says when:
``pdtrio.router.request.running_requests``); a short answer ends before, without
one.  Cleanup (an abort on decode, a release on prefill) is queued on the links,
never awaited: it cannot hang.  Errors go to the client after the nursery, with
nothing left to cut them.

Capacity: decode reserves KV for prompt + budget when it accepts, so a request
whose room is not there waits, before any byte goes out, in the router's
bounded FIFO (``pdtrio.router.request.capacity``) after prefill, its KV leased on
prefill meanwhile (the machine's KV_LEASE deadline bounds the wait).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from types import MappingProxyType
from typing import TYPE_CHECKING, final

import trio

from pdtrio.asgi import Receive, Send
from pdtrio.protocol import request as rm
from pdtrio.protocol.errors import Reason, status_for_worker_failure
from pdtrio.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    error_for,
)
from pdtrio.protocol.openai.answers import AnswerDelta, AnswerKind, AnyRequest, Shaper, answer_shape
from pdtrio.router.backend import (
    DecodeSide,
    MakeLegs,
    PrefillSide,
    RunDecode,
    ShellFailure,
    Wait,
    continues,
)
from pdtrio.router.core import Router
from pdtrio.router.metrics import Outcome
from pdtrio.router.request.client_response import ClientResponse
from pdtrio.tracing import request_trace

if TYPE_CHECKING:
    from pdtrio.tracing import RequestTrace

log = logging.getLogger("pdtrio.router.pipeline")

_OUTCOMES = MappingProxyType({ending: Outcome[ending.name] for ending in rm.Ending})
_STRANDED = rm.Failure(Reason.INTERNAL, "the router lost track of the request")


@final
class RequestPipeline:
    def __init__(
        self,
        router: Router,
        request: AnyRequest,
        kind: AnswerKind,
        receive: Receive,
        send: Send,
        make_legs: MakeLegs,
        hang_up: Callable[[], bool] = lambda: False,
        *,
        incoming_traceparent: str = "",
        key_id: str = "",
    ) -> None:
        self.router = router
        self._now = router.now
        # how the answer is named and shaped; what the instances run (a chat request
        # for /v1/responses)
        self.shape = shape = answer_shape(kind, request)
        self.request = request = shape.run
        self.kind = kind
        self.endpoint = shape.endpoint
        self._receive = receive
        config = router.config.router
        self.request_id = router.new_request_id(shape.id_prefix)
        # its spans (None: tracing is off); what its legs carry on as their spans' parent
        self.trace = self._start_trace(incoming_traceparent, key_id)
        # what /metrics and the access line say of it, recorded as it goes
        self.figures = router.metrics.figures(request.model)
        # the request on the instances: its prefill calls and its decode run
        self.prefill: PrefillSide
        self.decode: DecodeSide
        # a stream that may migrate, or whose failed handoff may go on from a new prefill,
        # keeps its tokens (n > 1 does neither: a continuation would have to replay every
        # choice's history)
        migrates = continues(config) and request.sampling.n == 1
        self.prefill, self.decode, first_token_from_prefill = make_legs(self)
        self.machine = rm.RequestMachine(
            router.request_limits,
            streaming=request.stream,
            keep_tokens=migrates and first_token_from_prefill,
            first_token_from_prefill=first_token_from_prefill,
        )
        self._ending_with_error = False  # the machine ended it: what is sent now is the error
        self.logprobs_shortfall_logged = False  # (LegHost's)
        self.created = int(time.time())
        self.shaper: Shaper | None = None
        # the alternatives each token's logprob comes with; None: no logprobs asked
        top_logprobs = request.sampling.logprobs if request.sampling.wants_logprobs else None
        if request.stream:
            self.shaper = shape.stream_shaper(self.request_id, self.created, top_logprobs)
        self.response = ClientResponse(
            request_id=self.request_id,
            kind=kind,
            model=request.model,
            created=self.created,
            shaper=self.shaper,
            body_of=shape.own_body,
            send=send,
            hang_up=hang_up,
            draining=lambda: router.requests.draining,
            top_logprobs=top_logprobs,
            tool_names=_tool_names(request),
            choices=request.sampling.n,
        )
        self._error: OpenAIError | None = None  # what the client is told, after the nursery
        self._recorded = False
        self._scope: trio.CancelScope | None = None  # the nursery's
        # the request's nursery while its path runs (its client's watch starts in it)
        self._nursery: trio.Nursery | None = None
        self._watching = False
        self._timer: trio.CancelScope | None = None  # the waits' deadline
        # the timer's deadline, as set (read here: the scope's property is a call)
        self._timer_deadline = math.inf
        self._emits: list[rm.EmitFirstToken | rm.Finish] = []  # what report writes

    # --- entry ------------------------------------------------------------------

    async def run(self) -> None:
        router = self.router
        queue_full = False
        if not router.requests.draining:
            queue_full = not self.decode.reserve_place()
        now = self._now()
        wait = self._feed(rm.Arrived(draining=router.requests.draining, queue_full=queue_full), now)
        scope: trio.CancelScope | None = None
        try:
            if wait is not None:
                try:
                    async with trio.open_nursery() as nursery:
                        scope = self._scope = nursery.cancel_scope
                        # (its client is watched once it has run a while: watch_client)
                        self._nursery = nursery
                        try:
                            router.requests.started(scope, self, now)
                            while wait is not None:
                                wait = await self._wait(wait)
                        finally:
                            self._nursery = None  # (closed to new tasks once this is done)
                            if self._watching:
                                scope.cancel()  # the watch: the path it watched is over
                finally:
                    self.decode.unreserve()
                    if not self.machine.done:
                        self._cut()
            await self._send_error()
        finally:
            if scope is not None:
                # only now: a drain waits for the error event to be out
                router.requests.ended(scope)
            # the legs hold this shell (their host), a cycle: broken here, the request's
            # objects go with its last reference, not at a garbage collection (each one
            # alive until then is traversed, and promoted, by the collections it meets)
            del self.prefill, self.decode

    @property
    def prefill_traceparent(self) -> str:
        trace = self.trace
        return "" if trace is None else trace.prefill_traceparent

    @property
    def decode_traceparent(self) -> str:
        trace = self.trace
        return "" if trace is None else trace.decode_traceparent

    def _start_trace(self, incoming_traceparent: str, key_id: str) -> RequestTrace | None:
        """The request's spans, under the client's trace if it sent one; None: tracing
        is off."""
        tracing = self.router.tracing
        if tracing is None:
            return None
        return request_trace(
            tracing,
            incoming_traceparent,
            request_id=self.request_id,
            model=self.request.model,
            endpoint=self.endpoint,
            key_id=key_id,
        )

    def _cut(self) -> None:
        """The nursery was cut short (or raised): tell the machine by whom."""
        if self.response.client_gone:
            event: rm.Event = rm.ClientGone()
        elif self.response.client_stalled:
            event = rm.ClientStalled()
        elif self.router.requests.drain_over.is_set():
            event = rm.DrainCut(torn=self._torn())
        else:
            # no one else cuts a request: a bug of ours raised out of the nursery (logged
            # where it surfaces) or left the machine waiting on nothing (logged here)
            log.error(
                "request %s: its path ended in phase %s with nothing to wait on",
                self.request_id,
                self.machine.phase_name,
            )
            event = rm.Failed(_STRANDED, torn=self._torn())
        now = self._now()
        self._feed(event, now)
        if not self.machine.done:  # (cannot be: every cut ends it)
            self._feed(rm.ClientGone(), now)

    def _torn(self) -> bool:
        return self.response.torn

    # --- the machine's commands -----------------------------------------------------

    def _feed(self, event: rm.Event, now: float) -> Wait | None:
        """Report ``event`` (at ``now``); do what the machine answers; return the wait it
        starts, if any.

        The machine ends its answer with at most one wait.  The client's first token and
        the response's end are written by :meth:`_step` (awaited) from ``_emits``.
        """
        wait: Wait | None = None
        commands = self.machine.handle(event, now)
        trace = self.trace
        if trace is not None:
            trace.observe(event, commands)
        for command in commands:
            kind = type(command)
            if kind is rm.WaitUntil:
                continue  # the machine's next_deadline bounds every wait
            if kind is rm.ReleasePrefill:
                self.prefill.release()
            elif kind is rm.AbortDecode:
                self.decode.abort()
            elif kind is rm.Migrate:
                assert isinstance(command, rm.Migrate)
                self.prefill.migrate(command)
            elif kind is rm.EmitFirstToken or kind is rm.Finish:
                self._emits.append(command)  # type: ignore[arg-type]
            elif kind is rm.RespondWithError or kind is rm.StreamError:
                assert isinstance(command, rm.RespondWithError | rm.StreamError)
                self._ending_with_error = True
                self._error = self._error_of(command.failure)
            elif kind is rm.End:
                assert isinstance(command, rm.End)
                self._record_end(command)
            else:
                wait = command  # type: ignore[assignment]
        return wait

    async def _step(self, event: rm.Event) -> Wait | None:
        """:meth:`_feed`, then write what it emitted to the client."""
        self._emits.clear()
        wait = self._feed(event, self._now())
        if self._emits:
            await self._write_emits()
        return wait

    async def _write_emits(self) -> None:
        emits = self._emits
        for command in emits:
            if type(command) is rm.Finish:
                await self.response.finish()
            else:
                assert isinstance(command, rm.EmitFirstToken)
                await self.prefill.emit_first_token(command.final)

    async def _wait(self, wait: Wait) -> Wait | None:
        """Carry out waits, one after the next, under a timer of the machine's earliest
        deadline; the wait that follows one the timer cut, or that it fired beside, if any.

        One timer for the waits, not one each (a cancel scope is dear on the request
        path): it follows the deadlines as they change, and is new only after it fired
        (a cancelled scope stays cancelled).
        """
        machine = self.machine
        self._timer_deadline = machine.earliest_deadline_at
        with trio.CancelScope(deadline=self._timer_deadline) as timer:
            self._timer = timer
            while True:
                after: Wait | None
                try:
                    if type(wait) is rm.SendPrefill:
                        after = await self.prefill.send(wait)
                    elif type(wait) is rm.PlaceDecode:
                        after = await self.decode.place(wait)
                    elif type(wait) is RunDecode:
                        after = await self.decode.run(wait)
                    elif type(wait) is rm.WaitForPrefill:
                        after = await self.prefill.wait_for_instance(wait)
                    else:
                        assert isinstance(wait, rm.WaitForDecode)
                        after = await self.decode.wait_for_link(wait)
                except ShellFailure as failure:
                    after = await self._step(rm.Failed(failure.failure, torn=self._torn()))
                if after is None:
                    return None
                wait = after
                deadline = machine.earliest_deadline_at
                if self._timer_deadline != deadline:
                    timer.deadline = self._timer_deadline = deadline
                if timer.cancel_called:
                    return wait  # (it fired as the wait ended) the next, under a new timer
        assert timer.cancelled_caught
        armed = self.machine.next_deadline()
        if self.machine.done:
            return None  # it ended as the timer fired: what it owed is done
        if armed is None or armed[0] > self._now():
            # a timer fired for a deadline that an event disarmed since, and cut a wait
            # that cannot resume: never a deadline's error, nor a drain's
            log.error(
                "request %s: a wait in phase %s was cut by a deadline no longer armed",
                self.request_id,
                self.machine.phase_name,
            )
            return await self._step(rm.Failed(_STRANDED, torn=self._torn()))
        return await self._step(rm.DeadlinePassed(armed[1], torn=self._torn()))

    async def report(self, event: rm.Event) -> Wait | None:
        """:meth:`_step` inside a wait: its timer follows the deadlines the event armed.

        Had the timer fired for a deadline the event disarms (an answer came as its
        deadline passed), what the event emits is written shielded from it: the
        answer is the machine's word, the expired timer's cancel is not.
        """
        timer = self._timer
        assert timer is not None  # (set by _wait)
        emits = self._emits
        emits.clear()
        now = self._now()
        deadline_before = self._timer_deadline
        wait = self._feed(event, now)
        deadline = self.machine.earliest_deadline_at
        if deadline_before != deadline:  # (most events leave it: a set is dear)
            timer.deadline = self._timer_deadline = deadline
        if not emits:
            return wait  # (most events write nothing)
        # whether the timer had fired before the event: its deadline had passed (a fired
        # scope stays cancelled whatever its deadline is set to after)
        fired = deadline_before <= now or timer.cancel_called
        if fired and deadline > now:  # (none armed: inf)
            with trio.CancelScope(shield=True):  # the cut it fired for is no longer due
                await self._write_emits()
        else:
            await self._write_emits()
        return wait

    # --- the client ---------------------------------------------------------------

    def watch_client(self) -> None:
        """The router's watch sweep: from now on, a client that leaves cuts the request.

        The watch is a task in the request's nursery (a no-op once its path is over).
        """
        nursery = self._nursery
        if nursery is not None and not self._watching:
            self._watching = True
            nursery.start_soon(self._watch_client, name="watch_disconnect")

    async def _watch_client(self) -> None:
        scope = self._scope
        assert scope is not None
        try:
            await self.response.watch_disconnect(self._receive, scope.cancel)
        except Exception:
            # cut as if the client left: the request still ends as a cut one does (its
            # error said, what it owed done), not with a raise out of its handler
            log.exception("request %s: watching its client failed", self.request_id)
            scope.cancel()

    def hang_up_if_stalled(self, now: float, write_timeout: float, cut_grace: float) -> None:
        """The router's sweep: hang up on a client whose send has waited too long (see
        :meth:`ClientResponse.hang_up_if_stalled`); one the request had not given up on
        ends the request."""
        scope = self._scope
        # cut: the drain, the client, or the machine's deadline (the wait's timer) ended it
        timer = self._timer
        cut = (
            scope is None
            or scope.cancel_called
            or self._ending_with_error
            or (timer is not None and timer.cancel_called)
        )
        if self.response.hang_up_if_stalled(now, write_timeout, cut_grace, cut=cut):
            assert scope is not None
            scope.cancel()

    async def deliver(self, delta: AnswerDelta) -> None:
        """Count ``delta`` as delivered, and send it (or, not streaming, gather it)."""
        self.router.tokens_delivered += delta.num_tokens
        self.figures.delivered(delta.num_tokens)
        await self.response.deliver(delta)

    def _error_of(self, failure: rm.AnyFailure) -> OpenAIError:
        """The error the client sees for the machine's failure (the one table's status)."""
        if isinstance(failure, rm.WorkerFailure):
            # a worker's 4xx is the client's own; another 5xx than 503: 502
            status = status_for_worker_failure(failure.status)
            return OpenAIError(
                failure.message,
                status=status,
                type=failure.error_type,
                param=self.shape.client_param(failure.param),
            )
        message = failure.message
        if failure.explain_no_prefill:
            message = self.prefill.no_instance_reason()
        return error_for(failure.reason, message, param=self.shape.client_param(failure.param))

    async def _send_error(self) -> None:
        """The error the machine ended the request with, if any, as it can go out."""
        error = self._error
        if error is None:
            return
        self._error = None  # (its traceback would hold this frame: a cycle)
        await self.response.fail(error, headers_sent=self.machine.headers_sent)

    # --- the end ------------------------------------------------------------------

    def _record_end(self, end: rm.End) -> None:
        """Count the request, record its figures, write its access line (once, at its end)."""
        self.decode.stop_counting()
        self.prefill.drop_lease()
        if self._recorded:
            return
        self._recorded = True
        status = None if end.failure is None else self._error_of(end.failure).status
        prefill = self.prefill.instance_id
        decode = self.decode.instance_id
        figures = self.figures
        usage = self.response.usage
        if usage is not None:
            figures.completion_tokens = usage.completion_tokens
        self.router.metrics.request_ended(
            endpoint=self.endpoint,
            model=self.request.model,
            outcome=_OUTCOMES[end.ending],
            status=status,
            figures=figures,
            request_id=self.request_id,
            prefill="-" if prefill is None else prefill,
            decode="-" if decode is None else decode,
            trace_id="" if self.trace is None else self.trace.trace_id,
            sampled=self.trace is not None and self.trace.recording,
        )
        if self.trace is not None:
            self.trace.end(
                outcome=_OUTCOMES[end.ending].value,
                status=status,
                failure=end.failure,
                prompt_tokens=figures.prompt_tokens or 0,
                completion_tokens=figures.completion_tokens,
                prefill=prefill,
                decode=decode,
            )


def _tool_names(request: ChatCompletionRequest | CompletionRequest) -> list[str] | None:
    """The functions a chat request's answer may call (None: no tools shown, or
    ``tool_choice`` ``none``: a call-like block in the text stays text)."""
    tools = request.tools if isinstance(request, ChatCompletionRequest) else None
    if tools is None or not tools.shown:
        return None
    return [function.name for function in tools.functions]
