"""The engines backend: requests on the vLLM or SGLang instances the router fronts.

Its instances are the engine pool's (``pdtrio.router.engines.pool``: listed, or
registered in etcd by ``pdtrio register``), probed over HTTP.  A request's legs are
the engines' HTTP legs (``pdtrio.router.engines.legs``); an engine's decode generates
every token again, so prefill samples none for the client.  It builds none of the
pdtrio backend's parts: no links, no decode-room queue (an engine queues for itself),
no KV lease clock (the engines keep their own leases).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal, final

import trio

from pdtrio.discovery.registry import DiscoveryState, EngineListener, Registry, RegistryListener
from pdtrio.protocol.link.registration import Registration
from pdtrio.protocol.openai.answers import AnswerKind, AnyRequest
from pdtrio.protocol.openai.responses import ResponsesRequest, engine_chat_body
from pdtrio.router.backend import MakeLegs
from pdtrio.router.engines.legs import EngineLegs
from pdtrio.router.engines.pool import EnginePool
from pdtrio.router.engines.prefill import EnginePrefillLeg, SglangPrefillLeg, VllmPrefillLeg
from pdtrio.router.state_metrics import BackendFigures, InstanceFigures


@final
class EngineBackend:
    def __init__(
        self,
        pool: EnginePool,
        discovery: DiscoveryState,
        *,
        registration_rejected: Callable[[str, str], None],
    ) -> None:
        self.pool = pool
        self._discovery = discovery
        self._refusals = RefusedRegistrations(registration_rejected)
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

    @property
    def registry_listener(self) -> RegistryListener:
        return self._refusals

    @property
    def admission_full(self) -> bool:
        return False  # the router queues nothing for an engine: each queues for itself

    def serving_at(self, server: Any) -> None:
        pass  # only pdtrio workers' registrations are checked against the router's address

    def figures(self) -> BackendFigures:
        return BackendFigures(
            instances=tuple(
                InstanceFigures(
                    instance.instance_id,
                    instance.config.role,
                    instance.model,
                    up=instance.usable,
                    active_requests=instance.in_flight,
                )
                for instance in self.pool.instances.values()
            )
        )

    def context_lengths(self) -> dict[str, int]:
        return self.pool.context_lengths()

    def health(self, active_requests: int) -> dict[str, Any]:
        return self.pool.health(active_requests, self._discovery, self._refusals.ignored)

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

    async def stop_processes(self) -> None:
        pass  # it starts no process: the engines are the operator's


@final
class RefusedRegistrations:
    """What etcd tells an engines router besides its engines: the entries it ignored.

    No pdtrio worker's registration comes here: the registry refuses any kind but the
    configured one, and reports it as ignored.
    """

    def __init__(self, registration_rejected: Callable[[str, str], None]) -> None:
        self._count_rejected = registration_rejected
        # registry keys that are not usable, and why (for /health)
        self.ignored: dict[str, str] = {}

    async def instance_listed(self, registration: Registration) -> None:
        pass

    def instance_registered(self, registration: Registration) -> None:
        pass

    def instance_deregistered(self, instance_id: str) -> None:
        pass

    def registration_ignored(self, key: str, reason: str | None) -> None:
        if reason is None:
            self.ignored.pop(key, None)
        else:
            self.ignored[key] = reason

    def registration_rejected(self, key: str, reason: str) -> None:
        self._count_rejected(key, reason)
