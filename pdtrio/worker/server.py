"""The worker: control API (hypercorn, trio), KV transfer server, decode links.

Roles: ``prefill`` serves ``POST /pd/prefill``; ``decode`` serves the
``/pd/decode`` websocket; ``both`` serves both and hands KV to itself without
a copy.  ``GET /pd/stats`` exposes the counts tests use to prove that nothing
leaks.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, final

import trio

from pdtrio import codec
from pdtrio.asgi import (
    BodyTooLarge,
    ClientDisconnected,
    Receive,
    Scope,
    Send,
    read_body,
    send_bytes,
    send_json,
)
from pdtrio.config import WorkerConfig
from pdtrio.engine.api import Engine, EngineError, NoRoom, PromptRejected, StepOutputs
from pdtrio.kv.api import KvTransport
from pdtrio.kv.tcp import TcpKvTransport
from pdtrio.protocol.wire import KvHandle, PrefillReply, PrefillRequest, WireError
from pdtrio.worker.decode_link import DecodeLinkServer
from pdtrio.worker.leases import KvLeases

log = logging.getLogger("pdtrio.worker")

_MAX_CONTROL_BODY = 64 * 1024 * 1024


def _error_body(message: str, *, type_: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": None}}


@final
class Worker:
    def __init__(
        self, config: WorkerConfig, engine: Engine, transport: KvTransport | None = None
    ) -> None:
        self.config = config
        self.engine = engine
        self.transport: KvTransport = transport or TcpKvTransport()
        self.instance_id = config.instance_id or f"{config.role}-{uuid.uuid4().hex[:8]}"
        self.leases = KvLeases(engine.free_request)
        self.transfer_endpoint: tuple[str, int] = (config.host, 0)
        self.http_port = 0
        self.links = DecodeLinkServer(self)
        self._prefill_scopes: dict[str, trio.CancelScope] = {}
        self.served_prefills = 0

    @property
    def serves_prefill(self) -> bool:
        return self.config.role in ("prefill", "both")

    @property
    def serves_decode(self) -> bool:
        return self.config.role in ("decode", "both")

    # --- lifetime -----------------------------------------------------------------

    async def run(
        self,
        *,
        task_status: trio.TaskStatus[dict[str, Any]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run until cancelled. Reports {"http_port", "transfer_port"} once serving."""
        from hypercorn.config import Config as HypercornConfig
        from hypercorn.trio import serve

        outputs_send, outputs_receive = trio.open_memory_channel[StepOutputs](64)
        async with trio.open_nursery() as nursery:
            await nursery.start(self.engine.run, outputs_send)
            nursery.start_soon(self.links.dispatch_outputs, outputs_receive)
            nursery.start_soon(self.leases.run_expiry)
            if self.serves_prefill:
                self.transfer_endpoint = await nursery.start(
                    self.transport.serve, self, self.config.host, self.config.transfer_port
                )
            hyper = HypercornConfig()
            hyper.bind = [f"{self.config.host}:{self.config.port}"]
            hyper.accesslog = None
            hyper.errorlog = logging.getLogger("pdtrio.worker.hypercorn")
            hyper.keep_alive_timeout = 300
            hyper.websocket_max_message_size = 64 * 1024 * 1024
            binds = await nursery.start(serve, self.asgi, hyper)
            self.http_port = int(binds[0].rsplit(":", 1)[1])
            task_status.started(
                {
                    "http_port": self.http_port,
                    "transfer_port": self.transfer_endpoint[1],
                    "instance_id": self.instance_id,
                }
            )

    # --- KvBlockSource for the transport server -----------------------------------

    def holds(self, request_id: str, block_ids: tuple[int, ...]) -> bool:
        return self.leases.holds(request_id, block_ids)

    async def read_blocks(self, block_ids: tuple[int, ...]) -> bytes:
        return await self.engine.read_blocks(block_ids)

    def release(self, request_id: str) -> bool:
        scope = self._prefill_scopes.get(request_id)
        if scope is not None:
            scope.cancel()  # released while still prefilling: stop it
        return self.leases.release(request_id)

    # --- ASGI -----------------------------------------------------------------------

    async def asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
            return
        path = scope["path"]
        if kind == "websocket":
            if path == "/pd/decode" and self.serves_decode:
                await self.links.serve_websocket(scope, receive, send)
            else:
                await send({"type": "websocket.close", "code": 1008})
            return
        method = scope["method"]
        try:
            if path == "/health" and method == "GET":
                await send_json(send, 200, {"status": "ok"})
            elif path == "/pd/info" and method == "GET":
                await send_json(send, 200, self.info())
            elif path == "/pd/stats" and method == "GET":
                await send_json(send, 200, self.stats())
            elif path == "/pd/prefill" and method == "POST" and self.serves_prefill:
                await self._handle_prefill(receive, send)
            elif path == "/pd/release" and method == "POST":
                body = await read_body(receive, 4096)
                request_id = str(codec.unpack(body)[0])
                released = self.release(request_id)
                await send_bytes(send, 200, codec.pack([released]), codec.MSGPACK_CONTENT_TYPE.encode())
            else:
                await send_json(
                    send, 404, _error_body(f"no route {method} {path}", type_="not_found_error")
                )
        except ClientDisconnected:
            return
        except (WireError, BodyTooLarge, IndexError, TypeError) as exc:
            await send_json(send, 400, _error_body(f"bad request: {exc}", type_="invalid_request_error"))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    def info(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "role": self.config.role,
            "model": self.engine.model_name,
            "max_model_len": self.engine.max_model_len,
            "layout": self.engine.layout.to_wire(),
            "transfer_endpoint": list(self.transfer_endpoint),
        }

    def stats(self) -> dict[str, Any]:
        engine = self.engine.statistics()
        return {
            "instance_id": self.instance_id,
            "role": self.config.role,
            "running_requests": engine.running_requests,
            "kv_blocks_in_use": engine.kv_blocks_in_use,
            "kv_blocks_total": engine.kv_blocks_total,
            "kv_leases": len(self.leases),
            "kv_leases_expired": self.leases.expired_count,
            "decode_links": self.links.link_count,
            "decode_requests": self.links.request_count,
            "prefills_in_progress": len(self._prefill_scopes),
            "served_prefills": self.served_prefills,
        }

    async def _handle_prefill(self, receive: Receive, send: Send) -> None:
        body = await read_body(receive, _MAX_CONTROL_BODY)
        request = PrefillRequest.from_wire(codec.unpack(body))
        request_id = request.request_id
        if request_id in self._prefill_scopes or self.leases.holds(request_id, ()):
            await send_json(
                send, 409, _error_body(f"request {request_id} is already known", type_="invalid_request_error")
            )
            return
        reply: PrefillReply | None = None
        failure: tuple[int, dict[str, Any]] | None = None
        scope = trio.CancelScope()
        self._prefill_scopes[request_id] = scope
        try:
            with scope:
                async with trio.open_nursery() as nursery:
                    # the router hanging up cancels the prefill and frees its blocks
                    nursery.start_soon(self._cancel_on_disconnect, receive, nursery.cancel_scope)
                    reply = await self._prefill(request)
                    nursery.cancel_scope.cancel()
        except* PromptRejected as group:
            exc = group.exceptions[0]
            assert isinstance(exc, PromptRejected)
            failure = 400, _error_body(exc.message, type_="invalid_request_error", param=exc.param)
        except* NoRoom as group:
            failure = 503, _error_body(
                f"prefill has no KV room: {group.exceptions[0]}", type_="service_unavailable"
            )
        except* EngineError as group:
            log.error("prefill of %s failed: %r", request_id, group.exceptions[0])
            failure = 500, _error_body(
                f"prefill failed: {group.exceptions[0]}", type_="internal_server_error"
            )
        finally:
            del self._prefill_scopes[request_id]
            if reply is None:
                self.engine.free_request(request_id)
        if failure is not None:
            await send_json(send, *failure)
            return
        if reply is None:
            return  # cancelled: released or the router left
        self.served_prefills += 1
        try:
            await send_bytes(send, 200, codec.pack(reply.to_wire()), codec.MSGPACK_CONTENT_TYPE.encode())
        except BaseException:
            self.leases.release(request_id)
            raise

    async def _cancel_on_disconnect(self, receive: Receive, scope: trio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    async def _prefill(self, request: PrefillRequest) -> PrefillReply:
        token_ids = await self.engine.tokenize(request.prompt)
        result = await self.engine.prefill(request.request_id, token_ids, request.sampling)
        handle: KvHandle | None = None
        if result.finish_reason is None:
            lease_s = self.config.kv_lease_s
            self.leases.hold(request.request_id, result.block_ids, trio.current_time() + lease_s)
            handle = KvHandle(
                request_id=request.request_id,
                instance_id=self.instance_id,
                transfer_host=self.transfer_endpoint[0],
                transfer_port=self.transfer_endpoint[1],
                block_ids=result.block_ids,
                num_tokens=len(token_ids),
                layout=self.engine.layout,
                lease_expiry=time.time() + lease_s,
            )
        return PrefillReply(
            request_id=request.request_id,
            prompt_token_ids=tuple(token_ids),
            cached_tokens=result.cached_tokens,
            first_token_id=result.first_token_id,
            first_text=result.first_text,
            finish_reason=result.finish_reason,
            remaining_tokens=result.remaining_tokens,
            kv_handle=handle,
        )


def dump_ready_line(info: dict[str, Any]) -> str:
    return "PDTRIO_READY " + json.dumps(info)
