"""What the router already holds, read at scrape time: instances, links, egress, workers.

Nothing here counts anything: :class:`RouterStateCollector` reads the router's own state
when ``/metrics`` is scraped (under multiprocess mode: in the process that answers it);
what its backend holds comes as the backend's figures (``Backend.figures``), whichever
backend serves.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, final

import attrs
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric


@final
@attrs.frozen
class LinkFigures:
    """What a router's link to an instance counted (``/metrics``' link families)."""

    reconnects: int  # connections made after the first
    heartbeat_misses: int  # connections dropped for silence
    frames_received: int
    clients_cut_off: int  # its streams ended because their client read too slowly


@final
@attrs.frozen
class InstanceFigures:
    """One instance's row of ``/metrics``' per-instance families."""

    instance_id: str
    role: str
    model: str
    up: bool  # takes new work
    active_requests: int
    kv_free_blocks: int | None = None  # None: it reports none
    cached_blocks: int | None = None  # what its prefix cache holds (None: it reports none)
    link: LinkFigures | None = None  # None: no link to it


@final
@attrs.frozen
class BackendFigures:
    """What a backend holds that ``/metrics`` exports, read at scrape time."""

    instances: tuple[InstanceFigures, ...] = ()
    # conditional disaggregation's threshold (0: never prefilled on decode)
    local_prefill_max_tokens: int = 0
    # the restarts of each worker process the backend started and supervises
    worker_restarts: Mapping[str, int] = attrs.field(factory=dict)


class FiguresSource(Protocol):
    """Whatever serves (``pdtrio.router.backend.Backend``), as the collector reads it."""

    def figures(self) -> BackendFigures: ...


class RouterState(Protocol):
    """What the collector reads of the router (``pdtrio.router.core.Router``)."""

    @property
    def backend(self) -> FiguresSource: ...

    @property
    def tokens_delivered(self) -> int: ...

    @property
    def egress(self) -> Any: ...


@final
class RouterStateCollector(Collector):
    """What the router already holds, read at scrape time: instances, links, egress.

    Under multiprocess mode these come from the process that answers the scrape.
    """

    def __init__(self, router: RouterState) -> None:
        self._router = router

    def describe(self) -> Iterator[Metric]:
        return iter(())  # nothing to check at registration; collect reads the router

    def collect(self) -> Iterator[Metric]:
        router = self._router
        figures = router.backend.figures()
        instances = _InstanceFamilies()
        for instance in figures.instances:
            instances.add(instance)
        yield from instances.families()
        yield from _router_families(
            router, instances.clients_cut_off, figures.local_prefill_max_tokens
        )
        yield _worker_restarts(figures.worker_restarts)


@final
class _InstanceFamilies:
    """One scrape's families of every instance and its link, filled an instance at a time."""

    def __init__(self) -> None:
        labels = ["instance", "role", "model"]
        self.up = GaugeMetricFamily(
            "pdtrio_instance_up",
            "1 while the instance takes new work (healthy, registered, linked, not draining).",
            labels=labels,
        )
        self.active = GaugeMetricFamily(
            "pdtrio_instance_active_requests",
            "Requests on the instance now: prefill calls waiting and decode streams.",
            labels=labels,
        )
        self.free = GaugeMetricFamily(
            "pdtrio_instance_kv_free_blocks",
            "Free KV blocks the decode instance last reported.",
            labels=labels,
        )
        self.reconnects = CounterMetricFamily(
            "pdtrio_link_reconnects",
            "Times the router's link to the instance connected again after a break.",
            labels=["instance"],
        )
        self.misses = CounterMetricFamily(
            "pdtrio_link_heartbeat_misses",
            "Links dropped because the instance sent nothing (heartbeats included) in time.",
            labels=["instance"],
        )
        self.cached = GaugeMetricFamily(
            "pdtrio_instance_cached_blocks",
            "KV blocks the instance's prefix cache holds, as its KV events told this router "
            "(the prefix index cache-aware routing reads; absent while it reports none).",
            labels=labels,
        )
        self.frames = CounterMetricFamily(
            "pdtrio_decode_frames_received",
            "Frames the router read from the instance's link.",
            labels=["instance"],
        )
        # streams of every link ended because their client read too slowly
        self.clients_cut_off = 0

    def add(self, instance: InstanceFigures) -> None:
        values = [instance.instance_id, instance.role, instance.model]
        self.up.add_metric(values, 1.0 if instance.up else 0.0)
        self.active.add_metric(values, float(instance.active_requests))
        if instance.kv_free_blocks is not None:
            self.free.add_metric(values, float(instance.kv_free_blocks))
        if instance.cached_blocks is not None:
            self.cached.add_metric(values, float(instance.cached_blocks))
        link = instance.link
        if link is None:
            return
        self.reconnects.add_metric([instance.instance_id], float(link.reconnects))
        self.misses.add_metric([instance.instance_id], float(link.heartbeat_misses))
        self.frames.add_metric([instance.instance_id], float(link.frames_received))
        self.clients_cut_off += link.clients_cut_off

    def families(self) -> tuple[Metric, ...]:
        return (
            self.up,
            self.active,
            self.free,
            self.cached,
            self.reconnects,
            self.misses,
            self.frames,
        )


def _router_families(
    router: RouterState, clients_cut_off: int, local_prefill_max_tokens: int
) -> Iterator[Metric]:
    """The router's own figures, one value each."""
    yield GaugeMetricFamily(
        "pdtrio_local_prefill_max_tokens",
        "Conditional disaggregation's threshold: a request missing no more of its prompt "
        "from its decode's prefix cache is prefilled there (0: never).",
        value=float(local_prefill_max_tokens),
    )
    yield CounterMetricFamily(
        "pdtrio_slow_clients_cut_off",
        "Streams ended because their client read too slowly.",
        value=float(clients_cut_off),
    )
    yield CounterMetricFamily(
        "pdtrio_tokens_delivered",
        "Tokens delivered by this process (all models; counted per event).",
        value=float(router.tokens_delivered),
    )
    yield GaugeMetricFamily(
        "pdtrio_egress_spacing_seconds",
        "How far apart each stream's sends go now (adaptive egress; 0: at once).",
        value=router.egress.spacing_s,
    )
    yield GaugeMetricFamily(
        "pdtrio_event_loop_busy_ratio",
        "How busy the router's event loop was lately (0 to 1).",
        value=router.egress.busy_fraction,
    )


def _worker_restarts(restarts_by_worker: Mapping[str, int]) -> Metric:
    restarts = CounterMetricFamily(
        "pdtrio_worker_restarts",
        "Restarts of each embedded worker.",
        labels=["worker"],
    )
    for worker, count in restarts_by_worker.items():
        restarts.add_metric([worker], float(count))
    return restarts
