"""The engines backend: requests on the vLLM or SGLang instances the router fronts.

Its instances are the engine pool's (``pdtrio.router.engines.pool``: listed, or
registered in etcd by ``pdtrio register``), probed over HTTP.  A request's legs are
the engines' HTTP legs (``pdtrio.router.engines.legs``); an engine's decode generates
every token again, so prefill samples none for the client.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal, final

import trio

from pdtrio.discovery.registry import DiscoveryState, EngineListener, Registry
from pdtrio.protocol.openai.answers import AnswerKind, AnyRequest
from pdtrio.protocol.openai.responses import ResponsesRequest, engine_chat_body
from pdtrio.router.backend import MakeLegs
from pdtrio.router.engines.legs import EngineLegs
from pdtrio.router.engines.pool import EnginePool
from pdtrio.router.engines.prefill import EnginePrefillLeg, SglangPrefillLeg, VllmPrefillLeg


@final
class EngineBackend:
    def __init__(self, pool: EnginePool, discovery: DiscoveryState) -> None:
        self.pool = pool
        self._discovery = discovery
        # the protocol's own prefill stage, chosen once (P and D of one kind only pair)
        self._prefill_stage: type[EnginePrefillLeg] = (
            SglangPrefillLeg if pool.kind == "sglang" else VllmPrefillLeg
        )

    @property
    def models(self) -> list[str]:
        return self.pool.models

    @property
    def registrations(self) -> EngineListener | None:
        return self.pool

    def context_lengths(self) -> dict[str, int]:
        return self.pool.context_lengths()

    def health(self, active_requests: int, ignored: Mapping[str, str]) -> dict[str, Any]:
        return self.pool.health(active_requests, self._discovery, ignored)

    def describe(self) -> str:
        return "engines " + self.pool.describe()

    def legs_for(self, request: AnyRequest, kind: AnswerKind, body: bytes | bytearray) -> MakeLegs:
        # an engine gets the client's own request (what pdtrio validated), its legs'
        # fields set on it; a Responses one as the chat request it stands for
        engine_body = json.loads(body)
        if isinstance(request, ResponsesRequest):
            engine_body = engine_chat_body(engine_body, request)
        engine_kind: Literal["chat", "completion"] = (
            "completion" if kind == "completion" else "chat"
        )
        return EngineLegs(self.pool, engine_body, engine_kind, self._prefill_stage)

    async def start(self, nursery: trio.Nursery, etcd: Registry | None) -> None:
        await nursery.start(self.pool.run)
        if etcd is not None:
            await nursery.start(etcd.run)
