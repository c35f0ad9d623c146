"""One request in front of a vLLM PD pair (the KV connector protocol), as a trio shell.

The legs (``pdtrio.protocol.vllm_pd``): a prefill leg answering
``kv_transfer_params``, then a decode leg carrying them, streamed back
through pdtrio's shaper (``pdtrio.protocol.sse``), so the client gets the
same shape as from pdtrio's own workers whatever the engine sends: the role
chunk with the first text, usage only when asked (with prefill's
``cached_tokens``), ``finish_reason``, and an error event + ``[DONE]`` for a
failure after the headers.

Retries as for pdtrio workers: a prefill answering 5xx or unreachable is
suspended and another prefill is tried; a decode failing before its first
token is suspended and the request starts again (a new prefill, another
decode).  A 4xx from either is the client's own: passed on, nothing suspended.

A client that leaves cancels the open leg (closing decode's stream aborts the
request in vLLM).  One that leaves after prefill answered but before decode
pulled the KV would strand prefill's blocks until vLLM gives up on them (0.32's
NIXL lease, ``kv_lease_duration``, 30 s by default; before it
``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s): the router sends the decode leg
anyway, as a one-token request in the background, so decode pulls the blocks
and prefill frees them at once.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, cast, final

import httpx
import trio

from pdtrio.asgi import Message, Receive, Send, send_json
from pdtrio.protocol.errors import Reason
from pdtrio.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    chat_completion_body,
    completion_body,
    error_for,
)
from pdtrio.protocol.request_machine import DRAIN_CUT, DRAIN_REFUSAL
from pdtrio.protocol.sglang_pd import ROOM_BITS, bootstrap_body, prefill_leg_body
from pdtrio.protocol.sse import StreamShaper
from pdtrio.protocol.vllm_pd import (
    PATHS,
    EngineAnswerError,
    PrefillAnswer,
    decode_body,
    parse_decode_event,
    parse_prefill_answer,
    prefill_body,
    release_body,
)
from pdtrio.protocol.wire import Usage
from pdtrio.router.engine_front import EngineInstance, EnginePool
from pdtrio.router.metrics import Outcome

if TYPE_CHECKING:
    from pdtrio.router.core import Router

log = logging.getLogger("pdtrio.router.vllm")

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
# request ids: unique across router processes sharing the engines, no system call each
_PROCESS_ID = secrets.token_hex(8)
_request_numbers = itertools.count()
# how long the background leg that frees a left client's prefill KV may take
_RELEASE_TIMEOUT_S = 30.0


def new_request_id(kind: Literal["chat", "completion"]) -> str:
    """The id both legs carry (``X-Request-Id``) and the client's answer shows."""
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    return f"{prefix}{_PROCESS_ID}{next(_request_numbers):x}"


class _InstanceFailed(Exception):
    """The leg failed on the instance's side (5xx, unreachable, a broken answer)."""


class _ClientError(Exception):
    """The instance refused the request as the client's fault (4xx): passed on."""

    def __init__(self, error: OpenAIError) -> None:
        super().__init__(error.message)
        self.error = error


@final
class VllmRequest:
    """One client request across a vLLM prefill and a vLLM decode."""

    def __init__(
        self,
        router: Router,
        pool: EnginePool,
        request: ChatCompletionRequest | CompletionRequest,
        client_body: Mapping[str, Any],
        kind: Literal["chat", "completion"],
        request_id: str,
        receive: Receive,
        send: Send,
        hang_up: Callable[[], bool] = lambda: False,
    ) -> None:
        self.router = router
        self.pool = pool
        self.request = request
        self.client_body = client_body
        self.kind = kind
        self.request_id = request_id
        self._receive = receive
        self._send_to_server = send
        # shuts the client's connection down (one that stopped reading); True if done
        self._hang_up = hang_up
        # the router's stall check (hang_up_if_stalled): which send is under way, since when
        self._sending = False
        self._sends = 0
        self._stall_mark: tuple[int, float] | None = None
        self._gave_up_on_client = False
        self.created = int(time.time())
        self.shaper = (
            StreamShaper(
                kind=kind,
                request_id=request_id,
                model=request.model,
                created=self.created,
                include_usage=request.include_usage,
                continuous_usage_stats=request.continuous_usage_stats,
            )
            if request.stream
            else None
        )
        self.client_gone = False
        self._headers_out = False
        self._complete = False
        self._prefill: EngineInstance | None = None
        self._decode: EngineInstance | None = None
        # prefill's blocks wait for a decode to pull them: set from prefill's answer to
        # decode's first token
        self._unpulled: PrefillAnswer | None = None
        self._text: list[str] = []
        self._delivered_tokens = 0
        self._bootstrap = pool.kind == "sglang"
        self._finish_reason: str | None = None
        self._usage: Usage | None = None
        self.figures = router.metrics.figures(request.model)

    # --- entry ----------------------------------------------------------------------

    async def run(self) -> None:
        error: OpenAIError | None = None
        config = self.router.config.router
        if self.router.requests.draining:
            refusal = error_for(Reason.SHUTTING_DOWN, DRAIN_REFUSAL)
            self._record(Outcome.REJECTED, refusal.status)
            await self._send_error(refusal)
            return
        with trio.CancelScope() as scope:
            self.router.requests.started(scope, self)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._watch_disconnect, nursery.cancel_scope)
                    with trio.move_on_after(config.request_timeout_s) as timer:
                        error = await self._legs()
                    if timer.cancelled_caught:
                        error = error_for(
                            Reason.TIMEOUT,
                            f"the request took longer than {config.request_timeout_s:g}s",
                        )
                    nursery.cancel_scope.cancel()
            finally:
                self._release_unpulled()
                if self.client_gone:
                    self._record(Outcome.DISCONNECTED, None)
        if scope.cancelled_caught and not self.client_gone:
            # the drain's cut: what is left of the time goes to saying so
            error = error_for(Reason.SHUTTING_DOWN, DRAIN_CUT)
        try:
            if not self.client_gone:
                if error is not None:
                    await self._send_error(error)
                self._record(
                    Outcome.OK
                    if error is None
                    else Outcome.FAILED
                    if self._headers_out
                    else Outcome.REJECTED,
                    None if error is None else error.status,
                )
        finally:
            self.router.requests.ended(scope)

    def hang_up_if_stalled(self, now: float, write_timeout: float, cut_grace: float) -> None:
        """The router's periodic look for a send waiting on a client that stopped reading
        (hypercorn shields its writes: it would hold the request as long as the client's
        TCP stays up): one seen under way ``write_timeout`` ago is given up, the client
        hung up on (the request then ends as the client's leaving)."""
        if not self._sending or self._gave_up_on_client:
            self._stall_mark = None
            return
        mark = self._stall_mark
        if mark is None or mark[0] != self._sends:
            self._stall_mark = (self._sends, now)
            return
        if now - mark[1] < (cut_grace if self._complete else write_timeout):
            return
        self._gave_up_on_client = True
        found = self._hang_up()
        log.warning(
            "request %s: its client has read nothing for %gs; %s",
            self.request_id,
            now - mark[1],
            "hung up on it" if found else "its connection is not found",
        )

    async def _send(self, message: Message) -> None:
        self._sending = True
        self._sends += 1
        try:
            await self._send_to_server(message)
        finally:
            self._sending = False

    async def _watch_disconnect(self, scope: trio.CancelScope) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                if not self._complete:
                    self.client_gone = True
                    scope.cancel()
                return

    # --- the legs ---------------------------------------------------------------------

    async def _legs(self) -> OpenAIError | None:
        if self.pool.kind == "sglang":
            return await self._bootstrap_legs()
        return await self._connector_legs()

    async def _connector_legs(self) -> OpenAIError | None:
        """Prefill then decode, retried as the module says; the error to send, if any."""
        pool = self.pool
        model = self.request.model
        tried_prefill: set[str] = set()
        tried_decode: set[str] = set()
        last_failure = ""
        # every instance once at most, for each role: a bounded number of tries
        for _ in range(len(pool.instances) + 1):
            prefill = pool.pick("prefill", model, frozenset(tried_prefill))
            if prefill is None:
                return self._unavailable("prefill", last_failure)
            try:
                answer = await self._prefill_leg(prefill)
            except _InstanceFailed as exc:
                tried_prefill.add(prefill.instance_id)
                last_failure = str(exc)
                continue
            except _ClientError as exc:
                return exc.error
            decode = pool.pick("decode", model, frozenset(tried_decode))
            if decode is None:
                return self._unavailable("decode", last_failure)
            try:
                return await self._decode_leg(decode, answer)
            except _InstanceFailed as exc:
                if self._delivered_tokens:
                    # tokens went out: a new leg cannot take them back (error event + [DONE])
                    return error_for(Reason.DECODE_FAILED, f"decode failed mid-stream: {exc}")
                tried_decode.add(decode.instance_id)
                last_failure = str(exc)
                self._release_unpulled()  # (the new prefill's blocks are another request's)
                self.router.metrics.retries.labels("decode").inc()
                log.warning(
                    "decode on %s failed before its first token: retrying", decode.instance_id
                )
            except _ClientError as exc:
                return exc.error
        return self._unavailable("prefill", last_failure)

    async def _bootstrap_legs(self) -> OpenAIError | None:
        """SGLang: both legs at once; a failed prefill closes the decode leg (it would wait
        for the KV), a failed decode the prefill leg; either, before decode's first token,
        starts both again elsewhere (a new room)."""
        pool = self.pool
        model = self.request.model
        tried_prefill: set[str] = set()
        tried_decode: set[str] = set()
        last_failure = ""
        for _ in range(len(pool.instances) + 1):
            prefill = pool.pick("prefill", model, frozenset(tried_prefill))
            if prefill is None:
                return self._unavailable("prefill", last_failure)
            decode = pool.pick("decode", model, frozenset(tried_decode))
            if decode is None:
                return self._unavailable("decode", last_failure)
            host = httpx.URL(prefill.url).host
            body = bootstrap_body(
                self.client_body, host, prefill.config.bootstrap_port, secrets.randbits(ROOM_BITS)
            )
            prefill_failure: _InstanceFailed | _ClientError | None = None
            decode_outcome: OpenAIError | _InstanceFailed | _ClientError | None = None
            with trio.CancelScope() as decode_scope:
                async with trio.open_nursery() as legs:

                    async def run_prefill(
                        instance: EngineInstance = prefill, leg: dict[str, Any] = body
                    ) -> None:
                        nonlocal prefill_failure
                        try:
                            await self._bootstrap_prefill(instance, leg)
                        except (_InstanceFailed, _ClientError) as exc:
                            prefill_failure = exc
                            if not self._delivered_tokens:
                                decode_scope.cancel()  # decode would wait for the KV

                    legs.start_soon(run_prefill)
                    try:
                        decode_outcome = await self._decode_leg(
                            decode, PrefillAnswer(None, 0, 0), decode_body(body, None)
                        )
                    except (_InstanceFailed, _ClientError) as exc:
                        decode_outcome = exc
                        legs.cancel_scope.cancel()  # prefill would wait for its decode
            if isinstance(decode_outcome, _ClientError):
                return decode_outcome.error
            if isinstance(decode_outcome, _InstanceFailed):
                if self._delivered_tokens:
                    return error_for(
                        Reason.DECODE_FAILED, f"decode failed mid-stream: {decode_outcome}"
                    )
                tried_decode.add(decode.instance_id)
                last_failure = str(decode_outcome)
                self.router.metrics.retries.labels("decode").inc()
                continue
            if decode_scope.cancelled_caught or (prefill_failure and not self._delivered_tokens):
                if isinstance(prefill_failure, _ClientError):
                    return prefill_failure.error
                tried_prefill.add(prefill.instance_id)
                last_failure = str(prefill_failure)
                self.router.metrics.retries.labels("prefill").inc()
                continue
            return decode_outcome
        return self._unavailable("prefill", last_failure)

    async def _bootstrap_prefill(self, instance: EngineInstance, body: dict[str, Any]) -> None:
        self._prefill = instance
        instance.in_flight += 1
        try:
            with trio.fail_after(self.router.config.router.prefill_timeout_s):
                response = await self.pool.http.post(
                    instance.url + PATHS[self.kind],
                    json=prefill_leg_body(body),
                    headers=instance.headers(self.request_id),
                )
        except (httpx.HTTPError, OSError, trio.TooSlowError) as exc:
            why = str(exc) or type(exc).__name__
            self.pool.failed(instance, f"prefill unreachable: {why}")
            raise _InstanceFailed(why) from exc
        finally:
            instance.in_flight -= 1
        self._check_status(instance, "prefill", response.status_code, response.content)
        self.pool.served(instance)

    def _unavailable(self, role: str, last_failure: str) -> OpenAIError:
        why = f" (last: {last_failure})" if last_failure else ""
        return error_for(Reason.SERVICE_UNAVAILABLE, f"no {role} instance is available{why}")

    async def _prefill_leg(self, instance: EngineInstance) -> PrefillAnswer:
        self._prefill = instance
        started = time.perf_counter()
        body = prefill_body(self.client_body)
        instance.in_flight += 1
        try:
            with trio.fail_after(self.router.config.router.prefill_timeout_s):
                response = await self.pool.http.post(
                    instance.url + PATHS[self.kind],
                    json=body,
                    headers=instance.headers(self.request_id),
                )
        except (httpx.HTTPError, OSError, trio.TooSlowError) as exc:
            why = str(exc) or type(exc).__name__
            self.pool.failed(instance, f"prefill unreachable: {why}")
            raise _InstanceFailed(why) from exc
        finally:
            instance.in_flight -= 1
        self._check_status(instance, "prefill", response.status_code, response.content)
        try:
            answer = parse_prefill_answer(response.json())
        except (ValueError, EngineAnswerError) as exc:
            self.pool.failed(instance, f"prefill's answer: {exc}")
            raise _InstanceFailed(f"prefill's answer: {exc}") from exc
        self.pool.served(instance)
        self.figures.prefill_s = time.perf_counter() - started
        self.figures.prompt_tokens = answer.prompt_tokens
        if answer.kv_transfer_params is not None:
            self._unpulled = answer
        return answer

    def _check_status(
        self, instance: EngineInstance, leg: str, status: int, content: bytes
    ) -> None:
        if status == 200:
            return
        message = _engine_message(content) or f"{leg} answered {status}"
        if 400 <= status < 500:
            # the client's request (its prompt, a field): its own error, the instance is fine
            raise _ClientError(OpenAIError(message, status=status, type=_engine_type(content)))
        self.pool.failed(instance, f"{leg} answered {status}: {message}")
        raise _InstanceFailed(f"{leg} on {instance.instance_id} answered {status}: {message}")

    async def _decode_leg(
        self, instance: EngineInstance, answer: PrefillAnswer, body: dict[str, Any] | None = None
    ) -> OpenAIError | None:
        self._decode = instance
        if self.shaper is not None:
            self.shaper.set_prompt_usage(answer.prompt_tokens, answer.cached_tokens)
        if body is None:
            body = decode_body(self.client_body, answer.kv_transfer_params)
        instance.in_flight += 1
        try:
            async with self.pool.http.stream(
                "POST",
                instance.url + PATHS[self.kind],
                json=body,
                headers=instance.headers(self.request_id),
            ) as response:
                if response.status_code != 200:
                    content = await response.aread()
                    self._check_status(instance, "decode", response.status_code, content)
                error = await self._relay(response, answer)
        except (httpx.HTTPError, OSError) as exc:
            why = str(exc) or type(exc).__name__
            self.pool.failed(instance, f"decode lost: {why}")
            raise _InstanceFailed(f"decode on {instance.instance_id} lost: {why}") from exc
        finally:
            instance.in_flight -= 1
        self.pool.served(instance)
        return error

    async def _relay(self, response: httpx.Response, answer: PrefillAnswer) -> OpenAIError | None:
        """Decode's stream to the client, shaped; an error once tokens went out."""
        lines_of = cast(AsyncGenerator[str, None], response.aiter_lines())
        async with contextlib.aclosing(lines_of) as lines:
            return await self._relay_lines(lines, answer)

    async def _relay_lines(
        self, lines: AsyncIterator[str], answer: PrefillAnswer
    ) -> OpenAIError | None:
        seen = 0
        finished = False
        failure: str | None = None
        # read to the end, past [DONE] or a failure: the response's byte iterators are then
        # exhausted, not left to the garbage collector
        async for line in lines:
            if failure is not None or not line.startswith("data:"):
                continue
            try:
                chunk = parse_decode_event(line[5:].strip(), self.kind)
            except EngineAnswerError as exc:
                failure = f"decode's stream: {exc}"
                continue
            if chunk is None:
                failure = "" if finished else "decode's stream ended before the answer did"
                continue
            if chunk.error is not None:
                failure = f"decode failed the request: {chunk.error}"
                continue
            tokens = 0
            if chunk.completion_tokens is not None:
                tokens = max(chunk.completion_tokens - seen, 0)
                seen = max(seen, chunk.completion_tokens)
            if tokens or chunk.text:
                self._unpulled = None  # decode has the KV: prefill freed its blocks
            if chunk.usage is not None:
                # vLLM: prefill's count of cached tokens (decode's says what decode found);
                # SGLang: decode's (prefill's answer may come after the stream)
                cached = chunk.usage.cached_tokens if self._bootstrap else answer.cached_tokens
                self._usage = Usage(
                    chunk.usage.prompt_tokens, chunk.usage.completion_tokens, cached
                )
                continue
            if finished or (not chunk.text and not tokens and chunk.finish_reason is None):
                continue
            if chunk.finish_reason is not None:
                finished = True
            await self._deliver(chunk.text, tokens, chunk.finish_reason, answer)
        if failure is None and not finished:
            failure = "decode's stream ended before the answer did"
        if failure:
            return self._failed(failure)
        self._unpulled = None
        await self._finish(answer, seen)
        return None

    def _failed(self, why: str) -> OpenAIError:
        """Decode failed the stream: before its first token, another may take it (raised);
        after, the error that ends the response."""
        if not self._delivered_tokens:
            if self._decode is not None:
                self.pool.failed(self._decode, why)
            self._text.clear()
            raise _InstanceFailed(why)
        return error_for(Reason.DECODE_FAILED, why)

    # --- the client ---------------------------------------------------------------------

    async def _deliver(
        self, text: str, tokens: int, finish_reason: str | None, answer: PrefillAnswer
    ) -> None:
        self.router.tokens_delivered += tokens
        self._delivered_tokens += tokens
        self.figures.delivered(tokens)
        if self.shaper is None:
            self._text.append(text)
            if finish_reason is not None:
                self._finish_reason = finish_reason
            return
        chunk = self.shaper.delta(text, tokens, finish_reason)
        if not self._headers_out:
            self._headers_out = True
            await self._send(
                {"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS}
            )
        if chunk:
            await self._send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def _finish(self, answer: PrefillAnswer, completion_tokens: int) -> None:
        usage = self._usage or Usage(answer.prompt_tokens, completion_tokens, answer.cached_tokens)
        self._usage = usage
        self._complete = True
        if self.shaper is not None:
            self.shaper.set_prompt_usage(usage.prompt_tokens, usage.cached_tokens)
            if not self._headers_out:
                self._headers_out = True
                await self._send(
                    {"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS}
                )
            await self._send(
                {"type": "http.response.body", "body": self.shaper.done(), "more_body": False}
            )
            return
        builder = chat_completion_body if self.kind == "chat" else completion_body
        await send_json(
            self._send,
            200,
            builder(
                request_id=self.request_id,
                model=self.request.model,
                created=self.created,
                text="".join(self._text),
                finish_reason=self._finish_reason,
                usage=usage,
            ),
        )

    async def _send_error(self, error: OpenAIError) -> None:
        self._complete = True
        if self._headers_out and self.shaper is not None:
            if not self.shaper.closed:
                body = self.shaper.error(error)
                await self._send({"type": "http.response.body", "body": body, "more_body": False})
            return
        extra = [(name.encode(), value.encode()) for name, value in error.headers]
        await send_json(self._send, error.status, error.to_body(), extra or None)

    # --- the end ----------------------------------------------------------------------

    def _release_unpulled(self) -> None:
        """Prefill still holds blocks no decode pulled (the client left, a deadline, a
        decode that failed before its first token): a one-token decode leg pulls them in
        the background, which frees them on prefill now rather than at vLLM's timeout."""
        answer = self._unpulled
        self._unpulled = None
        if answer is None or answer.kv_transfer_params is None:
            return
        nursery = self.pool.nursery
        # the decode this request was going to (it may only be slow), else any
        decode = self._decode
        if decode is None or decode.failures_in_a_row:
            decode = self.pool.pick("decode", self.request.model)
        if nursery is None or decode is None:
            log.warning(
                "request %s: no decode to pull its prefilled KV: prefill frees it at its timeout",
                self.request_id,
            )
            return
        body = release_body(self.client_body, answer.kv_transfer_params)
        try:
            nursery.start_soon(self._pull_and_drop, decode, body)
        except RuntimeError:  # the router is stopping: prefill frees the blocks at its timeout
            log.warning(
                "request %s: its prefilled KV is left to prefill's timeout", self.request_id
            )

    async def _pull_and_drop(self, decode: EngineInstance, body: dict[str, Any]) -> None:
        started = time.perf_counter()
        try:
            with trio.fail_after(_RELEASE_TIMEOUT_S):
                while True:
                    try:
                        response = await self.pool.http.post(
                            decode.url + PATHS[self.kind],
                            json=body,
                            headers=decode.headers(f"{self.request_id}-release"),
                        )
                        break
                    except (httpx.ConnectError, httpx.RemoteProtocolError):
                        # a decode restarting, a connection it dropped: again, until the
                        # timeout (prefill frees the blocks itself after its own)
                        await trio.sleep(0.5)
        except (httpx.HTTPError, OSError, trio.TooSlowError) as exc:
            log.warning(
                "request %s: the leg freeing its prefilled KV failed (%s): prefill frees it "
                "at its timeout",
                self.request_id,
                str(exc) or type(exc).__name__,
            )
            return
        log.info(
            "request %s: its client left before decode; decode %s pulled (and dropped) its "
            "prefilled KV in %.0f ms (%d)",
            self.request_id,
            decode.instance_id,
            (time.perf_counter() - started) * 1000,
            response.status_code,
        )

    def _record(self, outcome: Outcome, status: int | None) -> None:
        if self._usage is not None:
            self.figures.completion_tokens = self._usage.completion_tokens
        self.router.metrics.request_ended(
            endpoint=PATHS[self.kind],
            model=self.request.model,
            outcome=outcome,
            status=status,
            figures=self.figures,
            request_id=self.request_id,
            prefill="-" if self._prefill is None else self._prefill.instance_id,
            decode="-" if self._decode is None else self._decode.instance_id,
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
