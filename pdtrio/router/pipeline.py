"""One request, one nursery: prefill call, KV handoff, decode stream, cleanup.

The nursery owns the disconnect watcher and the pipeline under one absolute
deadline.  Whatever ends the request (finish, error, client gone, deadline),
a shielded and time-bounded cleanup aborts it on decode and releases its KV
on prefill, so no block outlives it anywhere.

Capacity: decode reserves KV for prompt + budget when it accepts, and a
started request never loses its blocks (no eviction).  So a request whose
room is not there waits, before any byte goes out, in the router's bounded
FIFO (``pdtrio.router.capacity``) after prefill: prefill is what knows the
prompt length and the budget for text and chat prompts.  Its KV stays leased
on prefill meanwhile, so the wait is bounded by that lease (503 if it would
pass; no lease extension to get wrong) as well as by the request's deadline
(504).  Refusals come first: 400 for a request no decode can ever hold, 429
with Retry-After when the queue is full.  The first token goes out once the
start is sent; a NO_ROOM answer from decode (its report was stale) sends the
request back to wait.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any, Literal, final

import trio

from pdtrio.asgi import Message, Receive, Send, send_json
from pdtrio.engine.blocks import blocks_needed
from pdtrio.protocol.egress import send_deadline
from pdtrio.protocol.errors import Reason, status_for_worker_failure
from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.lifecycle import Cleanup, Event, RequestLifecycle, State
from pdtrio.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    chat_completion_body,
    completion_body,
    error_for,
    gateway_timeout,
    queue_full,
    server_error,
    service_unavailable,
)
from pdtrio.protocol.sse import StreamShaper
from pdtrio.protocol.wire import (
    DRAINING_ERROR_TYPE,
    DecodeStart,
    KvHandle,
    PrefillFailed,
    PrefillReply,
    PrefillRequest,
    RejectReason,
    TokenPrompt,
    Usage,
)
from pdtrio.router.capacity import QueueFull
from pdtrio.router.core import Instance, Router
from pdtrio.router.kv_leases import LEASES
from pdtrio.router.metrics import MIGRATION_REASONS, Outcome
from pdtrio.router.worker_link import (
    CUT_OFF_MESSAGE,
    DecodeStream,
    WorkerLink,
    WorkerLinkClosed,
    WorkerLinkLost,
    rejection_is_retryable,
    release_token,
)

log = logging.getLogger("pdtrio.router.pipeline")

Connection = tuple[WorkerLink, int]
"""A decode link and which of its connections (``WorkerLink.connects``) a request was on."""
Tried = dict[str, Connection]
"""Decode instances a request failed on, by name, and on which connection."""

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
# request ids: unique across router processes sharing workers (the random part),
# and no system call per request (uuid4 reads the OS's randomness every time)
_PROCESS_ID = secrets.token_hex(8)
_request_numbers = itertools.count()
_ENDPOINTS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
# prefill instances a request tries (one after another, on 5xx or a lost link)
_PREFILL_ATTEMPTS = 3
# decode must pull the KV this long before prefill's lease frees it
_LEASE_MARGIN_S = 1.0
# a stream's failure reasons that are its link's, not the worker's word on the request
_LINK_FAILURES = frozenset({"link_lost", "link_timeout"})
_STALLED_MESSAGE = "the client read nothing for too long; the router hung up"


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
        self._send_to_server = send
        # shuts the client's connection down (a client that stopped reading); True if done
        self._hang_up = hang_up
        self._sending = False  # a send to the server is under way
        self._sends = 0  # sends started: the router's stall check tells one from the next
        self._stall_mark: tuple[int, float] | None = None  # (send, when first seen under way)
        self._client_stalled = False  # a send waited past client_write_timeout_s
        self._gave_up_on_client = False  # a stuck send was given up: the client is hung up on
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
        self.headers_sent = False
        self.client_gone = False
        # the last body message is going out: a disconnect after it is hypercorn closing
        # the connection, not the client leaving
        self._response_complete = False
        self._writing = False  # a body write is under way (a cancelled one leaves the wire torn)
        # what cleanup must undo, and where
        self.lifecycle = RequestLifecycle()
        self.prefill_instance: Instance | None = None
        self.decode_link: WorkerLink | None = None
        self._decode_connection: Connection | None = None  # decode_link's, when it started
        self._kv_access_token = ""  # the grant in prefill's KV handle, once it answered
        self._lease_holder: Instance | None = None  # the prefill instance holding our KV
        self._first_token_sent = False  # prefill's token, sent once whatever decode runs it
        # migration: the id workers know the current attempt by (a continuation gets a new
        # one, so nothing left of an earlier attempt, a late release say, can touch it), the
        # prompt's own token ids, and every token id delivered (kept when migration is on)
        self._wire_id = self.request_id
        self._prompt_ids: tuple[int, ...] = ()
        self._generated: list[int] | None = [] if router.config.router.migration_limit > 0 else None
        self._leg_generated = 0  # of the current prefill's prompt ids, how many are output
        self._queue_place_reserved = False  # holds a place in the router's decode queue
        # non-streaming accumulation
        self._text_parts: list[str] = []
        self._finish_reason: str | None = None
        self._usage: Usage | None = None
        # what /metrics and the access line say of it, recorded as it goes
        self.figures = router.metrics.figures(request.model)
        self._decoding = False  # counted in the router's active streams
        # the request's nursery scope (once it runs), and what a client is told when its
        # deadline passes
        self._scope: trio.CancelScope | None = None
        self._timeout_message = ""

    # --- entry ------------------------------------------------------------------

    async def run(self) -> None:
        router = self.router
        config = router.config.router
        if router.draining:
            refusal = _shutting_down("the router is shutting down")
            self._ended(Outcome.REJECTED, refusal.status)
            await self._send_error(refusal)
            return
        deadline = trio.current_time() + config.request_timeout_s
        self._timeout_message = f"the request did not complete within {config.request_timeout_s:g}s"
        error: OpenAIError | None = None
        scope: trio.CancelScope | None = None
        ran_to_the_end = False
        try:
            try:
                async with trio.open_nursery() as nursery:
                    # the request's deadline is the nursery's (one cancel scope, not two):
                    # what cut the pipeline short is told apart below
                    scope = self._scope = nursery.cancel_scope
                    scope.deadline = deadline
                    router.request_started(scope, self)
                    nursery.start_soon(self._watch_disconnect, scope)
                    try:
                        await self._pipeline(deadline)
                    except OpenAIError as exc:
                        # its traceback holds this frame, and the frame the error: a cycle
                        # that would keep the request (a huge prompt) alive until a full GC
                        error = exc.with_traceback(None)
                    ran_to_the_end = True
                    scope.cancel()
            finally:
                self._cleanup()
            if self.client_gone:
                self._ended(Outcome.DISCONNECTED)
                return
            if error is None and not ran_to_the_end:
                if self._client_stalled:
                    error = OpenAIError(
                        _STALLED_MESSAGE, status=503, type="server_error", code="client_too_slow"
                    )
                elif not router.drain_over.is_set():
                    # no one else cancels the scope: its deadline (the request's or prefill's)
                    error = gateway_timeout(self._timeout_message)
                elif not self._response_complete:
                    # the drain deadline cut it (the router's cancel of our scope)
                    error = _shutting_down("the router is shutting down; the request was cut short")
            if error is not None:
                # after the headers the status stays 200: the error travels in the stream
                outcome = Outcome.FAILED if self.headers_sent else Outcome.REJECTED
                self._ended(outcome, error.status)
                await self._send_error(error)
            else:
                self._ended(Outcome.OK)
        finally:
            if scope is not None:
                # only now: a drain waits for the error event to be out
                router.request_ended(scope)

    def _ended(self, outcome: Outcome, status: int | None = None) -> None:
        """Count the request, record its figures, write its access line (once, at its end)."""
        prefill = self.prefill_instance
        decode = self.decode_link
        figures = self.figures
        if self._usage is not None:
            figures.completion_tokens = self._usage.completion_tokens
        self.router.metrics.request_ended(
            endpoint=_ENDPOINTS[self.kind],
            model=self.request.model,
            outcome=outcome,
            status=status,
            figures=figures,
            request_id=self.request_id,
            prefill="-" if prefill is None else prefill.name,
            decode="-" if decode is None else decode.instance_id,
        )

    async def _watch_disconnect(self, cancel_scope: trio.CancelScope) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                if not self._response_complete:
                    self.client_gone = True
                    cancel_scope.cancel()
                return

    async def _send(self, message: Message) -> None:
        """Send to the server, marked as under way (the hot path, _write, marks its own)."""
        self._sending = True
        self._sends += 1
        try:
            await self._send_to_server(message)
        finally:
            self._sending = False

    def check_write(self, now: float, write_timeout: float, cut_grace: float) -> None:
        """The router's periodic look for a send that waits on a client that stopped reading.

        hypercorn shields its socket writes from cancellation, so such a send
        would hold the request (and a server shutting down) for as long as the
        client's TCP stays up.  A send seen under way ``write_timeout`` ago, or
        ``cut_grace`` ago once the request was cut (deadline, drain, an error),
        is given up: the router hangs up on the client, the send fails and the
        request ends.  No clock read per send: the look notes which send it
        saw, and when.
        """
        if not self._sending or self._gave_up_on_client:
            self._stall_mark = None
            return
        mark = self._stall_mark
        if mark is None or mark[0] != self._sends:
            self._stall_mark = (self._sends, now)
            return
        scope = self._scope
        cut = scope is None or scope.cancel_called
        if now - mark[1] < (cut_grace if cut else write_timeout):
            return
        self._gave_up_on_client = True
        if not cut:
            self._client_stalled = True  # the request ends for it
            assert scope is not None
            scope.cancel()
        why = "stopped reading" if cut else f"has read nothing for {write_timeout:g}s"
        if self._hang_up():
            log.warning("request %s: its client %s; hung up on it", self.request_id, why)
        else:
            log.warning(
                "request %s: its client %s; its connection is not found", self.request_id, why
            )

    # --- the pipeline --------------------------------------------------------------

    async def _pipeline(self, deadline: float) -> None:
        queue = self.router.decode_queue
        try:
            # a place in the queue from now: a burst cannot all go to prefill (and run it
            # out of KV) before the queue fills; refused now, it costs nothing
            queue.reserve()
        except QueueFull:
            raise queue_full() from None
        self._queue_place_reserved = True
        try:
            await self._prefill_then_decode(deadline)
        finally:
            if self._queue_place_reserved:
                self._queue_place_reserved = False
                queue.unreserve()

    async def _prefill_then_decode(self, deadline: float) -> None:
        reply = await self._prefill(deadline, self._prefill_call())
        self._prompt_ids = reply.prompt_token_ids
        if self.shaper is not None:
            self.shaper.set_prompt_usage(reply.prompt_tokens, reply.cached_tokens)
        lost_on: Tried = {}  # the decode connections the request was lost on mid-stream
        while True:
            try:
                await self._prefilled_to_the_end(reply, lost_on)
            except _LostMidStream as lost:
                lost_on[lost.instance_id] = lost.connection
                reply = await self._migrate(deadline, reply, lost, lost_on)
                continue
            break
        await self._finish()

    async def _prefilled_to_the_end(self, reply: PrefillReply, lost_on: Tried) -> None:
        """Deliver a prefilled request's tokens to its end, on a decode not in ``lost_on``
        (unless it has reconnected since).

        Raises :class:`_LostMidStream` when its decode is lost after its first token
        and the request may migrate.
        """
        if reply.kv_handle is not None:
            self._kv_access_token = reply.kv_handle.access_token  # what a release must show
            self._lease_holder = self.prefill_instance
            if self._lease_holder is not None:
                self._lease_holder.leases_out += 1  # its link stays until this request ends
            await _check_kv_source(self.router, reply.kv_handle, self.prefill_instance)
        if reply.kv_handle is None:
            await self._deliver(reply.first_text, 1, reply.finish_reason, reply.usage, final=True)
            return
        # the first token goes out once decode room is claimed and the start is sent
        self._first_token_sent = False
        tried = dict(lost_on)
        last_reason = "no decode instance is connected"
        handle = reply.kv_handle
        while True:
            try:
                stream = await self._start_decode(reply, handle, tried, last_reason)
                await self._stream_tokens(stream)
            except _FailedBeforeFirstToken as early:
                # prefill still holds the KV: another decode instance pulls it again
                tried[early.instance_id] = early.connection
                last_reason = early.message
                if await self._a_decode_connects(tried, handle.layout, _lease_left_s(handle)):
                    self.router.metrics.retries.labels("decode").inc()
                    log.warning(
                        "decode on %s failed before its first token (%s): trying another",
                        early.instance_id,
                        early.message,
                    )
                    continue
                if not self._first_token_sent or self._generated is None:
                    raise _decode_failed(early.message) from None
                # no decode can pull prefill's KV before its lease ends: it is freed, and the
                # request goes on from a new prefill, as one lost mid-stream does
                self._give_up_kv()
                raise _LostMidStream(
                    early.instance_id, early.message, early.reason, early.connection
                ) from None
            return

    def _give_up_kv(self) -> None:
        """Release prefill's KV for the current leg now: no decode will pull it."""
        instance = self.prefill_instance
        if instance is not None and instance.link is not None:
            instance.link.release(self._wire_id, self._kv_access_token)
        if self._lease_holder is not None:
            self._lease_holder.leases_out -= 1
            self._lease_holder = None
        self.lifecycle.handle(Event.KV_GIVEN_UP)

    def _prefill_call(self) -> PrefillRequest:
        request = self.request
        return PrefillRequest(
            self._wire_id,
            request.prompt,
            request.sampling,
            request.max_tokens,
            release_token(self._wire_id),
        )

    async def _migrate(
        self, deadline: float, reply: PrefillReply, lost: _LostMidStream, lost_on: Tried
    ) -> PrefillReply:
        """Continue a request whose decode was lost mid-stream, or end it as before.

        The prompt's token ids and every token delivered become a new prompt; a
        prefill computes their KV (told how many are output already: they are
        spent from the same budget and replayed into the stop rules, never sent
        again) and samples the next token; then another decode goes on.
        """
        router = self.router
        generated = self._generated
        if (
            generated is None
            or len(self.figures.migrations) >= router.config.router.migration_limit
            or not await self._a_decode_connects(lost_on, None, deadline - trio.current_time())
        ):
            raise _decode_failed(lost.message)
        self.figures.migrations.append(lost.reason)
        router.metrics.migrations.labels(lost.reason).inc()
        log.warning(
            "request %s: decode on %s lost after %d tokens (%s: %s); continuing elsewhere",
            self.request_id,
            lost.instance_id,
            len(generated),
            lost.reason,
            lost.message,
        )
        if self._lease_holder is not None:
            # its KV was released at decode's first token
            self._lease_holder.leases_out -= 1
            self._lease_holder = None
        self._wire_id = f"{self.request_id}-m{len(self.figures.migrations)}"
        self._leg_generated = len(generated)
        call = PrefillRequest(
            self._wire_id,
            TokenPrompt((*self._prompt_ids, *generated)),
            self.request.sampling,
            reply.token_budget,  # the whole budget: prefill spends the generated from it
            release_token(self._wire_id),
            generated_tokens=len(generated),
        )
        return await self._prefill(deadline, call, continuation=True)

    def _not_on(self, tried: Tried) -> frozenset[str]:
        """The instances in ``tried`` still on the connection they were tried on: one that
        has reconnected since (a reset link, a worker back from a stop) may be tried again,
        since the worker ended everything of the old connection's."""
        instances = self.router.instances
        excluded = set()
        for name, (link, connects) in tried.items():
            instance = instances.get(name)
            if instance is not None and instance.link is link and link.connects == connects:
                excluded.add(name)
        return frozenset(excluded)

    async def _a_decode_connects(
        self, tried: Tried, layout: KvLayout | None, within_s: float
    ) -> bool:
        """Whether a decode not in ``tried`` is connected now, or connects within
        ``router.decode_reconnect_wait_s`` (and ``within_s``)."""
        router = self.router
        if router.decode_links(self._not_on(tried), layout):
            return True
        wait_s = min(router.config.router.decode_reconnect_wait_s, within_s)
        if wait_s <= 0:
            return False
        with trio.move_on_after(wait_s):
            await router.wait_for_decode_link(lambda: self._not_on(tried), layout)
            return True
        return False

    def _kv_tokens(self, reply: PrefillReply) -> int:
        """The KV a prefilled request needs on decode: its prompt and its whole budget."""
        return reply.prompt_tokens - self._leg_generated + reply.token_budget

    async def _prefill(
        self, deadline: float, call: PrefillRequest, *, continuation: bool = False
    ) -> PrefillReply:
        """Prefill ``call`` on an instance, trying others on failure (``continuation``: a
        migration's, which the request's figures do not count again)."""
        router = self.router
        lifecycle = self.lifecycle
        request = self.request
        prefill_timeout_s = router.config.router.prefill_timeout_s
        request_timeout_message = self._timeout_message
        tried: set[str] = set()
        # what the last instance that failed said: the answer when no other is left
        failure: OpenAIError | None = None
        started = time.perf_counter()
        while True:
            instance = router.pick_prefill(request.model, frozenset(tried))
            if instance is None or instance.link is None or len(tried) >= _PREFILL_ATTEMPTS:
                raise failure or service_unavailable(_no_instance_reason(router, request.model))
            if tried:
                router.metrics.retries.labels("prefill").inc()
            tried.add(instance.name)
            self.prefill_instance = instance
            lifecycle.handle(Event.PREFILL_SENT)
            instance.active_prefills += 1
            # prefill's own timeout, when it comes first, is the request scope's deadline for
            # the call (no scope of its own); cut by it, the request ends as timed out
            scope = self._scope
            assert scope is not None  # run() set it
            prefill_deadline = trio.current_time() + prefill_timeout_s
            if prefill_deadline < deadline:
                scope.deadline = prefill_deadline
                self._timeout_message = "prefill did not answer in time"
            try:
                # a cancelled call releases the request on prefill itself
                answer = await instance.link.prefill(call)
            except WorkerLinkClosed:
                # it never saw the request: another instance may
                lifecycle.handle(Event.PREFILL_NOT_SENT)
                continue
            except WorkerLinkLost as exc:
                # the worker drops a lost link's prefills: another instance may try
                router.instance_failed(instance)
                lifecycle.handle(Event.PREFILL_LOST)
                failure = service_unavailable(f"prefill instance failed: {exc}")
                continue
            finally:
                instance.active_prefills -= 1
                if not scope.cancel_called:
                    scope.deadline = deadline
                    self._timeout_message = request_timeout_message
            if type(answer) is PrefillFailed:
                if answer.status >= 500:
                    # the instance's fault, not the request's (a 4xx is not retried);
                    # 503 is a busy one (no KV room): tried elsewhere, but not suspended
                    if answer.error_type == DRAINING_ERROR_TYPE:
                        router.instance_draining(instance)
                    elif answer.status != 503:
                        router.instance_failed(instance)
                    lifecycle.handle(Event.PREFILL_LOST)
                    failure = _prefill_error(answer)
                    log.warning(
                        "prefill on %s failed, trying another: %s", instance.name, answer.message
                    )
                    continue
                lifecycle.handle(Event.PREFILL_FAILED)
                raise _prefill_error(answer)
            assert type(answer) is PrefillReply
            router.instance_served(instance)
            if not continuation:
                self.figures.prefill_s = time.perf_counter() - started
                self.figures.prompt_tokens = answer.prompt_tokens
            lifecycle.handle(Event.PREFILLED if answer.kv_handle else Event.FINISHED_AT_PREFILL)
            return answer

    async def _start_decode(
        self, reply: PrefillReply, handle: KvHandle, tried: Tried, last_reason: str
    ) -> DecodeStream:
        """Start the request on a decode instance not in ``tried`` (which grows with each
        instance that cannot take it), with room for it, waiting for room if need be."""
        lifecycle = self.lifecycle
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
        num_tokens = self._kv_tokens(reply)
        figures = self.figures
        attempts = 0
        while True:
            if attempts:
                self.router.metrics.retries.labels("decode").inc()
            attempts += 1
            waited_from = time.perf_counter()
            instance = await self._wait_for_decode(reply, handle, tried, last_reason)
            sent_at = time.perf_counter()
            figures.queued_s = (figures.queued_s or 0.0) + (sent_at - waited_from)
            link = instance.link
            assert link is not None and link.capacity is not None  # what decode_with_room picks
            # no checkpoint from the pick to the promise inside start: the room is ours
            self.decode_link = link
            connection = self._decode_connection = (link, link.connects)
            lifecycle.handle(Event.DECODE_START_SENT)
            try:
                stream = await link.start(
                    start,
                    blocks_needed(num_tokens, link.capacity.block_size),
                    keep_token_ids=self._generated is not None,
                )
            except WorkerLinkClosed as exc:
                lifecycle.handle(Event.DECODE_NOT_STARTED)
                tried[instance.name] = connection
                last_reason = str(exc)
                continue
            if not self._first_token_sent:
                self._first_token_sent = True
                if self._generated is not None:
                    self._generated.append(reply.first_token_id)
                await self._deliver(reply.first_text, 1, reply.finish_reason, reply.usage)
            while not (stream.accepted or stream.rejection or stream.failure):
                await stream.wait_update()
            if stream.accepted:
                lifecycle.handle(Event.DECODE_ACCEPTED)
                figures.handoff_s = time.perf_counter() - sent_at
                self._decoding = True
                self.router.metrics.streams_active.inc()
                return stream
            if stream.failure is not None:
                lifecycle.handle(Event.DECODE_ENDED)
                # (it had not answered: prefill still holds the KV) another may take it
                raise _FailedBeforeFirstToken(
                    instance.name,
                    f"decode failed to start: {stream.failure}",
                    connection,
                    stream.failure_reason or "link_lost",
                )
            rejection = stream.rejection
            assert rejection is not None
            lifecycle.handle(Event.DECODE_NOT_STARTED)
            last_reason = rejection.message
            if rejection_is_retryable(rejection):
                if rejection.reason != RejectReason.NO_ROOM:
                    # shutting down, or its pull failed: another; NO_ROOM: a fresh report
                    tried[instance.name] = connection
                continue
            if rejection.reason == RejectReason.LAYOUT_MISMATCH:
                raise server_error(f"prefill and decode cannot be paired: {rejection.message}")
            raise server_error(f"decode rejected the request: {rejection.message}")

    async def _wait_for_decode(
        self, reply: PrefillReply, handle: KvHandle, tried: Tried, last_reason: str
    ) -> Instance:
        """A decode instance with room for the request (not one of ``tried``, unless it has
        reconnected since), waiting in FIFO order for one."""
        router = self.router
        links = router.decode_links(self._not_on(tried), handle.layout)
        if not links and await self._a_decode_connects(tried, handle.layout, _lease_left_s(handle)):
            links = router.decode_links(self._not_on(tried), handle.layout)
        if not links:
            if router.decode_links(self._not_on(tried)):
                last_reason = f"none takes prefill's KV layout [{handle.layout.describe()}]"
            raise service_unavailable(f"no decode instance could take the request: {last_reason}")
        num_tokens = self._kv_tokens(reply)
        own_prompt = reply.prompt_tokens - self._leg_generated
        reports = [link.capacity for link in links if link.capacity is not None]
        if reports and all(
            blocks_needed(num_tokens, c.block_size) > c.total_blocks for c in reports
        ):
            most = max(c.total_blocks * c.block_size for c in reports)
            raise OpenAIError(
                f"This request needs {num_tokens} tokens of KV cache ({own_prompt} in "
                f"the prompt, {reply.token_budget} for the completion), more than any decode "
                f"instance can hold ({most}). Please reduce max_tokens or the prompt.",
                status=400,
                param="max_tokens",
                code="context_length_exceeded",
            )

        def take() -> Instance | None:
            return router.decode_with_room(num_tokens, self._not_on(tried), handle.layout)

        if self._queue_place_reserved:
            # the reserved place becomes a waiter's (no checkpoint until wait_for holds it)
            self._queue_place_reserved = False
            router.decode_queue.unreserve()
        instance = router.decode_queue.take_now(take)
        if instance is not None:
            return instance  # room now: no timer needed (a deadline scope per request is dear)
        with trio.move_on_after(max(0.0, _lease_left_s(handle))) as timer:
            try:
                return await router.decode_queue.wait_for(take)
            except QueueFull:
                raise queue_full() from None
        assert timer.cancelled_caught
        raise service_unavailable("no decode capacity came free within the prefill KV lease")

    def _decode_instance(self) -> Instance | None:
        """The decode instance the request runs on, if it is still known."""
        link = self.decode_link
        return None if link is None else self.router.instances.get(link.instance_id)

    async def _stream_tokens(self, stream: DecodeStream) -> None:
        """Deliver decode's tokens as they come; under load, spaced (adaptive egress).

        The spacing (``router.egress``, fed by the loop's load) holds a stream's
        next send until its last send plus the spacing, so the tokens that come
        meanwhile go out in one event.  A finish or a failure is never held.
        """
        buffer = stream.buffer
        egress = self.router.egress
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
                if delta.num_tokens and self.lifecycle.state is State.DECODE_CONFIRMING:
                    self._decode_confirmed()
                await self._deliver(
                    delta.text, delta.num_tokens, delta.finish_reason, delta.usage, final=final
                )
                if final:
                    self.lifecycle.handle(Event.DECODE_ENDED)
                    decode = self._decode_instance()
                    if decode is not None:
                        self.router.instance_served(decode)
                    return
                if spacing:
                    # spaced from the schedule, not from when the send returned: the
                    # send's own time and a late wake-up would add to every gap
                    last_sent_at = held_until if held_until is not None else trio.current_time()
            if failure is not None:
                # decode holds nothing of it any more: it failed there, or the link aborted it
                before_first_token = self.lifecycle.state is State.DECODE_CONFIRMING
                if stream.cut_off:
                    self.lifecycle.handle(Event.DECODE_ENDED)
                    raise OpenAIError(
                        CUT_OFF_MESSAGE, status=503, type="server_error", code="client_too_slow"
                    )
                decode = self._decode_instance()
                if decode is not None and stream.failure_reason not in _LINK_FAILURES:
                    # a lost link is out of rotation until it reconnects: one loss fails
                    # all its streams at once, and is not that many failures in a row
                    self.router.instance_failed(decode)
                link = self.decode_link
                connection = self._decode_connection
                assert connection is not None  # set with decode_link
                if before_first_token and link is not None:
                    self.lifecycle.handle(Event.DECODE_ENDED)
                    raise _FailedBeforeFirstToken(
                        link.instance_id, failure, connection, stream.failure_reason
                    )
                if (
                    link is not None
                    and self._generated is not None
                    and stream.token_ids is not None
                    and stream.failure_reason in MIGRATION_REASONS
                ):
                    # every token it pushed went out above: the continuation starts after them
                    self._generated += stream.token_ids
                    self.lifecycle.handle(Event.DECODE_LOST)
                    if self._decoding:  # until another decode accepts it
                        self._decoding = False
                        self.router.metrics.streams_active.dec()
                    raise _LostMidStream(
                        link.instance_id, failure, stream.failure_reason, connection
                    )
                self.lifecycle.handle(Event.DECODE_ENDED)
                # a worker failed, not the router: 502 (what a non-streaming client sees)
                raise _decode_failed(failure)
            await stream.wait_update()

    def _decode_confirmed(self) -> None:
        """Decode produced its first token: prefill may free the KV it kept until now."""
        self.lifecycle.handle(Event.FIRST_DECODE_TOKEN)
        instance = self.prefill_instance
        if instance is not None and instance.link is not None:
            instance.link.release(self._wire_id, self._kv_access_token)

    # --- output -------------------------------------------------------------------

    async def _deliver(
        self,
        text: str,
        num_tokens: int,
        finish_reason: str | None,
        usage: Usage | None,
        *,
        final: bool = False,
    ) -> None:
        """Send (or, not streaming, gather) a delta; ``final``: and end the response with it."""
        self.router.tokens_delivered += num_tokens
        self.figures.delivered(num_tokens)
        if finish_reason is not None and usage is None:
            raise server_error("the engine finished the request without its token counts")
        if self.shaper is None:
            if text:
                self._text_parts.append(text)
            if finish_reason is not None:
                self._finish_reason = finish_reason
                self._usage = usage
            return
        chunk = self.shaper.delta(text, num_tokens, finish_reason, usage)
        if not self.headers_sent:
            await self._send_headers()
        if final:
            # the last event and [DONE] in one write
            self._response_complete = True
            await self._write(
                {
                    "type": "http.response.body",
                    "body": chunk + self.shaper.done(),
                    "more_body": False,
                }
            )
        elif chunk:
            self._writing = True
            await self._write({"type": "http.response.body", "body": chunk, "more_body": True})
            self._writing = False

    async def _write(self, message: dict[str, Any]) -> None:
        """Send a body part (the hot path: marked as under way here, as _send does).

        While the router drains, the cut that may come next must not tear a write
        in progress (the client would get half an event and no error): the write
        is shielded.  A client that does not read cannot hold it past the cut's
        grace: the router's stall check (check_write) hangs up on it.
        """
        self._sending = True
        self._sends += 1
        try:
            if not self.router.draining:
                await self._send_to_server(message)
                return
            with trio.CancelScope(shield=True):
                await self._send_to_server(message)
        finally:
            self._sending = False

    async def _send_headers(self) -> None:
        self.headers_sent = True
        await self._send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})

    async def _finish(self) -> None:
        if self.shaper is not None and self.shaper.closed:
            return  # the last delta ended the stream
        self._response_complete = True
        if self.shaper is not None:
            await self._send(
                {"type": "http.response.body", "body": self.shaper.done(), "more_body": False}
            )
            return
        usage = self._usage
        assert usage is not None  # _deliver refused a finish without it
        builder = chat_completion_body if self.kind == "chat" else completion_body
        payload = builder(
            request_id=self.request_id,
            model=self.request.model,
            created=self.created,
            text="".join(self._text_parts),
            finish_reason=self._finish_reason,
            usage=usage,
        )
        self.headers_sent = True
        await send_json(self._send, 200, payload)

    async def _send_error(self, error: OpenAIError) -> None:
        if self._gave_up_on_client:
            return  # the connection is gone
        if self.headers_sent:
            if self._writing:
                return  # a write was cut mid-way: more bytes would corrupt the stream; hang up
            if self.shaper is not None and not self.shaper.closed:
                # a client that is not reading cannot hold this: the router's stall check
                # (check_write) hangs up on it after cleanup_grace_s
                await self._send(
                    {
                        "type": "http.response.body",
                        "body": self.shaper.error(error),
                        "more_body": False,
                    }
                )
            return
        extra = [(name.encode(), value.encode()) for name, value in error.headers]
        await send_json(self._send, error.status, error.to_body(), extra or None)

    # --- cleanup ------------------------------------------------------------------

    def _cleanup(self) -> None:
        """Do what the lifecycle says is owed: abort on decode, release on prefill.

        Both are queued on the links, never awaited: cleanup cannot hang, and
        needs no shield from the cancellation that usually brings it.
        """
        if self._decoding:
            self._decoding = False
            self.router.metrics.streams_active.dec()
        owed = self.lifecycle.owed()
        if owed & Cleanup.ABORT_ON_DECODE and self.decode_link is not None:
            self.decode_link.abort(self._wire_id)
        instance = self.prefill_instance
        if owed & Cleanup.RELEASE_ON_PREFILL and instance is not None and instance.link is not None:
            instance.link.release(self._wire_id, self._kv_access_token)
        if self._lease_holder is not None:
            self._lease_holder.leases_out -= 1
            self._lease_holder = None
        self.lifecycle.handle(Event.CLEANED)


class _FailedBeforeFirstToken(Exception):
    """Decode failed the request before its first token: prefill still holds the KV."""

    def __init__(self, instance_id: str, message: str, connection: Connection, reason: str) -> None:
        super().__init__(message)
        self.instance_id = instance_id
        self.message = message
        self.connection = connection
        # why, as a MIGRATION_REASONS label: should the request go on from a new prefill
        self.reason = reason if reason in MIGRATION_REASONS else "decode_failed"


class _LostMidStream(Exception):
    """Decode was lost after its first token (``reason``: a MIGRATION_REASONS label)."""

    def __init__(self, instance_id: str, message: str, reason: str, connection: Connection) -> None:
        super().__init__(message)
        self.instance_id = instance_id
        self.message = message
        self.reason = reason
        self.connection = connection


def _lease_left_s(handle: KvHandle) -> float:
    """How long decode may still take to pull the KV: it waits on prefill under its lease
    (a TTL, counted on this router's clock from the reply), and must be pulled a margin
    before the lease frees it."""
    return LEASES.left_s(handle, trio.current_time()) - _LEASE_MARGIN_S


def _decode_failed(message: str) -> OpenAIError:
    """A decode worker failed the request: 502 (what a non-streaming client sees)."""
    return error_for(Reason.DECODE_FAILED, f"decode failed: {message}")


async def _check_kv_source(router: Router, handle: KvHandle, instance: Instance | None) -> None:
    """Decode pulls only from where the prefill instance registered its KV port: a handle
    naming another address (or instance) is refused, never passed on to decode.

    A restarted worker serves a new KV port: what its /pd/info says now (asked at the
    URL it registered, with the worker secret) is its registration then.
    """
    if instance is None:
        return
    named = (handle.transfer_host, handle.transfer_port)
    if handle.instance_id == instance.name and named != instance.transfer_endpoint:
        await router.refresh_transfer_endpoint(instance)
    if handle.instance_id != instance.name or named != instance.transfer_endpoint:
        log.error(
            "prefill instance %s handed out KV at %s:%d (as %r), not its registered %s:%d",
            instance.name,
            *named,
            handle.instance_id,
            *instance.transfer_endpoint,
        )
        raise error_for(
            Reason.BAD_KV_HANDLE,
            f"prefill instance {instance.name} named a KV source it is not registered with",
        )


def _no_instance_reason(router: Router, model: str) -> str:
    """Why no instance pair takes a request: the role none is up for, or why none pair."""
    instances = router.instances.values()
    if not any(i.serves_prefill and i.usable and i.model == model for i in instances):
        role = "prefill"
    elif not any(i.serves_decode and i.usable for i in instances):
        role = "decode"  # (a decode restarting, say): prefill is up, but has no counterpart
    else:
        role = "prefill"  # both are up, but none pairs: the reasons below say why
    unpaired = [
        reason
        for name, reason in router.unpaired().items()
        if router.instances[name].serves_prefill and router.instances[name].model == model
    ]
    if unpaired and role == "prefill":
        return "no prefill instance is available: " + "; ".join(unpaired)
    return f"no {role} instance is available"


def _shutting_down(message: str) -> OpenAIError:
    return error_for(Reason.SHUTTING_DOWN, message)


def _prefill_error(failed: PrefillFailed) -> OpenAIError:
    """Prefill's refusal or failure as the OpenAIError the client should see."""
    status = status_for_worker_failure(failed.status)  # a 5xx: the worker failed, not us
    return OpenAIError(failed.message, status=status, type=failed.error_type, param=failed.param)
