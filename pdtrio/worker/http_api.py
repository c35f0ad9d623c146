"""The worker's HTTP routes and its ``/pd/link`` websocket, behind the peer challenge.

Every route but ``/health`` (and ``/metrics`` with the metrics token) needs a
router's proof of the shared worker secret, refused before any body is read.
``POST /pd/prefill`` and ``POST /pd/release`` make the same calls as a router's
link (``pdtrio.worker.router_link``), for curl and tests; ``GET /pd/stats`` exposes
the counts tests use to prove that nothing leaks.  Bodies are msgpack
(``pdtrio.protocol.link.wire``) on the way in and out; errors are OpenAI-style JSON
bodies, a wrong path or method answered from the one route table type
(``pdtrio.protocol.routes``) the router's app uses too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Final, Protocol, final

import trio

from pdtrio.asgi import (
    BodyTooLarge,
    ClientDisconnected,
    Receive,
    Scope,
    Send,
    declared_body_too_large,
    header,
    read_body,
    send_bytes,
    send_json,
)
from pdtrio.logs import LogBudget
from pdtrio.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from pdtrio.protocol.errors import Reason
from pdtrio.protocol.link import wire
from pdtrio.protocol.link.wire import (
    PrefillFailed,
    PrefillReply,
    PrefillRequest,
    ReleaseReply,
    ReleaseRequest,
    WireError,
)
from pdtrio.protocol.openai import OpenAIError, error_body, error_for, not_found
from pdtrio.protocol.routes import RouteTable
from pdtrio.security import AUTH_SCHEME, ChallengeBook, bearer_matches, new_nonce
from pdtrio.worker.http_listener import HttpConnections
from pdtrio.worker.leases import KvLeases
from pdtrio.worker.metrics import WorkerMetrics
from pdtrio.worker.prefill import PrefillRole
from pdtrio.worker.router_link import OFF_LOOP_DECODE_BYTES, RouterLinkServer

log = logging.getLogger("pdtrio.worker")

_MAX_PREFILL_BODY = 64 * 1024 * 1024
_MAX_RELEASE_BODY = 4096
# prefill bodies being received over HTTP at once (each up to _MAX_PREFILL_BODY)
_MAX_BODIES_IN_FLIGHT = 4
_MSGPACK = wire.MSGPACK_CONTENT_TYPE.encode()
_prefill_request_decoder: wire.Decoder[PrefillRequest] = wire.Decoder(PrefillRequest)
_release_request_decoder: wire.Decoder[ReleaseRequest] = wire.Decoder(ReleaseRequest)

# the worker's HTTP routes and the one method each takes (a wrong method is a 405)
ROUTES: Final = RouteTable(
    {
        "/health": ("GET",),
        "/pd/auth": ("GET",),
        "/pd/info": ("GET",),
        "/metrics": ("GET",),
        "/pd/stats": ("GET",),
        "/pd/prefill": ("POST",),
        "/pd/release": ("POST",),
    }
)


class ServedWorker(Protocol):
    """What the routes read of the worker (``pdtrio.worker.server.Worker``)."""

    @property
    def link_server(self) -> RouterLinkServer | None: ...

    @property
    def serves_prefill(self) -> bool: ...

    @property
    def prefill(self) -> PrefillRole: ...

    @property
    def leases(self) -> KvLeases: ...

    @property
    def metrics(self) -> WorkerMetrics: ...

    @property
    def http_connections(self) -> HttpConnections: ...

    @property
    def draining(self) -> bool: ...

    def info(self) -> dict[str, Any]: ...

    def stats(self) -> dict[str, Any]: ...


# a bound on work in flight is reached, or the worker is starting: retry shortly
_SOON = (("retry-after", "1"),)


_HEALTH_PATHS = frozenset({"/health", "/health/live", "/health/ready"})


def _not_ready_because(worker: ServedWorker) -> str:
    """Why the worker takes no new work now ("" when it does)."""
    if worker.link_server is None:
        return "the worker is starting"
    if worker.draining:
        return "the worker is draining: it takes no new requests"
    return ""


@final
class WorkerHttpApi:
    """The worker's ASGI app: its routes, and its routers' links."""

    def __init__(
        self, worker: ServedWorker, *, challenges: ChallengeBook, metrics_token: str
    ) -> None:
        self._worker = worker
        # routers prove they hold the secret by answering a challenge of ours, once each
        self._challenges = challenges
        self._metrics_token = metrics_token
        # one big decode at a time: bounds the memory of bodies being decoded at once
        self._decode_limiter = trio.CapacityLimiter(1)
        self._bodies_in_flight = trio.CapacityLimiter(_MAX_BODIES_IN_FLIGHT)
        # what unauthenticated peers cause is logged within a budget: they cause it at will
        self._refusals = LogBudget()

    @property
    def bodies_receiving(self) -> int:
        """Prefill bodies being read off HTTP connections now."""
        return int(self._bodies_in_flight.borrowed_tokens)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        worker = self._worker
        kind = scope["type"]  # "http" or "websocket": our listener sends no lifespan
        path = scope["path"]
        links = worker.link_server
        # every endpoint but /health needs a router's proof: refused before any body is read
        authorization = header(scope, b"authorization")
        authenticated = self._challenges.admits(authorization, trio.current_time())
        if authenticated:
            # its connection leaves the strangers' bound (see http_listener)
            worker.http_connections.authenticated(scope.get("client"))
        admitted = (
            authenticated
            or path in _HEALTH_PATHS
            or (path == "/metrics" and bearer_matches(authorization, self._metrics_token))
        )
        if kind == "websocket":
            if not admitted:
                self._refusals.log(
                    log,
                    logging.WARNING,
                    "link",
                    "refused a router link that did not answer a challenge of ours",
                )
                await send({"type": "websocket.close", "code": 1008})  # (an HTTP 403)
            elif path != "/pd/link":
                await send({"type": "websocket.close", "code": 1008})  # policy: no such link
            elif links is None:
                await send({"type": "websocket.close", "code": 1013})  # try again later
            else:
                await links.serve_websocket(scope, receive, send)
            return
        method = scope["method"]
        if not admitted:
            # the challenge proves we hold the secret when the caller sent a nonce to answer
            challenge = self._challenges.challenge(authorization, trio.current_time(), new_nonce())
            await _send_error(
                send,
                error_for(
                    Reason.PEER_UNAUTHENTICATED,
                    "this worker endpoint needs proof of the shared worker secret "
                    f"(the {AUTH_SCHEME} challenge in WWW-Authenticate)",
                    headers=(("www-authenticate", challenge),),
                ),
            )
            return
        try:
            if declared_body_too_large(scope, _MAX_PREFILL_BODY):
                raise BodyTooLarge  # refused before a byte of it is read
            if path in ("/health", "/health/live") and method == "GET":
                await send_json(send, 200, {"status": "ok" if path == "/health" else "live"})
            elif path == "/health/ready" and method == "GET":
                reason = _not_ready_because(worker)
                if reason:
                    await send_json(send, 503, {"status": "not ready", "reason": reason})
                else:
                    await send_json(send, 200, {"status": "ready"})
            elif path == "/metrics" and method == "GET":
                await send_bytes(send, 200, worker.metrics.render(), METRICS_CONTENT_TYPE)
            elif links is None:
                raise error_for(Reason.SERVICE_UNAVAILABLE, "the worker is starting", headers=_SOON)
            else:
                await self._route(method, path, receive, send)
        except ClientDisconnected:
            return
        except OpenAIError as exc:  # no such route, not with that method, or not now
            await _send_error(send, exc)
        except BodyTooLarge:
            await _send_error(
                send, error_for(Reason.REQUEST_TOO_LARGE, "the request body is too large")
            )
        except WireError as exc:
            self._refusals.log(
                log, logging.INFO, "malformed", "a malformed request to %s: %s", path, exc
            )
            await _send_error(send, error_for(Reason.INVALID_REQUEST, f"malformed request: {exc}"))

    async def _route(self, method: str, path: str, receive: Receive, send: Send) -> None:
        """A running worker's routes past /health and /metrics; OpenAIError: 404 or 405."""
        worker = self._worker
        if path == "/pd/prefill" and not worker.serves_prefill:
            raise not_found(f"no route {method} {path}")
        ROUTES.check(method, path)
        if path == "/pd/auth":
            # admitted without a challenge: this worker holds no secret
            await send_json(send, 200, {"authentication": "none"})
        elif path == "/pd/info":
            await send_json(send, 200, worker.info())
        elif path == "/pd/stats":
            await send_json(send, 200, worker.stats())
        elif path == "/pd/prefill":
            await self._handle_prefill(receive, send)
        else:  # /pd/release (/health and /metrics are answered before)
            await self._handle_release(receive, send)

    async def _handle_release(self, receive: Receive, send: Send) -> None:
        body = await read_body(receive, _MAX_RELEASE_BODY)
        request = _release_request_decoder.decode(body)
        # a peer: only the holder of the request's grant may free its blocks
        released = self._worker.prefill.release_granted(request.request_id, request.access_token)
        await send_bytes(send, 200, wire.encode(ReleaseReply(released)), _MSGPACK)

    async def _handle_prefill(self, receive: Receive, send: Send) -> None:
        """``POST /pd/prefill``: the same call as the link's, for curl and tests."""
        # bodies in flight are bounded: a peer (even one with the secret) cannot make the
        # worker hold any number of 64 MB bodies at once
        try:
            self._bodies_in_flight.acquire_nowait()
        except trio.WouldBlock:
            raise error_for(
                Reason.SERVICE_UNAVAILABLE,
                "too many prefill bodies are being received; retry shortly",
                headers=_SOON,
            ) from None
        try:
            body = await read_body(receive, _MAX_PREFILL_BODY)
        finally:
            self._bodies_in_flight.release()
        if len(body) > OFF_LOOP_DECODE_BYTES:
            request = await trio.to_thread.run_sync(
                _prefill_request_decoder.decode, body, limiter=self._decode_limiter
            )
        else:
            request = _prefill_request_decoder.decode(body)
        del body  # the prompt lives on in the request; the raw bytes need not
        answer: PrefillReply | PrefillFailed | None = None
        async with trio.open_nursery() as nursery:
            # the caller hanging up cancels the prefill and frees its blocks
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            answer = await self._worker.prefill.prefill_call(request)
            nursery.cancel_scope.cancel()
        if answer is None:
            return  # cancelled: released, or the caller left
        if isinstance(answer, PrefillFailed):
            await send_json(
                send,
                answer.status,
                error_body(answer.message, type_=answer.error_type, param=answer.param),
            )
            return
        try:
            await send_bytes(send, 200, wire.encode(answer), _MSGPACK)
        except BaseException:
            self._worker.leases.release(request.request_id)  # nobody will come for the blocks
            raise


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _send_error(send: Send, error: OpenAIError) -> None:
    """The one way an error leaves the worker's HTTP API: the table's status and body."""
    await send_json(send, error.status, error.to_body(), _encoded(error.headers))


def _encoded(headers: Sequence[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(name.encode(), value.encode()) for name, value in headers]
