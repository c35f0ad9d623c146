"""The router's long-lived state, owned by the ASGI lifespan.

Holds the one ``httpx.AsyncClient`` (instance metadata and health probes only:
nothing per request), the known instances and one worker link per instance,
which carries every per-request message.  Everything long-lived runs in the
lifespan's nursery.
"""

from __future__ import annotations

import enum
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, final

import attrs
import httpx
import trio

from pdtrio.config import InstanceConfig, PdtrioConfig, Role
from pdtrio.discovery.registry import (
    DiscoveryState,
    EtcdRegistry,
    Registry,
    StaticRegistry,
    static_registration,
)
from pdtrio.engine.blocks import blocks_needed
from pdtrio.protocol.egress import EgressConfig, EgressController
from pdtrio.protocol.kv_layout import KvLayout, layout_mismatch
from pdtrio.protocol.registration import Registration, RegistrationError
from pdtrio.protocol.scheduling import Candidate, Scheduler
from pdtrio.router.capacity import CapacityQueue
from pdtrio.router.cluster import WorkerProcess, embedded_workers
from pdtrio.router.loop_load import run_egress_control
from pdtrio.router.worker_link import LINK_ERRORS, HoldTimer, WorkerLink

log = logging.getLogger("pdtrio.router")

# the longest an instance failing with 5xx stays out of rotation before it is tried again
_MAX_INSTANCE_BACKOFF_S = 30.0


class Outcome(enum.Enum):
    """How a completion request ended, as /metrics counts it."""

    OK = "ok"
    DISCONNECTED = "disconnected"
    """The client went away before the response was complete."""
    REJECTED = "rejected"
    """Refused before any byte of the response went out (with its status)."""
    FAILED = "failed"
    """Ended by an error event after the stream had started (with the error's status)."""


class RouterStartFailed(Exception):
    """The router cannot serve with what it was given (instances, configuration)."""


@attrs.define(eq=False)
class Instance:
    name: str
    role: Role
    url: str
    model: str
    layout: KvLayout
    max_model_len: int
    healthy: bool = True
    # still registered (etcd): once deregistered it takes no new work, then goes
    registered: bool = True
    # it said it is stopping (a prefill refused as draining): no new work
    draining: bool = False
    active_prefills: int = 0
    # out of rotation until then (trio clock) after failing requests with a 5xx: the
    # next request after it probes the instance; each failure in a row doubles the wait
    suspended_until: float = 0.0
    failures_in_a_row: int = 0
    link: WorkerLink | None = None
    link_scope: trio.CancelScope | None = None

    @property
    def serves_prefill(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def usable(self) -> bool:
        """Whether new work may go to it now (suspension aside)."""
        return (
            self.healthy
            and self.registered
            and not self.draining
            and self.link is not None
            and self.link.connected
        )

    def pairs_with(self, other: Instance) -> bool:
        """Whether KV prefilled on one of the two can be decoded on the other."""
        return self.model == other.model and self.layout == other.layout

    @property
    def serves_decode(self) -> bool:
        return self.role in ("decode", "both")


@final
class Router:
    def __init__(
        self, config: PdtrioConfig, nursery: trio.Nursery, http: httpx.AsyncClient
    ) -> None:
        self.config = config
        self.http = http
        self._nursery = nursery
        self.instances: dict[str, Instance] = {}
        self.workers: list[WorkerProcess] = []
        self.tokens_delivered = 0
        # (outcome, status class or "") -> completion requests that ended so
        self.outcomes: Counter[tuple[Outcome, str]] = Counter()
        self.active_requests = 0
        # draining: new requests are refused; drain_over: running ones are cut
        self.draining = False
        self.drain_over = trio.Event()
        self._running: set[trio.CancelScope] = set()
        self._idle = trio.Event()
        self._idle.set()
        # prefilled requests waiting for decode KV room, woken by the links' reports
        self.decode_queue: CapacityQueue[Instance] = CapacityQueue(
            config.router.admission_queue_limit
        )
        # how far apart each stream's sends go under load (0: at once), kept by open_router
        self.egress = EgressController(EgressConfig(max_delay_s=config.router.egress_max_delay_s))
        self.hold_timer = HoldTimer()  # ends the streams' holds; run by open_router
        self._prefill_scheduler = Scheduler(config.router.prefill_policy)
        self._decode_scheduler = Scheduler(config.router.decode_policy)
        # where instances come from, for /health; registry keys that are not usable, and why
        self.discovery = DiscoveryState(
            "etcd"
            if config.discovery.uses_etcd
            else "embedded"
            if config.uses_embedded_cluster
            else "static"
        )
        self.ignored_registrations: dict[str, str] = {}

    # --- instances ------------------------------------------------------------------

    @property
    def models(self) -> list[str]:
        return sorted({i.model for i in self.instances.values()})

    async def add_instance(self, role: Role, url: str, name: str) -> None:
        """An embedded worker is ready: learn it from its /pd/info and connect its link.

        ``name`` is the id the router gave the worker; the worker must say the same.
        """
        try:
            registration = await static_registration(
                self.http,
                InstanceConfig(role=role, url=url),
                timeout_s=self.config.router.connect_timeout_s,
            )
        except RegistrationError as exc:
            raise RouterStartFailed(str(exc)) from None
        if name != registration.instance_id:
            raise RouterStartFailed(
                f"the worker at {url} says it is {registration.instance_id!r}, but was "
                f"started as {name!r}"
            )
        await self.instance_listed(registration)

    async def instance_listed(self, registration: Registration) -> None:
        """A listed instance (static, embedded): learn it and connect (which must work)."""
        instance = self._replace_instance(registration)
        await self._nursery.start(self._keep_link, instance, True)

    def instance_registered(self, registration: Registration) -> None:
        """A registry says the instance exists: learn it, or its change (never blocks)."""
        old = self.instances.get(registration.instance_id)
        if old is not None and old.registered and _same(old, registration):
            return  # a lease renewal or a re-registration of the same worker
        instance = self._replace_instance(registration)
        log.info(
            "instance %s (%s, model %s) registered at %s",
            instance.name,
            instance.role,
            instance.model,
            instance.url,
        )
        self._nursery.start_soon(self._keep_link, instance, False)
        self._report_unpaired(instance)

    def instance_deregistered(self, instance_id: str) -> None:
        """A registry says the instance left: no new work; its link goes once it is idle."""
        instance = self.instances.get(instance_id)
        if instance is None or not instance.registered:
            return
        instance.registered = False
        log.info("instance %s deregistered: finishing what it runs", instance_id)
        self.decode_queue.changed()  # waiters may have to look elsewhere
        self._nursery.start_soon(self._retire, instance)

    def registration_ignored(self, key: str, reason: str | None) -> None:
        if reason is None:
            self.ignored_registrations.pop(key, None)
        else:
            self.ignored_registrations[key] = reason

    def _replace_instance(self, registration: Registration) -> Instance:
        """The instance for a registration; one it replaces stops taking work and goes."""
        old = self.instances.get(registration.instance_id)
        instance = Instance(
            name=registration.instance_id,
            role=registration.role,
            url=registration.url,
            model=registration.model,
            layout=registration.layout,
            max_model_len=registration.max_model_len,
        )
        self.instances[instance.name] = instance
        if old is not None:
            old.registered = False
            self._nursery.start_soon(self._retire, old)
        return instance

    async def _retire(self, instance: Instance) -> None:
        """Close a deregistered or replaced instance's link once nothing runs on it."""
        link = instance.link
        while link is not None and link.connected and (link.busy or instance.active_prefills):  # noqa: ASYNC110 - state of many parts, checked rarely
            await trio.sleep(0.05)
        if instance.link_scope is not None:
            instance.link_scope.cancel()
        if self.instances.get(instance.name) is instance:
            del self.instances[instance.name]

    def _report_unpaired(self, instance: Instance) -> None:
        if not any(
            instance.pairs_with(other)
            for other in self.instances.values()
            if (instance.serves_prefill and other.serves_decode)
            or (instance.serves_decode and other.serves_prefill)
        ):
            log.warning("%s; it is not routed to until one comes", self._unpaired_reason(instance))

    def _unpaired_reason(self, instance: Instance) -> str:
        wanted = "decode" if instance.role == "prefill" else "prefill"
        same_model = [
            other
            for other in self.instances.values()
            if other is not instance
            and other.registered
            and other.model == instance.model
            and (other.serves_decode if wanted == "decode" else other.serves_prefill)
        ]
        if not same_model:
            return f"{instance.name} cannot be paired: no {wanted} instance serves {instance.model}"
        other = same_model[0]
        prefill, decode = (instance, other) if wanted == "decode" else (other, instance)
        return (
            f"{instance.name} cannot be paired with {other.name}: "
            f"{layout_mismatch(prefill.layout, decode.layout)}"
        )

    def unpaired(self) -> dict[str, str]:
        """Registered instances no counterpart can pair with, and why (for /health)."""
        reasons: dict[str, str] = {}
        live = [i for i in self.instances.values() if i.registered]
        for instance in live:
            if instance.role == "both" and instance.pairs_with(instance):
                continue
            counterparts = [
                other
                for other in live
                if (instance.serves_prefill and other.serves_decode)
                or (instance.serves_decode and other.serves_prefill)
            ]
            if not any(instance.pairs_with(other) for other in counterparts):
                reasons[instance.name] = self._unpaired_reason(instance)
        return reasons

    def lose_instance(self, name: str) -> None:
        """Stop routing to an embedded worker that died; its restart registers it anew.

        (A static instance needs nothing of the kind: its link's state is its health.)
        """
        instance = self.instances.get(name)
        if instance is not None:
            instance.healthy = False

    async def _keep_link(
        self,
        instance: Instance,
        must_connect: bool,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Hold the websocket to an instance open, reconnecting when it breaks.

        With ``must_connect`` the first connection must succeed (start-up fails
        otherwise); a registered instance is retried until it deregisters.
        """
        ws_url = instance.url.replace("http://", "ws://", 1) + "/pd/link"
        link = WorkerLink(
            instance.name,
            ws_url,
            max_pending_tokens=self.config.router.stream_buffer_tokens,
            on_capacity=self.decode_queue.changed,
            link_timeout_s=self.config.router.link_timeout_s,
            heartbeat_s=self.config.router.link_heartbeat_s,
            stream_idle_timeout_s=self.config.router.stream_idle_timeout_s,
            connect_timeout_s=self.config.router.connect_timeout_s,
        )
        instance.link = link
        status = task_status
        with trio.CancelScope() as scope:
            instance.link_scope = scope
            while True:
                try:
                    await link.run(task_status=status)
                except LINK_ERRORS as exc:
                    if must_connect and not link.ever_connected:
                        raise
                    if link.ever_connected:
                        log.warning("the link to %s is down: %r", instance.name, exc)
                    else:
                        log.warning("cannot reach %s at %s: %r", instance.name, instance.url, exc)
                status = trio.TASK_STATUS_IGNORED
                await trio.sleep(0.5)

    # --- requests and draining ------------------------------------------------------

    def request_started(self, scope: trio.CancelScope) -> None:
        """Count a running request; ``scope`` is cancelled when the drain deadline passes."""
        self.active_requests += 1
        self._running.add(scope)
        if self._idle.is_set():
            self._idle = trio.Event()
        if self.drain_over.is_set():
            scope.cancel()

    def request_ended(self, scope: trio.CancelScope) -> None:
        self.active_requests -= 1
        self._running.discard(scope)
        if self.active_requests == 0:
            self._idle.set()

    async def drain(self, drain_s: float) -> None:
        """Refuse new requests, give running ones ``drain_s`` to finish, then cut them.

        Returns once no request is left (the cut ones get a bounded moment to say why).
        """
        if not self.draining:
            self.draining = True
            log.info("draining: %d requests running, up to %gs", self.active_requests, drain_s)
        with trio.move_on_after(drain_s):
            await self._idle.wait()
        if not self.drain_over.is_set():
            if self.active_requests:
                log.warning("drain time is up: cutting %d requests", self.active_requests)
            self.drain_over.set()
            for scope in self._running:
                scope.cancel()
        # each cut request sends its error event and cleans up, both bounded by cleanup_grace_s
        with trio.move_on_after(2 * self.config.router.cleanup_grace_s + 1):
            await self._idle.wait()

    def pick_prefill(
        self, model: str | None = None, exclude: frozenset[str] = frozenset()
    ) -> Instance | None:
        """A usable prefill instance for ``model`` that some usable decode can pair with;
        suspended ones only when no other is left."""
        now = trio.current_time()
        decodes = [i for i in self.instances.values() if i.serves_decode and i.usable]
        usable = [
            i
            for i in self.instances.values()
            if i.serves_prefill
            and i.usable
            and (model is None or i.model == model)
            and any(i.pairs_with(d) for d in decodes)
        ]
        for allow_suspended in (False, True):
            candidates = [
                Candidate(i.name, i.active_prefills, allow_suspended or i.suspended_until <= now)
                for i in usable
            ]
            chosen = self._prefill_scheduler.pick(candidates, exclude=exclude)
            if chosen is not None:
                return self.instances[chosen]
        return None

    def instance_draining(self, instance: Instance) -> None:
        """It said it is stopping: no new work goes to it (a restart registers it anew)."""
        if not instance.draining:
            instance.draining = True
            log.info("instance %s is draining: no new work goes to it", instance.name)

    def instance_failed(self, instance: Instance) -> None:
        """It failed a request with a 5xx: out of rotation for a while (doubling, capped)."""
        instance.failures_in_a_row += 1
        backoff = self.config.router.instance_backoff_s * 2 ** (instance.failures_in_a_row - 1)
        instance.suspended_until = trio.current_time() + min(backoff, _MAX_INSTANCE_BACKOFF_S)
        log.warning(
            "instance %s failed %d request(s) in a row: out of rotation for %gs",
            instance.name,
            instance.failures_in_a_row,
            min(backoff, _MAX_INSTANCE_BACKOFF_S),
        )

    def instance_served(self, instance: Instance) -> None:
        """It served a request: back in full rotation."""
        if instance.failures_in_a_row:
            instance.failures_in_a_row = 0
            instance.suspended_until = 0.0

    def decode_links(
        self, exclude: frozenset[str] = frozenset(), layout: KvLayout | None = None
    ) -> list[WorkerLink]:
        """The links of usable decode instances not in ``exclude`` (that take ``layout``)."""
        return [
            i.link
            for i in self.instances.values()
            if i.serves_decode
            and i.usable
            and i.link is not None
            and i.name not in exclude
            and (layout is None or i.layout == layout)
        ]

    def decode_with_room(
        self, num_tokens: int, exclude: frozenset[str] = frozenset(), layout: KvLayout | None = None
    ) -> Instance | None:
        """A decode instance with room for ``num_tokens`` now, chosen by the decode policy."""
        candidates: list[Candidate] = []
        for link in self.decode_links(exclude, layout):
            capacity = link.capacity
            if capacity is None:
                continue
            free = link.available_blocks
            if free >= blocks_needed(num_tokens, capacity.block_size):
                candidates.append(Candidate(link.instance_id, link.active_requests, True, free))
        chosen = self._decode_scheduler.pick(candidates)
        return None if chosen is None else self.instances[chosen]

    def health(self) -> dict[str, Any]:

        prefill = sum(1 for i in self.instances.values() if i.serves_prefill and i.usable)
        decode = sum(1 for i in self.instances.values() if i.serves_decode and i.usable)
        report: dict[str, Any] = {
            "status": "ok" if prefill and decode else "unavailable",
            "prefill_instances": prefill,
            "decode_instances": decode,
            "active_requests": self.active_requests,
            # which process answered: under `hypercorn -w N` each runs its own router
            "pid": os.getpid(),
            "discovery": self.discovery.report(),
        }
        ignored = [
            {"instance": name, "reason": reason} for name, reason in self.unpaired().items()
        ] + [{"key": key, "reason": reason} for key, reason in self.ignored_registrations.items()]
        if ignored:
            report["ignored"] = ignored
        return report

    def count_outcome(self, outcome: Outcome, status: int | None = None) -> None:
        """Count one completion request by how it ended; errors by status class (4xx, 5xx)."""
        self.outcomes[(outcome, "" if status is None else f"{status // 100}xx")] += 1

    def metrics_text(self) -> str:
        lines = [
            "# TYPE pdtrio_requests_active gauge",
            f"pdtrio_requests_active {self.active_requests}",
            "# TYPE pdtrio_requests_total counter",
        ]
        for (outcome, status_class), count in sorted(
            self.outcomes.items(), key=lambda item: (item[0][0].value, item[0][1])
        ):
            status = f',status="{status_class}"' if status_class else ""
            lines.append(f'pdtrio_requests_total{{outcome="{outcome.value}"{status}}} {count}')
        cut_off = sum(i.link.clients_cut_off for i in self.instances.values() if i.link is not None)
        lines.append("# TYPE pdtrio_slow_clients_cut_off_total counter")
        lines.append(f"pdtrio_slow_clients_cut_off_total {cut_off}")
        lines.append("# TYPE pdtrio_egress_spacing_seconds gauge")
        lines.append(f"pdtrio_egress_spacing_seconds {self.egress.spacing_s:g}")
        lines.append("# TYPE pdtrio_event_loop_busy_ratio gauge")
        lines.append(f"pdtrio_event_loop_busy_ratio {self.egress.busy_fraction:.3f}")
        lines.append("# TYPE pdtrio_tokens_delivered_total counter")
        lines.append(f"pdtrio_tokens_delivered_total {self.tokens_delivered}")
        lines.append("# TYPE pdtrio_decode_frames_received_total counter")
        for instance in self.instances.values():
            if instance.link is not None:
                lines.append(
                    f'pdtrio_decode_frames_received_total{{instance="{instance.name}"}} '
                    f"{instance.link.frames_received}"
                )
        lines.append("# TYPE pdtrio_worker_restarts_total counter")
        for worker in self.workers:
            lines.append(
                f'pdtrio_worker_restarts_total{{worker="{worker.name}"}} {worker.restarts}'
            )
        return "\n".join(lines) + "\n"


@asynccontextmanager
async def open_router(config: PdtrioConfig) -> AsyncIterator[Router]:
    """Start everything the router needs; stop it all on exit."""
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(limits=limits, timeout=None) as http:
        async with trio.open_nursery() as nursery:
            router = Router(config, nursery, http)
            await nursery.start(run_egress_control, router.egress)
            nursery.start_soon(router.hold_timer.run)
            if config.uses_embedded_cluster:
                await _start_embedded(router, nursery)
            else:
                # the static list, then (or instead) what etcd has
                registries: list[Registry] = []
                if config.instances:
                    registries.append(
                        StaticRegistry(
                            config.instances,
                            router,
                            http,
                            timeout_s=config.router.connect_timeout_s,
                        )
                    )
                if config.discovery.uses_etcd:
                    registries.append(EtcdRegistry(config.discovery, router, router.discovery))
                for registry in registries:
                    await nursery.start(registry.run)
            try:
                yield router
            finally:
                nursery.cancel_scope.cancel()


async def _start_embedded(router: Router, nursery: trio.Nursery) -> None:
    embedded = router.config.embedded
    for name, role in embedded_workers(embedded):
        router.workers.append(
            WorkerProcess(
                name,
                role,
                embedded.worker,
                ready_timeout_s=embedded.ready_timeout_s,
                restart_backoff_s=embedded.restart_backoff_s,
                on_ready=router.add_instance,
                on_lost=router.lose_instance,
            )
        )

    async def start_one(worker: WorkerProcess) -> None:
        await nursery.start(worker.supervise)

    # workers load their models in parallel
    async with trio.open_nursery() as starters:
        for worker in router.workers:
            starters.start_soon(start_one, worker)


def _same(instance: Instance, registration: Registration) -> bool:
    """Whether a registration says nothing new about an instance (a renewal)."""
    return (
        instance.role == registration.role
        and instance.url == registration.url
        and instance.model == registration.model
        and instance.layout == registration.layout
        and instance.max_model_len == registration.max_model_len
    )
