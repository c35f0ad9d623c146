"""The pdtrio backend: requests on pdtrio workers, over one link per worker.

It owns its parts: the instance table (``pdtrio.router.workers.instances``), whose
instances are found by the static list, etcd, or the embedded cluster it starts, and
kept linked by its link supervisor (``pdtrio.router.workers.supervisor``); the queue of
prefilled requests waiting for decode KV room, and the KV lease clock.  A request's legs are
:class:`~pdtrio.router.workers.prefill.PrefillLeg` and
:class:`~pdtrio.router.workers.decode.DecodeLeg`; prefill samples the first token.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, final

import attrs
import httpx
import trio

from pdtrio.config import PdtrioConfig, TracingConfig, WorkerConfig
from pdtrio.discovery.registry import (
    DiscoveryState,
    EngineListener,
    Registry,
    RegistryListener,
    StaticRegistry,
)
from pdtrio.protocol.openai.answers import AnswerKind, AnyRequest
from pdtrio.router.backend import DecodeSide, LegHost, MakeLegs, PrefillSide, continues
from pdtrio.router.request.capacity import CapacityQueue
from pdtrio.router.state_metrics import BackendFigures, InstanceFigures, LinkFigures
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
        nursery: trio.Nursery,
        http: httpx.AsyncClient,
        *,
        discovery: DiscoveryState,
        credentials: PeerCredentials,
        lease_margin_s: float,
        registration_rejected: Callable[[str, str], None],
    ) -> None:
        self._config = config
        self._http = http
        router = config.router
        # the pdtrio instances, their state and placement on them
        self.instances = InstanceTable(
            router.prefill_policy,
            router.decode_policy,
            backoff_s=router.instance_backoff_s,
            prefill_cache_weight=router.prefill_cache_weight,
            decode_cache_weight=router.decode_cache_weight,
            local_prefill_max_tokens=router.local_prefill_max_tokens,
        )
        # prefilled requests waiting for decode KV room, woken by the links' reports
        self.decode_queue: CapacityQueue[Instance] = CapacityQueue(router.admission_queue_limit)
        # when the KV leases of the handles prefill sent end, on this router's clock
        self.leases = LeaseClock()
        # what registries say becomes instances with links, kept open and retired
        self.links = LinkSupervisor(
            self.instances,
            config,
            nursery,
            http,
            credentials,
            capacity_changed=self._decode_capacity_changed,
            registration_rejected=registration_rejected,
            leases=self.leases,
        )
        self._discovery = discovery
        self._credentials = credentials
        self._lease_margin_s = lease_margin_s
        # the embedded cluster's worker processes, when it runs one
        self.workers: list[WorkerProcess] = []

    def _decode_capacity_changed(self) -> None:
        """A link reported capacity, connected or went: waiters for room or a link look again."""
        self.decode_queue.changed()
        self.instances.links_changed()

    # --- what the router asks ---------------------------------------------------------

    @property
    def models(self) -> list[str]:
        return sorted({i.model for i in self.instances.values()})

    @property
    def registrations(self) -> EngineListener | None:
        return None

    @property
    def registry_listener(self) -> RegistryListener:
        return self.links

    @property
    def admission_full(self) -> bool:
        return self.decode_queue.full

    def serving_at(self, server: Any) -> None:
        self.links.serving_at(server)

    def figures(self) -> BackendFigures:
        return BackendFigures(
            instances=tuple(_instance_figures(i) for i in self.instances.values()),
            local_prefill_max_tokens=self.instances.local_prefill_max_tokens,
            worker_restarts={worker.name: worker.restarts for worker in self.workers},
        )

    def context_lengths(self) -> dict[str, int]:
        lengths: dict[str, int] = {}
        for instance in self.instances.values():
            if instance.serves_prefill:
                lengths[instance.model] = max(
                    lengths.get(instance.model, 0), instance.max_model_len
                )
        return lengths

    def health(self, active_requests: int) -> dict[str, Any]:
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
        ] + [
            {"key": key, "reason": reason}
            for key, reason in self.links.ignored_registrations.items()
        ]
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

    # --- the start and the stop ---------------------------------------------------------

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

    async def stop_processes(self) -> None:
        async with trio.open_nursery() as stopping:
            for worker in self.workers:
                stopping.start_soon(worker.stop)


def _instance_figures(instance: Instance) -> InstanceFigures:
    link = instance.link
    streams = 0 if link is None else link.active_requests
    figures = InstanceFigures(
        instance.instance_id,
        instance.role,
        instance.model,
        up=instance.usable,
        active_requests=streams + instance.active_prefills,
    )
    if link is None:
        return figures
    counts = link.statistics()
    return attrs.evolve(
        figures,
        kv_free_blocks=None if link.capacity is None else link.capacity.free_blocks,
        cached_blocks=len(link.cached_blocks) if link.cached_blocks.reporting else None,
        link=LinkFigures(
            reconnects=max(0, counts.connects - 1),
            heartbeat_misses=counts.hangs,
            frames_received=counts.frames_received,
            clients_cut_off=counts.clients_cut_off,
        ),
    )


def _traced_like_the_router(worker: WorkerConfig, tracing: TracingConfig) -> WorkerConfig:
    """The embedded workers send spans where the router does, unless their own table says
    where (their service name stays theirs)."""
    if worker.tracing.endpoint or not tracing.endpoint:
        return worker
    return attrs.evolve(
        worker, tracing=attrs.evolve(tracing, service_name=worker.tracing.service_name)
    )
