"""The router's lifespan: starts everything, reports failure so hypercorn exits."""

from __future__ import annotations

import logging

import httpx

from pdtrio.asgi import Receive, Scope, Send
from pdtrio.config import ConfigError, PdtrioConfig, load_config_from_env
from pdtrio.router.cluster import WorkerStartFailed
from pdtrio.router.core import RouterStartFailed, open_router
from pdtrio.router.decode_link import LINK_ERRORS

log = logging.getLogger("pdtrio.router")

_STARTUP_ERRORS = (ConfigError, WorkerStartFailed, RouterStartFailed, httpx.HTTPError, *LINK_ERRORS)


async def run_lifespan(
    scope: Scope, receive: Receive, send: Send, config: PdtrioConfig | None = None
) -> None:
    """Called after lifespan.startup was received, on trio."""
    try:
        if config is None:
            config = load_config_from_env()
    except ConfigError as exc:
        await send({"type": "lifespan.startup.failed", "message": str(exc)})
        return
    failure: str | None = None
    started = False
    try:
        async with open_router(config) as router:
            scope.setdefault("state", {})["router"] = router
            await send({"type": "lifespan.startup.complete"})
            started = True
            while (await receive())["type"] != "lifespan.shutdown":
                pass
            log.info("router shutting down")
    except* Exception as group:
        # anything that breaks start-up must stop hypercorn, not leave it half-serving
        if started:
            raise
        leaves = _leaves(group)
        if not all(isinstance(e, _STARTUP_ERRORS) for e in leaves):
            log.error("router start-up crashed", exc_info=group)
        failure = "; ".join(str(e) or repr(e) for e in leaves)
    if failure is not None:
        log.error("router start-up failed: %s", failure)
        await send(
            {"type": "lifespan.startup.failed", "message": f"pdtrio start-up failed: {failure}"}
        )
        return
    await send({"type": "lifespan.shutdown.complete"})


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    leaves: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            leaves.extend(_leaves(exc))
        else:
            leaves.append(exc)
    return leaves
