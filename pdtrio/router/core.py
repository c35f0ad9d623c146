"""The router's long-lived state, owned by the ASGI lifespan.

Holds the one ``httpx.AsyncClient`` (instance metadata and health probes only:
nothing per request), the known instances and one worker link per instance,
which carries every per-request message.  Everything long-lived runs in the
lifespan's nursery.
"""

from __future__ import annotations

import enum
import itertools
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, final

import attrs
import httpx
import msgspec
import trio

from pdtrio.config import PdtrioConfig, Role
from pdtrio.engine.blocks import blocks_needed
from pdtrio.protocol.egress import EgressConfig, EgressController
from pdtrio.protocol.kv_layout import KvLayout
from pdtrio.protocol.scheduling import Candidate, pick_instance
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
        # round-robin turns among equally loaded prefill instances
        self._prefill_turns = itertools.count()
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

    # --- instances ------------------------------------------------------------------

    @property
    def models(self) -> list[str]:
        return sorted({i.model for i in self.instances.values()})

    async def add_instance(self, role: Role, url: str, name: str | None = None) -> None:
        """Learn an instance from its /pd/info and open its link.

        The instance's identity is the one it was registered with (``name``, which
        the embedded cluster also gives the worker), else the one the worker reports.
        """
        response = await self.http.get(
            f"{url}/pd/info", timeout=self.config.router.connect_timeout_s
        )
        response.raise_for_status()
        info: dict[str, Any] = response.json()
        reported = str(info["instance_id"])
        if name is None:
            name = reported
        elif name != reported:
            raise RouterStartFailed(
                f"the worker at {url} says it is {reported!r}, but was registered as {name!r}"
            )
        old = self.instances.get(name)
        if old is not None and old.link_scope is not None:
            old.link_scope.cancel()
        instance = Instance(
            name=name,
            role=role,
            url=url,
            model=str(info["model"]),
            layout=msgspec.convert(info["layout"], KvLayout),
            max_model_len=int(info["max_model_len"]),
        )
        self.instances[name] = instance
        await self._nursery.start(self._keep_link, instance)

    def lose_instance(self, name: str) -> None:
        """Stop routing to an embedded worker that died; its restart registers it anew.

        (A static instance needs nothing of the kind: its link's state is its health.)
        """
        instance = self.instances.get(name)
        if instance is not None:
            instance.healthy = False

    async def _keep_link(
        self, instance: Instance, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Hold the websocket to an instance open, reconnecting when it breaks.

        The first connection must succeed (start-up fails otherwise).
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
                    if not link.ever_connected:
                        raise
                    log.warning("the link to %s is down: %r", instance.name, exc)
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

    def pick_prefill(self, exclude: frozenset[str] = frozenset()) -> Instance | None:
        """A usable prefill instance; suspended ones only when no other is left."""
        now = trio.current_time()
        turn = next(self._prefill_turns)
        usable = [
            i
            for i in self.instances.values()
            if i.serves_prefill and i.healthy and i.link is not None and i.link.connected
        ]
        for allow_suspended in (False, True):
            candidates = [
                Candidate(i.name, i.active_prefills, allow_suspended or i.suspended_until <= now)
                for i in usable
            ]
            chosen = pick_instance(candidates, turn=turn, exclude=exclude)
            if chosen is not None:
                return self.instances[chosen]
        return None

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

    def decode_links(self, exclude: frozenset[str] = frozenset()) -> list[WorkerLink]:
        """The connected links of healthy decode instances not in ``exclude``."""
        return [
            i.link
            for i in self.instances.values()
            if i.serves_decode
            and i.healthy
            and i.link is not None
            and i.link.connected
            and i.name not in exclude
        ]

    def decode_with_room(
        self, num_tokens: int, exclude: frozenset[str] = frozenset()
    ) -> Instance | None:
        """The decode instance with the most unpromised free blocks, if it fits ``num_tokens``."""
        best: WorkerLink | None = None
        best_free = -1
        for link in self.decode_links(exclude):
            capacity = link.capacity
            if capacity is None:
                continue
            free = link.available_blocks
            if free >= blocks_needed(num_tokens, capacity.block_size) and free > best_free:
                best, best_free = link, free
        return None if best is None else self.instances[best.instance_id]

    def health(self) -> dict[str, Any]:

        prefill = sum(
            1
            for i in self.instances.values()
            if i.serves_prefill and i.healthy and i.link is not None and i.link.connected
        )
        decode = sum(
            1
            for i in self.instances.values()
            if i.serves_decode and i.healthy and i.link is not None and i.link.connected
        )
        return {
            "status": "ok" if prefill and decode else "unavailable",
            "prefill_instances": prefill,
            "decode_instances": decode,
            "active_requests": self.active_requests,
            # which process answered: under `hypercorn -w N` each runs its own router
            "pid": os.getpid(),
        }

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
                for instance in config.instances:
                    await router.add_instance(instance.role, instance.url)
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
