"""A request's two legs on pdtrio instances: here the prefill calls (the decode run is
``pdtrio.router.workers.decode``'s).

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
from typing import Protocol, final

from pdtrio.protocol import request as rm
from pdtrio.protocol.errors import Reason
from pdtrio.protocol.link.wire import (
    KvHandle,
    PrefillFailed,
    PrefillReply,
    PrefillRequest,
    TokenPrompt,
    first_logprob,
    reply_choices,
    traced_call,
)
from pdtrio.protocol.openai.answers import AnswerDelta
from pdtrio.protocol.placement.prefix_index import PromptBlocks
from pdtrio.router.backend import (
    BackendLost,
    BackendUnreachable,
    LegHost,
    ShellFailure,
    Wait,
)
from pdtrio.router.request.capacity import CapacityQueue
from pdtrio.router.request.token_path import (
    NO_COUNTS,
)
from pdtrio.router.workers.instances import Instance, InstanceTable
from pdtrio.router.workers.kv_leases import LeaseClock
from pdtrio.router.workers.supervisor import LinkSupervisor


class WorkerParts(Protocol):
    """What the legs use of the pdtrio backend (``pdtrio.router.workers.backend``)."""

    instances: InstanceTable
    links: LinkSupervisor
    decode_queue: CapacityQueue[Instance]
    leases: LeaseClock


log = logging.getLogger("pdtrio.router.pipeline")


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
            AnswerDelta(
                reply.first_text,
                1,
                reply.finish_reason,
                reply.usage,
                final=final and not more,
                logprobs=None if logprob is None else (logprob,),
            )
        )
        for first in more:  # n > 1: the other choices' first tokens, the last one final
            await self._host.deliver(
                AnswerDelta(
                    first.text,
                    1,
                    first.finish_reason,
                    first.usage,
                    final=final and first is more[-1],
                    logprobs=None if first.logprob is None else (first.logprob,),
                    choice=first.choice,
                )
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
        if instance is None and command.avoid:  # (the one a failed handoff blamed: last)
            avoid = command.exclude | command.avoid
            instance = instances.pick_prefill(model, now, avoid, self._prompt_blocks)
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
            answer = await instance.link.prefill(traced_call(call, host.prefill_traceparent))
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

    async def wait_for_instance(self, command: rm.WaitForPrefill) -> Wait | None:
        """Until a prefill instance not in the command's ``exclude`` could take the request
        (the machine's PREFILL_WAIT deadline bounds it)."""
        host = self._host
        instances = self._workers.instances
        if not instances.prefill_available(host.request.model, command.exclude):
            log.info("request %s: no prefill instance is up; waiting for one", host.request_id)
            await instances.wait_for_prefill(host.request.model, command.exclude)
        return await host.report(rm.PrefillConnected())

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
            self._workers.leases.release_token(self.wire_id),
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
        if command.reason == rm.MigrationReason.HANDOFF_FAILED:
            log.warning(
                "request %s: no decode could take prefill %s's KV (last: %s); "
                "going again from a new prefill",
                host.request_id,
                self.instance_id,
                command.lost_on,
            )
        else:
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
            self._workers.leases.release_token(self.wire_id),
            generated_tokens=len(generated),
        )


def running_choices(reply: PrefillReply) -> tuple[tuple[int, int], ...]:
    """The choices decode runs, as (choice, first token id): those prefill did not finish."""
    choices = ((0, reply.first_token_id),) if reply.finish_reason is None else ()
    if type(reply) is PrefillReply:  # (n = 1: no more choices, nothing to look through)
        return choices
    return choices + tuple(
        (first.choice, first.token_id)
        for first in reply_choices(reply)
        if first.finish_reason is None
    )
