"""A request's decode leg on pdtrio workers: placed on a decode with room (waiting for
room, or for a link), started, and its tokens handed to the client."""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Mapping
from typing import final

import trio

from pdtrio.protocol import request as rm
from pdtrio.protocol.errors import Reason
from pdtrio.protocol.kv_layout import KvLayout, choice_blocks_needed
from pdtrio.protocol.link.wire import (
    DecodeStart,
    DecodeStartChoices,
    KvHandle,
    PrefillReply,
    RejectReason,
    TokenPrompt,
    choice_request_id,
    traced_start,
)
from pdtrio.router.backend import (
    BackendUnreachable,
    DecodeRun,
    LegHost,
    RunDecode,
    ShellFailure,
    Wait,
)
from pdtrio.router.request.capacity import QueueFull
from pdtrio.router.request.token_path import stream_choices, stream_tokens
from pdtrio.router.stream_outcome import (
    StreamAccepted,
    StreamFailed,
    StreamRejected,
    StreamUnanswered,
)
from pdtrio.router.workers.instances import Instance
from pdtrio.router.workers.link import (
    WorkerLink,
    rejection_is_retryable,
)
from pdtrio.router.workers.prefill import PrefillLeg, WorkerParts, running_choices

log = logging.getLogger("pdtrio.router.pipeline")


class _NoDecodeLeft(Exception):
    """No decode that could take the request is connected any more: it stops waiting
    for room (the next in the queue then looks)."""


class _NoDecodeTakesIt(Exception):
    """No decode could take the request (each tried failed, or none is up): the machine
    hears it as ``DecodeUnavailable`` (a failed handoff may go on from a new prefill)."""

    def __init__(self, failure: rm.Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


@final
class DecodeLeg:
    """The request on a decode instance: its placement, its start, and its stream.

    ``lease_margin_s``: decode must pull the KV this long before prefill's lease frees it.
    """

    def __init__(
        self, host: LegHost, workers: WorkerParts, prefill: PrefillLeg, *, lease_margin_s: float
    ) -> None:
        self._host = host
        self._workers = workers
        self._prefill = prefill
        self._lease_margin_s = lease_margin_s
        self.link: WorkerLink | None = None  # the decode link the request was started on
        # n > 1: the ids the request's choices 1.. run under on that decode
        self._choice_ids: list[str] = []
        self._queue_place_reserved = False  # holds a place in the router's decode queue
        self._streaming = False  # counted in the router's active streams

    @property
    def instance_id(self) -> str | None:
        return None if self.link is None else self.link.instance_id

    # --- the router's decode queue ----------------------------------------------------

    def reserve_place(self) -> bool:
        """A place in the decode queue from the request's arrival (False: it is full): a
        burst cannot all go to prefill (and run it out of KV) before the queue fills."""
        try:
            self._workers.decode_queue.reserve()
        except QueueFull:
            return False
        self._queue_place_reserved = True
        return True

    def unreserve(self) -> None:
        if self._queue_place_reserved:
            self._queue_place_reserved = False
            self._workers.decode_queue.unreserve()

    # --- placement --------------------------------------------------------------------

    def _not_on(self, tried: Mapping[str, Hashable]) -> frozenset[str]:
        return self._workers.instances.still_on(tried)

    async def wait_for_link(self, command: rm.WaitForDecode) -> Wait | None:
        """Until a decode not in the command's ``exclude`` is connected (the machine's
        RECONNECT deadline bounds it)."""
        reply = self._prefill.reply
        assert reply is not None
        layout = None if command.any_layout or reply.kv_handle is None else reply.kv_handle.layout
        tried = command.exclude
        instances = self._workers.instances
        if not instances.decode_links(self._not_on(tried), layout):
            await instances.wait_for_decode_link(lambda: self._not_on(tried), layout)
        if not command.any_layout:
            log.warning("decode failed before its first token: trying another")
        return await self._host.report(rm.DecodeConnected())

    def _kv_tokens(self, reply: PrefillReply) -> int:
        """The KV a prefilled request needs on decode: its prompt and its whole budget (n > 1:
        and each more choice's budget, with a block or two it cannot share, at most)."""
        tokens = reply.prompt_tokens - self._prefill.leg_generated + reply.token_budget
        more = len(running_choices(reply)) - 1
        if more > 0:
            assert reply.kv_handle is not None
            tokens += more * (reply.token_budget + 2 * reply.kv_handle.layout.block_size)
        return tokens

    def _blocks(self, reply: PrefillReply, block_size: int) -> int:
        """The blocks decode allocates for the request (the full prompt blocks once)."""
        choices = len(running_choices(reply))
        own_tokens = reply.prompt_tokens - self._prefill.leg_generated
        return choice_blocks_needed(
            reply.prompt_tokens, own_tokens + reply.token_budget, max(choices, 1), block_size
        )

    async def place(self, command: rm.PlaceDecode) -> Wait | None:
        """Place the request on a decode with room (waiting for room if need be); the
        start goes out in the :class:`RunDecode` wait that follows."""
        host = self._host
        reply = self._prefill.reply
        assert reply is not None and reply.kv_handle is not None
        if command.retry:
            host.router.metrics.retries.labels("decode").inc()
        figures = host.figures
        waited_from = time.perf_counter()
        try:
            instance = await self._with_room(reply, reply.kv_handle, command)
        except _NoDecodeTakesIt as exc:
            return await host.report(rm.DecodeUnavailable(exc.failure))
        sent_at = time.perf_counter()
        figures.queued_s = (figures.queued_s or 0.0) + (sent_at - waited_from)
        link = instance.link
        assert link is not None and link.capacity is not None  # what decode_with_room picks
        # no checkpoint from the pick to the promise inside start: the room is ours
        self.link = link
        await host.report(rm.DecodeStartSent(instance.instance_id, (link, link.connects)))
        return RunDecode(sent_at)

    async def _with_room(
        self,
        reply: PrefillReply,
        handle: KvHandle,
        command: rm.PlaceDecode,
    ) -> Instance:
        """A decode instance with room for the request (not one the command excludes,
        unless it has reconnected since), waiting in FIFO order for one.

        While it waits, the decodes that could take it may all go (a link lost, or
        silent: a hung worker): it then waits for one to (re)connect as a newcomer does,
        ``decode_reconnect_wait_s``, not for the worker to wake within the KV lease
        (unless the command says a new prefill is the better hope)."""
        tried, last_reason = command.exclude, command.last_reason
        router = self._host.router
        instances = self._workers.instances
        num_tokens = self._kv_tokens(reply)
        # prefilled on a decode (conditional disaggregation): decoded there while it has
        # room (its KV in place); another decode pulls it otherwise
        prefer = self._prefill.instance_id if self._prefill.local else None
        # the prompt as decodes' caches would hold it: hashed once, at the first pick
        prompt = instances.prompt_blocks(TokenPrompt(reply.prompt_token_ids))

        def take() -> Instance | None:
            not_on = self._not_on(tried)
            instance = instances.decode_with_room(
                num_tokens, router.now(), not_on, handle.layout, prompt, prefer
            )
            if instance is None and not instances.decode_links(not_on, handle.layout):
                raise _NoDecodeLeft
            return instance

        while True:
            not_on = self._not_on(tried)
            links = instances.decode_links(not_on, handle.layout)
            if (
                not links
                and command.await_link
                and await self._a_decode_connects(tried, handle.layout, handle)
            ):
                not_on = self._not_on(tried)  # (asked again after a wait)
                links = instances.decode_links(not_on, handle.layout)
            unplaceable = instances.decode_unplaceable(
                links,
                not_on,
                handle.layout,
                num_tokens,
                reply.prompt_tokens - self._prefill.leg_generated,
                reply.token_budget,
                last_reason,
            )
            if unplaceable is not None:
                if unplaceable[0] is Reason.SERVICE_UNAVAILABLE:
                    raise _NoDecodeTakesIt(rm.Failure(*unplaceable))
                raise ShellFailure(rm.Failure(*unplaceable))
            # the reserved place becomes a waiter's (no checkpoint until wait_for holds it);
            # a request back after a decode refused it holds none: it was admitted already
            admitted = not self._queue_place_reserved
            self.unreserve()
            try:
                instance = self._workers.decode_queue.take_now(take)
                if instance is not None:
                    return instance
                # the machine's KV_LEASE deadline bounds the wait
                return await self._workers.decode_queue.wait_for(take, admitted=admitted)
            except _NoDecodeLeft:
                # its place is its own again while it waits for a decode (it has just
                # left it: nothing ran since)
                self.reserve_place()
            except QueueFull as exc:
                raise ShellFailure(rm.Failure(Reason.QUEUE_FULL, rm.QUEUE_FULL_MESSAGE)) from exc

    async def _a_decode_connects(
        self, tried: Mapping[str, Hashable], layout: KvLayout, handle: KvHandle
    ) -> bool:
        """Whether a decode not in ``tried`` connects within ``decode_reconnect_wait_s``
        (and before the KV must be pulled)."""
        router = self._host.router
        within_s = self._workers.leases.left_s(handle, router.now()) - self._lease_margin_s
        wait_s = min(router.config.router.decode_reconnect_wait_s, within_s)
        if wait_s <= 0:
            return False
        with trio.move_on_after(wait_s):
            await self._workers.instances.wait_for_decode_link(lambda: self._not_on(tried), layout)
            return True
        return False

    # --- the run ----------------------------------------------------------------------

    async def run(self, wait: RunDecode) -> Wait | None:
        """Start the request on the decode placed, and stream its tokens to the client."""
        host = self._host
        prefill = self._prefill
        reply = prefill.reply
        assert reply is not None and reply.kv_handle is not None
        link, sent_at = self.link, wait.sent_at
        assert link is not None and link.capacity is not None  # (what decode_with_room picks)
        start = DecodeStart(
            request_id=prefill.wire_id,
            prompt_token_ids=reply.prompt_token_ids,
            first_token_id=reply.first_token_id,
            sampling=host.request.sampling,
            token_budget=reply.token_budget,
            tokens_generated=prefill.leg_generated + 1,
            cached_tokens=reply.cached_tokens,
            kv_handle=reply.kv_handle,
            generated_tokens=prefill.leg_generated,
        )
        choices = running_choices(reply)
        if host.request.sampling.n > 1:
            start = DecodeStartChoices.of(start, choices)
        start = traced_start(start, host.decode_traceparent)
        self._choice_ids = [choice_request_id(prefill.wire_id, c) for c, _ in choices if c]
        try:
            stream = await link.start(
                start,
                self._blocks(reply, link.capacity.block_size),
                keep_token_ids=prefill.generated is not None,
            )
        except BackendUnreachable as exc:
            return await host.report(rm.DecodeNotSent(str(exc)))
        await host.report(rm.DecodeStartQueued())  # (prefill's token goes out now)
        while isinstance(stream.outcome, StreamUnanswered):
            await stream.wait_update()
        outcome = stream.outcome
        if isinstance(outcome, StreamAccepted) or (
            isinstance(outcome, StreamFailed) and outcome.accepted
        ):
            host.figures.handoff_s = time.perf_counter() - sent_at
            if not self._streaming:
                self._streaming = True
                host.router.metrics.streams_active.inc()
            await host.report(rm.DecodeAccepted())
            if stream.choices is not None:
                return await stream_choices(host, stream, self._served, self._failed)
            return await stream_tokens(host, stream, self._served, self._failed)
        if isinstance(outcome, StreamFailed):
            reason = outcome.loss.migration_reason
            return await host.report(rm.DecodeFailed(outcome.message, reason))
        assert isinstance(outcome, StreamRejected)
        rejection = outcome.rejection
        return await host.report(
            rm.DecodeRejected(
                rejection.message,
                retryable=rejection_is_retryable(rejection),
                # shutting down, or its pull failed: another; NO_ROOM: a fresh report
                exclude=rejection.reason != RejectReason.NO_ROOM,
                layout_mismatch=rejection.reason == RejectReason.LAYOUT_MISMATCH,
                kv_source_failed=rejection.reason == RejectReason.TRANSFER_FAILED,
            )
        )

    def _served(self) -> None:
        decode = self.instance()
        if decode is not None:
            self._workers.instances.instance_served(decode)

    async def _failed(self, stream: DecodeRun, failure: StreamFailed) -> Wait | None:
        """Decode holds nothing of it any more: it failed there, or the link aborted it."""
        host = self._host
        if failure.cut_off:
            return await host.report(rm.DecodeFailed(failure.message, cut_off=True))
        loss = failure.loss
        decode = self.instance()
        if decode is not None and not loss.is_link_loss:
            # a lost link is out of rotation until it reconnects: one loss fails all its
            # streams at once, and is not that many failures in a row
            self._workers.instances.instance_failed(decode, host.router.now())
        migratable = loss.may_migrate and stream.token_ids is not None
        generated = self._prefill.generated
        if migratable and generated is not None and host.machine.decode_confirmed:
            # every token it pushed went out: a continuation starts after them
            assert stream.token_ids is not None
            generated += stream.token_ids
            self.stop_counting()  # until another decode accepts it
        event = rm.DecodeFailed(failure.message, loss.migration_reason, migratable=migratable)
        return await host.report(event)

    def abort(self) -> None:
        """End the request on its decode, if it still runs there (each of its choices)."""
        if self.link is not None:
            self.link.abort(self._prefill.wire_id)
            for choice_id in self._choice_ids:
                self.link.abort(choice_id)

    def stop_counting(self) -> None:
        """The request streams from no decode (now): out of the active streams' count."""
        if self._streaming:
            self._streaming = False
            self._host.router.metrics.streams_active.dec()

    def instance(self) -> Instance | None:
        """The decode instance the request runs on, if it is still known."""
        link = self.link
        return None if link is None else self._workers.instances.get(link.instance_id)
