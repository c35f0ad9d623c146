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

vLLM (the KV connector protocol, ``pdtrio.protocol.engines.vllm``): prefill's leg
is a one-token, unstreamed request keeping the KV for a remote decode; its
answer's ``kv_transfer_params`` go whole to decode's leg, streamed back.  Prefill's
blocks wait for a decode to pull them; a request that ends before one did (the
client left, a deadline, a decode failing before its first token) would strand
them until vLLM gives up on them (0.32's NIXL lease, 30 s by default; before it
``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s), so the release sends a one-token
decode leg in the background, which pulls them and so frees them on prefill.

SGLang (the bootstrap protocol, ``pdtrio.protocol.engines.sglang``): both legs go at
once with one room.  The prefill leg picks the instance and names the room
(``Prefilled`` at once); its call goes out in the decode run, beside decode's
stream: a prefill failing before decode's first token closes the decode leg
(it would wait for KV that never comes), and the machine hears of it
(``PrefillFailed``/``PrefillLost`` while decode starts) and tries another.

Several choices (``n`` > 1): a PD flow per choice (its prefill, its leg on the decode
placed), streamed back as the choices of one answer by the shared
:func:`pdtrio.router.request.token_path.stream_choices` (:class:`EngineDecodeLeg` says how;
``vllm_pd.choice_body`` why the engines are never sent ``n``).  A choice failing
before its own first token once other choices' went out runs again alone (a new
prefill and decode leg, :meth:`EngineDecodeLeg._rerun_choice`).  A client that leaves,
or a choice failing otherwise, closes every leg; each choice's unpulled KV is freed as
one request's is.

Tools: the legs carry the client's ``tools`` and ``tool_choice``, and the engine
renders them with its chat template.  The calls its tool parser read out of the answer
(``delta.tool_calls``: vLLM's ``--enable-auto-tool-choice --tool-call-parser ...``,
SGLang's ``--tool-call-parser``) reach the client as whole OpenAI calls; an engine with
no parser answers text, whose ``<tool_call>`` blocks the router reads out as it does
on its own workers (``pdtrio.protocol.openai.tools``).

Logprobs: the legs carry the client's fields as they came; decode's stream
brings every token's (vLLM's decode computes them all again; SGLang's gets the
first token's from prefill with the KV, so its prefill leg must ask too), read
into the items the shared token path hands the shaper with their tokens.  A
request that asks for none has its stream read as before, logprobs not looked at.

A 4xx from an engine is the client's own: passed on, never counted against
the instance.  A 5xx, an unreachable engine or a broken answer puts it out of
rotation for a while (``EnginePool.failed``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, cast, final

import attrs
import httpx
import trio

from pdtrio.protocol.engines.sglang import ROOM_BITS, bootstrap_body, prefill_leg_body
from pdtrio.protocol.engines.vllm import (
    PATHS,
    EngineAnswerError,
    EngineToolCalls,
    PrefillAnswer,
    choice_body,
    decode_body,
    parse_decode_event,
    parse_prefill_answer,
    prefill_body,
    release_body,
)
from pdtrio.protocol.errors import Reason
from pdtrio.protocol.link.wire import DecodeRejected, TokenLogprob, Usage
from pdtrio.protocol.openai.tools import ToolCall
from pdtrio.protocol.request import machine as rm
from pdtrio.protocol.tokens.stream_buffer import PushResult, StreamBuffer
from pdtrio.router.backend import (
    DecodeRun,
    DecodeSide,
    LegHost,
    PrefillSide,
    RunDecode,
    ShellFailure,
    Wait,
)
from pdtrio.router.engines.pool import EngineInstance, EnginePool
from pdtrio.router.request.token_path import CUT_OFF_MESSAGE, stream_choices, stream_tokens

if TYPE_CHECKING:
    from pdtrio.router.request.hold_timer import HoldTimer

log = logging.getLogger("pdtrio.router.engines")

# how long the background leg that frees an unpulled prefill's KV may take
_RELEASE_TIMEOUT_S = 30.0
# what an engine's transport failures raise (httpx's, and the OS's under it)
_TRANSPORT_ERRORS = (httpx.HTTPError, OSError)
# where a prefill running beside its decode may still fail the request
_DECODE_PHASES = frozenset({rm.Phase.DECODE_STARTING, rm.Phase.DECODING})
# a leg's stream failed by the decode instance (the reason it is suspended for)
_DECODE_FAILED = "decode_failed"
# what the machine hears of a prefill call that did not answer with KV
_PrefillFailure: TypeAlias = rm.PrefillNotSent | rm.PrefillLost | rm.PrefillFailed


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
    ) -> None:
        self.pool = pool
        self.client_body = client_body
        self.kind = kind

    def __call__(self, host: LegHost) -> tuple[PrefillSide, DecodeSide, bool]:
        prefill = EnginePrefillLeg(host, self)
        return prefill, EngineDecodeLeg(host, self, prefill), False


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _answer_failure(
    pool: EnginePool, instance: EngineInstance, leg: str, status: int, content: bytes
) -> rm.WorkerFailure:
    """An engine's non-200 answer, as the failure the machine passes on or retries: a 4xx
    is the client's (the instance is fine), a 5xx the instance's (out of rotation)."""
    message = _engine_message(content) or f"{leg} answered {status}"
    if status < 500:
        return rm.WorkerFailure(status, _engine_type(content), message)
    pool.failed(instance, f"{leg} answered {status}: {message}")
    return rm.WorkerFailure(status, "server_error", f"{leg} answered {status}: {message}")


@final
class EnginePrefillLeg:
    """The request's prefill leg on an engine: vLLM's call, or SGLang's room (its call
    goes out beside decode's, in :meth:`call_beside`)."""

    def __init__(self, host: LegHost, legs: EngineLegs) -> None:
        self._host = host
        self._legs = legs
        self._pool = legs.pool
        self.instance: EngineInstance | None = None
        # the client's request as each of its choices runs it (``vllm_pd.choice_body``)
        self.choice_bodies = [
            choice_body(legs.client_body, choice) for choice in range(host.request.sampling.n)
        ]
        choices = len(self.choice_bodies)
        # vLLM: each choice's prefill answer, once it came
        self.answers: list[PrefillAnswer | None] = [None] * choices
        # vLLM: each choice's kv_transfer_params while its blocks wait for a decode to pull
        # them (None: pulled, freed, or none kept)
        self.unpulled: list[Mapping[str, Any] | None] = [None] * choices
        # a decode run is under way: it frees what its legs did not pull when it ends (a
        # release now would race its legs' pulls)
        self.decoding = False
        # SGLang: each choice's body for both its legs (its room named), once the prefill
        # instance is picked
        self.bootstraps: list[dict[str, Any]] | None = None
        self.decode: EngineInstance | None = None  # the decode it was placed on, if any
        self._last_failure = ""
        # what the engines know each choice's legs by (a choice started again alone: a
        # new id, its old legs' may still be held)
        self._request_ids = [
            host.request_id if choice == 0 else f"{host.request_id}-{choice}"
            for choice in range(choices)
        ]
        self._reruns = 0
        # the prompt's keys in the pool's approximate prefix index (decode's leg's too)
        self.prefix_keys = self._pool.prefix_keys(host.request.prompt)

    @property
    def instance_id(self) -> str | None:
        return None if self.instance is None else self.instance.instance_id

    def no_instance_reason(self) -> str:
        why = f" (last: {self._last_failure})" if self._last_failure else ""
        return f"no prefill instance is available{why}"

    async def send(self, command: rm.SendPrefill) -> Wait | None:
        host = self._host
        pool = self._pool
        instance = pool.pick("prefill", host.request.model, command.exclude, self.prefix_keys)
        if instance is None:
            raise ShellFailure(rm.Failure(Reason.SERVICE_UNAVAILABLE, self.no_instance_reason()))
        if command.retry:
            host.router.metrics.retries.labels("prefill").inc()
        self.instance = instance
        await host.report(rm.PrefillSent(instance.instance_id))
        if pool.kind == "sglang":
            # a room per choice: each choice is a transfer of its own
            self.bootstraps = [
                bootstrap_body(
                    body,
                    httpx.URL(instance.url).host,
                    instance.config.bootstrap_port,
                    secrets.randbits(ROOM_BITS),
                )
                for body in self.choice_bodies
            ]
            # its calls go out with decode's (SGLang's prefill answers once decode fetched)
            return await host.report(rm.Prefilled(None))
        started = time.perf_counter()
        choices = len(self.choice_bodies)
        self.answers = [None] * choices
        self.unpulled = [None] * choices
        # each choice's prefill at once (a PD flow per choice: ``vllm_pd.choice_body``)
        failures: list[_PrefillFailure | None] = [None] * choices

        async def prefill_choice(choice: int) -> None:
            failures[choice] = await self.prefill_choice(instance, choice)

        async with trio.open_nursery() as calls:
            for choice in range(choices):
                calls.start_soon(prefill_choice, choice)
        failed = [failure for failure in failures if failure is not None]
        if failed:
            self.release()  # the choices it did prefill: no decode pulls them now
            return await host.report(min(failed, key=_prefill_failure_rank))
        answer = self.answers[0]
        assert answer is not None
        pool.served(instance)
        pool.served_prefix(instance, self.prefix_keys)
        host.figures.prefill_s = time.perf_counter() - started
        host.figures.prompt_tokens = answer.prompt_tokens
        if host.shaper is not None:
            host.shaper.set_prompt_usage(answer.prompt_tokens, answer.cached_tokens)
        # (no lease known: vLLM's own timer frees what no decode pulls)
        return await host.report(rm.Prefilled(None))

    def choice_request_id(self, choice: int) -> str:
        """What the engines know choice ``choice``'s legs by (choice 0: the request's own
        id; the others: ids of their own, as requests running at once on one engine must
        have, and as vLLM names their KV transfers by)."""
        return self._request_ids[choice]

    def rerun_request_id(self, choice: int) -> str:
        """A new id for choice ``choice``, started again alone (``{id}-rerun{k}-{choice}``)."""
        self._reruns += 1
        request_id = f"{self._host.request_id}-rerun{self._reruns}-{choice}"
        self._request_ids[choice] = request_id
        return request_id

    async def prefill_choice(self, instance: EngineInstance, choice: int) -> _PrefillFailure | None:
        """vLLM: choice ``choice``'s prefill call; its answer (and KV) recorded as it comes,
        so a request cut meanwhile frees what the calls that answered kept.  What failed,
        if it did."""
        answered = await self._call(
            instance, prefill_body(self.choice_bodies[choice]), self.choice_request_id(choice)
        )
        if not isinstance(answered, httpx.Response):
            return answered
        try:
            answer = parse_prefill_answer(answered.json())
        except (ValueError, EngineAnswerError) as exc:
            why = f"prefill's answer: {exc}"
            self._failed(instance, why)
            return rm.PrefillLost(why)
        self.answers[choice] = answer
        self.unpulled[choice] = answer.kv_transfer_params
        return None

    async def _call(
        self, instance: EngineInstance, body: Mapping[str, Any], request_id: str
    ) -> httpx.Response | _PrefillFailure:
        """Post a prefill leg (as ``request_id``): its 200 answer, or what the machine hears
        instead."""
        pool = self._pool
        instance.in_flight += 1
        try:
            response = await pool.http.post(
                instance.url + PATHS[self._legs.kind],
                json=body,
                headers=instance.headers(request_id),
            )
        except httpx.ConnectError as exc:
            self._failed(instance, f"prefill unreachable: {_why(exc)}")
            return rm.PrefillNotSent()  # it never saw it: another may take it
        except _TRANSPORT_ERRORS as exc:
            why = f"prefill lost: {_why(exc)}"
            self._failed(instance, why)
            return rm.PrefillLost(why)
        finally:
            instance.in_flight -= 1
        if response.status_code != 200:
            failure = _answer_failure(
                pool, instance, "prefill", response.status_code, response.content
            )
            self._last_failure = f"{instance.instance_id}: {failure.message}"
            return rm.PrefillFailed(failure)
        return response

    def _failed(self, instance: EngineInstance, why: str) -> None:
        self._pool.failed(instance, why)
        self._last_failure = f"{instance.instance_id}: {why}"

    async def call_beside(
        self, instance: EngineInstance, body: Mapping[str, Any], request_id: str
    ) -> _PrefillFailure | None:
        """SGLang: a choice's prefill call on ``instance`` (``body``: its room's), beside its
        decode stream (bounded by the prefill timeout); what failed, if it did."""
        started = time.perf_counter()
        with trio.move_on_after(self._host.router.config.router.prefill_timeout_s):
            answered = await self._call(instance, prefill_leg_body(body), request_id)
            if not isinstance(answered, httpx.Response):
                return answered
            self._pool.served(instance)
            self._pool.served_prefix(instance, self.prefix_keys)
            self._host.figures.prefill_s = time.perf_counter() - started
            return None
        why = "prefill did not answer in time"
        self._failed(instance, why)
        return rm.PrefillLost(why)

    async def emit_first_token(self, final: bool) -> None:
        raise AssertionError("an engine's prefill samples no token for the client")

    def migrate(self, command: rm.Migrate) -> None:
        raise AssertionError("a regenerating engine's machine keeps no tokens to migrate")

    def release(self) -> None:
        """Free prefill's blocks no decode pulled (vLLM): a one-token decode leg per choice
        pulls them in the background, which frees them on prefill now rather than at
        vLLM's timeout.  While a decode run is under way, its end does it (its legs may
        be pulling them).  (SGLang's prefill call ends with the decode run that carries
        it.)"""
        if not self.decoding:
            self.release_unpulled()

    def release_unpulled(self) -> None:
        """Free the blocks of every choice no decode pulled (see :meth:`release`)."""
        unpulled = [
            (choice, params) for choice, params in enumerate(self.unpulled) if params is not None
        ]
        self.unpulled = [None] * len(self.unpulled)
        if unpulled:
            self._release_all(unpulled)

    def release_params(self, choice: int, params: Mapping[str, Any]) -> None:
        """Free choice ``choice``'s blocks that ``params`` names (it starts again alone)."""
        self._release_all([(choice, params)])

    def _release_all(self, unpulled: Sequence[tuple[int, Mapping[str, Any]]]) -> None:
        pool = self._pool
        host = self._host
        # the decode this request was going to (it may only be slow), else any
        decode = self.decode
        if decode is None or decode.failures_in_a_row:
            decode = pool.pick("decode", host.request.model)
        nursery = pool.nursery
        if nursery is None or decode is None:
            log.warning(
                "request %s: no decode to pull its prefilled KV: prefill frees it at its timeout",
                host.request_id,
            )
            return
        try:
            for choice, params in unpulled:
                body = release_body(self.choice_bodies[choice], params)
                nursery.start_soon(
                    self._pull_and_drop, decode, body, self.choice_request_id(choice)
                )
        except RuntimeError:  # the router is stopping: prefill frees the blocks at its timeout
            log.warning(
                "request %s: its prefilled KV is left to prefill's timeout", host.request_id
            )

    async def _pull_and_drop(
        self, decode: EngineInstance, body: dict[str, Any], request_id: str
    ) -> None:
        started = time.perf_counter()
        try:
            with trio.fail_after(_RELEASE_TIMEOUT_S):
                while True:
                    try:
                        response = await self._pool.http.post(
                            decode.url + PATHS[self._legs.kind],
                            json=body,
                            headers=decode.headers(f"{request_id}-release"),
                        )
                        break
                    except (httpx.ConnectError, httpx.RemoteProtocolError):
                        # a decode restarting, a connection it dropped: again, until the
                        # timeout (prefill frees the blocks itself after its own)
                        await trio.sleep(0.5)
        except (*_TRANSPORT_ERRORS, trio.TooSlowError) as exc:
            log.warning(
                "request %s: the leg freeing its prefilled KV failed (%s): prefill frees it "
                "at its timeout",
                request_id,
                _why(exc),
            )
            return
        log.info(
            "request %s: ended before decode pulled its prefilled KV; decode %s pulled (and "
            "dropped) it in %.0f ms (%d)",
            request_id,
            decode.instance_id,
            (time.perf_counter() - started) * 1000,
            response.status_code,
        )

    def drop_lease(self) -> None:
        """Nothing of the router's is held for an engine's KV (no link to keep up)."""


@final
@attrs.define(eq=False)
class _ChoiceLeg:
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
class EngineDecodeLeg:
    """The request's decode leg on an engine: its placement and its stream.

    ``n`` > 1: each choice is a PD flow of its own (one sample each, ``vllm_pd.choice_body``
    says why): its prefill (vLLM: its call and KV; SGLang: its room, its prefill call
    beside its decode stream) and its leg on the decode placed, all at once, streamed
    back as the choices of one answer by the shared :func:`stream_choices`.  The request
    is one to the machine: a choice failing before any token went out sends the whole
    request again from new prefills.  One failing before its own first token, once other
    choices' went out, is started again alone (:meth:`_rerun_choice`: a new prefill, a new
    decode leg, under the request's limits: ``rm.ChoiceRetry``) while the others stream
    on; one failing after its first token, or out of retries, fails the request.
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
        self._prefill_failed: _PrefillFailure | None = None
        self._choices: list[_ChoiceLeg] = []  # the current run's, by choice
        self._reader: trio.Nursery | None = None  # the current run's legs, while streaming
        # the choices started again alone, each with its retries' bookkeeping
        self._retries: dict[int, rm.ChoiceRetry] = {}

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

    def _choice_legs(self) -> list[_ChoiceLeg]:
        """This run's legs, one per choice, each with a stream of its own."""
        host = self._host
        prefill = self._prefill
        max_pending = host.router.config.router.stream_buffer_tokens
        with_logprobs = host.request.sampling.wants_logprobs
        decode = self.instance
        assert decode is not None
        legs = []
        for choice, client_body in enumerate(prefill.choice_bodies):
            stream = EngineStream(max_pending, with_logprobs=with_logprobs)
            request_id = prefill.choice_request_id(choice)
            if prefill.bootstraps is not None:  # SGLang: its room, on both legs
                room_body = prefill.bootstraps[choice]
                legs.append(
                    _ChoiceLeg(
                        choice,
                        decode_body(room_body, None),
                        stream,
                        decode,
                        request_id,
                        prefill_leg_body(room_body),
                        prefill.instance,
                    )
                )
            else:  # vLLM: each choice's leg pulls its own prefill's KV
                params = prefill.unpulled[choice]
                legs.append(
                    _ChoiceLeg(choice, decode_body(client_body, params), stream, decode, request_id)
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
        if failed is not None and host.machine.phase in _DECODE_PHASES:
            # (in another phase, decode's own failure was reported first: the machine
            # is already trying again)
            self._stop_counting()
            return await host.report(failed)
        return outcome

    async def _prefill_beside(self, decode_scope: trio.CancelScope, leg: _ChoiceLeg) -> None:
        assert leg.prefill_body is not None and leg.prefill is not None
        failed = None
        with leg.prefill_scope:  # (cancelled: its choice started again alone)
            failed = await self._prefill.call_beside(leg.prefill, leg.prefill_body, leg.request_id)
        if failed is None or leg.decoded or self._scope is not decode_scope:
            return
        if any(other.decoded for other in self._choices):
            # other choices are under way (their tokens may be out): this one cannot be
            # served, which fails the request; decode is not to blame
            why = _prefill_failure_message(failed)
            leg.stream.fail(f"prefill failed choice {leg.choice}: {why}", blame=False)
            return
        self._prefill_failed = failed
        decode_scope.cancel()  # decode would wait for KV that never comes

    async def _decode(self, sent_at: float) -> Wait | None:
        """Every choice's leg at once; once each answered 200 (decode accepted the request),
        their streams to the client.  A leg that did not is decode's answer: refused (a
        4xx, the client's own) or failed."""
        host = self._host
        answers = _LegAnswers(len(self._choices))
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

    def _retry_choice(self, choice: int, failure: str) -> bool:
        """:func:`stream_choices`' ``retry_alone``: choice ``choice`` failed (``failure``)
        before any of its tokens went out, once other choices' had.  Start it again alone
        (a new prefill, a new decode leg, into its stream: the client sees nothing of
        it); False once its retries ran out, and its failure is the request's."""
        leg = self._choices[choice]
        stream = leg.stream
        reader = self._reader
        if reader is None or stream.cut_off:
            return False
        retry = self._retries.get(choice)
        if retry is None:
            retry = self._retries[choice] = rm.ChoiceRetry(self._host.machine.limits)
            if self._prefill.instance is not None:
                retry.prefill_sent(self._prefill.instance.instance_id)
        if retry.given_up:
            return False
        if stream.failure_reason == _DECODE_FAILED:
            self._pool.failed(leg.decode, failure)
            retry.decode_failed(leg.decode.instance_id)
        log.info(
            "request %s: choice %d failed before its first token (%s): started again alone",
            self._host.request_id,
            choice,
            failure,
        )
        # (its legs, if still open, are closed: aborted in the engines)
        leg.scope.cancel()
        leg.prefill_scope.cancel()
        stream.restart()
        reader.start_soon(self._rerun_choice, leg, retry, failure)
        return True

    async def _rerun_choice(self, failed: _ChoiceLeg, retry: rm.ChoiceRetry, failure: str) -> None:
        """Choice ``failed.choice`` again: a prefill (not one this round tried) and a decode
        leg (not on a decode it failed on), streamed into its stream as its first run's
        would have been; what fails is its stream's failure (:meth:`_retry_choice` is then
        asked again)."""
        host = self._host
        pool = self._pool
        prefill = self._prefill
        choice = failed.choice
        stream = failed.stream
        model = host.request.model
        # vLLM: its unpulled KV on the prefill it had is freed (a new prefill computes it)
        unpulled = prefill.unpulled[choice]
        prefill.unpulled[choice] = None
        if unpulled is not None:
            prefill.release_params(choice, unpulled)
        # its decode first: with none left, no prefill is computed for nothing
        decode = pool.pick("decode", model, frozenset(retry.excluded_decodes), prefill.prefix_keys)
        if decode is None:
            retry.given_up = True
            stream.fail(
                f"choice {choice}: no decode instance is available (last: {failure})",
                blame=False,
            )
            return
        request_id = prefill.rerun_request_id(choice)
        client_body = prefill.choice_bodies[choice]
        while True:
            instance = None
            if retry.may_prefill():
                instance = pool.pick(
                    "prefill", model, frozenset(retry.tried_prefills), prefill.prefix_keys
                )
            if instance is None:
                retry.given_up = True
                stream.fail(f"choice {choice}: {prefill.no_instance_reason()}", blame=False)
                return
            retry.prefill_sent(instance.instance_id)
            host.router.metrics.retries.labels("prefill").inc()
            if pool.kind == "sglang":
                room_body = bootstrap_body(
                    client_body,
                    httpx.URL(instance.url).host,
                    instance.config.bootstrap_port,
                    secrets.randbits(ROOM_BITS),
                )
                body = decode_body(room_body, None)
                prefill_call: dict[str, Any] | None = prefill_leg_body(room_body)
                break
            prefill_failed = await prefill.prefill_choice(instance, choice)
            if prefill_failed is None:
                body = decode_body(client_body, prefill.unpulled[choice])
                prefill_call = None
                break
            if isinstance(prefill_failed, rm.PrefillFailed) and prefill_failed.failure.status < 500:
                retry.given_up = True  # the request's own (a 4xx): not retried
                stream.fail(prefill_failed.failure.message, blame=False)
                return
        host.router.metrics.retries.labels("decode").inc()
        leg = _ChoiceLeg(choice, body, stream, decode, request_id, prefill_call, instance)
        self._choices[choice] = leg
        answers = _LegAnswers(1)
        async with trio.open_nursery() as beside:
            if prefill_call is not None:
                beside.start_soon(self._prefill_beside_alone, leg, retry)
            await self._leg(leg, answers)
            if answers.refusal is not None or stream.failure is not None:
                beside.cancel_scope.cancel()  # (its prefill would wait for a fetch)
        refusal = answers.refusal
        if refusal is None:
            return
        if isinstance(refusal, rm.DecodeRejected):  # the client's own (a 4xx)
            retry.given_up = True
        else:  # (the decode is out of rotation already: never again for this choice)
            retry.decode_failed(decode.instance_id)
        stream.fail(refusal.message, blame=False)

    async def _prefill_beside_alone(self, leg: _ChoiceLeg, retry: rm.ChoiceRetry) -> None:
        """SGLang: a choice started again alone's prefill call, beside its decode leg."""
        assert leg.prefill is not None and leg.prefill_body is not None
        failed = None
        with leg.prefill_scope:  # (cancelled: its decode leg failed first)
            failed = await self._prefill.call_beside(leg.prefill, leg.prefill_body, leg.request_id)
        if failed is None or leg.decoded or leg.scope.cancel_called:
            return
        leg.scope.cancel()  # its decode would wait for KV that never comes
        if isinstance(failed, rm.PrefillFailed) and failed.failure.status < 500:
            retry.given_up = True  # the request's own (a 4xx): not retried
        why = _prefill_failure_message(failed)
        leg.stream.fail(f"prefill failed choice {leg.choice}: {why}", blame=False)

    async def _leg(self, leg: _ChoiceLeg, answers: _LegAnswers) -> None:
        """Choice ``leg.choice``'s leg on the decode placed: its answer to ``answers``, then
        its events into its stream."""
        instance = leg.decode
        instance.in_flight += 1
        try:
            with leg.scope:
                await self._leg_call(leg, answers)
        finally:
            instance.in_flight -= 1

    async def _leg_call(self, leg: _ChoiceLeg, answers: _LegAnswers) -> None:
        pool = self._pool
        instance = leg.decode
        try:
            async with pool.http.stream(
                "POST",
                instance.url + PATHS[self._legs.kind],
                json=leg.body,
                headers=instance.headers(leg.request_id),
            ) as response:
                if response.status_code != 200:
                    content = await response.aread()
                    failure = _answer_failure(
                        pool, instance, "decode", response.status_code, content
                    )
                    if failure.status < 500:  # the client's own: passed on
                        answers.refused(
                            rm.DecodeRejected(failure.message, retryable=False, failure=failure)
                        )
                    else:
                        answers.refused(rm.DecodeFailed(failure.message))
                    return
                answers.accepted()
                await self._read(response, leg)
        except _TRANSPORT_ERRORS as exc:
            # (the stream's own reads are _read's: this is the leg failing to start)
            why = f"decode on {instance.instance_id} lost: {_why(exc)}"
            pool.failed(instance, why)
            answers.refused(rm.DecodeFailed(why))

    async def _read(self, response: httpx.Response, leg: _ChoiceLeg) -> None:
        """A leg's server-sent events into its choice's stream: text, tool calls and token
        counts as they come, the finish held until the counts that end the stream (its
        usage chunk).

        Read to the end, past ``[DONE]`` or a failure: the response's byte iterators are
        then exhausted, not left to the garbage collector.
        """
        kind = self._legs.kind
        stream = leg.stream
        with_logprobs = stream.logprobs is not None
        tool_calls = EngineToolCalls()
        seen = 0
        ending: _Ending | None = None
        final_usage: Usage | None = None
        failure: str | None = None
        done = False
        lines_of = cast(AsyncGenerator[str, None], response.aiter_lines())
        try:
            async with contextlib.aclosing(lines_of) as lines:
                async for line in lines:
                    if done or failure is not None or not line.startswith("data:"):
                        continue
                    try:
                        chunk = parse_decode_event(
                            line[5:].strip(), kind, with_logprobs=with_logprobs
                        )
                        whole = (
                            tool_calls.feed(chunk.tool_calls)
                            if chunk is not None and chunk.tool_calls and ending is None
                            else []
                        )
                    except EngineAnswerError as exc:
                        failure = f"decode's stream: {exc}"
                        continue
                    if chunk is None:  # [DONE]
                        done = True
                        continue
                    if chunk.error is not None:
                        failure = f"decode failed the request: {chunk.error}"
                        continue
                    if chunk.usage is not None:
                        final_usage = chunk.usage
                        continue
                    if chunk.logprobs:
                        # one item per token: counted so, each logprob goes out with its token
                        tokens = len(chunk.logprobs)
                        seen = max(seen + tokens, chunk.completion_tokens or 0)
                    elif chunk.completion_tokens is not None:
                        tokens = max(chunk.completion_tokens - seen, 0)
                        seen = max(seen, chunk.completion_tokens)
                    else:
                        # (an engine not counting as it goes)
                        tokens = 1 if chunk.text or chunk.tool_calls else 0
                        seen += tokens
                    if ending is not None or not (
                        tokens or chunk.text or chunk.finish_reason or whole
                    ):
                        continue
                    if (tokens or chunk.text) and not leg.decoded:
                        self._decoded(leg)
                    if chunk.finish_reason is not None:
                        try:
                            whole += tool_calls.finish()
                        except EngineAnswerError as exc:
                            failure = f"decode's stream: {exc}"
                            continue
                        ending = _Ending(
                            chunk.text, tokens, chunk.finish_reason, chunk.logprobs, whole
                        )
                        continue
                    if not await stream.push(
                        chunk.text, tokens, None, None, chunk.logprobs, tool_calls=whole
                    ):
                        return  # cut off: closing the stream aborts the request in the engine
        except _TRANSPORT_ERRORS as exc:
            failure = f"decode lost: {_why(exc)}"
        if failure is None and ending is None:
            failure = "decode's stream ended before the answer did"
        if failure is not None:
            stream.fail(failure)
            return
        assert ending is not None
        await stream.push(
            ending.text,
            ending.tokens,
            ending.finish_reason,
            self._usage(leg.choice, final_usage, seen),
            ending.logprobs,
            tool_calls=ending.tool_calls,
        )

    def _decoded(self, leg: _ChoiceLeg) -> None:
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
        assert self.instance is not None
        self._pool.served(self.instance)

    async def _failed(self, stream: DecodeRun, failure: str) -> Wait | None:
        host = self._host
        if stream.cut_off:
            return await host.report(rm.DecodeFailed(CUT_OFF_MESSAGE, cut_off=True))
        if stream.failure_reason == _DECODE_FAILED:
            # (the decode its choice's leg ran on: a choice started again alone may be on
            # another)
            decode = next((leg.decode for leg in self._choices if leg.stream is stream), None)
            if decode is None:
                decode = self.instance
            assert decode is not None
            self._pool.failed(decode, failure)
        return await host.report(rm.DecodeFailed(failure))

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


@final
class _LegAnswers:
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


@final
@attrs.frozen
class _Ending:
    """A leg's finishing chunk, held until the counts that end its stream."""

    text: str
    tokens: int
    finish_reason: str
    logprobs: tuple[TokenLogprob, ...] | None
    tool_calls: list[ToolCall]


def _prefill_failure_rank(failed: _PrefillFailure) -> int:
    """Which of a request's prefill failures (one per failed choice) the machine hears: the
    client's own (a 4xx: not retried) first, then the instance's, then a call it never saw
    (only when no choice's got through)."""
    if isinstance(failed, rm.PrefillFailed):
        return 0 if failed.failure.status < 500 else 1
    return 2 if isinstance(failed, rm.PrefillLost) else 3


def _prefill_failure_message(failed: _PrefillFailure) -> str:
    if isinstance(failed, rm.PrefillFailed):
        return failed.failure.message
    if isinstance(failed, rm.PrefillLost):
        return failed.message
    return "unreachable"


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
        self.accepted = True  # (it exists once decode answered 200)
        self.rejection: DecodeRejected | None = None
        self.failure: str | None = None
        # decode_failed: the decode instance's failure; another: not the instance's fault
        self.failure_reason = _DECODE_FAILED
        self.cut_off = False
        self.token_ids: list[int] | None = None  # (an engine's request never migrates)
        # the request asked for logprobs: those of tokens pushed and not yet delivered
        self.logprobs: list[TokenLogprob] | None = [] if with_logprobs else None
        # the calls the engine read out of its answer, pushed and not yet delivered
        self.tool_calls: list[ToolCall] | None = []
        self.holding = False
        self._updated = False
        self._lot = trio.lowlevel.ParkingLot()  # (shared by a request's choices)
        self._taken = trio.Event()  # the consumer came back for more

    def _notify(self) -> None:
        self._updated = True
        self._lot.unpark_all()

    def fail(self, failure: str, *, blame: bool = True) -> None:
        """End the stream with ``failure`` (``blame``: the decode instance's)."""
        self.failure = failure
        if not blame:
            self.failure_reason = "decode_not_to_blame"
        self._notify()

    def restart(self) -> None:
        """Its choice starts again alone (nothing of it went out): no failure now."""
        self.failure = None
        self.failure_reason = _DECODE_FAILED

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
            self.cut_off = True
            self.fail(CUT_OFF_MESSAGE)
            return False
        self._notify()
        while self.buffer.has_pending and not self.holding and finish_reason is None:
            self._taken = trio.Event()
            await self._taken.wait()
        return True

    async def wait_update(self) -> None:
        self._taken.set()
        if self._updated:
            await trio.lowlevel.checkpoint()
        else:
            await self._lot.park()
        self._updated = False

    async def hold_until(self, deadline: float, timer: HoldTimer) -> None:
        """Until ``deadline`` (a cancel scope's: the router's hold timer is the worker
        links'), or a finish or a failure."""
        self.holding = True
        self._taken.set()
        try:
            with trio.move_on_at(deadline):
                while not self.buffer.finished and self.failure is None:
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
        if any(stream._updated for stream in streams):
            await trio.lowlevel.checkpoint()
        else:
            await self._lot.park()
        for stream in streams:
            stream._updated = False


def _engine_message(content: bytes) -> str:
    """The message of an engine's OpenAI error body (vLLM's, or a plain string)."""
    try:
        body = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        return content[:200].decode("utf-8", "replace").strip()
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            return str(error.get("message", ""))
        return str(body.get("message", error))
    return str(body)


def _engine_type(content: bytes) -> str:
    try:
        body = json.loads(content)
        error = body.get("error", body)
        value = error.get("type")
        return str(value) if value else "invalid_request_error"
    except (ValueError, AttributeError, UnicodeDecodeError):
        return "invalid_request_error"
