"""The router as an ASGI app for hypercorn's trio worker."""

from __future__ import annotations

import logging
import time
from typing import Any, final

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
from pdtrio.protocol.openai import (
    OpenAIError,
    models_list_body,
    not_found,
    parse_chat_completion_request,
    parse_completion_request,
    request_too_large,
    service_unavailable,
)

log = logging.getLogger("pdtrio.router")

TRIO_ONLY_MESSAGE = (
    "pdtrio runs on Trio, not asyncio: start it with `hypercorn -k trio pdtrio.app:app`"
)


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

    def __init__(self, config: Any = None) -> None:
        self._config = config

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
            await send({"type": "lifespan.startup.failed", "message": TRIO_ONLY_MESSAGE})
            return
        from pdtrio.router.lifespan import run_lifespan

        await run_lifespan(scope, receive, send, self._config)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope.get("state") or {}
        router = state.get("router")
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
        try:
            if path in ("/v1/chat/completions", "/v1/completions"):
                if method != "POST":
                    raise OpenAIError(f"{method} is not allowed on {path}; use POST", status=405)
                await self._completion(router, scope, receive, send, path == "/v1/chat/completions")
            elif path == "/v1/models" and method == "GET":
                await send_json(
                    send, 200, models_list_body(router.models, created=int(time.time()))
                )
            elif path == "/health" and method == "GET":
                health = router.health()
                await send_json(send, 200 if health["status"] == "ok" else 503, health)
            elif path == "/metrics" and method == "GET":
                await send_bytes(
                    send, 200, router.metrics_text().encode(), b"text/plain; version=0.0.4"
                )
            else:
                raise not_found(f"no route {method} {path}")
        except OpenAIError as exc:
            await send_json(send, exc.status, exc.to_body())
        except ClientDisconnected:
            return

    async def _completion(
        self, router: Any, scope: Scope, receive: Receive, send: Send, chat: bool
    ) -> None:
        from pdtrio.router.pipeline import RequestPipeline

        limit = router.config.router.max_request_bytes
        try:
            body = await read_body(receive, limit)
        except BodyTooLarge:
            raise request_too_large(limit) from None
        parse = parse_chat_completion_request if chat else parse_completion_request
        request = parse(
            body,
            served_models=router.models,
            max_tokens_limit=router.config.router.max_tokens_limit,
        )
        pipeline = RequestPipeline(router, request, "chat" if chat else "completion", receive, send)
        await pipeline.run()
