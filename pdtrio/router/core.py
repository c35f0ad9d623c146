"""The router's long-lived state, owned by the ASGI lifespan.

Holds the one ``httpx.AsyncClient`` (instance metadata and health probes only:
nothing per request), the known instances and one worker link per instance,
which carries every per-request message.  Everything long-lived runs in the
lifespan's nursery.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import AsyncIterator, Callable
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
from pdtrio.peer_auth import PeerAuthenticationError, link_authorization
from pdtrio.protocol.egress import EgressConfig, EgressController
from pdtrio.protocol.kv_layout import KvLayout, blocks_needed, layout_mismatch
from pdtrio.protocol.registration import (
    REJECTED_ROUTER_URL,
    ROUTER_HEADER,
    Registration,
    RegistrationError,
    is_own_url,
    registration_key,
)
from pdtrio.protocol.scheduling import Candidate, Scheduler
from pdtrio.router.capacity import CapacityQueue
from pdtrio.router.client_limits import ClientLimits
from pdtrio.router.cluster import WorkerProcess, embedded_workers
from pdtrio.router.engine_front import EnginePool
from pdtrio.router.loop_load import run_egress_control
from pdtrio.router.metrics import Outcome, RouterMetrics
from pdtrio.router.running_requests import RunningRequests
from pdtrio.router.worker_link import LINK_ERRORS, HoldTimer, PeerRefused, WorkerLink
from pdtrio.security import (
    ApiKeys,
    PeerCredentials,
    client_tls_context,
    derive_key,
    new_worker_secret,
    resolve_worker_secret,
)

log = logging.getLogger("pdtrio.router")

# the longest wait between links asked of an instance that keeps failing to prove itself
_REFUSED_RETRY_MAX_S = 30.0

# how long after a registration an instance nothing can pair with is warned about
_PAIRING_GRACE_S = 2.0
# the longest an instance failing with 5xx stays out of rotation before it is tried again
_MAX_INSTANCE_BACKOFF_S = 30.0


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
    # where its KV is pulled from, as registered: a KV handle naming another is refused
    transfer_endpoint: tuple[str, int] = ("", 0)
    healthy: bool = True
    # still registered (etcd): once deregistered it takes no new work, then goes
    registered: bool = True
    # it said it is stopping (a prefill refused as draining): no new work
    draining: bool = False
    active_prefills: int = 0
    # requests it prefilled that have not ended: each still owes it a release of its KV
    leases_out: int = 0
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
        # the vLLM or SGLang instances fronted instead of pdtrio workers (kind = "vllm")
        self.engines: EnginePool | None = (
            EnginePool(config, http) if config.engine_kind is not None else None
        )
        self.workers: list[WorkerProcess] = []
        self.tokens_delivered = 0
        # the running requests: their count, the drain, the stall sweep
        self.requests = RunningRequests(
            self._requests_counted,
            write_timeout_s=config.router.client_write_timeout_s,
            cut_grace_s=config.router.cleanup_grace_s,
        )
        # prefilled requests waiting for decode KV room, woken by the links' reports
        self.decode_queue: CapacityQueue[Instance] = CapacityQueue(
            config.router.admission_queue_limit
        )
        # requests waiting for a decode link to (re)connect, woken by the same reports
        self._decode_link_waiters = trio.lowlevel.ParkingLot()
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
        # who may call: clients' API keys and their limits; the credential workers ask for
        security = config.security
        self.api_keys = ApiKeys.resolve(security.api_keys, security.api_keys_file)
        self.client_limits = ClientLimits(
            per_key=security.max_concurrent_requests_per_key,
            total=security.max_concurrent_requests,
        )
        secret = resolve_worker_secret(security.worker_secret, security.worker_secret_file)
        if not secret and config.uses_embedded_cluster:
            secret = new_worker_secret()  # its workers get it from their environment
        self.worker_secret = PeerCredentials(
            secret, client_tls=client_tls_context(security.worker_tls_ca_file)
        )
        # etcd entries must be signed with the key the secret gives (None: no secret, any
        # entry is taken)
        self.registration_signing_key = derive_key(secret, "registration") if secret else None
        # the (host, port) pairs the router was reached at: a registration naming one is
        # the router itself; and the registrations found to point at a router
        self.own_addresses: set[tuple[str, int]] = set()
        self._router_registrations: dict[str, Registration] = {}
        # last: its collector reads the rest of this object at scrape time
        self.metrics = RouterMetrics(self)

    # --- instances ------------------------------------------------------------------

    @property
    def models(self) -> list[str]:
        if self.engines is not None:
            return self.engines.models
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
                credentials=self.worker_secret,
                expected_instance=name,
            )
        except (RegistrationError, PeerAuthenticationError) as exc:
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
        if self._router_registrations.get(registration.instance_id) == registration:
            return  # listed again: already found to be a router, and reported
        self._router_registrations.pop(registration.instance_id, None)
        if is_own_url(registration.url, self.own_addresses):
            self.instance_deregistered(registration.instance_id)
            self._points_at_a_router(registration, "this router's own address")
            return
        instance = self._replace_instance(registration)
        log.info(
            "instance %s (%s, model %s) registered at %s",
            instance.name,
            instance.role,
            instance.model,
            instance.url,
        )
        self._nursery.start_soon(self._keep_link, instance, False)
        self._nursery.start_soon(self._refuse_if_a_router, instance, registration)
        self._nursery.start_soon(self._report_unpaired, instance)

    def instance_deregistered(self, instance_id: str) -> None:
        """A registry says the instance left: no new work; its link goes once it is idle."""
        instance = self.instances.get(instance_id)
        if instance is None or not instance.registered:
            return
        instance.registered = False
        log.info("instance %s deregistered: finishing what it runs", instance_id)
        self._decode_capacity_changed()  # waiters may have to look elsewhere
        self._nursery.start_soon(self._retire, instance)

    def registration_ignored(self, key: str, reason: str | None) -> None:
        if reason is None:
            self.ignored_registrations.pop(key, None)
        else:
            self.ignored_registrations[key] = reason

    def registration_rejected(self, key: str, reason: str) -> None:
        self.metrics.registry_rejected.labels(reason).inc()

    def serving_at(self, server: Any) -> None:
        """A request reached the router at ``server`` (ASGI's [host, port])."""
        host, port = server[0], server[1]
        if isinstance(host, str) and isinstance(port, int):
            self.own_addresses.add((host.lower(), port))

    async def _refuse_if_a_router(self, instance: Instance, registration: Registration) -> None:
        """Ask a newly registered instance's URL who answers (no credential shown): a
        pdtrio router (this one, or another) is no worker, and its registration is
        refused. (Its link could not open anyway: a router refuses websockets.)"""
        try:
            with trio.move_on_after(self.config.router.connect_timeout_s):
                response = await self.http.get(
                    f"{instance.url}/pd/info", timeout=self.config.router.connect_timeout_s
                )
                if ROUTER_HEADER not in response.headers:
                    return
                if self.instances.get(instance.name) is instance and instance.registered:
                    self.instance_deregistered(instance.name)
                    self._points_at_a_router(registration, "a pdtrio router answers there")
        except httpx.HTTPError:
            return  # not up yet, or not HTTP: its link says what it is

    def _points_at_a_router(self, registration: Registration, why: str) -> None:
        key = registration_key(self.config.discovery.prefix, registration.instance_id)
        reason = f"its url {registration.url} is not a worker: {why}"
        log.warning("ignoring the registration at %s (%s): %s", key, REJECTED_ROUTER_URL, reason)
        self._router_registrations[registration.instance_id] = registration
        self.registration_ignored(key, reason)
        self.registration_rejected(key, REJECTED_ROUTER_URL)

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
            transfer_endpoint=(registration.transfer_host, registration.transfer_port),
        )
        self.instances[instance.name] = instance
        if old is not None:
            old.registered = False
            self._nursery.start_soon(self._retire, old)
        return instance

    async def _retire(self, instance: Instance) -> None:
        """Close a deregistered or replaced instance's link once nothing runs on it."""
        # (the state of many parts, looked at rarely: polled)
        while self._still_used(instance):  # noqa: ASYNC110
            await trio.sleep(0.05)
        if instance.link_scope is not None:
            instance.link_scope.cancel()
        if self.instances.get(instance.name) is instance:
            del self.instances[instance.name]

    @staticmethod
    def _still_used(instance: Instance) -> bool:
        """Whether requests still run on, or owe a release to, the instance over its link."""
        link = instance.link
        if link is None or not link.connected:
            return False
        return link.busy or bool(instance.active_prefills or instance.leases_out)

    async def _report_unpaired(self, instance: Instance) -> None:
        """Warn about an instance nothing can pair with, once its peers had time to come
        (a listing registers them one at a time)."""
        await trio.sleep(_PAIRING_GRACE_S)
        if self.instances.get(instance.name) is not instance or not instance.registered:
            return
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
        ws_url = "ws" + instance.url.removeprefix("http") + "/pd/link"  # (https: wss)
        link = WorkerLink(
            instance.name,
            ws_url,
            max_pending_tokens=self.config.router.stream_buffer_tokens,
            on_capacity=self._decode_capacity_changed,
            link_timeout_s=self.config.router.link_timeout_s,
            heartbeat_s=self.config.router.link_heartbeat_s,
            stream_idle_timeout_s=self.config.router.stream_idle_timeout_s,
            connect_timeout_s=self.config.router.connect_timeout_s,
            authorize=functools.partial(
                link_authorization, self.http, instance.url, self.worker_secret, instance.name
            ),
            ssl_context=self.worker_secret.client_tls,
        )
        instance.link = link
        status = task_status
        with trio.CancelScope() as scope:
            instance.link_scope = scope
            refusals = 0  # in a row: an instance that cannot prove itself is asked less often
            while True:
                try:
                    await link.run(task_status=status)
                except PeerRefused as exc:
                    if must_connect and not link.ever_connected:
                        raise
                    if refusals == 0:
                        log.warning("not linking to %s: %s", instance.name, exc)
                    refusals += 1
                except LINK_ERRORS as exc:
                    if must_connect and not link.ever_connected:
                        raise
                    refusals = 0
                    if link.ever_connected:
                        log.warning("the link to %s is down: %r", instance.name, exc)
                    else:
                        log.warning("cannot reach %s at %s: %r", instance.name, instance.url, exc)
                status = trio.TASK_STATUS_IGNORED
                await trio.sleep(min(0.5 * 2.0 ** min(refusals, 6), _REFUSED_RETRY_MAX_S))

    # --- requests ----------------------------------------------------------------

    def _requests_counted(self, change: int) -> None:
        if change > 0:
            self.metrics.requests_active.inc()
        else:
            self.metrics.requests_active.dec()

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

    async def refresh_transfer_endpoint(self, instance: Instance) -> None:
        """Ask the instance (at its registered URL) where its KV port is now: a worker
        restarted behind the same URL serves a new one."""
        listed = InstanceConfig(role=instance.role, url=instance.url)
        try:
            with trio.move_on_after(self.config.router.connect_timeout_s):
                current = await static_registration(
                    self.http,
                    listed,
                    timeout_s=self.config.router.connect_timeout_s,
                    credentials=self.worker_secret,
                    expected_instance=instance.name,
                )
                if current.instance_id == instance.name:
                    instance.transfer_endpoint = (current.transfer_host, current.transfer_port)
        except (httpx.HTTPError, RegistrationError, PeerAuthenticationError) as exc:
            log.warning("cannot ask %s where its KV port is: %s", instance.name, exc)

    def instance_draining(self, instance: Instance) -> None:
        """It said it is stopping: no new work goes to it (a restart registers it anew)."""
        if not instance.draining:
            instance.draining = True
            log.info("instance %s is draining: no new work goes to it", instance.name)

    def instance_failed(self, instance: Instance) -> None:
        """It failed a request (a prefill 5xx, a decode failing a stream): out of rotation
        for a while (doubling, capped); the next request after that probes it."""
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

    def _decode_capacity_changed(self) -> None:
        """A link reported capacity, connected or went: waiters for room or a link look again."""
        self.decode_queue.changed()
        self._decode_link_waiters.unpark_all()

    async def wait_for_decode_link(
        self, exclude: Callable[[], frozenset[str]], layout: KvLayout | None = None
    ) -> None:
        """Until a usable decode link not in ``exclude()`` (asked anew at each change; it
        may shrink as instances reconnect) takes ``layout``.  The caller bounds the wait."""
        while not self.decode_links(exclude(), layout):
            await self._decode_link_waiters.park()

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
        """A decode instance with room for ``num_tokens`` now, chosen by the decode policy;
        one suspended for failing requests only when no other has room."""
        now = trio.current_time()
        candidates: list[Candidate] = []
        for link in self.decode_links(exclude, layout):
            capacity = link.capacity
            if capacity is None:
                continue
            free = link.available_blocks
            if free >= blocks_needed(num_tokens, capacity.block_size):
                in_rotation = self.instances[link.instance_id].suspended_until <= now
                candidates.append(
                    Candidate(link.instance_id, link.active_requests, in_rotation, free)
                )
        chosen = self._decode_scheduler.pick(candidates)
        if chosen is None and candidates:
            chosen = self._decode_scheduler.pick(
                [attrs.evolve(c, healthy=True) for c in candidates]
            )
        return None if chosen is None else self.instances[chosen]

    def health(self) -> dict[str, Any]:
        if self.engines is not None:
            return self.engines.health(len(self.requests))

        prefill = sum(1 for i in self.instances.values() if i.serves_prefill and i.usable)
        decode = sum(1 for i in self.instances.values() if i.serves_decode and i.usable)
        report: dict[str, Any] = {
            "status": "ok" if prefill and decode else "unavailable",
            "prefill_instances": prefill,
            "decode_instances": decode,
            "active_requests": len(self.requests),
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

    def count_outcome(
        self, outcome: Outcome, status: int | None = None, *, endpoint: str, model: str = ""
    ) -> None:
        """Count (and log) a completion request that ended before its pipeline ran."""
        self.metrics.request_ended(endpoint=endpoint, model=model, outcome=outcome, status=status)

    def metrics_text(self) -> bytes:
        """``/metrics`` (Prometheus text format; every process's with multiprocess mode)."""
        return self.metrics.render()


@asynccontextmanager
async def open_router(config: PdtrioConfig) -> AsyncIterator[Router]:
    """Start everything the router needs; stop it all on exit."""
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    # workers behind TLS: verified against the configured CA
    tls = client_tls_context(config.security.worker_tls_ca_file)
    async with httpx.AsyncClient(limits=limits, timeout=None, verify=tls or True) as http:
        async with trio.open_nursery() as nursery:
            router = Router(config, nursery, http)
            await nursery.start(run_egress_control, router.egress)
            nursery.start_soon(router.hold_timer.run)
            nursery.start_soon(router.requests.hang_up_stalled_clients)
            if router.engines is not None:
                await nursery.start(router.engines.run)
            elif config.uses_embedded_cluster:
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
                            credentials=router.worker_secret,
                        )
                    )
                if config.discovery.uses_etcd:
                    if router.registration_signing_key is None:
                        log.warning(
                            "registrations in etcd are not authenticated: no worker secret "
                            "is set, so whoever can write to etcd can register an instance"
                        )
                    registries.append(
                        EtcdRegistry(
                            config.discovery,
                            router,
                            router.discovery,
                            signing_key=router.registration_signing_key,
                        )
                    )
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
                secret=router.worker_secret.value,
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
        and instance.transfer_endpoint == (registration.transfer_host, registration.transfer_port)
    )
