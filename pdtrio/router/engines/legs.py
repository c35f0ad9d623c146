"""A request's two legs on vLLM or SGLang instances: the engine-HTTP backend of the legs.

The request runs through the same machine (``pdtrio.protocol.request.machine``)
and shell (``pdtrio.router.request.pipeline``) as on pdtrio's workers; only the legs
differ.  The machine is built with ``first_token_from_prefill=False``: an
engine's decode generates every token from the request again, so prefill's
answer carries nothing for the client, the response starts with decode's
first batch, and a decode failing before it sends the request again from a new
prefill.  Everything else is the shared one: client writes and egress
(:func:`pdtrio.router.request.token_path.stream_tokens`), the stall sweep's hang-up, the
deadlines, retries, cancellation, the drain, and cleanup (the machine's
``ReleasePrefill`` here frees prefill's KV no decode pulled).

vLLM's KV connector protocol and SGLang's bootstrap protocol are the prefill leg's
(``pdtrio.router.engines.prefill`` says how each runs).

Several choices (``n`` > 1): a PD flow per choice (its prefill, its leg on the decode
placed), streamed back as the choices of one answer by the shared
:func:`pdtrio.router.request.token_path.stream_choices` (:class:`EngineDecodeLeg` says how;
``vllm_pd.choice_body`` why the engines are never sent ``n``).  A choice failing
before its own first token once other choices' went out runs again alone (a new
prefill and decode leg, :meth:`EngineDecodeLeg._rerun_choice`).  A client that leaves,
or a choice failing otherwise, closes every leg; each choice's unpulled KV is freed as
one request's is.

Logprobs: the legs carry the client's fields as they came; decode's stream
brings every token's (vLLM's decode computes them all again; SGLang's gets the
first token's from prefill with the KV, so its prefill leg must ask too), read
into the items the shared token path hands the shaper with their tokens.  A
request that asks for none has its stream read without looking at them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Mapping
from typing import TYPE_CHECKING, Any, Literal, cast, final

import httpx
import trio

from pdtrio.protocol import request as rm
from pdtrio.protocol.engines.decode_events import DecodeEventReader
from pdtrio.protocol.engines.vllm import (
    PATHS,
)
from pdtrio.protocol.errors import Reason, is_clients_fault
from pdtrio.protocol.link.wire import Usage
from pdtrio.router.backend import (
    BackendError,
    DecodeRun,
    DecodeSide,
    LegHost,
    PrefillSide,
    RunDecode,
    Wait,
)
from pdtrio.router.engines.pool import EngineInstance, EnginePool, transport_errors
from pdtrio.router.engines.prefill import (
    EnginePrefillLeg,
    PrefillFailure,
    answer_failure,
    prefill_failure_message,
)
from pdtrio.router.engines.stream import (
    ChoiceLeg,
    EngineChoices,
    EngineStream,
    LegAnswers,
)
from pdtrio.router.request.token_path import stream_choices, stream_tokens
from pdtrio.router.stream_outcome import DecodeLoss, StreamFailed

if TYPE_CHECKING:
    pass

log = logging.getLogger("pdtrio.router.engines")


@final
class EngineLegs:
    """The pipeline's ``make_legs`` for a request on ``pool``'s engines: ``client_body``
    is the client's request as it came (what pdtrio validated; a ``/v1/responses`` one
    as the chat request it stands for, ``responses.engine_chat_body``), the legs' fields
    set on it."""

    def __init__(
        self,
        pool: EnginePool,
        client_body: Mapping[str, Any],
        kind: Literal["chat", "completion"],
        prefill_stage: type[EnginePrefillLeg],
    ) -> None:
        self.pool = pool
        self.client_body = client_body
        self.kind = kind
        self._prefill_stage = prefill_stage  # vLLM's or SGLang's, as the backend chose

    def __call__(self, host: LegHost) -> tuple[PrefillSide, DecodeSide, bool]:
        prefill = self._prefill_stage(host, self)
        return prefill, EngineDecodeLeg(host, self, prefill), False


@final
class EngineDecodeLeg:
    """The request's decode leg on an engine: its placement and its stream.

    ``n`` > 1: each choice is a PD flow of its own (one sample each, ``vllm_pd.choice_body``
    says why): its prefill (vLLM: its call and KV; SGLang: its room, its prefill call
    beside its decode stream) and its leg on the decode placed, all at once, streamed
    back as the choices of one answer by the shared :func:`stream_choices`.  The request
    is one to the machine: a choice failing before any token went out sends the whole
    request again from new prefills.  One failing before its own first token, once other
    choices' went out, is started again alone (:meth:`_rerun_choice`: a new prefill, a new
    decode leg, as the machine's ``choice_reruns`` answer, under the request's limits)
    while the others stream on; one failing after its first token, or out of retries,
    fails the request.
    """

    def __init__(self, host: LegHost, legs: EngineLegs, prefill: EnginePrefillLeg) -> None:
        self._host = host
        self._legs = legs
        self._pool = legs.pool
        self._prefill = prefill
        self.instance: EngineInstance | None = None
        self._scope: trio.CancelScope | None = None  # the decode run's legs, while open
        self._streaming = False  # counted in the router's active streams
        # SGLang: what a prefill call beside decode failed with (before any decode's token)
        self._prefill_failed: PrefillFailure | None = None
        self._choices: list[ChoiceLeg] = []  # the current run's, by choice
        self._reader: trio.Nursery | None = None  # the current run's legs, while streaming

    @property
    def instance_id(self) -> str | None:
        return None if self.instance is None else self.instance.instance_id

    def reserve_place(self) -> bool:
        """Engines queue requests themselves: the router's decode queue is its workers'."""
        return True

    def unreserve(self) -> None:
        """(Nothing reserved: see :meth:`reserve_place`.)"""

    async def wait_for_link(self, command: rm.WaitForDecode) -> Wait | None:
        """An engine is reached per request over HTTP: there is no connection to wait for."""
        return await self._host.report(rm.DecodeConnected())

    async def place(self, command: rm.PlaceDecode) -> Wait | None:
        host = self._host
        if command.retry:
            host.router.metrics.retries.labels("decode").inc()
        instance = self._pool.pick(
            "decode", host.request.model, frozenset(command.exclude), self._prefill.prefix_keys
        )
        if instance is None:
            why = f" (last: {command.last_reason})" if command.retry else ""
            failure = rm.Failure(
                Reason.SERVICE_UNAVAILABLE, f"no decode instance is available{why}"
            )
            return await host.report(rm.DecodeUnavailable(failure))
        self.instance = self._prefill.decode = instance
        await host.report(rm.DecodeStartSent(instance.instance_id, instance.instance_id))
        return RunDecode(time.perf_counter())

    def _choice_legs(self) -> list[ChoiceLeg]:
        """This run's legs, one per choice, each with a stream of its own."""
        host = self._host
        prefill = self._prefill
        max_pending = host.router.config.router.stream_buffer_tokens
        with_logprobs = host.request.sampling.wants_logprobs
        decode = self.instance
        assert decode is not None
        legs = []
        for choice in range(len(prefill.choice_bodies)):
            stream = EngineStream(max_pending, with_logprobs=with_logprobs)
            legs.append(
                prefill.choice_leg(choice, stream, decode, prefill.choice_request_id(choice))
            )
        return legs

    async def run(self, wait: RunDecode) -> Wait | None:
        """Decode's legs (and SGLang's prefill calls beside them), streamed to the client."""
        host = self._host
        await host.report(rm.DecodeStartQueued())
        self._prefill_failed = None
        self._choices = self._choice_legs()
        outcome: Wait | None = None
        self._prefill.decoding = True
        try:
            async with trio.open_nursery() as beside:
                with trio.CancelScope() as decode_scope:
                    self._scope = decode_scope
                    for leg in self._choices:
                        if leg.prefill_body is not None:
                            beside.start_soon(self._prefill_beside, decode_scope, leg)
                    outcome = await self._decode(wait.sent_at)
                self._scope = None
                ended = host.machine.ended
                if ended is None or ended.ending is not rm.Ending.OK:
                    # decode did not finish: a prefill beside it would wait for its decode
                    beside.cancel_scope.cancel()
                # (it finished: SGLang's prefill answers once the transfer is done)
        finally:
            # vLLM: a choice whose leg ended before its first token leaves KV no decode
            # will pull now (a run again starts from new prefills): freed
            self._prefill.decoding = False
            self._prefill.release_unpulled()
        failed, self._prefill_failed = self._prefill_failed, None
        if failed is not None and host.machine.decode_under_way:
            # (in another phase, decode's own failure was reported first: the machine
            # is already trying again)
            self._stop_counting()
            return await host.report(failed)
        return outcome

    async def _prefill_beside(self, decode_scope: trio.CancelScope, leg: ChoiceLeg) -> None:
        assert leg.prefill_body is not None and leg.prefill is not None
        failed = None
        with leg.prefill_scope:  # (cancelled: its choice started again alone)
            failed = await self._prefill.call_beside(leg.prefill, leg.prefill_body, leg.request_id)
        if failed is None or leg.decoded or self._scope is not decode_scope:
            return
        if any(other.decoded for other in self._choices):
            # other choices are under way (their tokens may be out): this one cannot be
            # served, which fails the request; decode is not to blame
            why = prefill_failure_message(failed)
            leg.stream.fail(
                f"prefill failed choice {leg.choice}: {why}", DecodeLoss.NOT_DECODES_FAULT
            )
            return
        self._prefill_failed = failed
        decode_scope.cancel()  # decode would wait for KV that never comes

    async def _decode(self, sent_at: float) -> Wait | None:
        """Every choice's leg at once; once each answered 200 (decode accepted the request),
        their streams to the client.  A leg that did not is decode's answer: refused (a
        4xx, the client's own) or failed."""
        host = self._host
        answers = LegAnswers(len(self._choices))
        async with trio.open_nursery() as reader:
            self._reader = reader
            for leg in self._choices:
                reader.start_soon(self._leg, leg, answers)
            await answers.all_in.wait()
            if answers.refusal is not None:
                reader.cancel_scope.cancel()  # (the other legs: closed, aborted there)
                return await host.report(answers.refusal)
            host.figures.handoff_s = time.perf_counter() - sent_at
            if not self._streaming:
                self._streaming = True
                host.router.metrics.streams_active.inc()
            await host.report(rm.DecodeAccepted())
            if len(self._choices) == 1:
                outcome = await stream_tokens(
                    host, self._choices[0].stream, self._served, self._failed
                )
            else:
                runs = EngineChoices([leg.stream for leg in self._choices])
                outcome = await stream_choices(
                    host, runs, self._served, self._failed, retry_alone=self._retry_choice
                )
            self._reader = None
            reader.cancel_scope.cancel()
        return outcome

    # --- a choice started again alone ------------------------------------------------

    def _retry_choice(self, choice: int, failure: StreamFailed) -> bool:
        """:func:`stream_choices`' ``retry_alone``: choice ``choice`` failed (``failure``)
        before any of its tokens went out, once other choices' had.  Start it again alone
        (a new prefill, a new decode leg, into its stream: the client sees nothing of
        it); False once its retries ran out, and its failure is the request's."""
        leg = self._choices[choice]
        stream = leg.stream
        reader = self._reader
        if reader is None:
            return False
        blamed = failure.loss is DecodeLoss.DECODE_FAILED
        first_prefill = self._prefill.instance
        rerun = self._host.machine.choice_reruns.failed(
            choice,
            cut_off=failure.cut_off,
            decode=leg.decode.instance_id if blamed else None,
            prefill=None if first_prefill is None else first_prefill.instance_id,
        )
        if rerun is None:
            return False
        if blamed:
            self._pool.failed(leg.decode, failure.message)
        log.info(
            "request %s: choice %d failed before its first token (%s): started again alone",
            self._host.request_id,
            choice,
            failure.message,
        )
        # (its legs, if still open, are closed: aborted in the engines)
        leg.scope.cancel()
        leg.prefill_scope.cancel()
        stream.restart()
        reader.start_soon(self._rerun_choice, leg, rerun, failure.message)
        return True

    async def _rerun_choice(self, failed: ChoiceLeg, rerun: rm.RerunChoice, failure: str) -> None:
        """Choice ``failed.choice`` again, as ``rerun`` says: a prefill (as the machine's
        ``choice_reruns`` allows) and a decode leg (not on a decode it failed on), streamed
        into its stream as its first run's would have been; what fails is its stream's
        failure (:meth:`_retry_choice` is then asked again)."""
        host = self._host
        pool = self._pool
        prefill = self._prefill
        reruns = host.machine.choice_reruns
        choice = failed.choice
        stream = failed.stream
        model = host.request.model
        # vLLM: its unpulled KV on the prefill it had is freed (a new prefill computes it)
        unpulled = prefill.unpulled[choice]
        prefill.unpulled[choice] = None
        if unpulled is not None:
            prefill.release_params(choice, unpulled)
        # its decode first: with none left, no prefill is computed for nothing
        decode = pool.pick("decode", model, rerun.exclude_decodes, prefill.prefix_keys)
        if decode is None:
            reruns.give_up(choice)
            stream.fail(
                f"choice {choice}: no decode instance is available (last: {failure})",
                DecodeLoss.NOT_DECODES_FAULT,
            )
            return
        request_id = prefill.rerun_request_id(choice)
        while True:
            instance = None
            send = reruns.next_prefill(choice)
            if send is not None:
                instance = pool.pick("prefill", model, send.exclude, prefill.prefix_keys)
            if instance is None:
                reruns.give_up(choice)
                why = prefill.no_instance_reason()
                stream.fail(f"choice {choice}: {why}", DecodeLoss.NOT_DECODES_FAULT)
                return
            reruns.prefill_sent(choice, instance.instance_id)
            host.router.metrics.retries.labels("prefill").inc()
            bodies = await prefill.rerun_bodies(instance, choice)
            if isinstance(bodies, tuple):
                body, prefill_call = bodies
                break
            prefill_failed = bodies
            if not reruns.prefill_failed(choice, prefill_failed):
                assert isinstance(prefill_failed, rm.PrefillFailed)  # the request's own (a 4xx)
                stream.fail(prefill_failed.failure.message, DecodeLoss.NOT_DECODES_FAULT)
                return
        host.router.metrics.retries.labels("decode").inc()
        leg = ChoiceLeg(choice, body, stream, decode, request_id, prefill_call, instance)
        self._choices[choice] = leg
        answers = LegAnswers(1)
        async with trio.open_nursery() as beside:
            if prefill_call is not None:
                beside.start_soon(self._prefill_beside_alone, leg)
            await self._leg(leg, answers)
            if answers.refusal is not None or isinstance(stream.outcome, StreamFailed):
                beside.cancel_scope.cancel()  # (its prefill would wait for a fetch)
        refusal = answers.refusal
        if refusal is None:
            return
        # (a decode that failed is out of rotation already)
        reruns.decode_refused(choice, decode.instance_id, refusal)
        stream.fail(refusal.message, DecodeLoss.NOT_DECODES_FAULT)

    async def _prefill_beside_alone(self, leg: ChoiceLeg) -> None:
        """SGLang: a choice started again alone's prefill call, beside its decode leg."""
        assert leg.prefill is not None and leg.prefill_body is not None
        failed = None
        with leg.prefill_scope:  # (cancelled: its decode leg failed first)
            failed = await self._prefill.call_beside(leg.prefill, leg.prefill_body, leg.request_id)
        if failed is None or leg.decoded or leg.scope.cancel_called:
            return
        leg.scope.cancel()  # its decode would wait for KV that never comes
        self._host.machine.choice_reruns.prefill_failed(leg.choice, failed)
        why = prefill_failure_message(failed)
        leg.stream.fail(f"prefill failed choice {leg.choice}: {why}", DecodeLoss.NOT_DECODES_FAULT)

    async def _leg(self, leg: ChoiceLeg, answers: LegAnswers) -> None:
        """Choice ``leg.choice``'s leg on the decode placed: its answer to ``answers``, then
        its events into its stream."""
        instance = leg.decode
        instance.in_flight += 1
        try:
            with leg.scope:
                await self._leg_call(leg, answers)
        finally:
            instance.in_flight -= 1

    async def _leg_call(self, leg: ChoiceLeg, answers: LegAnswers) -> None:
        pool = self._pool
        instance = leg.decode
        try:
            with transport_errors():
                await self._leg_stream(leg, answers)
        except BackendError as exc:
            # (the stream's own reads are _read's: this is the leg failing to start)
            why = f"decode on {instance.instance_id} lost: {exc}"
            pool.failed(instance, why)
            answers.refused(rm.DecodeFailed(why))

    async def _leg_stream(self, leg: ChoiceLeg, answers: LegAnswers) -> None:
        pool = self._pool
        instance = leg.decode
        async with pool.http.stream(
            "POST",
            instance.url + PATHS[self._legs.kind],
            json=leg.body,
            headers=instance.headers(leg.request_id, self._host.decode_traceparent),
        ) as response:
            if response.status_code != 200:
                content = await response.aread()
                failure = answer_failure(pool, instance, "decode", response.status_code, content)
                if is_clients_fault(failure.status):  # passed on
                    answers.refused(
                        rm.DecodeRejected(failure.message, retryable=False, failure=failure)
                    )
                else:
                    answers.refused(rm.DecodeFailed(failure.message))
                return
            answers.accepted()
            await self._read(response, leg)

    async def _read(self, response: httpx.Response, leg: ChoiceLeg) -> None:
        """A leg's server-sent events into its choice's stream: text, tool calls and token
        counts as they come, the finish held until the counts that end the stream (its
        usage chunk).

        Read to the end, past ``[DONE]`` or a failure: the response's byte iterators are
        then exhausted, not left to the garbage collector.
        """
        stream = leg.stream
        reader = DecodeEventReader(self._legs.kind, with_logprobs=stream.logprobs is not None)
        try:
            with transport_errors():
                if not await self._read_lines(response, reader, leg):
                    return  # cut off: closing the stream aborts the request in the engine
        except BackendError as exc:
            reader.lost(f"decode lost: {exc}")
        ending = reader.end()
        if isinstance(ending, str):
            stream.fail(ending)
            return
        await stream.push(
            ending.text,
            ending.tokens,
            ending.finish_reason,
            self._usage(leg.choice, reader.final_usage, reader.seen),
            ending.logprobs,
            tool_calls=ending.tool_calls,
        )

    async def _read_lines(
        self, response: httpx.Response, reader: DecodeEventReader, leg: ChoiceLeg
    ) -> bool:
        """Push what ``reader`` makes of each line to the leg's stream; False once the
        stream is cut off (its client too far behind)."""
        lines_of = cast(AsyncGenerator[str, None], response.aiter_lines())
        async with contextlib.aclosing(lines_of) as lines:
            async for line in lines:
                delta = reader.line(line)
                if reader.produced and not leg.decoded:
                    self._decoded(leg)
                if delta is not None and not await leg.stream.push(
                    delta.text,
                    delta.tokens,
                    None,
                    None,
                    delta.logprobs,
                    tool_calls=delta.tool_calls,
                ):
                    return False
        return True

    def _decoded(self, leg: ChoiceLeg) -> None:
        """Decode produced ``leg``'s first token: it has the KV (prefill freed its blocks,
        decode caches them)."""
        leg.decoded = True
        self._pool.served_prefix(leg.decode, self._prefill.prefix_keys)
        self._prefill.unpulled[leg.choice] = None

    def _usage(self, choice: int, final: Usage | None, completion_tokens: int) -> Usage:
        """Choice ``choice``'s counts: decode's, with its prefill's cached tokens (vLLM:
        decode's say what decode found; SGLang: decode's, prefill's answer may come
        after)."""
        answer = self._prefill.answers[choice]
        if final is None:
            prompt = 0 if answer is None else answer.prompt_tokens
            cached = 0 if answer is None else answer.cached_tokens
            return Usage(prompt, completion_tokens, cached)
        cached = final.cached_tokens if answer is None else answer.cached_tokens
        return Usage(final.prompt_tokens, final.completion_tokens, cached)

    def _served(self) -> None:
        """Every decode the answer's choices finished on served it, but one that failed
        another of its choices: that failure stands (as it would have for ``n`` = 1)."""
        decodes = {leg.decode.instance_id: leg.decode for leg in self._choices}
        if len(self._choices) > 1:
            for instance_id in self._host.machine.choice_reruns.failed_decodes:
                decodes.pop(instance_id, None)
        for decode in decodes.values():
            self._pool.served(decode)

    async def _failed(self, stream: DecodeRun, failure: StreamFailed) -> Wait | None:
        host = self._host
        if failure.cut_off:
            return await host.report(rm.DecodeFailed(failure.message, cut_off=True))
        if failure.loss is DecodeLoss.DECODE_FAILED:
            # (the decode its choice's leg ran on: a choice started again alone may be on
            # another)
            decode = next((leg.decode for leg in self._choices if leg.stream is stream), None)
            if decode is None:
                decode = self.instance
            assert decode is not None
            self._pool.failed(decode, failure.message)
        return await host.report(rm.DecodeFailed(failure.message))

    def abort(self) -> None:
        """End the request on decode: closing its legs' streams aborts it in the engine."""
        if self._scope is not None:
            self._scope.cancel()

    def stop_counting(self) -> None:
        self._stop_counting()

    def _stop_counting(self) -> None:
        if self._streaming:
            self._streaming = False
            self._host.router.metrics.streams_active.dec()
