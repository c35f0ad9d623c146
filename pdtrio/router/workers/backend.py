"""The pdtrio backend: requests on pdtrio workers, over one link per worker.

Its instances are the instance table's (``pdtrio.router.workers.instances``), found by
the static list, etcd, or the embedded cluster it starts, and kept linked by the link
supervisor (``pdtrio.router.workers.supervisor``).  A request's legs are
:class:`~pdtrio.router.workers.prefill.PrefillLeg` and
:class:`~pdtrio.router.workers.decode.DecodeLeg`; prefill samples the first token.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, final

import attrs
import httpx
import trio

from pdtrio.config import PdtrioConfig, TracingConfig, WorkerConfig
from pdtrio.discovery.registry import DiscoveryState, EngineListener, Registry, StaticRegistry
from pdtrio.protocol.openai.answers import AnswerKind, AnyRequest
from pdtrio.router.backend import DecodeSide, LegHost, MakeLegs, PrefillSide, continues
from pdtrio.router.request.capacity import CapacityQueue
from pdtrio.router.workers.cluster import WorkerProcess, embedded_workers
from pdtrio.router.workers.decode import DecodeLeg
from pdtrio.router.workers.instances import Instance, InstanceTable
from pdtrio.router.workers.kv_leases import LeaseClock
from pdtrio.router.workers.prefill import PrefillLeg
from pdtrio.router.workers.supervisor import LinkSupervisor

if TYPE_CHECKING:
    from pdtrio.security import PeerCredentials


@final
class WorkerBackend:
    def __init__(
        self,
        config: PdtrioConfig,
        http: httpx.AsyncClient,
        instances: InstanceTable,
        links: LinkSupervisor,
        decode_queue: CapacityQueue[Instance],
        leases: LeaseClock,
        *,
        discovery: DiscoveryState,
        credentials: PeerCredentials,
        lease_margin_s: float,
        processes: list[WorkerProcess],
    ) -> None:
        self._config = config
        self._http = http
        self.instances = instances
        self.links = links
        self.decode_queue = decode_queue
        # when the KV leases of the handles prefill sent end, on this router's clock
        self.leases = leases
        self._discovery = discovery
        self._credentials = credentials
        self._lease_margin_s = lease_margin_s
        # the embedded cluster's worker processes (the router's list), when it runs one
        self.workers = processes

    # --- what the router asks ---------------------------------------------------------

    @property
    def models(self) -> list[str]:
        return sorted({i.model for i in self.instances.values()})

    @property
    def registrations(self) -> EngineListener | None:
        return None

    def context_lengths(self) -> dict[str, int]:
        lengths: dict[str, int] = {}
        for instance in self.instances.values():
            if instance.serves_prefill:
                lengths[instance.model] = max(
                    lengths.get(instance.model, 0), instance.max_model_len
                )
        return lengths

    def health(self, active_requests: int, ignored: Mapping[str, str]) -> dict[str, Any]:
        counts = self.instances.statistics()
        prefill, decode = counts.prefill_usable, counts.decode_usable
        report: dict[str, Any] = {
            "status": "ok" if prefill and decode else "unavailable",
            "prefill_instances": prefill,
            "decode_instances": decode,
            "active_requests": active_requests,
            # which process answered: under `hypercorn -w N` each runs its own router
            "pid": os.getpid(),
            "discovery": self._discovery.report(),
        }
        unpaired = [
            {"instance": instance_id, "reason": reason}
            for instance_id, reason in self.instances.unpaired().items()
        ] + [{"key": key, "reason": reason} for key, reason in ignored.items()]
        if unpaired:
            report["ignored"] = unpaired
        return report

    def describe(self) -> str:
        instances = sorted(self.instances.values(), key=lambda instance: instance.instance_id)
        if not instances:
            return "no instances yet"
        return "instances " + ", ".join(
            f"{instance.instance_id} ({instance.role}, {instance.model}) at {instance.url}"
            for instance in instances
        )

    def legs_for(self, request: AnyRequest, kind: AnswerKind, body: bytes | bytearray) -> MakeLegs:
        return self._legs

    def _legs(self, host: LegHost) -> tuple[PrefillSide, DecodeSide, bool]:
        # a stream that may migrate keeps its tokens (n > 1 does not migrate: a
        # continuation would have to replay every choice's history)
        keep_tokens = continues(self._config.router) and host.request.sampling.n == 1
        prefill = PrefillLeg(host, self, keep_tokens=keep_tokens)
        decode = DecodeLeg(host, self, prefill, lease_margin_s=self._lease_margin_s)
        return prefill, decode, True

    # --- the start --------------------------------------------------------------------

    async def start(self, nursery: trio.Nursery, etcd: Registry | None) -> None:
        config = self._config
        if config.uses_embedded_cluster:
            await self._start_embedded(nursery)
            return
        # the static list, then (or instead) what etcd has
        registries: list[Registry] = []
        if config.instances:
            registries.append(
                StaticRegistry(
                    config.instances,
                    self.links,
                    self._http,
                    timeout_s=config.router.connect_timeout_s,
                    credentials=self._credentials,
                )
            )
        if etcd is not None:
            registries.append(etcd)
        for registry in registries:
            await nursery.start(registry.run)

    async def _start_embedded(self, nursery: trio.Nursery) -> None:
        embedded = self._config.embedded
        for name, role in embedded_workers(embedded):
            self.workers.append(
                WorkerProcess(
                    name,
                    role,
                    _traced_like_the_router(embedded.worker, self._config.tracing),
                    ready_timeout_s=embedded.ready_timeout_s,
                    restart_backoff_s=embedded.restart_backoff_s,
                    on_ready=self.links.add_instance,
                    on_lost=self.links.lose_instance,
                    secret=self._credentials.value,
                )
            )

        async def start_one(worker: WorkerProcess) -> None:
            await nursery.start(worker.supervise)

        # workers load their models in parallel
        async with trio.open_nursery() as starters:
            for worker in self.workers:
                starters.start_soon(start_one, worker)


def _traced_like_the_router(worker: WorkerConfig, tracing: TracingConfig) -> WorkerConfig:
    """The embedded workers send spans where the router does, unless their own table says
    where (their service name stays theirs)."""
    if worker.tracing.endpoint or not tracing.endpoint:
        return worker
    return attrs.evolve(
        worker, tracing=attrs.evolve(tracing, service_name=worker.tracing.service_name)
    )
