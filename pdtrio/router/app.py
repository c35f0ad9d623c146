"""The router as an ASGI app for hypercorn's trio worker."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final, final

import trio

from pdtrio import hypercorn_guard
from pdtrio.asgi import (
    BodyTooLarge,
    ClientDisconnected,
    Message,
    Receive,
    Scope,
    Send,
    declared_body_too_large,
    hang_up,
    header,
    read_body,
    send_bytes,
    send_json,
)
from pdtrio.config import PdtrioConfig
from pdtrio.memory import (
    ROUTER_YOUNG_COLLECTION_THRESHOLD,
    HeapTrimmer,
    collect_young_less_often,
    freeze_startup_objects,
    limit_heap_retention,
)
from pdtrio.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from pdtrio.metrics import OPENMETRICS_CONTENT_TYPE, wants_openmetrics
from pdtrio.protocol.errors import Reason
from pdtrio.protocol.link.registration import ROUTER_HEADER
from pdtrio.protocol.openai import (
    OpenAIError,
    body_timeout,
    error_for,
    is_json_content_type,
    models_list_body,
    parse_chat_completion_request,
    parse_completion_request,
    queue_full,
    request_too_large,
    service_unavailable,
    unauthorized,
    unsupported_media_type,
)
from pdtrio.protocol.openai.answers import AnswerKind, AnyRequest
from pdtrio.protocol.openai.responses import (
    parse_responses_request,
)
from pdtrio.protocol.routes import RouteTable
from pdtrio.router.core import Router
from pdtrio.router.gil_handoff import GilHandoff
from pdtrio.router.metrics import Outcome
from pdtrio.tracing import TRACEPARENT_HEADER

log = logging.getLogger("pdtrio.router")

_COMPLETION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
# each completion path's request parser and the answer kind the pipeline shapes
_PARSERS: Final[Mapping[str, tuple[Callable[..., AnyRequest], AnswerKind]]] = MappingProxyType(
    {
        "/v1/chat/completions": (parse_chat_completion_request, "chat"),
        "/v1/completions": (parse_completion_request, "completion"),
        "/v1/responses": (parse_responses_request, "responses"),
    }
)

TRIO_ONLY_MESSAGE = (
    "pdtrio runs on Trio, not asyncio: start it with `hypercorn -k trio pdtrio.app:app`"
)


# Each known path and the methods it answers; any other method gets a 405 with Allow.
ROUTES: Final = RouteTable(
    {
        "/v1/chat/completions": ("POST",),
        "/v1/completions": ("POST",),
        "/v1/responses": ("POST",),
        "/v1/models": ("GET",),
        "/health": ("GET",),
        "/health/live": ("GET",),
        "/health/ready": ("GET",),
        "/metrics": ("GET",),
    }
)
# Bodies above this are parsed on a thread, so the loop keeps serving meanwhile.
OFF_LOOP_PARSE_BYTES: Final = 256 * 1024
# While a thread parses, the loop gets the GIL back this soon after asking for it.
# CPython's default (5 ms) is paid on each of the several system calls an answer
# makes (every one releases the GIL), so even /health would wait on a big parse.
PARSE_SWITCH_INTERVAL_S: Final = 0.0005


_HEALTH_PATHS = frozenset({"/health", "/health/live", "/health/ready"})


def readiness(router: Router) -> tuple[bool, str]:
    """Whether the router takes requests now, and if not, why (for ``/health/ready``)."""
    if router.requests.draining:
        return False, "the router is draining: it takes no new requests"
    health = router.health()
    if health["status"] == "ok":
        return True, ""
    missing = [role for role in ("prefill", "decode") if not health.get(f"{role}_instances", 0)]
    if missing:
        return False, "no " + " and no ".join(missing) + " instance is up"
    return False, f"the router's health is {health['status']!r}"


def _running_on_trio() -> bool:
    import sniffio

    try:
        return sniffio.current_async_library() == "trio"
    except sniffio.AsyncLibraryNotFoundError:
        return False


@final
class RouterApp:
    """``pdtrio.app:app``. All state lives in the lifespan, none in this object.

    ``config`` is for embedding and tests; hypercorn's app reads ``PDTRIO_CONFIG``.
    """

    def __init__(self, config: PdtrioConfig | None = None) -> None:
        # hypercorn serves this app: no peer's bytes may end its server (see the module)
        hypercorn_guard.install()
        self._config = config
        # one big parse at a time: they hold the GIL in turns anyway, and this bounds memory
        self._parse_limiter = trio.CapacityLimiter(1)
        # while a big body is parsed on a thread, the loop gets the GIL back sooner
        self._gil_handoff = GilHandoff(PARSE_SWITCH_INTERVAL_S)
        # a big body's memory goes back to the OS once its request is done with
        self.heap_trimmer = HeapTrimmer()
        # the running router, for a program that embeds the app with its own config (tests)
        self.router: Router | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(scope, receive, send)
        elif kind == "http":
            await self._http(scope, receive, send)
        elif kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        if message["type"] != "lifespan.startup":
            return
        if not _running_on_trio():
            from pdtrio.router.lifespan import fail_startup

            await fail_startup(send, TRIO_ONLY_MESSAGE, exit_process=self._config is None)
            return
        from pdtrio.router.lifespan import run_lifespan

        limit_heap_retention()
        if self._config is not None:  # embedded in another program (tests): its objects

            async def send_then_keep(message: Message) -> None:
                if message["type"] == "lifespan.startup.complete":
                    self.router = scope["state"]["router"]
                await send(message)

            await run_lifespan(scope, receive, send_then_keep, self._config)
            return

        async def send_then_freeze(message: Message) -> None:
            await send(message)
            if message["type"] == "lifespan.startup.complete":
                freeze_startup_objects()  # the heap trimmer's collections skip them
                collect_young_less_often(ROUTER_YOUNG_COLLECTION_THRESHOLD)

        await run_lifespan(scope, receive, send_then_freeze, self._config)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope.get("state") or {}
        router: Router | None = state.get("router")
        if router is None:
            await send_json(
                send,
                503,
                service_unavailable(
                    "the router is not running (" + TRIO_ONLY_MESSAGE + ")"
                ).to_body(),
            )
            return
        path: str = scope["path"]
        method: str = scope["method"]
        server = scope.get("server")
        if server is not None:
            router.backend.serving_at(server)
        try:
            if path not in ROUTES and path.startswith("/pd/"):
                # a worker's path: say who answers, so that a registration pointing
                # at a router is recognised as one (and ignored) when it is dialed
                raise error_for(
                    Reason.NOT_FOUND,
                    f"this is a pdtrio router, not a worker: no route {method} {path}",
                    headers=[(ROUTER_HEADER, "1")],
                )
            ROUTES.check(method, path)
            key_id = _client_key(router, path, scope)
            if path in _COMPLETION_PATHS:
                limits = router.client_limits
                limits.admit(key_id)
                try:
                    await self._completion(router, scope, receive, send, path, key_id)
                finally:
                    limits.release(key_id)
            elif path == "/v1/models":
                await send_json(
                    send, 200, models_list_body(router.models, created=int(time.time()))
                )
            elif path == "/health":
                health = router.health()
                await send_json(send, 200 if health["status"] == "ok" else 503, health)
            elif path == "/health/live":
                # the loop answers: nothing else is asked (a restart would not help it)
                await send_json(send, 200, {"status": "live", "pid": os.getpid()})
            elif path == "/health/ready":
                ready, reason = readiness(router)
                answer = {"status": "ready" if ready else "not ready", "pid": os.getpid()}
                if reason:
                    answer["reason"] = reason
                await send_json(send, 200 if ready else 503, answer)
            elif wants_openmetrics(header(scope, b"accept")):
                text = router.metrics_text(openmetrics=True)
                await send_bytes(send, 200, text, OPENMETRICS_CONTENT_TYPE)
            else:
                await send_bytes(send, 200, router.metrics_text(), METRICS_CONTENT_TYPE)
        except OpenAIError as exc:
            if path in _COMPLETION_PATHS:
                # refused before the pipeline ran (method, key, media type, size, validation)
                trace_id = ""
                if router.tracing is not None:
                    trace_id = router.tracing.refused_request(
                        header(scope, TRACEPARENT_HEADER) or "",
                        method=method,
                        endpoint=path,
                        status=exc.status,
                        message=exc.message,
                    )
                router.count_outcome(Outcome.REJECTED, exc.status, endpoint=path, trace_id=trace_id)
            headers = [(name.encode(), value.encode()) for name, value in exc.headers]
            await send_json(send, exc.status, exc.to_body(), headers)
        except ClientDisconnected:
            if path in _COMPLETION_PATHS:
                router.count_outcome(Outcome.DISCONNECTED, endpoint=path)
            return

    async def _completion(
        self,
        router: Router,
        scope: Scope,
        receive: Receive,
        send: Send,
        path: str,
        key_id: str = "",
    ) -> None:
        from pdtrio.router.request.pipeline import RequestPipeline

        content_type = header(scope, b"content-type")
        # checked before reading: a browser's text/plain "simple request" never gets parsed;
        # a client that names no type at all is taken at its word that the body is JSON
        if content_type is not None and not is_json_content_type(content_type):
            raise unsupported_media_type(content_type)
        limit = router.config.router.max_request_bytes
        if declared_body_too_large(scope, limit):
            raise request_too_large(limit)
        timeout_s = router.config.router.body_read_timeout_s
        body: bytearray | None = None
        try:
            # a client that sends headers and never the whole body holds no task for long
            # (an absolute deadline: a relative one reads the clock twice more on entry)
            with trio.CancelScope(deadline=router.now() + timeout_s):
                body = await read_body(receive, limit)
        except BodyTooLarge:
            raise request_too_large(limit) from None
        if body is None:
            raise body_timeout(timeout_s)
        if router.backend.admission_full and not router.requests.draining:
            # it could only join the queue's tail after prefill: refused before it is even
            # parsed (the pipeline checks again, for a queue that fills meanwhile)
            raise queue_full()
        parser, kind = _PARSERS[path]
        parse: Callable[[], AnyRequest] = functools.partial(
            parser,
            body,
            served_models=router.models,
            max_tokens_limit=router.config.router.max_tokens_limit,
            context_lengths=router.backend.context_lengths(),
        )
        big = len(body) > OFF_LOOP_PARSE_BYTES
        try:
            request: AnyRequest | OpenAIError
            if big:
                with self._gil_handoff.prompt():
                    request = await trio.to_thread.run_sync(
                        _parse_leaving_nothing, parse, limiter=self._parse_limiter
                    )
            else:
                request = parse()
            if isinstance(request, OpenAIError):
                raise request
            make_legs = router.backend.legs_for(request, kind, body)
            del body, parse  # a big body's memory goes back now, not when the stream ends
            pipeline = RequestPipeline(
                router,
                request,
                kind,
                receive,
                send,
                make_legs,
                functools.partial(hang_up, scope),
                # (read only when tracing: the request path pays nothing for it otherwise)
                incoming_traceparent=""
                if router.tracing is None
                else (header(scope, TRACEPARENT_HEADER) or ""),
                key_id=key_id,
            )
            del request
            await pipeline.run()
        finally:
            if big:
                # by the time it runs (a moment later) the response is out and all is freed
                self.heap_trimmer.trim_soon()


def _client_key(router: Router, path: str, scope: Scope) -> str:
    """The id of the API key the request carries ("" when none is asked); 401 if wrong.

    Checked before the body is read.  /health and /metrics are open unless configured.
    """
    keys = router.api_keys
    if not keys.required:
        return ""
    security = router.config.security
    if (path in _HEALTH_PATHS and not security.protect_health) or (
        path == "/metrics" and not security.protect_metrics
    ):
        return ""
    authorization = header(scope, b"authorization")
    key_id: str | None = keys.identify(authorization)
    if key_id is None:
        raise unauthorized(has_key=authorization is not None)
    return key_id


def _parse_leaving_nothing(
    parse: Callable[[], AnyRequest],
) -> AnyRequest | OpenAIError:
    """On the parse thread: the request, or the error refusing it, holding no frame.

    A raised error's traceback (and the JSON error it replaced, with the whole
    text) would keep the parse's locals, every object parsed from the body,
    alive until the loop thread dropped them: freeing a million of them there
    stalls the loop.  Here they are freed on this thread, before it returns.
    """
    try:
        return parse()
    except OpenAIError as exc:
        exc.__traceback__ = None
        exc.__context__ = None
        return exc
