"""The worker: control API (hypercorn, trio), KV transfer server, router links.

Roles: ``prefill``, ``decode``, or ``both`` (which hands KV to itself without
a copy).  Each router holds one websocket to each worker, ``/pd/link``
(``pdtrio.worker.router_link``): prefill calls, releases, decode starts,
aborts and tokens all travel on it.  ``POST /pd/prefill`` and
``POST /pd/release`` do the same calls over plain HTTP, for curl and tests.
``GET /pd/stats`` exposes the counts tests use to prove that nothing leaks.
Bodies are msgpack (``pdtrio.protocol.wire``) on the way in and out; errors
are OpenAI-style JSON bodies.
"""

from __future__ import annotations

import logging
import math
from typing import Any, final

import msgspec
import trio

from pdtrio.asgi import (
    BodyTooLarge,
    ClientDisconnected,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    send_bytes,
    send_json,
)
from pdtrio.config import WorkerConfig
from pdtrio.engine.api import Engine, EngineError, EngineOutput, NoRoom, PromptRejected
from pdtrio.kv.api import KvTransport
from pdtrio.kv.selection import kv_transport_for
from pdtrio.memory import limit_heap_retention
from pdtrio.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from pdtrio.protocol import wire
from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.openai import error_body
from pdtrio.protocol.registration import Registration
from pdtrio.protocol.wire import (
    DRAINING_ERROR_TYPE,
    KvHandle,
    PrefillFailed,
    PrefillReply,
    PrefillRequest,
    ReleaseReply,
    ReleaseRequest,
    TokenPrompt,
    WireError,
)
from pdtrio.security import (
    AUTH_SCHEME,
    ChallengeBook,
    PeerCredentials,
    bearer_matches,
    client_tls_context,
    new_access_token,
    new_nonce,
    resolve_metrics_token,
    resolve_worker_secret,
    server_tls_context,
)
from pdtrio.worker.admission import DecodeAdmission
from pdtrio.worker.fault_hooks import fault_hooks_for
from pdtrio.worker.http_listener import HttpConnections, serve_http
from pdtrio.worker.leases import KvLeases, release_token_matches
from pdtrio.worker.metrics import WorkerMetrics
from pdtrio.worker.router_link import OFF_LOOP_DECODE_BYTES, RouterLinkServer

log = logging.getLogger("pdtrio.worker")

_MAX_PREFILL_BODY = 64 * 1024 * 1024
_MAX_RELEASE_BODY = 4096
# an HTTP connection idle this long is closed (hypercorn's keep-alive timeout)
_IDLE_CONNECTION_TIMEOUT_S = 5.0
# prefill bodies being received over HTTP at once (each up to _MAX_PREFILL_BODY)
_MAX_BODIES_IN_FLIGHT = 4
_MSGPACK = wire.MSGPACK_CONTENT_TYPE.encode()
_prefill_request_decoder: wire.Decoder[PrefillRequest] = wire.Decoder(PrefillRequest)
_release_request_decoder: wire.Decoder[ReleaseRequest] = wire.Decoder(ReleaseRequest)


def default_instance_id(role: str, host: str, http_port: int) -> str:
    """The id of an instance nobody named: stable across restarts on the same address."""
    return f"{role}@{host}:{http_port}"


# the worker's HTTP routes and the one method each takes (a wrong method is a 405)
_ROUTE_METHODS = {
    "/health": "GET",
    "/pd/auth": "GET",
    "/pd/info": "GET",
    "/metrics": "GET",
    "/pd/stats": "GET",
    "/pd/prefill": "POST",
    "/pd/release": "POST",
}


@final
class Worker:
    def __init__(
        self, config: WorkerConfig, engine: Engine, transport: KvTransport | None = None
    ) -> None:
        self.config = config
        self.engine = engine
        self.transport: KvTransport = transport or kv_transport_for(config.kv_transport, engine)
        # what every endpoint but /health asks of a peer (none when no secret is set)
        self.secret = PeerCredentials(
            resolve_worker_secret(config.secret, config.secret_file),
            client_tls=client_tls_context(config.tls_ca_file),
            server_tls=server_tls_context(config.tls_cert_file, config.tls_key_file),
        )
        self.transport.secret = self.secret
        # routers prove they hold the secret by answering a challenge of ours, once each
        self.challenges = ChallengeBook(self.secret)
        self._metrics_token = resolve_metrics_token(config.metrics_token, config.metrics_token_file)
        # testing only ([faults]): None unless a hook is configured
        self.faults = fault_hooks_for(config.faults)
        if self.faults is not None:
            self.transport = self.faults.wrap_transport(self.transport)
        # empty until the worker serves: the default names the bound HTTP port
        self.instance_id = config.instance_id
        self.leases = KvLeases(engine.free_request)
        self.transfer_endpoint: tuple[str, int] = (config.advertised_host, 0)
        self.http_port = 0
        self.links: RouterLinkServer | None = None  # set once the instance id is known
        # prefills in progress: their scope, and the release token of the router that asked
        self._prefill_scopes: dict[str, tuple[trio.CancelScope, str]] = {}
        self.served_prefills = 0
        # asked to stop: new work is refused while running requests finish (see drain)
        self.draining = False
        # one big decode at a time: bounds the memory of bodies being decoded at once
        self._decode_limiter = trio.CapacityLimiter(1)
        self._bodies_in_flight = trio.CapacityLimiter(_MAX_BODIES_IN_FLIGHT)
        self.http_connections = HttpConnections(
            max_strangers=config.max_unauthenticated_connections,
            max_peers=config.max_authenticated_connections,
        )
        self.metrics = WorkerMetrics(self)
        engine.observe_steps(self.metrics.step)

    @property
    def serves_prefill(self) -> bool:
        return self.config.role in ("prefill", "both")

    @property
    def serves_decode(self) -> bool:
        return self.config.role in ("decode", "both")

    @property
    def advertised_port(self) -> int:
        return self.config.advertise_port or self.http_port

    @property
    def url(self) -> str:
        """The base URL others reach this worker at (its advertised address)."""
        host = self.config.advertised_host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 address
        scheme = "https" if self.config.tls_cert_file else "http"
        return f"{scheme}://{host}:{self.advertised_port}"

    @property
    def kv_layout(self) -> KvLayout:
        """The layout this worker reports and pairs by (a fault hook may alter it)."""
        layout = self.engine.layout
        return layout if self.faults is None else self.faults.layout(layout)

    # --- lifetime -----------------------------------------------------------------

    async def run(
        self,
        *,
        task_status: trio.TaskStatus[dict[str, Any]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run until cancelled. Reports {"http_port", "transfer_port", "instance_id", "url"}."""
        from hypercorn.config import Config as HypercornConfig

        config = self.config
        limit_heap_retention()  # huge prompts' memory goes back to the OS (pdtrio.memory)
        outputs_send, outputs_receive = trio.open_memory_channel[EngineOutput](64)
        async with trio.open_nursery() as nursery:
            await nursery.start(self.engine.run, outputs_send)
            nursery.start_soon(self.leases.run_expiry)
            # NIXL registers the KV cache here; prefill also serves its KV transfer port
            endpoint = await nursery.start(
                self.transport.run,
                self if self.serves_prefill else None,
                config.host,
                config.transfer_port,
            )
            if endpoint is not None:
                # what decode dials: the advertised address, not the bound one
                self.transfer_endpoint = (
                    config.advertised_host,
                    config.advertise_transfer_port or endpoint[1],
                )
            hyper = HypercornConfig()  # protocol settings; the listener is ours (capped)
            if config.tls_cert_file:  # HTTPS and WSS (checked loadable above)
                hyper.certfile = config.tls_cert_file
                hyper.keyfile = config.tls_key_file
            hyper.accesslog = None
            hyper.errorlog = logging.getLogger("pdtrio.worker.hypercorn")
            # an idle HTTP connection (one that sends nothing, or nothing more) goes soon:
            # routers talk over their links (websockets, not subject to it), so only a
            # stranger would keep one idle; it bounds how long each can be held
            hyper.keep_alive_timeout = _IDLE_CONNECTION_TIMEOUT_S
            hyper.websocket_max_message_size = 64 * 1024 * 1024
            # until the id is known every route but /health answers 503 (see asgi)
            self.http_port = await nursery.start(
                serve_http, self.asgi, hyper, self.http_connections, config.host, config.port
            )
            if not self.instance_id:
                self.instance_id = default_instance_id(
                    config.role, config.advertised_host, self.advertised_port
                )
            self.secret.identity = self.instance_id  # what its proofs are bound to
            admission = (
                DecodeAdmission(
                    self.engine,
                    self.leases,
                    self.transport,
                    self.instance_id,
                    layout=self.kv_layout,
                )
                if self.serves_decode
                else None
            )
            links = RouterLinkServer(
                admission,
                self if self.serves_prefill else None,
                self.engine,
                config.flush,
                faults=self.faults,
            )
            nursery.start_soon(links.dispatch_outputs, outputs_receive)
            self.links = links
            task_status.started(
                {
                    "http_port": self.http_port,
                    "transfer_port": self.transfer_endpoint[1],
                    "instance_id": self.instance_id,
                    "url": self.url,
                }
            )

    # --- draining -------------------------------------------------------------------

    def begin_drain(self) -> None:
        """Refuse new work from now on: prefills get a 503, decode starts a retryable
        rejection, and decode reports no free blocks (routers send it nothing new)."""
        if self.draining:
            return
        self.draining = True
        if self.links is not None:
            self.links.draining = True
            self.links.capacity_changed()

    @property
    def busy(self) -> bool:
        """Whether anything runs here or waits to be pulled: prefills, leases, decodes."""
        links = self.links
        return bool(
            self._prefill_scopes
            or len(self.leases)
            or (links is not None and links.request_count)
            or self.engine.statistics().running_requests
        )

    async def drain(self, grace_s: float) -> bool:
        """Refuse new work and wait up to ``grace_s`` for the running work to end.

        True when it all ended in time.
        """
        self.begin_drain()
        log.info("draining: up to %gs for running requests to finish", grace_s)
        with trio.move_on_after(grace_s):
            while self.busy:  # noqa: ASYNC110 - state of many parts, checked rarely
                await trio.sleep(0.05)
            return True
        log.warning("drain time is up: stopping with requests still running")
        return False

    # --- KvBlockSource for the transport server -----------------------------------

    def holds(
        self, request_id: str, block_ids: tuple[int, ...], access_token: str | None = None
    ) -> bool:
        return self.leases.holds(request_id, block_ids, access_token)

    def release_granted(self, request_id: str, access_token: str) -> bool:
        """A peer's release: frees the blocks of the grant's holder; the release token of
        the router that asked for the prefill also stops it while it runs (asked over a
        link that is gone since, say)."""
        running = self._prefill_scopes.get(request_id)
        if running is not None:
            scope, owner = running
            if release_token_matches(access_token, owner):
                scope.cancel()
                return True
            return False
        return self.leases.release_granted(request_id, access_token)

    async def read_blocks(self, block_ids: tuple[int, ...]) -> bytes:
        return await self.engine.read_blocks(block_ids)

    def release(self, request_id: str) -> bool:
        running = self._prefill_scopes.get(request_id)
        if running is not None:
            running[0].cancel()  # released while still prefilling: stop it
        return self.leases.release(request_id)

    # --- ASGI -----------------------------------------------------------------------

    async def asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]  # "http" or "websocket": our listener sends no lifespan
        path = scope["path"]
        links = self.links
        # every endpoint but /health needs a router's proof: refused before any body is read
        authorization = header(scope, b"authorization")
        authenticated = self.challenges.admits(authorization, trio.current_time())
        if authenticated:
            # its connection leaves the strangers' bound (see http_listener)
            self.http_connections.authenticated(scope.get("client"))
        admitted = (
            authenticated
            or path == "/health"
            or (path == "/metrics" and bearer_matches(authorization, self._metrics_token))
        )
        if kind == "websocket":
            if not admitted:
                log.warning("refused a router link that did not answer a challenge of ours")
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
            challenge = self.challenges.challenge(authorization, trio.current_time(), new_nonce())
            await send_json(
                send,
                401,
                error_body(
                    "this worker endpoint needs proof of the shared worker secret "
                    f"(the {AUTH_SCHEME} challenge in WWW-Authenticate)",
                    type_="authentication_error",
                ),
                [(b"www-authenticate", challenge.encode())],
            )
            return
        try:
            if path == "/health" and method == "GET":
                await send_json(send, 200, {"status": "ok"})
            elif path == "/metrics" and method == "GET":
                await send_bytes(send, 200, self.metrics.render(), METRICS_CONTENT_TYPE)
            elif links is None:
                await send_json(
                    send, 503, error_body("the worker is starting", type_="service_unavailable")
                )
            elif path == "/pd/auth" and method == "GET":
                # admitted without a challenge: this worker holds no secret
                await send_json(send, 200, {"authentication": "none"})
            elif path == "/pd/info" and method == "GET":
                await send_json(send, 200, self.info())
            elif path == "/pd/stats" and method == "GET":
                await send_json(send, 200, self.stats())
            elif path == "/pd/prefill" and method == "POST" and self.serves_prefill:
                await self._handle_prefill(receive, send)
            elif path == "/pd/release" and method == "POST":
                await self._handle_release(receive, send)
            elif path in _ROUTE_METHODS and not (path == "/pd/prefill" and not self.serves_prefill):
                allowed = _ROUTE_METHODS[path]
                await send_json(
                    send,
                    405,
                    error_body(
                        f"{method} is not allowed on {path}; use {allowed}",
                        type_="invalid_request_error",
                    ),
                    [(b"allow", allowed.encode())],
                )
            else:
                await send_json(
                    send, 404, error_body(f"no route {method} {path}", type_="not_found_error")
                )
        except ClientDisconnected:
            return
        except BodyTooLarge:
            await send_json(
                send,
                413,
                error_body("the request body is too large", type_="invalid_request_error"),
            )
        except WireError as exc:
            await send_json(
                send, 400, error_body(f"malformed request: {exc}", type_="invalid_request_error")
            )
        except Busy as exc:
            await send_json(
                send,
                503,
                error_body(str(exc), type_="service_unavailable"),
                [(b"retry-after", b"1")],
            )

    def info(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "role": self.config.role,
            "model": self.engine.model_name,
            "max_model_len": self.engine.max_model_len,
            # the wire form (a list): msgspec.convert(info["layout"], KvLayout) reads it
            "layout": msgspec.to_builtins(self.kv_layout),
            "transfer_endpoint": list(self.transfer_endpoint),
            "kv_transport": self.transport.info(),
            # what it would register in etcd: what a router listing it statically reads
            "registration": msgspec.to_builtins(self.registration()),
        }

    def registration(self) -> Registration:
        """What this worker registers about itself: its advertised addresses and layout."""
        return Registration(
            instance_id=self.instance_id,
            role=self.config.role,
            url=self.url,
            transfer_host=self.transfer_endpoint[0],
            transfer_port=self.transfer_endpoint[1],
            model=self.engine.model_name,
            max_model_len=self.engine.max_model_len,
            layout=self.kv_layout,
            kv_blocks_total=self.engine.statistics().kv_blocks_total,
            kv_transport=self.transport.name,
        )

    def stats(self) -> dict[str, Any]:
        engine = self.engine.statistics()
        links = self.links
        return {
            "instance_id": self.instance_id,
            "role": self.config.role,
            "running_requests": engine.running_requests,
            "kv_blocks_in_use": engine.kv_blocks_in_use,
            "kv_blocks_total": engine.kv_blocks_total,
            "kv_leases": len(self.leases),
            "kv_leases_expired": self.leases.expired_count,
            "router_links": 0 if links is None else links.link_count,
            "decode_requests": 0 if links is None else links.request_count,
            "prefills_in_progress": len(self._prefill_scopes),
            # prefill bodies being read off HTTP connections (bounded: beyond, a 503)
            "prefill_bodies_receiving": self._bodies_in_flight.borrowed_tokens,
            "served_prefills": self.served_prefills,
        }

    async def _handle_release(self, receive: Receive, send: Send) -> None:
        body = await read_body(receive, _MAX_RELEASE_BODY)
        request = _release_request_decoder.decode(body)
        # a peer: only the holder of the request's grant may free its blocks
        released = self.release_granted(request.request_id, request.access_token)
        await send_bytes(send, 200, wire.encode(ReleaseReply(released)), _MSGPACK)

    async def _handle_prefill(self, receive: Receive, send: Send) -> None:
        """``POST /pd/prefill``: the same call as the link's, for curl and tests."""
        # bodies in flight are bounded: a peer (even one with the secret) cannot make the
        # worker hold any number of 64 MB bodies at once
        try:
            self._bodies_in_flight.acquire_nowait()
        except trio.WouldBlock:
            raise Busy("too many prefill bodies are being received; retry shortly") from None
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
            nursery.start_soon(self._cancel_on_disconnect, receive, nursery.cancel_scope)
            answer = await self.prefill_call(request)
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
            self.leases.release(request.request_id)  # nobody will come for the blocks
            raise

    async def prefill_call(self, request: PrefillRequest) -> PrefillReply | PrefillFailed | None:
        """One prefill, from the link or the HTTP route: the reply, the error, or None.

        None: a release stopped it (the caller gave up).  Whatever does not end
        in a reply frees the request's blocks here.
        """
        request_id = request.request_id
        try:
            check_prefill_request(request)
        except WireError as exc:
            return PrefillFailed(
                request_id, 400, f"malformed request: {exc}", "invalid_request_error"
            )
        if self.draining:
            return PrefillFailed(request_id, 503, "the instance is draining", DRAINING_ERROR_TYPE)
        if self._knows(request_id):
            return PrefillFailed(
                request_id, 409, f"request {request_id} is already known", "invalid_request_error"
            )
        outcome: PrefillReply | PrefillFailed | None = None
        scope = trio.CancelScope()
        self._prefill_scopes[request_id] = (scope, request.release_token)
        try:
            with scope:
                outcome = await self._prefill_or_error(request)
        finally:
            del self._prefill_scopes[request_id]
            if not isinstance(outcome, PrefillReply):
                self.engine.free_request(request_id)
        if isinstance(outcome, PrefillReply):
            self.served_prefills += 1
        return outcome

    def _knows(self, request_id: str) -> bool:
        """Whether the id is in use here: a second request would share its blocks."""
        links = self.links
        return (
            request_id in self._prefill_scopes
            or self.leases.holds(request_id, ())
            or (links is not None and request_id in links.owner)
        )

    async def _cancel_on_disconnect(self, receive: Receive, scope: trio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    async def _prefill_or_error(self, request: PrefillRequest) -> PrefillReply | PrefillFailed:
        """The reply, or the error the engine's refusal or failure maps to."""
        request_id = request.request_id
        try:
            if self.faults is not None and self.faults.watches_prefill:
                failed = await self.faults.before_prefill(request_id)
                if failed is not None:
                    return failed
            return await self._prefill(request)
        except PromptRejected as exc:
            return PrefillFailed(
                request_id, 400, exc.message, "invalid_request_error", param=exc.param
            )
        except NoRoom as exc:
            return PrefillFailed(
                request_id, 503, f"prefill has no KV room: {exc}", "service_unavailable"
            )
        except EngineError as exc:
            log.error("prefill of %s failed: %r", request_id, exc)
            return PrefillFailed(request_id, 500, f"prefill failed: {exc}", "internal_server_error")

    async def _prefill(self, request: PrefillRequest) -> PrefillReply:
        request_id = request.request_id
        token_ids = await self.engine.tokenize(request.prompt)
        result = await self.engine.prefill(
            request_id, token_ids, request.sampling, request.max_tokens, request.generated_tokens
        )
        handle: KvHandle | None = None
        if result.finish_reason is None:
            lease_s = self.config.kv_lease_s
            access_token = new_access_token()
            self.leases.hold(
                request_id,
                result.block_ids,
                trio.current_time() + lease_s,
                access_token,
                request.release_token,
            )
            handle = KvHandle(
                request_id=request_id,
                instance_id=self.instance_id,
                transfer_host=self.transfer_endpoint[0],
                transfer_port=self.transfer_endpoint[1],
                block_ids=result.block_ids,
                num_tokens=len(token_ids),
                layout=self.kv_layout,
                # a duration: the router and decode count it from their own clocks
                lease_ttl_s=lease_s,
                access_token=access_token,
            )
        return PrefillReply(
            request_id=request_id,
            prompt_token_ids=tuple(token_ids),
            cached_tokens=result.cached_tokens,
            first_token_id=result.first_token_id,
            first_text=result.first_text,
            finish_reason=result.finish_reason,
            token_budget=result.token_budget,
            kv_handle=handle,
            usage=result.usage,
        )


class Busy(Exception):
    """A bound on work in flight is reached: 503, retry shortly."""


def check_prefill_request(request: PrefillRequest) -> None:
    """What msgspec's types cannot say about a prefill request; WireError (a 400) if wrong.

    The router validated the client's request, but the worker trusts no peer:
    a bad value here would fail deep in the engine, as a 500.
    """
    if not request.request_id:
        raise WireError("request_id is empty")
    sampling = request.sampling
    if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0.0):
        raise WireError(f"temperature {sampling.temperature} is not a finite number >= 0")
    if not 0.0 < sampling.top_p <= 1.0:
        raise WireError(f"top_p {sampling.top_p} is not in (0, 1]")
    if sampling.min_tokens < 0:
        raise WireError(f"min_tokens {sampling.min_tokens} is negative")
    if any(not stop for stop in sampling.stop):
        raise WireError("a stop sequence is empty")
    if request.max_tokens is not None and request.max_tokens < 1:
        raise WireError(f"max_tokens {request.max_tokens} is less than 1")
    if request.generated_tokens:
        prompt = request.prompt
        if not isinstance(prompt, TokenPrompt) or not (
            0 < request.generated_tokens < len(prompt.token_ids)
        ):
            raise WireError(
                f"generated_tokens {request.generated_tokens} needs a token prompt longer than that"
            )
