"""The router's long-lived state, owned by the ASGI lifespan.

The :class:`Router` is its named parts: its one backend, chosen here as it starts
(:meth:`Router._choose_backend`: pdtrio's workers, or the vLLM or SGLang engines it
fronts; ``pdtrio.router.backend``), which owns its instances, their health and
placement (and for pdtrio's workers their links, the decode room queue and the KV
lease clock); the registry of running requests
(``pdtrio.router.request.running_requests``), the egress controller, the request
machines' limits, security and metrics; plus the one ``httpx.AsyncClient``
(instance metadata and health probes only: nothing per request).  Everything
long-lived runs in the lifespan's nursery.
"""

from __future__ import annotations

import functools
import itertools
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, final

import httpx
import trio

from pdtrio.config import PdtrioConfig, RouterConfig
from pdtrio.discovery.registry import DiscoveryState, EtcdRegistry
from pdtrio.protocol import request as rm
from pdtrio.protocol.tokens.egress import EgressConfig, EgressController
from pdtrio.router.backend import Backend
from pdtrio.router.engines.backend import EngineBackend
from pdtrio.router.engines.pool import EnginePool
from pdtrio.router.loop_load import run_egress_control
from pdtrio.router.metrics import Outcome, RouterMetrics
from pdtrio.router.request.client_limits import ClientLimits
from pdtrio.router.request.hold_timer import HoldTimer
from pdtrio.router.request.running_requests import RunningRequests
from pdtrio.router.workers.backend import WorkerBackend
from pdtrio.router.workers.supervisor import RouterStartFailed
from pdtrio.security import (
    ApiKeys,
    PeerCredentials,
    client_tls_context,
    derive_key,
    new_worker_secret,
    resolve_worker_secret,
    system_tls_context,
)
from pdtrio.tracing import start_tracing

__all__ = ["Router", "RouterStartFailed", "open_router"]

if TYPE_CHECKING:
    from pdtrio.tracing import Tracing

log = logging.getLogger("pdtrio.router")


@final
class Router:
    def __init__(
        self,
        config: PdtrioConfig,
        nursery: trio.Nursery,
        http: httpx.AsyncClient,
        tracing: Tracing | None = None,
    ) -> None:
        self.config = config
        self.http = http
        # the requests' spans (None: tracing is off; the request path checks only this)
        self.tracing = tracing
        # the run's clock, read straight: trio.current_time() is two calls more on the
        # way to it, and the request path reads it a dozen times a request
        self.now: Callable[[], float] = trio.lowlevel.current_clock().current_time
        self.tokens_delivered = 0
        # the running requests: their count, the drain, the stall sweep
        self.requests = RunningRequests(
            self._requests_counted,
            write_timeout_s=config.router.client_write_timeout_s,
            cut_grace_s=config.router.cleanup_grace_s,
        )
        # how far apart each stream's sends go under load (0: at once), kept by open_router
        self.egress = EgressController(EgressConfig(max_delay_s=config.router.egress_max_delay_s))
        self.hold_timer = HoldTimer()  # ends the streams' holds; run by open_router
        # request ids: unique across routers sharing workers (the random part), and no
        # system call per request (uuid4 reads the OS's randomness every time)
        self._request_id_part = secrets.token_hex(8)
        self._request_numbers = itertools.count()
        # what each request's state machine is held to
        self.request_limits = request_limits(config.router)
        self._models_seen: set[str] = set()
        self._models_listed: list[str] = []
        # where instances come from, for /health
        self.discovery = DiscoveryState(_discovery_kind(config))
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
        # its collector reads the rest of this object, the backend too, at scrape time
        self.metrics = RouterMetrics(self)
        # what serves: chosen here, once; everything else asks it through its interface
        self.backend = self._choose_backend(nursery)

    def _choose_backend(self, nursery: trio.Nursery) -> Backend:
        config = self.config
        if config.engine_kind is not None:  # vLLM or SGLang instances, fronted over HTTP
            return EngineBackend(
                EnginePool(config, self.http),
                self.discovery,
                registration_rejected=self._registration_rejected,
            )
        return WorkerBackend(
            config,
            nursery,
            self.http,
            discovery=self.discovery,
            credentials=self.worker_secret,
            lease_margin_s=self.request_limits.lease_margin_s,
            registration_rejected=self._registration_rejected,
        )

    # --- instances ------------------------------------------------------------------

    @property
    def models(self) -> list[str]:
        """The models instances offer now, and every one the router has offered before
        (taken a request for, or listed): one whose instances are all away (a partition,
        a restart) is still served, and its requests wait for an instance
        (``prefill_wait_s``) and get a 503, not a 404."""
        offered = self.backend.models
        if not self._models_seen.issuperset(offered):
            self._models_seen.update(offered)
            self._models_listed = sorted(self._models_seen)
        return self._models_listed

    def _registration_rejected(self, key: str, reason: str) -> None:
        self.metrics.registry_rejected.labels(reason).inc()

    # --- requests ----------------------------------------------------------------

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}{self._request_id_part}{next(self._request_numbers):x}"

    def _requests_counted(self, change: int) -> None:
        if change > 0:
            self.metrics.requests_active.inc()
        else:
            self.metrics.requests_active.dec()

    def health(self) -> dict[str, Any]:
        return self.backend.health(len(self.requests))

    def count_outcome(
        self,
        outcome: Outcome,
        status: int | None = None,
        *,
        endpoint: str,
        model: str = "",
        trace_id: str = "",
    ) -> None:
        """Count (and log) a completion request that ended before its pipeline ran
        (``trace_id``: its refusal's trace, when tracing is on)."""
        self.metrics.request_ended(
            endpoint=endpoint, model=model, outcome=outcome, status=status, trace_id=trace_id
        )

    def metrics_text(self, *, openmetrics: bool = False) -> bytes:
        """``/metrics`` (Prometheus text format, or OpenMetrics with exemplars; every
        process's with multiprocess mode)."""
        return self.metrics.render(openmetrics=openmetrics)


_KEEPALIVE_S = 4.0
# decode must pull the KV this long before prefill's lease frees it
LEASE_MARGIN_S = 1.0


def request_limits(config: RouterConfig) -> rm.Limits:
    """What each request's machine is held to, from the router's settings."""
    return rm.Limits(
        request_timeout_s=config.request_timeout_s,
        prefill_timeout_s=config.prefill_timeout_s,
        migration_limit=config.migration_limit,
        decode_reconnect_wait_s=config.decode_reconnect_wait_s,
        lease_margin_s=LEASE_MARGIN_S,
        handoff_attempts=config.handoff_attempts,
        prefill_wait_s=config.prefill_wait_s,
    )


@asynccontextmanager
async def open_router(config: PdtrioConfig) -> AsyncIterator[Router]:
    """Start everything the router needs; stop it all on exit."""
    # an idle connection is dropped here before the server drops it (uvicorn, vLLM's and
    # SGLang's server, and hypercorn close one after 5 s): a request sent on a connection as
    # the server closes it fails unanswered
    limits = httpx.Limits(
        max_connections=1024, max_keepalive_connections=256, keepalive_expiry=_KEEPALIVE_S
    )
    # workers behind TLS: verified against the configured CA
    tls = client_tls_context(config.security.worker_tls_ca_file)
    async with httpx.AsyncClient(
        limits=limits, timeout=None, verify=tls or system_tls_context()
    ) as http:
        tracing = start_tracing(config.tracing, "router")
        try:
            async with trio.open_nursery() as nursery:
                router = Router(config, nursery, http, tracing)
                await nursery.start(
                    functools.partial(
                        run_egress_control, router.egress, until_busy=router.requests.until_busy
                    )
                )
                nursery.start_soon(router.hold_timer.run)
                nursery.start_soon(router.requests.hang_up_stalled_clients)
                nursery.start_soon(router.requests.watch_lasting_requests)
                etcd = _etcd_registry(router) if config.discovery.uses_etcd else None
                await router.backend.start(nursery, etcd)
                try:
                    yield router
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            if tracing is not None:
                await tracing.aclose()  # the last spans, sent off the loop, bounded


def _discovery_kind(config: PdtrioConfig) -> str:
    if config.discovery.uses_etcd:
        return "etcd"
    return "embedded" if config.uses_embedded_cluster else "static"


def _etcd_registry(router: Router) -> EtcdRegistry:
    """What etcd has: pdtrio workers' registrations to the links, engines' (``[discovery]
    kind``) to the engine pool."""
    if router.registration_signing_key is None:
        log.warning(
            "registrations in etcd are not authenticated: no worker secret "
            "is set, so whoever can write to etcd can register an instance"
        )
    return EtcdRegistry(
        router.config.discovery,
        router.backend.registry_listener,
        router.discovery,
        signing_key=router.registration_signing_key,
        engines=router.backend.registrations,
    )
