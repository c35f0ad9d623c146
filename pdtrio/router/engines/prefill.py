"""An engine request's prefill leg: one base, and each protocol's stage as a thin subclass
(:class:`VllmPrefillLeg`: the call; :class:`SglangPrefillLeg`: the room, its call going
out beside decode's), chosen once with the backend; an engine's error answers read into
the failures the machine knows.

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

A 4xx from an engine is the client's own: passed on, never counted against
the instance.  A 5xx, an unreachable engine or a broken answer puts it out of
rotation for a while (``EnginePool.failed``).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias, final

import httpx
import trio

from pdtrio.protocol import request as rm
from pdtrio.protocol.engines.sglang import ROOM_BITS, bootstrap_body, prefill_leg_body
from pdtrio.protocol.engines.vllm import (
    PATHS,
    EngineAnswerError,
    PrefillAnswer,
    choice_body,
    decode_body,
    parse_prefill_answer,
    prefill_body,
    release_body,
)
from pdtrio.protocol.errors import Reason, is_clients_fault
from pdtrio.router.backend import (
    BackendLost,
    BackendUnreachable,
    LegHost,
    ShellFailure,
    Wait,
)
from pdtrio.router.engines.pool import (
    EngineInstance,
    EnginePool,
    exception_text,
    transport_errors,
)
from pdtrio.router.engines.stream import ChoiceLeg, EngineStream

if TYPE_CHECKING:
    pass

log = logging.getLogger("pdtrio.router.engines")

# how long the background leg that frees an unpulled prefill's KV may take
RELEASE_TIMEOUT_S = 30.0
# what an engine's transport failures raise (httpx's, and the OS's under it)
_TRANSPORT_ERRORS = (httpx.HTTPError, OSError)
# what the machine hears of a prefill call that did not answer with KV
PrefillFailure: TypeAlias = rm.PrefillNotSent | rm.PrefillLost | rm.PrefillFailed


class EngineRequest(Protocol):
    """What the prefill leg reads of the request's ``EngineLegs``."""

    pool: EnginePool
    client_body: Mapping[str, Any]
    kind: Literal["chat", "completion"]


def answer_failure(
    pool: EnginePool, instance: EngineInstance, leg: str, status: int, content: bytes
) -> rm.WorkerFailure:
    """An engine's non-200 answer, as the failure the machine passes on or retries: a 4xx
    is the client's (the instance is fine), a 5xx the instance's (out of rotation)."""
    message = _engine_message(content) or f"{leg} answered {status}"
    if is_clients_fault(status):
        return rm.WorkerFailure(status, _engine_type(content), message)
    pool.failed(instance, f"{leg} answered {status}: {message}")
    return rm.WorkerFailure(status, "server_error", f"{leg} answered {status}: {message}")


class EnginePrefillLeg:
    """The request's prefill leg on an engine: vLLM's call, or SGLang's room (its call
    goes out beside decode's, in :meth:`call_beside`)."""

    def __init__(self, host: LegHost, legs: EngineRequest) -> None:
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
        instance = None
        if command.avoid:  # (the one a failed handoff blamed: last)
            avoid = command.exclude | command.avoid
            instance = pool.pick("prefill", host.request.model, avoid, self.prefix_keys)
        if instance is None:
            instance = pool.pick("prefill", host.request.model, command.exclude, self.prefix_keys)
        if instance is None and not command.exclude:
            return await host.report(rm.PrefillUnavailable())  # none is up: it may wait
        if instance is None:  # every one tried: the last failure says why
            raise ShellFailure(rm.Failure(Reason.SERVICE_UNAVAILABLE, self.no_instance_reason()))
        if command.retry:
            host.router.metrics.retries.labels("prefill").inc()
        self.instance = instance
        await host.report(rm.PrefillSent(instance.instance_id))
        return await self._prefill(instance)

    async def wait_for_instance(self, command: rm.WaitForPrefill) -> Wait | None:
        """Until a prefill engine not in the command's ``exclude`` is up (the machine's
        PREFILL_WAIT deadline bounds it)."""
        await self._pool.wait_for_instance("prefill", self._host.request.model, command.exclude)
        return await self._host.report(rm.PrefillConnected())

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

    async def prefill_choice(self, instance: EngineInstance, choice: int) -> PrefillFailure | None:
        """vLLM: choice ``choice``'s prefill call; its answer (and KV) recorded as it comes,
        so a request cut meanwhile frees what the calls that answered kept.  What failed,
        if it did."""
        answered = await self._call(
            instance,
            prefill_body(self.choice_bodies[choice]),
            self.choice_request_id(choice),
            self._host.prefill_traceparent,
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
        self,
        instance: EngineInstance,
        body: Mapping[str, Any],
        request_id: str,
        traceparent: str,
    ) -> httpx.Response | PrefillFailure:
        """Post a prefill leg (as ``request_id``, a child of ``traceparent``'s span): its
        200 answer, or what the machine hears instead."""
        pool = self._pool
        instance.in_flight += 1
        try:
            with transport_errors():
                response = await pool.http.post(
                    instance.url + PATHS[self._legs.kind],
                    json=body,
                    headers=instance.headers(request_id, traceparent),
                )
        except BackendUnreachable as exc:
            self._failed(instance, f"prefill unreachable: {exc}")
            return rm.PrefillNotSent()  # it never saw it: another may take it
        except BackendLost as exc:
            why = f"prefill lost: {exc}"
            self._failed(instance, why)
            return rm.PrefillLost(why)
        finally:
            instance.in_flight -= 1
        if response.status_code != 200:
            failure = answer_failure(
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
    ) -> PrefillFailure | None:
        """SGLang: a choice's prefill call on ``instance`` (``body``: its room's), beside its
        decode stream (bounded by the prefill timeout); what failed, if it did.  It runs
        within the decode attempt (SGLang's prefill answers once decode has fetched the
        KV), so its trace parent is that attempt's span."""
        started = time.perf_counter()
        with trio.move_on_after(self._host.router.config.router.prefill_timeout_s):
            answered = await self._call(
                instance, prefill_leg_body(body), request_id, self._host.decode_traceparent
            )
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
            with trio.fail_after(RELEASE_TIMEOUT_S):
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
                exception_text(exc),
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

    async def _prefill(self, instance: EngineInstance) -> Wait | None:
        """The engine's own prefill stage on ``instance`` (each protocol's subclass)."""
        raise NotImplementedError

    def choice_leg(
        self, choice: int, stream: EngineStream, decode: EngineInstance, request_id: str
    ) -> ChoiceLeg:
        """Choice ``choice``'s leg on ``decode`` after this prefill stage (each protocol's)."""
        raise NotImplementedError

    async def rerun_bodies(
        self, instance: EngineInstance, choice: int
    ) -> tuple[dict[str, Any], dict[str, Any] | None] | PrefillFailure:
        """Choice ``choice`` started again alone on prefill ``instance``: its decode leg's
        body and (a prefill running beside decode) its prefill call's, or why the
        prefill failed (each protocol's)."""
        raise NotImplementedError


@final
class VllmPrefillLeg(EnginePrefillLeg):
    """vLLM's KV connector: each choice's prefill call first; decode pulls its KV."""

    async def _prefill(self, instance: EngineInstance) -> Wait | None:
        host = self._host
        pool = self._pool
        started = time.perf_counter()
        choices = len(self.choice_bodies)
        self.answers = [None] * choices
        self.unpulled = [None] * choices
        # each choice's prefill at once (a PD flow per choice: ``vllm_pd.choice_body``)
        failures: list[PrefillFailure | None] = [None] * choices

        async def prefill_choice(choice: int) -> None:
            failures[choice] = await self.prefill_choice(instance, choice)

        async with trio.open_nursery() as calls:
            for choice in range(choices):
                calls.start_soon(prefill_choice, choice)
        failed = [failure for failure in failures if failure is not None]
        if failed:
            self.release()  # the choices it did prefill: no decode pulls them now
            return await host.report(min(failed, key=prefill_failure_rank))
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

    def choice_leg(
        self, choice: int, stream: EngineStream, decode: EngineInstance, request_id: str
    ) -> ChoiceLeg:
        # each choice's leg pulls its own prefill's KV
        body = decode_body(self.choice_bodies[choice], self.unpulled[choice])
        return ChoiceLeg(choice, body, stream, decode, request_id)

    async def rerun_bodies(
        self, instance: EngineInstance, choice: int
    ) -> tuple[dict[str, Any], dict[str, Any] | None] | PrefillFailure:
        failed = await self.prefill_choice(instance, choice)
        if failed is not None:
            return failed
        return decode_body(self.choice_bodies[choice], self.unpulled[choice]), None


@final
class SglangPrefillLeg(EnginePrefillLeg):
    """SGLang's bootstrap: a room per choice; the prefill call goes out beside decode's."""

    async def _prefill(self, instance: EngineInstance) -> Wait | None:
        # a room per choice: each choice is a transfer of its own
        self.bootstraps = [_room(body, instance) for body in self.choice_bodies]
        # its calls go out with decode's (SGLang's prefill answers once decode fetched)
        return await self._host.report(rm.Prefilled(None))

    def choice_leg(
        self, choice: int, stream: EngineStream, decode: EngineInstance, request_id: str
    ) -> ChoiceLeg:
        assert self.bootstraps is not None
        room_body = self.bootstraps[choice]  # its room, on both legs
        return ChoiceLeg(
            choice,
            decode_body(room_body, None),
            stream,
            decode,
            request_id,
            prefill_leg_body(room_body),
            self.instance,
        )

    async def rerun_bodies(
        self, instance: EngineInstance, choice: int
    ) -> tuple[dict[str, Any], dict[str, Any] | None] | PrefillFailure:
        room_body = _room(self.choice_bodies[choice], instance)
        return decode_body(room_body, None), prefill_leg_body(room_body)


def _room(body: Mapping[str, Any], instance: EngineInstance) -> dict[str, Any]:
    """``body`` with a new bootstrap room on SGLang prefill ``instance``."""
    return bootstrap_body(
        body,
        httpx.URL(instance.url).host,
        instance.config.bootstrap_port,
        secrets.randbits(ROOM_BITS),
    )


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


def prefill_failure_rank(failed: PrefillFailure) -> int:
    """Which of a request's prefill failures (one per failed choice) the machine hears: the
    client's own (a 4xx: not retried) first, then the instance's, then a call it never saw
    (only when no choice's got through)."""
    if isinstance(failed, rm.PrefillFailed):
        return 0 if is_clients_fault(failed.failure.status) else 1
    return 2 if isinstance(failed, rm.PrefillLost) else 3


def prefill_failure_message(failed: PrefillFailure) -> str:
    if isinstance(failed, rm.PrefillFailed):
        return failed.failure.message
    if isinstance(failed, rm.PrefillLost):
        return failed.message
    return "unreachable"
