"""A request's two legs on pdtrio instances: the prefill calls and the decode run.

The shell (``pdtrio.router.request.pipeline``) carries out the request machine's
commands; the ones that reach an instance come here.  :class:`PrefillLeg` picks
a prefill instance, calls it (the first call, a retry, a migration's
continuation), checks its KV handle, and releases its KV; :class:`DecodeLeg`
places the request on a decode instance with room (waiting for room or for a
link), starts it, and hands its tokens to the client.  Each reports what
happened to the machine through the shell (:meth:`LegHost.report`) and does
what the answer says next; neither decides anything the machine decides.

These are the pdtrio backend's legs (``pdtrio.router.workers.backend``), with the
shapes the shell knows (``pdtrio.router.backend``: :class:`PrefillSide`,
:class:`DecodeSide`); placement is the instance table's
(``pdtrio.router.workers.instances``); the token stream to the client is the one every
backend shares (``pdtrio.router.request.token_path``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Mapping
from typing import Protocol, final

import trio

from pdtrio.protocol import request as rm
from pdtrio.protocol.errors import Reason
from pdtrio.protocol.kv_layout import KvLayout, choice_blocks_needed
from pdtrio.protocol.link.wire import (
    DecodeStart,
    DecodeStartChoices,
    KvHandle,
    PrefillFailed,
    PrefillReply,
    PrefillRequest,
    RejectReason,
    TokenPrompt,
    choice_request_id,
    first_logprob,
    reply_choices,
)
from pdtrio.protocol.placement.prefix_index import PromptBlocks
from pdtrio.protocol.request.lifecycle import State
from pdtrio.router.backend import (
    BackendLost,
    BackendUnreachable,
    DecodeRun,
    LegHost,
    RunDecode,
    ShellFailure,
    Wait,
)
from pdtrio.router.metrics import MIGRATION_REASONS
from pdtrio.router.request.capacity import CapacityQueue, QueueFull
from pdtrio.router.request.token_path import (
    CUT_OFF_MESSAGE,
    NO_COUNTS,
    stream_choices,
    stream_tokens,
)
from pdtrio.router.workers.instances import Instance, InstanceTable
from pdtrio.router.workers.kv_leases import LeaseClock
from pdtrio.router.workers.link import (
    WorkerLink,
    rejection_is_retryable,
    release_token,
)
from pdtrio.router.workers.supervisor import LinkSupervisor


class WorkerParts(Protocol):
    """What the legs use of the pdtrio backend (``pdtrio.router.workers.backend``)."""

    instances: InstanceTable
    links: LinkSupervisor
    decode_queue: CapacityQueue[Instance]
    leases: LeaseClock


log = logging.getLogger("pdtrio.router.pipeline")

# a stream's failure reasons that are its link's, not the worker's word on the request
_LINK_FAILURES = frozenset({"link_lost", "link_timeout"})


class _NoDecodeLeft(Exception):
    """No decode that could take the request is connected any more: it stops waiting
    for room (the next in the queue then looks)."""


@final
class PrefillLeg:
    """The request's prefill calls: the first, its retries, a migration's continuation.

    ``keep_tokens``: every token id delivered is kept (``generated``), for a migration
    to continue from.
    """

    def __init__(self, host: LegHost, workers: WorkerParts, *, keep_tokens: bool) -> None:
        self._host = host
        self._workers = workers
        self.instance: Instance | None = None  # the prefill instance called last
        # that instance is the request's decode too (conditional disaggregation): the KV
        # stays where it was computed
        self.local = False
        # the current leg: the id workers know it by (a continuation gets a new one, so
        # nothing left of an earlier one, a late release say, can touch it), its call,
        # and prefill's reply
        self.wire_id = host.request_id
        self._call: PrefillRequest | None = None
        self.reply: PrefillReply | None = None
        # what the prefix index knows of the call's prompt, and of which call
        self._prompt_blocks: PromptBlocks | None = None
        self._prompt_blocks_of: PrefillRequest | None = None
        self._kv_access_token = ""  # the grant in prefill's KV handle, once it answered
        self._lease_holder: Instance | None = None  # the prefill instance holding our KV
        # the prompt's own token ids; every token id delivered; of the current prompt's
        # ids, how many are output
        self.prompt_ids: tuple[int, ...] = ()
        self.generated: list[int] | None = [] if keep_tokens else None
        self.leg_generated = 0
        self._started = 0.0

    async def emit_first_token(self, final: bool) -> None:
        """Deliver prefill's token (``final``: the whole answer)."""
        reply = self.reply
        assert reply is not None
        generated = self.generated
        if not final and generated is not None:
            generated.append(reply.first_token_id)
        logprob = first_logprob(reply)
        more = reply_choices(reply)
        await self._host.deliver(
            reply.first_text,
            1,
            reply.finish_reason,
            reply.usage,
            final=final and not more,
            logprobs=None if logprob is None else (logprob,),
        )
        for first in more:  # n > 1: the other choices' first tokens, the last one final
            await self._host.deliver(
                first.text,
                1,
                first.finish_reason,
                first.usage,
                final=final and first is more[-1],
                logprobs=None if first.logprob is None else (first.logprob,),
                choice=first.choice,
            )

    @property
    def instance_id(self) -> str | None:
        return None if self.instance is None else self.instance.instance_id

    def no_instance_reason(self) -> str:
        host = self._host
        return self._workers.instances.no_instance_reason(host.request.model)

    async def send(self, command: rm.SendPrefill) -> Wait | None:
        host = self._host
        router = host.router
        instances = self._workers.instances
        if self._call is None:
            self._call = self._first_call()
        call = self._call
        if self._prompt_blocks_of is not call:
            # what the prefix index knows of this call's prompt (a migration's is new)
            self._prompt_blocks = instances.prompt_blocks(call.prompt)
            self._prompt_blocks_of = call
        now = router.now()
        model = host.request.model
        # little of the prompt missing from a decode's cache: that decode prefills it
        instance = instances.pick_local_prefill(model, now, command.exclude, self._prompt_blocks)
        self.local = instance is not None
        if instance is None:
            instance = instances.pick_prefill(model, now, command.exclude, self._prompt_blocks)
        if instance is None or instance.link is None:
            return await host.report(rm.PrefillUnavailable())
        if command.retry:
            router.metrics.retries.labels("prefill").inc()
        else:
            self._started = time.perf_counter()
        where = "local" if self.local else "remote"
        router.metrics.prefill_placed[where].inc()
        host.figures.prefill_at = where
        self.instance = instance
        await host.report(rm.PrefillSent(instance.instance_id))
        instance.prefill_started()
        try:
            # a cancelled call releases the request on prefill itself
            answer = await instance.link.prefill(call)
        except BackendUnreachable:
            return await host.report(rm.PrefillNotSent())  # it never saw it: another may
        except BackendLost as exc:
            # the worker drops a lost link's prefills: another instance may try
            instances.instance_failed(instance, router.now())
            return await host.report(rm.PrefillLost(str(exc)))
        finally:
            instance.prefill_ended()
        if type(answer) is PrefillFailed:
            instances.prefill_failed(instance, answer, router.now())
            failure = rm.WorkerFailure(
                answer.status, answer.error_type, answer.message, answer.param
            )
            return await host.report(rm.PrefillFailed(failure))
        assert isinstance(answer, PrefillReply)  # (or a reply with a logprob)
        instances.instance_served(instance)
        if self._prompt_blocks is not None:
            instances.learn_prompt(self._prompt_blocks, instance, answer.prompt_token_ids)
        if answer.finish_reason is not None and answer.usage is None:
            raise ShellFailure(NO_COUNTS)
        if not command.continuation:  # the request's own prefill, not a migration's
            host.figures.prefill_s = time.perf_counter() - self._started
            host.figures.prompt_tokens = answer.prompt_tokens
            self.prompt_ids = answer.prompt_token_ids
            if host.shaper is not None:
                host.shaper.set_prompt_usage(answer.prompt_tokens, answer.cached_tokens)
        self.reply = answer
        handle = answer.kv_handle
        if handle is None:
            self._check_choices(answer, instance)
            return await host.report(rm.Prefilled(None))
        self._kv_access_token = handle.access_token  # what a release must show
        self._lease_holder = instance
        instance.lease_taken()  # its link stays until this request ends
        self._check_choices(answer, instance)  # (its KV is released with the grant, if not)
        await self._check_kv_source(handle, instance)
        ends_at = self._workers.leases.ends_at(handle, router.now())
        return await host.report(rm.Prefilled(ends_at))

    def _check_choices(self, answer: PrefillReply, instance: Instance) -> None:
        """A reply has a first token for every choice asked for, and counts for those
        that finished (a worker from before n > 1 answers one choice)."""
        asked = self._host.request.sampling.n
        choices = reply_choices(answer)
        if len(choices) != asked - 1 or any(
            first.choice != index for index, first in enumerate(choices, 1)
        ):
            raise ShellFailure(
                rm.Failure(
                    Reason.INTERNAL,
                    f"prefill instance {instance.instance_id} answered {len(choices) + 1} "
                    f"choices of the {asked} asked for",
                )
            )
        if any(first.finish_reason is not None and first.usage is None for first in choices):
            raise ShellFailure(NO_COUNTS)

    async def _check_kv_source(self, handle: KvHandle, instance: Instance) -> None:
        """Decode pulls only from where the prefill instance registered its KV port: a
        handle naming another address (or instance) is refused, never passed on.

        A restarted worker serves a new KV port: what its /pd/info says now (asked at
        the URL it registered, with the worker secret) is its registration then.
        """
        instances = self._workers.instances
        if handle.instance_id == instance.instance_id and instances.kv_source_mismatch(
            handle, instance
        ):
            await self._workers.links.refresh_transfer_endpoint(instance)
        if instances.kv_source_mismatch(handle, instance):
            log.error(
                "prefill instance %s handed out KV at %s:%d (as %r), not its registered %s:%d",
                instance.instance_id,
                handle.transfer_host,
                handle.transfer_port,
                handle.instance_id,
                *instance.transfer_endpoint,
            )
            raise ShellFailure(
                rm.Failure(
                    Reason.BAD_KV_HANDLE,
                    f"prefill instance {instance.instance_id} named a KV source it is not "
                    "registered with",
                )
            )

    def _first_call(self) -> PrefillRequest:
        request = self._host.request
        return PrefillRequest(
            self.wire_id,
            request.prompt,
            request.sampling,
            request.max_tokens,
            release_token(self.wire_id),
        )

    def release(self) -> None:
        """Free what prefill holds of the current leg (its KV, or its running prefill)."""
        instance = self.instance
        if instance is not None and instance.link is not None:
            instance.link.release(self.wire_id, self._kv_access_token)

    def drop_lease(self) -> None:
        """The request holds prefill's KV no more: its link may go."""
        if self._lease_holder is not None:
            self._lease_holder.lease_returned()
            self._lease_holder = None

    def migrate(self, command: rm.Migrate) -> None:
        """A new leg: the prompt's token ids and every token delivered become a new prompt;
        a prefill computes their KV (told how many are output already: they are spent
        from the same budget and replayed into the stop rules, never sent again)."""
        host = self._host
        generated = self.generated
        reply = self.reply
        assert generated is not None and reply is not None
        host.figures.migrations.append(command.reason)
        host.router.metrics.migrations.labels(command.reason).inc()
        log.warning(
            "request %s: decode on %s lost after %d tokens (%s); continuing elsewhere",
            host.request_id,
            command.lost_on,
            len(generated),
            command.reason,
        )
        self.drop_lease()  # its KV was released (at decode's first token, or given up)
        self.wire_id = f"{host.request_id}-m{len(host.figures.migrations)}"
        self.leg_generated = len(generated)
        self._call = PrefillRequest(
            self.wire_id,
            TokenPrompt((*self.prompt_ids, *generated)),
            host.request.sampling,
            reply.token_budget,  # the whole budget: prefill spends the generated from it
            release_token(self.wire_id),
            generated_tokens=len(generated),
        )


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
        more = len(_running_choices(reply)) - 1
        if more > 0:
            assert reply.kv_handle is not None
            tokens += more * (reply.token_budget + 2 * reply.kv_handle.layout.block_size)
        return tokens

    def _blocks(self, reply: PrefillReply, block_size: int) -> int:
        """The blocks decode allocates for the request (the full prompt blocks once)."""
        choices = len(_running_choices(reply))
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
        instance = await self._with_room(
            reply, reply.kv_handle, command.exclude, command.last_reason
        )
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
        tried: Mapping[str, Hashable],
        last_reason: str,
    ) -> Instance:
        """A decode instance with room for the request (not one of ``tried``, unless it has
        reconnected since), waiting in FIFO order for one.

        While it waits, the decodes that could take it may all go (a link lost, or
        silent: a hung worker): it then waits for one to (re)connect as a newcomer does,
        ``decode_reconnect_wait_s``, not for the worker to wake within the KV lease."""
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
            if not links and await self._a_decode_connects(tried, handle.layout, handle):
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
                raise ShellFailure(rm.Failure(*unplaceable))
            # the reserved place becomes a waiter's (no checkpoint until wait_for holds it)
            self.unreserve()
            try:
                instance = self._workers.decode_queue.take_now(take)
                if instance is not None:
                    return instance
                # the machine's KV_LEASE deadline bounds the wait
                return await self._workers.decode_queue.wait_for(take)
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
        choices = _running_choices(reply)
        if host.request.sampling.n > 1:
            start = DecodeStartChoices.of(start, choices)
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
        while not (stream.accepted or stream.rejection or stream.failure):
            await stream.wait_update()
        if stream.accepted:
            host.figures.handoff_s = time.perf_counter() - sent_at
            if not self._streaming:
                self._streaming = True
                host.router.metrics.streams_active.inc()
            await host.report(rm.DecodeAccepted())
            if stream.choices is not None:
                return await stream_choices(host, stream, self._served, self._failed)
            return await stream_tokens(host, stream, self._served, self._failed)
        if stream.failure is not None:
            reason = stream.failure_reason or "link_lost"
            return await host.report(rm.DecodeFailed(stream.failure, migration_label(reason)))
        rejection = stream.rejection
        assert rejection is not None
        return await host.report(
            rm.DecodeRejected(
                rejection.message,
                retryable=rejection_is_retryable(rejection),
                # shutting down, or its pull failed: another; NO_ROOM: a fresh report
                exclude=rejection.reason != RejectReason.NO_ROOM,
                layout_mismatch=rejection.reason == RejectReason.LAYOUT_MISMATCH,
            )
        )

    def _served(self) -> None:
        decode = self.instance()
        if decode is not None:
            self._workers.instances.instance_served(decode)

    async def _failed(self, stream: DecodeRun, failure: str) -> Wait | None:
        """Decode holds nothing of it any more: it failed there, or the link aborted it."""
        host = self._host
        if stream.cut_off:
            return await host.report(rm.DecodeFailed(CUT_OFF_MESSAGE, cut_off=True))
        reason = stream.failure_reason
        decode = self.instance()
        if decode is not None and reason not in _LINK_FAILURES:
            # a lost link is out of rotation until it reconnects: one loss fails all its
            # streams at once, and is not that many failures in a row
            self._workers.instances.instance_failed(decode, host.router.now())
        migratable = reason in MIGRATION_REASONS and stream.token_ids is not None
        generated = self._prefill.generated
        if migratable and generated is not None and host.machine.lifecycle.state is State.DECODING:
            # every token it pushed went out: a continuation starts after them
            assert stream.token_ids is not None
            generated += stream.token_ids
            self.stop_counting()  # until another decode accepts it
        event = rm.DecodeFailed(failure, migration_label(reason), migratable=migratable)
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


def _running_choices(reply: PrefillReply) -> tuple[tuple[int, int], ...]:
    """The choices decode runs, as (choice, first token id): those prefill did not finish."""
    choices = ((0, reply.first_token_id),) if reply.finish_reason is None else ()
    if type(reply) is PrefillReply:  # (n = 1: no more choices, nothing to look through)
        return choices
    return choices + tuple(
        (first.choice, first.token_id)
        for first in reply_choices(reply)
        if first.finish_reason is None
    )


def migration_label(reason: str) -> str:
    """A stream's failure reason as a MIGRATION_REASONS label."""
    return reason if reason in MIGRATION_REASONS else "decode_failed"
