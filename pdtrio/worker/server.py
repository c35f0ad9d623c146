"""The worker: its parts, their lifetime, and what it reports about itself.

Roles: ``prefill``, ``decode``, or ``both`` (which hands KV to itself without
a copy).  A decode worker also prefills a request the router means to decode on
it (conditional disaggregation: little of its prompt is missing from the cache
here), and serves that KV to another decode if it comes to that.  :class:`Worker` puts the parts together and runs them: the engine,
the KV transport (which also serves prefill's KV transfer port), the KV leases,
the prefill role (``pdtrio.worker.prefill``), decode admission
(``pdtrio.worker.admission``), the routers' links (``pdtrio.worker.router_link``:
each router holds one websocket to each worker, ``/pd/link``, and prefill calls,
releases, decode starts, aborts and tokens all travel on it), and the HTTP API
(``pdtrio.worker.http_api``: ``/health``, ``/metrics``, ``/pd/*``).  It also
drains, and says what it is (``info``, ``registration``) and what runs on it
(``stats``).
"""

from __future__ import annotations

import logging
from typing import Any, final

import msgspec
import trio

from pdtrio.config import WorkerConfig
from pdtrio.engine.api import Engine, EngineOutput
from pdtrio.kv.api import KvTransport
from pdtrio.kv.digest import KvDigestCounts, coverage_for
from pdtrio.kv.selection import kv_transport_for
from pdtrio.memory import (
    WORKER_MMAP_THRESHOLD_BYTES,
    WORKER_TRIM_THRESHOLD_BYTES,
    limit_heap_retention,
)
from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.link.registration import Registration
from pdtrio.security import (
    ChallengeBook,
    PeerCredentials,
    client_tls_context,
    resolve_metrics_token,
    resolve_worker_secret,
    server_tls_context,
)
from pdtrio.tracing import start_tracing
from pdtrio.worker.admission import DecodeAdmission
from pdtrio.worker.fault_hooks import fault_hooks_for
from pdtrio.worker.http_api import WorkerHttpApi
from pdtrio.worker.http_listener import HttpConnections, serve_http
from pdtrio.worker.leases import KvLeases
from pdtrio.worker.metrics import WorkerMetrics
from pdtrio.worker.prefill import PrefillRole
from pdtrio.worker.router_link import RouterLinkServer

log = logging.getLogger("pdtrio.worker")

# an HTTP connection idle this long is closed (hypercorn's keep-alive timeout)
_IDLE_CONNECTION_TIMEOUT_S = 5.0


def default_instance_id(role: str, host: str, http_port: int) -> str:
    """The id of an instance nobody named: stable across restarts on the same address."""
    return f"{role}@{host}:{http_port}"


@final
class Worker:
    def __init__(
        self, config: WorkerConfig, engine: Engine, transport: KvTransport | None = None
    ) -> None:
        self.config = config
        self.engine = engine
        self.transport: KvTransport = transport or kv_transport_for(config.kv_transport, engine)
        # what every endpoint but /health asks of a peer (none when no secret is set)
        self.secret = PeerCredentials(
            resolve_worker_secret(config.secret, config.secret_file),
            client_tls=client_tls_context(config.tls_ca_file),
            server_tls=server_tls_context(config.tls_cert_file, config.tls_key_file),
        )
        self.transport.secret = self.secret
        # testing only ([faults]): None unless a hook is configured
        self.faults = fault_hooks_for(config.faults)
        if self.faults is not None:
            self.transport = self.faults.wrap_transport(self.transport)
        # empty until the worker serves: the default names the bound HTTP port
        self.instance_id = config.instance_id
        self.leases = KvLeases(self._free_leased)
        self.transfer_endpoint: tuple[str, int] = (config.advertised_host, 0)
        self.http_port = 0
        self.link_server: RouterLinkServer | None = None  # set once the instance id is known
        # asked to stop: new work is refused while running requests finish (see drain)
        self.draining = False
        self.prefill = PrefillRole(
            self,
            engine,
            self.leases,
            lease_s=config.kv_lease_s,
            digest=coverage_for(config.kv_digest),
            faults=self.faults,
        )
        # decode's checks of pulled KV against what prefill wrote (for /metrics)
        self.kv_digest_counts = KvDigestCounts()
        self.http_connections = HttpConnections(
            max_strangers=config.max_unauthenticated_connections,
            max_peers=config.max_authenticated_connections,
        )
        self.metrics = WorkerMetrics(self)
        engine.observe_steps(self.metrics.step)
        # spans of the work a tracing router asks for (None: tracing is off here)
        self.tracing = start_tracing(config.tracing, "worker")
        self.http = WorkerHttpApi(
            self,
            # routers prove they hold the secret by answering a challenge of ours, once each
            challenges=ChallengeBook(self.secret),
            metrics_token=resolve_metrics_token(config.metrics_token, config.metrics_token_file),
        )

    @property
    def serves_prefill(self) -> bool:
        return self.config.role in ("prefill", "both")

    @property
    def serves_decode(self) -> bool:
        return self.config.role in ("decode", "both")

    @property
    def advertised_port(self) -> int:
        return self.config.advertise_port or self.http_port

    @property
    def url(self) -> str:
        """The base URL others reach this worker at (its advertised address)."""
        host = self.config.advertised_host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 address
        scheme = "https" if self.config.tls_cert_file else "http"
        return f"{scheme}://{host}:{self.advertised_port}"

    @property
    def kv_layout(self) -> KvLayout:
        """The layout this worker reports and pairs by (a fault hook may alter it)."""
        layout = self.engine.layout
        return layout if self.faults is None else self.faults.layout(layout)

    # --- lifetime -----------------------------------------------------------------

    async def run(
        self,
        *,
        task_status: trio.TaskStatus[dict[str, Any]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run until cancelled. Reports {"http_port", "transfer_port", "instance_id", "url"}."""
        try:
            await self._serve(task_status)
        finally:
            if self.tracing is not None:
                await self.tracing.aclose()  # the last spans, sent off the loop, bounded

    async def _serve(self, task_status: trio.TaskStatus[dict[str, Any]]) -> None:
        from hypercorn.config import Config as HypercornConfig

        config = self.config
        # huge prompts' memory goes back to the OS; the engine's step buffers stay (pdtrio.memory)
        limit_heap_retention(WORKER_MMAP_THRESHOLD_BYTES, WORKER_TRIM_THRESHOLD_BYTES)
        outputs_send, outputs_receive = trio.open_memory_channel[EngineOutput](64)
        async with trio.open_nursery() as nursery:
            await nursery.start(self.engine.run, outputs_send)
            nursery.start_soon(self.leases.run_expiry)
            # NIXL registers the KV cache here, and the KV transfer port is served: by
            # decode workers too, which prefill a request themselves when little of its
            # prompt is missing from their cache (the router's conditional
            # disaggregation), and whose KV another decode then pulls if they have no room
            endpoint = await nursery.start(
                self.transport.run,
                self.prefill,
                config.host,
                config.transfer_port,
            )
            if endpoint is not None:
                # what decode dials: the advertised address, not the bound one
                self.transfer_endpoint = (
                    config.advertised_host,
                    config.advertise_transfer_port or endpoint[1],
                )
            hyper = HypercornConfig()  # protocol settings; the listener is ours (capped)
            if config.tls_cert_file:  # HTTPS and WSS (checked loadable above)
                hyper.certfile = config.tls_cert_file
                hyper.keyfile = config.tls_key_file
            hyper.accesslog = None
            hyper.errorlog = logging.getLogger("pdtrio.worker.hypercorn")
            # an idle HTTP connection (one that sends nothing, or nothing more) goes soon:
            # routers talk over their links (websockets, not subject to it), so only a
            # stranger would keep one idle; it bounds how long each can be held
            hyper.keep_alive_timeout = _IDLE_CONNECTION_TIMEOUT_S
            hyper.websocket_max_message_size = 64 * 1024 * 1024
            # until the id is known every route but /health answers 503 (see asgi)
            self.http_port = await nursery.start(
                serve_http, self.http, hyper, self.http_connections, config.host, config.port
            )
            if not self.instance_id:
                self.instance_id = default_instance_id(
                    config.role, config.advertised_host, self.advertised_port
                )
            self.secret.identity = self.instance_id  # what its proofs are bound to
            admission = (
                DecodeAdmission(
                    self.engine,
                    self.leases,
                    self.transport,
                    self.instance_id,
                    layout=self.kv_layout,
                    digest_counts=self.kv_digest_counts,
                )
                if self.serves_decode
                else None
            )
            links = RouterLinkServer(
                admission,
                # (a decode worker prefills when the router asks: see the transport above)
                self.prefill,
                self.engine,
                config.flush,
                faults=self.faults,
                tracing=self.tracing,
                instance_id=self.instance_id,
            )
            nursery.start_soon(links.dispatch_outputs, outputs_receive)
            self.link_server = links
            task_status.started(
                {
                    "http_port": self.http_port,
                    "transfer_port": self.transfer_endpoint[1],
                    "instance_id": self.instance_id,
                    "url": self.url,
                }
            )

    def _free_leased(self, request_id: str) -> None:
        """A lease's end (released, pulled, expired): its blocks go back to the engine, and a
        decode worker that prefilled locally tells its routers it has that room again."""
        self.engine.free_request(request_id)
        if self.link_server is not None:
            self.link_server.capacity_changed()

    # --- draining -------------------------------------------------------------------

    def begin_drain(self) -> None:
        """Refuse new work from now on: prefills get a 503, decode starts a retryable
        rejection, and decode reports no free blocks (routers send it nothing new)."""
        if self.draining:
            return
        self.draining = True
        if self.link_server is not None:
            self.link_server.draining = True
            self.link_server.capacity_changed()

    @property
    def busy(self) -> bool:
        """Whether anything runs here or waits to be pulled: prefills, leases, decodes."""
        links = self.link_server
        return bool(
            self.prefill.in_progress
            or len(self.leases)
            or (links is not None and links.request_count)
            or self.engine.statistics().running_requests
        )

    async def drain(self, grace_s: float) -> bool:
        """Refuse new work and wait up to ``grace_s`` for the running work to end.

        True when it all ended in time.
        """
        self.begin_drain()
        log.info("draining: up to %gs for running requests to finish", grace_s)
        with trio.move_on_after(grace_s):
            while self.busy:  # noqa: ASYNC110 - state of many parts, checked rarely
                await trio.sleep(0.05)
            return True
        log.warning("drain time is up: stopping with requests still running")
        return False

    def info(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "role": self.config.role,
            "model": self.engine.model_name,
            "max_model_len": self.engine.max_model_len,
            # the wire form (a list): msgspec.convert(info["layout"], KvLayout) reads it
            "layout": msgspec.to_builtins(self.kv_layout),
            "transfer_endpoint": list(self.transfer_endpoint),
            "kv_transport": self.transport.info(),
            # what it would register in etcd: what a router listing it statically reads
            "registration": msgspec.to_builtins(self.registration()),
        }

    def registration(self) -> Registration:
        """What this worker registers about itself: its advertised addresses and layout."""
        return Registration(
            instance_id=self.instance_id,
            role=self.config.role,
            url=self.url,
            transfer_host=self.transfer_endpoint[0],
            transfer_port=self.transfer_endpoint[1],
            model=self.engine.model_name,
            max_model_len=self.engine.max_model_len,
            layout=self.kv_layout,
            kv_blocks_total=self.engine.statistics().kv_blocks_total,
            kv_transport=self.transport.name,
        )

    def stats(self) -> dict[str, Any]:
        engine = self.engine.statistics()
        links = self.link_server
        return {
            "instance_id": self.instance_id,
            "role": self.config.role,
            "running_requests": engine.running_requests,
            "kv_blocks_in_use": engine.kv_blocks_in_use,
            "kv_blocks_total": engine.kv_blocks_total,
            "kv_leases": len(self.leases),
            "kv_leases_expired": self.leases.expired_count,
            "router_links": 0 if links is None else links.link_count,
            "decode_requests": 0 if links is None else links.request_count,
            "prefills_in_progress": self.prefill.in_progress,
            # prefill bodies being read off HTTP connections (bounded: beyond, a 503)
            "prefill_bodies_receiving": self.http.bodies_receiving,
            "served_prefills": self.prefill.served_prefills,
        }
