"""One request, one nursery: the trio shell that carries out the request machine's commands.

Every decision of the request path (admission, prefill attempts and retries,
decode placement and its retries before the first token, migration, which
deadline applies, what cleanup owes, how the response ends) is the machine's:
``pdtrio.protocol.request_machine``, one (phase, event) table.  This shell
owns the nursery, the disconnect watcher and the I/O: it reports what happened
as events, does what the machine answers, and holds no request logic.

The instances are reached through the backend seam (``pdtrio.router.backend``);
placement is the router's (``pdtrio.router.core``); a failure's status is the
one table's (``pdtrio.protocol.errors``).

Deadlines: each wait (a prefill call, a decode placement and its stream, a wait
for a decode to connect) runs under the machine's earliest armed deadline; when
it passes, the shell reports which (``DeadlinePassed``).  A client that leaves,
one that stops reading, and the drain's cut cancel the nursery, and are
reported once it has unwound.  Cleanup (an abort on decode, a release on
prefill) is queued on the links, never awaited: it cannot hang.  Errors go to
the client after the nursery, with nothing left to cut them.

Capacity: decode reserves KV for prompt + budget when it accepts, so a request
whose room is not there waits, before any byte goes out, in the router's
bounded FIFO (``pdtrio.router.capacity``) after prefill, its KV leased on
prefill meanwhile (the machine's KV_LEASE deadline bounds the wait).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Literal, final

import attrs
import trio

from pdtrio.asgi import Receive, Send
from pdtrio.protocol import request_machine as rm
from pdtrio.protocol.egress import send_deadline
from pdtrio.protocol.errors import Reason, status_for_worker_failure
from pdtrio.protocol.kv_layout import KvLayout, blocks_needed
from pdtrio.protocol.lifecycle import State
from pdtrio.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    error_for,
)
from pdtrio.protocol.sse import StreamShaper
from pdtrio.protocol.wire import (
    DecodeStart,
    KvHandle,
    PrefillFailed,
    PrefillReply,
    PrefillRequest,
    RejectReason,
    TokenPrompt,
    Usage,
)
from pdtrio.router.backend import BackendLost, BackendUnreachable, DecodeRun
from pdtrio.router.capacity import QueueFull
from pdtrio.router.client_response import ClientResponse
from pdtrio.router.core import Instance, Router
from pdtrio.router.kv_leases import LEASES
from pdtrio.router.metrics import MIGRATION_REASONS, Outcome
from pdtrio.router.worker_link import (
    CUT_OFF_MESSAGE,
    WorkerLink,
    rejection_is_retryable,
    release_token,
)

log = logging.getLogger("pdtrio.router.pipeline")

# request ids: unique across router processes sharing workers (the random part),
# and no system call per request (uuid4 reads the OS's randomness every time)
_PROCESS_ID = secrets.token_hex(8)
_request_numbers = itertools.count()
_ENDPOINTS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
# decode must pull the KV this long before prefill's lease frees it
_LEASE_MARGIN_S = 1.0
# a stream's failure reasons that are its link's, not the worker's word on the request
_LINK_FAILURES = frozenset({"link_lost", "link_timeout"})
_OUTCOMES = {ending: Outcome[ending.name] for ending in rm.Ending}


@final
@attrs.frozen
class _RunDecode:
    """The shell's own wait after the machine heard the start is going out: the start,
    the answer and the stream, under a timer of the deadlines that hold from then on.

    Placing disarms the KV lease's deadline; had that timer fired meanwhile (the room
    came free as the lease ran out), the rest of the wait would be cut by a deadline
    no longer armed, so it runs under a timer of its own.
    """

    link: WorkerLink
    sent_at: float  # (perf_counter) when the start went out: the handoff's time counts from it


# what the shell waits on: the machine's commands that start a wait, and its own
_Wait = rm.SendPrefill | rm.PlaceDecode | rm.WaitForDecode | _RunDecode


class _ShellFailure(Exception):
    """A failure the shell found itself (reported to the machine as ``Failed``)."""

    def __init__(self, failure: rm.Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


@final
class RequestPipeline:
    def __init__(
        self,
        router: Router,
        request: ChatCompletionRequest | CompletionRequest,
        kind: Literal["chat", "completion"],
        receive: Receive,
        send: Send,
        hang_up: Callable[[], bool] = lambda: False,
    ) -> None:
        self.router = router
        self.request = request
        self.kind = kind
        self._receive = receive
        config = router.config.router
        self.machine = rm.RequestMachine(
            rm.Limits(
                request_timeout_s=config.request_timeout_s,
                prefill_timeout_s=config.prefill_timeout_s,
                migration_limit=config.migration_limit,
                decode_reconnect_wait_s=config.decode_reconnect_wait_s,
                lease_margin_s=_LEASE_MARGIN_S,
            ),
            streaming=request.stream,
            keep_tokens=config.migration_limit > 0,
        )
        self._ending_with_error = False  # the machine ended it: what is sent now is the error
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        self.request_id = f"{prefix}{_PROCESS_ID}{next(_request_numbers):x}"
        self.created = int(time.time())
        self.shaper: StreamShaper | None = None
        if request.stream:
            self.shaper = StreamShaper(
                kind=kind,
                request_id=self.request_id,
                model=request.model,
                created=self.created,
                include_usage=request.include_usage,
                continuous_usage_stats=request.continuous_usage_stats,
            )
        self.response = ClientResponse(
            request_id=self.request_id,
            kind=kind,
            model=request.model,
            created=self.created,
            shaper=self.shaper,
            send=send,
            hang_up=hang_up,
            draining=lambda: router.requests.draining,
        )
        # the instances the request is on (the machine names them; these are their links)
        self.prefill_instance: Instance | None = None
        self.decode_link: WorkerLink | None = None
        self._kv_access_token = ""  # the grant in prefill's KV handle, once it answered
        self._lease_holder: Instance | None = None  # the prefill instance holding our KV
        # the current leg: the id workers know it by (a continuation gets a new one, so
        # nothing left of an earlier one, a late release say, can touch it), its call, and
        # prefill's reply; the prompt's own token ids; every token id delivered (kept when
        # migration is on); of the current prompt ids, how many are output
        self._wire_id = self.request_id
        self._call: PrefillRequest | None = None
        self._reply: PrefillReply | None = None
        self._prompt_ids: tuple[int, ...] = ()
        self._generated: list[int] | None = [] if config.migration_limit > 0 else None
        self._leg_generated = 0
        self._prefill_started = 0.0
        self._queue_place_reserved = False  # holds a place in the router's decode queue
        self._error: OpenAIError | None = None  # what the client is told, after the nursery
        self._recorded = False
        # what /metrics and the access line say of it, recorded as it goes
        self.figures = router.metrics.figures(request.model)
        self._decoding = False  # counted in the router's active streams
        self._scope: trio.CancelScope | None = None
        self._timer: trio.CancelScope | None = None  # the current wait's deadline
        self._emits: list[rm.EmitFirstToken | rm.Finish] = []  # what _step writes

    # --- entry ------------------------------------------------------------------

    async def run(self) -> None:
        router = self.router
        queue_full = False
        if not router.requests.draining:
            try:
                # a place in the queue from now: a burst cannot all go to prefill (and run
                # it out of KV) before the queue fills; refused now, it costs nothing
                router.decode_queue.reserve()
                self._queue_place_reserved = True
            except QueueFull:
                queue_full = True
        wait = self._feed(rm.Arrived(draining=router.requests.draining, queue_full=queue_full))
        scope: trio.CancelScope | None = None
        try:
            if wait is not None:
                try:
                    async with trio.open_nursery() as nursery:
                        scope = self._scope = nursery.cancel_scope
                        router.requests.started(scope, self)
                        nursery.start_soon(
                            self.response.watch_disconnect, self._receive, scope.cancel
                        )
                        while wait is not None:
                            wait = await self._wait(wait)
                        scope.cancel()
                finally:
                    self._unreserve()
                    if self.machine.phase is not rm.Phase.DONE:
                        self._cut()
            await self._send_error()
        finally:
            if scope is not None:
                # only now: a drain waits for the error event to be out
                router.requests.ended(scope)

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
                self.machine.phase.name,
            )
            event = rm.Failed(_STRANDED, torn=self._torn())
        self._feed(event)
        if self.machine.phase is not rm.Phase.DONE:  # (cannot be: every cut ends it)
            self._feed(rm.ClientGone())

    def _torn(self) -> bool:
        return self.response.torn

    # --- the machine's commands -----------------------------------------------------

    def _feed(self, event: rm.Event) -> _Wait | None:
        """Report ``event``; do what the machine answers; return the wait it starts, if any.

        The machine ends its answer with at most one wait.  The client's first token and
        the response's end are written by :meth:`_step` (awaited) from ``_emits``.
        """
        wait: _Wait | None = None
        for command in self.machine.handle(event, trio.current_time()):
            kind = type(command)
            if kind is rm.WaitUntil:
                continue  # the machine's next_deadline bounds every wait
            if kind is rm.ReleasePrefill:
                self._release_prefill()
            elif kind is rm.AbortDecode:
                if self.decode_link is not None:
                    self.decode_link.abort(self._wire_id)
            elif kind is rm.Migrate:
                assert isinstance(command, rm.Migrate)
                self._migrate(command)
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

    async def _step(self, event: rm.Event) -> _Wait | None:
        """:meth:`_feed`, then write what it emitted to the client."""
        self._emits = []
        wait = self._feed(event)
        await self._write_emits()
        return wait

    async def _write_emits(self) -> None:
        emits = self._emits
        for command in emits:
            if type(command) is rm.Finish:
                await self.response.finish()
            else:
                assert isinstance(command, rm.EmitFirstToken)
                await self._emit_first_token(command.final)

    async def _wait(self, wait: _Wait) -> _Wait | None:
        """Carry out one wait under the machine's earliest deadline; the next wait, if any."""
        armed = self.machine.next_deadline()
        with trio.CancelScope(deadline=armed[0] if armed else float("inf")) as timer:
            self._timer = timer
            try:
                if type(wait) is rm.SendPrefill:
                    return await self._send_prefill(wait)
                if type(wait) is rm.PlaceDecode:
                    return await self._place_decode(wait)
                if type(wait) is _RunDecode:
                    return await self._run_decode(wait)
                assert isinstance(wait, rm.WaitForDecode)
                return await self._wait_for_decode_link(wait)
            except _ShellFailure as failure:
                return await self._step(rm.Failed(failure.failure, torn=self._torn()))
        assert timer.cancelled_caught
        armed = self.machine.next_deadline()
        if self.machine.phase is rm.Phase.DONE:
            return None  # it ended as the timer fired: what it owed is done
        if armed is None or armed[0] > trio.current_time():
            # a timer fired for a deadline that an event disarmed since, and cut a wait
            # that cannot resume: never a deadline's error, nor a drain's
            log.error(
                "request %s: a wait in phase %s was cut by a deadline no longer armed",
                self.request_id,
                self.machine.phase.name,
            )
            return await self._step(rm.Failed(_STRANDED, torn=self._torn()))
        return await self._step(rm.DeadlinePassed(armed[1], torn=self._torn()))

    async def _report(self, event: rm.Event) -> _Wait | None:
        """:meth:`_step` inside a wait: its timer follows the deadlines the event armed.

        Had the timer fired for a deadline the event disarms (an answer came as its
        deadline passed), what the event emits is written shielded from it: the
        answer is the machine's word, the expired timer's cancel is not.
        """
        timer = self._timer
        assert timer is not None  # (set by _wait)
        fired = timer.cancel_called
        self._emits = []
        wait = self._feed(event)
        armed = self.machine.next_deadline()
        timer.deadline = armed[0] if armed else float("inf")
        if fired and (armed is None or armed[0] > trio.current_time()):
            with trio.CancelScope(shield=True):  # the cut it fired for is no longer due
                await self._write_emits()
        else:
            await self._write_emits()
        return wait

    # --- prefill ------------------------------------------------------------------

    async def _send_prefill(self, command: rm.SendPrefill) -> _Wait | None:
        router = self.router
        instances = router.instances
        instance = instances.pick_prefill(self.request.model, trio.current_time(), command.exclude)
        if instance is None or instance.link is None:
            return await self._report(rm.PrefillUnavailable())
        if command.retry:
            router.metrics.retries.labels("prefill").inc()
        else:
            self._prefill_started = time.perf_counter()
        self.prefill_instance = instance
        await self._report(rm.PrefillSent(instance.instance_id))
        if self._call is None:
            self._call = self._first_call()
        call = self._call
        instance.prefill_started()
        try:
            # a cancelled call releases the request on prefill itself
            answer = await instance.link.prefill(call)
        except BackendUnreachable:
            return await self._report(rm.PrefillNotSent())  # it never saw it: another may
        except BackendLost as exc:
            # the worker drops a lost link's prefills: another instance may try
            instances.instance_failed(instance, trio.current_time())
            return await self._report(rm.PrefillLost(str(exc)))
        finally:
            instance.prefill_ended()
        if type(answer) is PrefillFailed:
            instances.prefill_failed(instance, answer, trio.current_time())
            failure = rm.WorkerFailure(
                answer.status, answer.error_type, answer.message, answer.param
            )
            return await self._report(rm.PrefillFailed(failure))
        assert type(answer) is PrefillReply
        instances.instance_served(instance)
        if answer.finish_reason is not None and answer.usage is None:
            raise _ShellFailure(_NO_COUNTS)
        if not command.continuation:  # the request's own prefill, not a migration's
            self.figures.prefill_s = time.perf_counter() - self._prefill_started
            self.figures.prompt_tokens = answer.prompt_tokens
            self._prompt_ids = answer.prompt_token_ids
            if self.shaper is not None:
                self.shaper.set_prompt_usage(answer.prompt_tokens, answer.cached_tokens)
        self._reply = answer
        handle = answer.kv_handle
        if handle is None:
            return await self._report(rm.Prefilled(None))
        self._kv_access_token = handle.access_token  # what a release must show
        self._lease_holder = instance
        instance.lease_taken()  # its link stays until this request ends
        await self._check_kv_source(handle, instance)
        ends_at = LEASES.ends_at(handle, trio.current_time())
        return await self._report(rm.Prefilled(ends_at))

    async def _check_kv_source(self, handle: KvHandle, instance: Instance) -> None:
        """Decode pulls only from where the prefill instance registered its KV port: a
        handle naming another address (or instance) is refused, never passed on.

        A restarted worker serves a new KV port: what its /pd/info says now (asked at
        the URL it registered, with the worker secret) is its registration then.
        """
        instances = self.router.instances
        if handle.instance_id == instance.instance_id and instances.kv_source_mismatch(
            handle, instance
        ):
            await self.router.links.refresh_transfer_endpoint(instance)
        if instances.kv_source_mismatch(handle, instance):
            log.error(
                "prefill instance %s handed out KV at %s:%d (as %r), not its registered %s:%d",
                instance.instance_id,
                handle.transfer_host,
                handle.transfer_port,
                handle.instance_id,
                *instance.transfer_endpoint,
            )
            raise _ShellFailure(
                rm.Failure(
                    Reason.BAD_KV_HANDLE,
                    f"prefill instance {instance.instance_id} named a KV source it is not "
                    "registered with",
                )
            )

    def _first_call(self) -> PrefillRequest:
        request = self.request
        return PrefillRequest(
            self._wire_id,
            request.prompt,
            request.sampling,
            request.max_tokens,
            release_token(self._wire_id),
        )

    def _release_prefill(self) -> None:
        instance = self.prefill_instance
        if instance is not None and instance.link is not None:
            instance.link.release(self._wire_id, self._kv_access_token)

    def _drop_lease(self) -> None:
        if self._lease_holder is not None:
            self._lease_holder.lease_returned()
            self._lease_holder = None

    def _migrate(self, command: rm.Migrate) -> None:
        """A new leg: the prompt's token ids and every token delivered become a new prompt;
        a prefill computes their KV (told how many are output already: they are spent
        from the same budget and replayed into the stop rules, never sent again)."""
        generated = self._generated
        reply = self._reply
        assert generated is not None and reply is not None
        self.figures.migrations.append(command.reason)
        self.router.metrics.migrations.labels(command.reason).inc()
        log.warning(
            "request %s: decode on %s lost after %d tokens (%s); continuing elsewhere",
            self.request_id,
            command.lost_on,
            len(generated),
            command.reason,
        )
        self._drop_lease()  # its KV was released (at decode's first token, or given up)
        self._wire_id = f"{self.request_id}-m{len(self.figures.migrations)}"
        self._leg_generated = len(generated)
        self._call = PrefillRequest(
            self._wire_id,
            TokenPrompt((*self._prompt_ids, *generated)),
            self.request.sampling,
            reply.token_budget,  # the whole budget: prefill spends the generated from it
            release_token(self._wire_id),
            generated_tokens=len(generated),
        )

    # --- decode -------------------------------------------------------------------

    def _not_on(self, tried: Mapping[str, Hashable]) -> frozenset[str]:
        return self.router.instances.still_on(tried)

    async def _wait_for_decode_link(self, command: rm.WaitForDecode) -> _Wait | None:
        """Until a decode not in the command's ``exclude`` is connected (the machine's
        RECONNECT deadline bounds it)."""
        reply = self._reply
        assert reply is not None
        layout = None if command.any_layout or reply.kv_handle is None else reply.kv_handle.layout
        tried = command.exclude
        instances = self.router.instances
        if not instances.decode_links(self._not_on(tried), layout):
            await instances.wait_for_decode_link(lambda: self._not_on(tried), layout)
        if not command.any_layout:
            log.warning("decode failed before its first token: trying another")
        return await self._report(rm.DecodeConnected())

    def _kv_tokens(self, reply: PrefillReply) -> int:
        """The KV a prefilled request needs on decode: its prompt and its whole budget."""
        return reply.prompt_tokens - self._leg_generated + reply.token_budget

    async def _place_decode(self, command: rm.PlaceDecode) -> _Wait | None:
        """Place the request on a decode with room (waiting for room if need be), start
        it there, and stream its tokens to the client."""
        reply = self._reply
        assert reply is not None and reply.kv_handle is not None
        handle = reply.kv_handle
        if command.retry:
            self.router.metrics.retries.labels("decode").inc()
        figures = self.figures
        waited_from = time.perf_counter()
        instance = await self._decode_with_room(reply, handle, command.exclude, command.last_reason)
        sent_at = time.perf_counter()
        figures.queued_s = (figures.queued_s or 0.0) + (sent_at - waited_from)
        link = instance.link
        assert link is not None and link.capacity is not None  # what decode_with_room picks
        # no checkpoint from the pick to the promise inside start: the room is ours
        self.decode_link = link
        await self._report(rm.DecodeStartSent(instance.instance_id, (link, link.connects)))
        return _RunDecode(link, sent_at)

    async def _run_decode(self, wait: _RunDecode) -> _Wait | None:
        """Start the request on the decode placed, and stream its tokens to the client."""
        reply = self._reply
        assert reply is not None and reply.kv_handle is not None
        handle = reply.kv_handle
        link, sent_at, figures = wait.link, wait.sent_at, self.figures
        assert link.capacity is not None  # (what decode_with_room picks)
        start = DecodeStart(
            request_id=self._wire_id,
            prompt_token_ids=reply.prompt_token_ids,
            first_token_id=reply.first_token_id,
            sampling=self.request.sampling,
            token_budget=reply.token_budget,
            tokens_generated=self._leg_generated + 1,
            cached_tokens=reply.cached_tokens,
            kv_handle=handle,
            generated_tokens=self._leg_generated,
        )
        try:
            stream = await link.start(
                start,
                blocks_needed(self._kv_tokens(reply), link.capacity.block_size),
                keep_token_ids=self._generated is not None,
            )
        except BackendUnreachable as exc:
            return await self._report(rm.DecodeNotSent(str(exc)))
        await self._report(rm.DecodeStartQueued())  # (prefill's token goes out now)
        while not (stream.accepted or stream.rejection or stream.failure):
            await stream.wait_update()
        if stream.accepted:
            figures.handoff_s = time.perf_counter() - sent_at
            if not self._decoding:
                self._decoding = True
                self.router.metrics.streams_active.inc()
            await self._report(rm.DecodeAccepted())
            return await self._stream_tokens(stream)
        if stream.failure is not None:
            reason = stream.failure_reason or "link_lost"
            return await self._report(rm.DecodeFailed(stream.failure, _migration_label(reason)))
        rejection = stream.rejection
        assert rejection is not None
        return await self._report(
            rm.DecodeRejected(
                rejection.message,
                retryable=rejection_is_retryable(rejection),
                # shutting down, or its pull failed: another; NO_ROOM: a fresh report
                exclude=rejection.reason != RejectReason.NO_ROOM,
                layout_mismatch=rejection.reason == RejectReason.LAYOUT_MISMATCH,
            )
        )

    async def _decode_with_room(
        self,
        reply: PrefillReply,
        handle: KvHandle,
        tried: Mapping[str, Hashable],
        last_reason: str,
    ) -> Instance:
        """A decode instance with room for the request (not one of ``tried``, unless it has
        reconnected since), waiting in FIFO order for one."""
        router = self.router
        instances = router.instances
        links = instances.decode_links(self._not_on(tried), handle.layout)
        if not links and await self._a_decode_connects(tried, handle.layout, handle):
            links = instances.decode_links(self._not_on(tried), handle.layout)
        num_tokens = self._kv_tokens(reply)
        unplaceable = instances.decode_unplaceable(
            links,
            self._not_on(tried),
            handle.layout,
            num_tokens,
            reply.prompt_tokens - self._leg_generated,
            reply.token_budget,
            last_reason,
        )
        if unplaceable is not None:
            raise _ShellFailure(rm.Failure(*unplaceable))

        def take() -> Instance | None:
            return instances.decode_with_room(
                num_tokens, trio.current_time(), self._not_on(tried), handle.layout
            )

        # the reserved place becomes a waiter's (no checkpoint until wait_for holds it)
        self._unreserve()
        instance = router.decode_queue.take_now(take)
        if instance is not None:
            return instance
        try:
            # the machine's KV_LEASE deadline bounds the wait
            return await router.decode_queue.wait_for(take)
        except QueueFull:
            raise _ShellFailure(rm.Failure(Reason.QUEUE_FULL, rm.QUEUE_FULL_MESSAGE)) from None

    async def _a_decode_connects(
        self, tried: Mapping[str, Hashable], layout: KvLayout, handle: KvHandle
    ) -> bool:
        """Whether a decode not in ``tried`` connects within ``decode_reconnect_wait_s``
        (and before the KV must be pulled)."""
        router = self.router
        within_s = LEASES.left_s(handle, trio.current_time()) - _LEASE_MARGIN_S
        wait_s = min(router.config.router.decode_reconnect_wait_s, within_s)
        if wait_s <= 0:
            return False
        with trio.move_on_after(wait_s):
            await router.instances.wait_for_decode_link(lambda: self._not_on(tried), layout)
            return True
        return False

    def _unreserve(self) -> None:
        if self._queue_place_reserved:
            self._queue_place_reserved = False
            self.router.decode_queue.unreserve()

    async def _stream_tokens(self, stream: DecodeRun) -> _Wait | None:
        """Deliver decode's tokens as they come; under load, spaced (adaptive egress).

        The spacing (``router.egress``, fed by the loop's load) holds a stream's
        next send until its last send plus the spacing, so the tokens that come
        meanwhile go out in one event.  A finish or a failure is never held.  The
        machine hears of the first batch and of the end, not of each token.
        """
        buffer = stream.buffer
        egress = self.router.egress
        machine = self.machine
        last_sent_at: float | None = None
        while True:
            spacing = egress.spacing_s
            held_until: float | None = None
            if spacing and not buffer.finished and stream.failure is None:
                deadline = send_deadline(last_sent_at, spacing, trio.current_time())
                if deadline is not None:
                    await stream.hold_until(deadline, self.router.hold_timer)
                    held_until = deadline
            # read before the take: every token pushed before a failure goes out first
            failure = stream.failure
            delta = buffer.take()
            if delta is not None:
                final = delta.finish_reason is not None
                if final and delta.usage is None:
                    raise _ShellFailure(_NO_COUNTS)
                if delta.num_tokens and machine.lifecycle.state is State.DECODE_CONFIRMING:
                    await self._report(rm.DecodeTokens())  # prefill may free the KV now
                await self._deliver(
                    delta.text, delta.num_tokens, delta.finish_reason, delta.usage, final=final
                )
                if final:
                    decode = self._decode_instance()
                    if decode is not None:
                        self.router.instances.instance_served(decode)
                    return await self._report(rm.DecodeTokens(final=True))
                if spacing:
                    # spaced from the schedule, not from when the send returned: the
                    # send's own time and a late wake-up would add to every gap
                    last_sent_at = held_until if held_until is not None else trio.current_time()
            if failure is not None:
                return await self._decode_failed(stream, failure)
            await stream.wait_update()

    async def _decode_failed(self, stream: DecodeRun, failure: str) -> _Wait | None:
        """Decode holds nothing of it any more: it failed there, or the link aborted it."""
        if stream.cut_off:
            return await self._report(rm.DecodeFailed(CUT_OFF_MESSAGE, cut_off=True))
        reason = stream.failure_reason
        decode = self._decode_instance()
        if decode is not None and reason not in _LINK_FAILURES:
            # a lost link is out of rotation until it reconnects: one loss fails all its
            # streams at once, and is not that many failures in a row
            self.router.instances.instance_failed(decode, trio.current_time())
        migratable = reason in MIGRATION_REASONS and stream.token_ids is not None
        if (
            migratable
            and self._generated is not None
            and self.machine.lifecycle.state is State.DECODING
        ):
            # every token it pushed went out: a continuation starts after them
            assert stream.token_ids is not None
            self._generated += stream.token_ids
            if self._decoding:  # until another decode accepts it
                self._decoding = False
                self.router.metrics.streams_active.dec()
        event = rm.DecodeFailed(failure, _migration_label(reason), migratable=migratable)
        return await self._report(event)

    def _decode_instance(self) -> Instance | None:
        """The decode instance the request runs on, if it is still known."""
        link = self.decode_link
        return None if link is None else self.router.instances.get(link.instance_id)

    # --- the client ---------------------------------------------------------------

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

    async def _emit_first_token(self, final: bool) -> None:
        """Prefill's token (``final``: the whole answer)."""
        reply = self._reply
        assert reply is not None
        if not final and self._generated is not None:
            self._generated.append(reply.first_token_id)
        await self._deliver(reply.first_text, 1, reply.finish_reason, reply.usage, final=final)

    async def _deliver(
        self,
        text: str,
        num_tokens: int,
        finish_reason: str | None,
        usage: Usage | None,
        *,
        final: bool = False,
    ) -> None:
        """Count a delta as delivered and hand it to the response."""
        self.router.tokens_delivered += num_tokens
        self.figures.delivered(num_tokens)
        await self.response.deliver(text, num_tokens, finish_reason, usage, final=final)

    def _error_of(self, failure: rm.AnyFailure) -> OpenAIError:
        """The error the client sees for the machine's failure (the one table's status)."""
        if isinstance(failure, rm.WorkerFailure):
            # a worker's 4xx is the client's own; another 5xx than 503: 502
            status = status_for_worker_failure(failure.status)
            return OpenAIError(
                failure.message, status=status, type=failure.error_type, param=failure.param
            )
        message = failure.message
        if failure.explain_no_prefill:
            message = self.router.instances.no_instance_reason(self.request.model)
        return error_for(failure.reason, message, param=failure.param)

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
        if self._decoding:
            self._decoding = False
            self.router.metrics.streams_active.dec()
        self._drop_lease()
        if self._recorded:
            return
        self._recorded = True
        status = None if end.failure is None else self._error_of(end.failure).status
        prefill = self.prefill_instance
        decode = self.decode_link
        figures = self.figures
        usage = self.response.usage
        if usage is not None:
            figures.completion_tokens = usage.completion_tokens
        self.router.metrics.request_ended(
            endpoint=_ENDPOINTS[self.kind],
            model=self.request.model,
            outcome=_OUTCOMES[end.ending],
            status=status,
            figures=figures,
            request_id=self.request_id,
            prefill="-" if prefill is None else prefill.instance_id,
            decode="-" if decode is None else decode.instance_id,
        )


_STRANDED = rm.Failure(Reason.INTERNAL, "the router lost track of the request")
_NO_COUNTS = rm.Failure(Reason.INTERNAL, "the engine finished the request without its token counts")


def _migration_label(reason: str) -> str:
    """A stream's failure reason as a MIGRATION_REASONS label."""
    return reason if reason in MIGRATION_REASONS else "decode_failed"
