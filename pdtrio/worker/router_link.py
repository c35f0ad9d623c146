"""Worker side of the router <-> worker link (``/pd/link``): it only moves messages.

One websocket per connected router carries everything a request needs of this
worker, whatever its role: prefill calls (``PrefillRequest`` answered by
``PrefillReply`` or ``PrefillFailed``), releases (which also stop a prefill in
progress), decode starts and aborts, and the token frames.  A reader takes
the router's frames; a prefill runs as a task of the link, through the
worker's :class:`Prefiller`; admission (``worker.admission``) decides on each
decode start; a single sender (``pdtrio.worker.link_sender``) writes every
frame, so writes never interleave: engine outputs, control messages, the KV
capacity reports, batches and heartbeats are its.  Here: the reader, the
dispatch of each message, and the routing of engine outputs to the links.

When the router goes away, the link's prefills in progress are cancelled
and its decode requests aborted, and a prefill whose reply was not written
to the link frees its KV (nobody holds its handle).  A prefill whose reply
was written keeps its KV lease: a decode may be pulling it over another
link; a release (with the handle's grant or the call's release token, over
any link) or the lease's expiry frees it.

A release over the link for a prefill that link asked for, and whose reply it
has not written yet, needs no token: it stops the prefill (one not started yet
never starts) or frees what it leased.

The router names the heartbeat interval in the link's URL (``?heartbeat_s=``),
whether it reads batches (``?batch=1``) and the prefix cache's changes
(``?kv_events=1``).

A link only ever touches the requests it started, and each of them ends with
exactly one of: its finish entry, ``DecodeRejected``, ``DecodeFailed``, or the
router's own abort.
"""

from __future__ import annotations

import logging
import math
import urllib.parse
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Final, Protocol, final

import trio

from pdtrio.asgi import Receive, Scope, Send
from pdtrio.engine.api import (
    BlocksFreed,
    Engine,
    EngineError,
    EngineOutput,
    StepFailed,
    StepLogprobs,
    StepOutputs,
)
from pdtrio.memory import HeapTrimmer
from pdtrio.protocol.errors import Reason
from pdtrio.protocol.link import wire
from pdtrio.protocol.link.wire import (
    DecodeAbort,
    DecodeAccepted,
    DecodeFailed,
    DecodeRejected,
    DecodeStart,
    DecodeStartChoices,
    PrefillFailed,
    PrefillReply,
    PrefillRequest,
    RejectReason,
    ReleaseRequest,
    WireError,
    prefill_failed,
    request_id_in_use,
    traceparent_of,
)
from pdtrio.protocol.tokens.flush import FlushConfig
from pdtrio.worker.admission import Decision, DecodeAdmission, Rejected
from pdtrio.worker.fault_hooks import FaultHooks
from pdtrio.worker.link_sender import DEFAULT_HEARTBEAT_S, Control, LinkSender

if TYPE_CHECKING:
    from pdtrio.protocol.link.message_base import Usage
    from pdtrio.tracing import Tracing, WorkSpan

log = logging.getLogger("pdtrio.worker.link")

# Messages above this are decoded on a thread: a 15 MB prompt is milliseconds of memcpy.
OFF_LOOP_DECODE_BYTES: Final = 256 * 1024
# the heartbeat interval a router names is kept within these
_MIN_HEARTBEAT_S: Final = 0.01
_MAX_HEARTBEAT_S: Final = 3600.0


class Prefiller(Protocol):
    """What the link needs of a prefill worker."""

    async def prefill_call(self, request: PrefillRequest) -> PrefillReply | PrefillFailed | None:
        """Prefill the request; a refusal or failure is ``PrefillFailed``, a release None."""
        ...

    def release(self, request_id: str) -> bool:
        """Free the request's leased blocks, or stop its prefill; harmless when unknown."""
        ...

    def release_granted(self, request_id: str, access_token: str) -> bool:
        """Free the request's leased blocks if ``access_token`` is their grant."""
        ...


@final
class RouterConnection:
    """One router's link: its reader and the dispatch of each message; its sender sends."""

    def __init__(
        self,
        server: RouterLinkServer,
        send: Send,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        *,
        batches: bool = False,
        kv_events: bool = False,
    ) -> None:
        self._server = server
        self._engine = server.engine
        self.sender = LinkSender(
            send,
            server.engine,
            server.flush,
            heartbeat_s=heartbeat_s,
            batches=batches,
            kv_events=kv_events,
            reports_capacity=server.admission is not None,
            is_draining=lambda: server.draining,
            reply_written=self._reply_written,
            faults=server.faults,
        )
        # the requests this link started and that have not ended: the scope of a
        # start still in progress, None once the engine runs the request
        self.requests: dict[str, trio.CancelScope | None] = {}
        # prefills this link asked for whose reply it has not written (a release of one
        # needs no grant; the link's close frees them) -> whether a release stopped it
        self.prefilling: dict[str, bool] = {}
        # traced decodes' run spans, from admission to their end (see forget), with the
        # tokens generated before this decode (empty unless the router traces)
        self.decode_spans: dict[str, tuple[WorkSpan, int]] = {}

    def _reply_written(self, request_id: str) -> None:
        self.prefilling.pop(request_id, None)

    async def run_reader(self, receive: Receive, nursery: trio.Nursery) -> None:
        decode = wire.to_worker_decoder.decode
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("bytes")
            if data is None:
                log.warning("dropping a text frame from the router")
                continue
            if len(data) > OFF_LOOP_DECODE_BYTES:
                # a huge prompt: decode it on a thread, the loop keeps serving the others;
                # and not kept alive here until the next frame comes
                nursery.start_soon(self._decode_off_loop, data, nursery)
                del message, data
                continue
            try:
                parsed = decode(data)
            except WireError as exc:
                log.warning("dropping a bad frame from the router: %s", exc)
                continue
            await self._dispatch(parsed, nursery)

    async def _decode_off_loop(self, data: bytes, nursery: trio.Nursery) -> None:
        try:
            parsed = await trio.to_thread.run_sync(
                wire.to_worker_decoder.decode, data, limiter=self._server.big_decodes
            )
        except WireError as exc:
            log.warning("dropping a bad frame from the router: %s", exc)
            del data
            # the frame's memory goes back to the OS (left to glibc, 60 MB once stayed)
            self._server.heap_trimmer.trim_soon()
            return
        del data
        if isinstance(parsed, PrefillRequest):
            self._start_prefill(parsed, nursery, big=True)  # trimmed once it is answered
        else:
            await self._dispatch(parsed, nursery)
            self._server.heap_trimmer.trim_soon()

    async def _dispatch(self, message: wire.ToWorker, nursery: trio.Nursery) -> None:
        server = self._server
        if isinstance(message, DecodeAbort):
            self.abort(message.request_id)
            return
        if isinstance(message, ReleaseRequest):
            prefiller = server.prefiller
            if prefiller is None:
                return
            if message.request_id in self.prefilling:
                # its own call, not answered on the link yet: stop it (not started yet: it
                # never starts), or free what it leased
                self.prefilling[message.request_id] = True
                prefiller.release(message.request_id)
            else:
                # an answered prefill: only the holder of its grant (or of the release token
                # of the router that asked for it) may free the blocks
                prefiller.release_granted(message.request_id, message.access_token)
            return
        if isinstance(message, PrefillRequest):
            self._start_prefill(message, nursery)
            return
        request_id = message.request_id
        if server.admission is None:
            await self.sender.send_control(
                DecodeRejected(
                    request_id, RejectReason.BAD_REQUEST, "this instance does not decode"
                )
            )
            return
        choice_ids = _choice_ids(message) if isinstance(message, DecodeStartChoices) else ()
        owners = {server.owner.get(i) for i in (request_id, *choice_ids)} - {None}
        if owners:
            # on this link, the router's own mistake; over another, the router lost that
            # link (its run here ends when this worker sees it go)
            reason = RejectReason.BAD_REQUEST if owners == {self} else RejectReason.ALREADY_RUNNING
            message_text = f"request {request_id} is already running here"
            await self.sender.send_control(DecodeRejected(request_id, reason, message_text))
            return
        scope = trio.CancelScope()
        self.requests[request_id] = scope
        server.owner[request_id] = self
        # n > 1: each other choice is a request of its own once started (its outputs come
        # to this link; an abort of any while the start runs stops the start)
        for choice_id in choice_ids:
            self.requests[choice_id] = scope
            server.owner[choice_id] = self
        # (its KV lease's TTL counts from its arrival)
        nursery.start_soon(self._start, message, scope, trio.current_time())

    def _start_prefill(
        self, request: PrefillRequest, nursery: trio.Nursery, *, big: bool = False
    ) -> None:
        """Track the call from now (a release that comes before its task runs stops it),
        and run it as a task of the link."""
        if request.request_id in self.prefilling:
            nursery.start_soon(self.sender.send_control, request_id_in_use(request.request_id))
            return
        self.prefilling[request.request_id] = False
        nursery.start_soon(self._prefill, request, big)

    async def _prefill(self, request: PrefillRequest, big: bool = False) -> None:
        try:
            await self._prefill_and_answer(request)
        finally:
            if big:
                # a huge prompt's memory (the message, its tokens) goes back to the OS
                self._server.heap_trimmer.trim_soon()

    async def _prefill_and_answer(self, request: PrefillRequest) -> None:
        prefiller = self._server.prefiller
        request_id = request.request_id
        answer: PrefillReply | PrefillFailed | None = None
        try:
            if prefiller is None:
                answer = prefill_failed(
                    request_id, Reason.INVALID_REQUEST, "this instance does not prefill"
                )
            elif not self.prefilling.get(request_id, True):
                with self._work("prefill", request) as span:
                    answer = await prefiller.prefill_call(request)
                    if span is not None and isinstance(answer, PrefillReply):
                        span.set("gen_ai.usage.input_tokens", answer.prompt_tokens)
                        span.set("pdtrio.cached_tokens", answer.cached_tokens)
                        span.set("pdtrio.kv_leased", answer.kv_handle is not None)
                        if answer.kv_handle is not None:
                            # written and leased for decode to pull
                            blocks = len(answer.kv_handle.block_ids)
                            span.event("kv_written", {"pdtrio.kv_blocks": blocks})
                    elif span is not None and isinstance(answer, PrefillFailed):
                        span.fail(f"{answer.status} {answer.error_type}: {answer.message}")
                if isinstance(answer, PrefillReply):
                    # a decode worker's local prefill leased blocks: its report says so
                    self._server.capacity_changed()
            if answer is None or self.prefilling.get(request_id, True):
                # released before it started, or while it ran (over this link, or with the
                # release token over another): the router has given up on it (and a lease
                # it may have made is freed)
                if prefiller is not None and isinstance(answer, PrefillReply):
                    prefiller.release(request_id)
                self.prefilling.pop(request_id, None)
                return
            await self.sender.send_control(answer)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the router is gone: the link's close frees what the reply leased
        finally:
            if not isinstance(answer, PrefillReply):
                self.prefilling.pop(request_id, None)  # nothing held: nothing to track
            # (a reply is tracked until it is written; the link's close frees it if not)

    def _work(
        self, name: str, message: PrefillRequest | DecodeStart
    ) -> AbstractContextManager[WorkSpan | None]:
        """A span of this worker's part of a request, when the router traces it."""
        tracing = self._server.tracing
        traceparent = traceparent_of(message)
        if tracing is None or not traceparent:
            return nullcontext()
        attributes = {
            "pdtrio.request_id": message.request_id,
            "pdtrio.instance": self._server.instance_id,
        }
        return tracing.work(name, traceparent, attributes)

    def _start_decode_span(self, start: DecodeStart) -> WorkSpan | None:
        """The decode's run span, when the router traces it: ended by ``forget``."""
        tracing = self._server.tracing
        traceparent = traceparent_of(start)
        if tracing is None or not traceparent:
            return None
        attributes: dict[str, str | int | bool] = {
            "pdtrio.request_id": start.request_id,
            "pdtrio.instance": self._server.instance_id,
            "pdtrio.tokens_before": start.tokens_generated,
        }
        span = tracing.start_work("decode", traceparent, attributes)
        if span is not None:
            self.decode_spans[start.request_id] = (span, start.tokens_generated)
        return span

    def decode_finished(self, request_id: str, finish: str, usage: Usage | None) -> None:
        """A traced decode's last token: its finish and the tokens it generated."""
        traced = self.decode_spans.get(request_id)
        if traced is None:
            return
        span, tokens_before = traced
        span.set("pdtrio.finish", finish)
        if usage is not None:
            span.set("gen_ai.usage.output_tokens", usage.completion_tokens)
            span.set("pdtrio.tokens_generated", usage.completion_tokens - tokens_before)

    def decode_failed(self, request_id: str, message: str) -> None:
        traced = self.decode_spans.get(request_id)
        if traced is not None:
            traced[0].set("pdtrio.finish", "error")
            traced[0].fail(message)

    def abort(self, request_id: str) -> None:
        """The router gave up on a request: only one this link started."""
        if request_id not in self.requests:
            return
        scope = self.requests[request_id]
        traced = self.decode_spans.get(request_id) if self.decode_spans else None
        if traced is not None:
            traced[0].set("pdtrio.finish", "abort")
        if scope is not None:
            scope.cancel()  # the start unwinds, frees what it took, and forgets the request
            return
        self.forget(request_id)
        self._engine.abort(request_id)
        self._server.capacity_changed()

    def forget(self, request_id: str) -> None:
        """The request ended here; the link is told (or asked for it) separately."""
        if request_id in self.requests:
            del self.requests[request_id]
            del self._server.owner[request_id]
        if self.decode_spans:
            traced = self.decode_spans.pop(request_id, None)
            if traced is not None:
                traced[0].end()

    async def _start(
        self, start: DecodeStart, scope: trio.CancelScope, received_at: float | None = None
    ) -> None:
        request_id = start.request_id
        choices = start.choices if isinstance(start, DecodeStartChoices) else ()
        # the ids the start runs under besides the request's own (n > 1: choices 1..)
        choice_ids = _choice_ids(start) if isinstance(start, DecodeStartChoices) else ()
        accepted = started = False
        ending: Control | None = None
        try:
            with scope:
                admission = self._server.admission
                assert admission is not None  # the reader rejects starts without it
                decision: Decision
                if self._server.draining:
                    decision = Rejected(RejectReason.SHUTTING_DOWN, "decode is draining")
                else:
                    run_span = self._start_decode_span(start)
                    # (its KV pull from prefill is part of admission)
                    with self._work("decode admission", start) as span:
                        decision = await admission.admit(start, received_at)
                        if isinstance(decision, Rejected):
                            refusal = f"rejected ({decision.reason}): {decision.message}"
                            if span is not None:
                                span.fail(refusal)
                            if run_span is not None:
                                run_span.fail(refusal)
                if isinstance(decision, Rejected):
                    ending = DecodeRejected(request_id, decision.reason, decision.message)
                else:
                    accepted = True
                    await self.sender.send_control(DecodeAccepted(request_id))
                    try:
                        await self._engine.start_decode(
                            request_id,
                            list(start.prompt_token_ids),
                            start.first_token_id,
                            start.sampling,
                            start.token_budget,
                            start.tokens_generated,
                            start.cached_tokens,
                            start.generated_tokens,
                            choices=choices,  # (n = 1: none, one sequence)
                        )
                        started = True
                    except EngineError as exc:
                        log.error("decode of %s did not start: %s", request_id, exc)
                        ending = DecodeFailed(request_id, f"decode did not start: {exc}")
                        self.decode_failed(request_id, ending.message)
        finally:
            if not started:
                if accepted:  # (admission frees what it took on any other way out)
                    for choice_id in choice_ids:
                        self._engine.free_request(choice_id)
                    self._engine.free_request(request_id)
                for choice_id in choice_ids:
                    self.forget(choice_id)
                self.forget(request_id)
            elif scope.cancel_called:
                # aborted just as it started: nothing was cancelled, so end it here
                for choice_id in choice_ids:
                    self._engine.abort(choice_id)
                    self.forget(choice_id)
                self._engine.abort(request_id)
                self.forget(request_id)
            else:
                for choice_id in choice_ids:
                    if choice_id in self.requests:  # (not already finished)
                        self.requests[choice_id] = None
                if choices and all(choice for choice, _ in choices):
                    # choice 0 finished at prefill: nothing runs under the request's own id
                    self.forget(request_id)
                elif request_id in self.requests:  # (not already finished)
                    self.requests[request_id] = None
            self._server.capacity_changed()  # allocated, or freed on the way out
        if ending is not None:
            await self.sender.send_control(ending)
            if accepted:
                # the router reads each choice from decode's accept on: each hears the end
                for choice_id in choice_ids:
                    assert isinstance(ending, DecodeFailed)
                    await self.sender.send_control(DecodeFailed(choice_id, ending.message))


def _choice_ids(start: DecodeStartChoices) -> tuple[str, ...]:
    """The ids the choices of a start other than choice 0 run under."""
    return tuple(
        wire.choice_request_id(start.request_id, choice) for choice, _ in start.choices if choice
    )


# router links a worker keeps at once (each router process holds one)
MAX_LINKS = 256


@final
class RouterLinkServer:
    """Every router's link to this worker, and the routing of engine outputs.

    ``admission`` is None on a worker that does not decode, ``prefiller`` None
    on one that does not prefill: the link then refuses those messages.
    """

    def __init__(
        self,
        admission: DecodeAdmission | None,
        prefiller: Prefiller | None,
        engine: Engine,
        flush: FlushConfig,
        *,
        faults: FaultHooks | None = None,
        tracing: Tracing | None = None,
        instance_id: str = "",
    ) -> None:
        self.faults = faults  # testing only: None unless a fault hook is configured
        # spans of the work a tracing router asks for (None: tracing is off here)
        self.tracing = tracing
        self.instance_id = instance_id
        self.admission = admission
        self.prefiller = prefiller
        self.engine = engine
        # one huge message decoded at a time: bounds the memory held by decoding
        self.big_decodes = trio.CapacityLimiter(1)
        self.heap_trimmer = HeapTrimmer()
        self.flush = flush
        self.owner: dict[str, RouterConnection] = {}  # request id -> the link that started it
        self._links: set[RouterConnection] = set()
        self.draining = False  # the worker is stopping: decode starts are refused

    def capacity_changed(self) -> None:
        """The engine's free blocks may have changed: every link reports it (never blocks)."""
        for link in self._links:
            link.sender.mark_capacity()

    @property
    def link_count(self) -> int:
        return len(self._links)

    @property
    def request_count(self) -> int:
        return len(self.owner)

    async def dispatch_outputs(self, outputs: trio.MemoryReceiveChannel[EngineOutput]) -> None:
        """Route each engine step's entries to the link that started each request; blocks
        freed late (``BlocksFreed``) are a capacity report to every link."""
        async with outputs:
            async for step in outputs:
                if isinstance(step, StepFailed):
                    await self._fail(step)
                    continue
                if isinstance(step, StepLogprobs):
                    await self._deliver_logprobs(step)
                    continue
                if isinstance(step, BlocksFreed):
                    # aborts freed their blocks after the abort's own report went out
                    self.capacity_changed()
                    continue
                owner = self.owner
                if len(self._links) == 1:
                    (link,) = self._links
                    await self._deliver(link, [e for e in step if owner.get(e.request_id) is link])
                    continue
                per_link: dict[RouterConnection, StepOutputs] = {}
                for entry in step:
                    target = owner.get(entry.request_id)
                    if target is not None:
                        per_link.setdefault(target, []).append(entry)
                for target, entries in per_link.items():
                    await self._deliver(target, entries)

    async def _deliver(self, link: RouterConnection, entries: StepOutputs) -> None:
        if not entries:
            return
        if self.faults is not None:
            self.faults.on_decode_outputs(entries)  # may exit the process (testing only)
        finished = False
        for entry in entries:
            if entry.finish_reason is not None:
                if link.decode_spans:
                    link.decode_finished(entry.request_id, entry.finish_reason, entry.usage)
                link.forget(entry.request_id)
                finished = True
        if finished:
            self.capacity_changed()  # a finished request's blocks are free
        try:
            await link.sender.outbox_send.send(entries)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the link is gone; its requests were aborted

    async def _deliver_logprobs(self, step: StepLogprobs) -> None:
        """Each request's logprobs to its link, ahead of the step's tokens."""
        per_link: dict[RouterConnection, list[wire.TokenLogprobs]] = {}
        for entry in step.entries:
            target = self.owner.get(entry.request_id)
            if target is not None:
                per_link.setdefault(target, []).append(entry)
        for target, entries in per_link.items():
            try:
                await target.sender.outbox_send.send(StepLogprobs(entries))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the link is gone; its requests were aborted

    async def _fail(self, failed: StepFailed) -> None:
        for request_id in failed.request_ids:
            link = self.owner.get(request_id)
            if link is None:
                continue
            if link.decode_spans:
                link.decode_failed(request_id, failed.message)
            link.forget(request_id)
            self.capacity_changed()
            try:
                await link.sender.send_control(DecodeFailed(request_id, failed.message))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the link is gone

    async def serve_websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        if len(self._links) >= MAX_LINKS:
            # one per router process: more is a misconfiguration or a peer gone wrong
            log.warning("refused a router link: %d are open, the most a worker keeps", MAX_LINKS)
            await send({"type": "websocket.close", "code": 1013})  # (an HTTP 403)
            return
        await send({"type": "websocket.accept"})
        link = RouterConnection(
            self,
            send,
            _heartbeat_interval(scope),
            batches=_wants_batches(scope),
            kv_events=_wants_kv_events(scope),
        )
        self._links.add(link)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(link.sender.run)
                await link.run_reader(receive, nursery)
                nursery.cancel_scope.cancel()
        finally:
            self._links.discard(link)
            link.sender.outbox_send.close()
            # the router went away: every request it started here ends now
            for request_id in list(link.requests):
                link.abort(request_id)
            if self.prefiller is not None:
                # (their tasks have ended) replies never written: nobody holds the handle
                for request_id in link.prefilling:
                    self.prefiller.release(request_id)
            link.prefilling.clear()
            self.capacity_changed()  # the other routers learn what it freed


def _query(scope: Scope) -> dict[str, list[str]]:
    return urllib.parse.parse_qs(bytes(scope.get("query_string", b"")).decode("latin-1"))


def _wants_batches(scope: Scope) -> bool:
    """Whether the router reads batches of messages (``?batch=1``)."""
    return _query(scope).get("batch", [""])[-1] == "1"


def _wants_kv_events(scope: Scope) -> bool:
    """Whether the router reads the prefix cache's changes (``?kv_events=1``)."""
    return _query(scope).get("kv_events", [""])[-1] == "1"


def _heartbeat_interval(scope: Scope) -> float:
    """The interval the router asked for (``?heartbeat_s=``), within sane bounds."""
    query = _query(scope)
    try:
        asked = float(query["heartbeat_s"][-1])
    except (KeyError, ValueError):
        return DEFAULT_HEARTBEAT_S
    if not math.isfinite(asked):
        return DEFAULT_HEARTBEAT_S
    return min(max(asked, _MIN_HEARTBEAT_S), _MAX_HEARTBEAT_S)
